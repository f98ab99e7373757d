// attnx: helpers for code on the LibTorch stable ABI (torch/csrc/stable), which reaches torch through a C API.
#pragma once

#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/version.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace attnx::stable {

// The message of an error that crossed torch's C API, as the op raised it: a Python exception raised below
// the call (a Python autograd kernel's, say) arrives as "<type>: <message>\n\nAt:\n<traceback>", and a
// NotImplementedError from a C++ kernel as "NotImplementedError: <message>". The error is raised again as a
// RuntimeError (the C API does not carry its type), so only the message is kept.
inline std::string error_message(std::string message) {
  const size_t traceback = message.find("\n\nAt:\n");
  if (traceback != std::string::npos) message.resize(traceback);
  const size_t colon = message.find(": ");
  const auto is_name = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
  };
  if (colon != std::string::npos && colon >= 5 && message.compare(colon - 5, 5, "Error") == 0 &&
      std::all_of(message.begin(), message.begin() + colon, is_name)) {
    message.erase(0, colon + 2);
  }
  return message;
}

// The message of the last error attnx raised on this thread. torch 2.10 to 2.12 do not pass an error's message
// back through their C API (they log it to stderr); where the op that failed below a dispatcher call is one of
// attnx's own (the kernel op a router chose, the attention mha runs), the message was raised in this library,
// and dispatch() reads it back from here.
inline std::string& raised_message() {
  thread_local std::string message;
  return message;
}

[[noreturn]] inline void raise(std::string message) {
  raised_message() = message;
  throw std::runtime_error(std::move(message));
}

// The message of the error that failed the last call into torch's C API: passed through from torch 2.13 on,
// nullptr before.
inline const char* torch_error_message() {
#if defined(TORCH_VERSION_2_13_0) && TORCH_FEATURE_VERSION >= TORCH_VERSION_2_13_0
  return torch_exception_get_what_without_backtrace();
#else
  // Targeting an older torch: the getter, where the running torch has it.
  using Getter = const char* (*)();
  const auto getter = reinterpret_cast<Getter>(dlsym(RTLD_DEFAULT, "torch_exception_get_what_without_backtrace"));
  return getter ? getter() : nullptr;
#endif
}

// Raises the error of a failed call into torch's C API (a shim call, a dispatcher call whose op raised) as a
// RuntimeError that carries the op's own message. (torch's STABLE_TORCH_ERROR_CODE_CHECK also prints the
// backtrace to stderr and appends its own call site to the message.) Where torch < 2.13 does not pass the
// message on, the exception says so.
inline void check(AOTITorchError error, const char* what) {
  if (error == TORCH_SUCCESS) return;
  const char* message = torch_error_message();
  raise(message ? error_message(message)
                : std::string(what) + " failed (torch < 2.13 logs the error to stderr)");
}

// Calls `name`.`overload` on a boxed stack through the dispatcher, raising its error as check() does; under
// torch < 2.13, an error that attnx's own code raised below the call keeps its message (raised_message).
inline void dispatch(const char* name, const char* overload, StableIValue* stack, const char* what) {
  raised_message().clear();
  const AOTITorchError error = torch_call_dispatcher(name, overload, stack, TORCH_ABI_VERSION);
  if (error == TORCH_SUCCESS) return;
  const char* message = torch_error_message();
  if (message == nullptr && !raised_message().empty()) raise(std::string(raised_message()));
  check(error, what);
}

using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// ---------------------------------------------------------------------------------------------------------------
// Errors. TORCH_CHECK's behaviour without c10: the message is built only on failure and is exactly the message
// (the stable headers' STD_TORCH_CHECK prefixes the function, file and line). It reaches Python as a
// RuntimeError, as TORCH_CHECK's does.

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  raise(message.str());
}

#define ATTNX_CHECK(cond, ...)                  \
  do {                                          \
    if (!(cond)) ::attnx::stable::fail(__VA_ARGS__); \
  } while (0)

// The arguments printed one after another, as c10::str does.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  return message.str();
}

// A list of sizes as torch prints an IntArrayRef: [2, 3].
struct Sizes {
  IntHeaderOnlyArrayRef values;
};

inline std::ostream& operator<<(std::ostream& os, Sizes s) {
  os << '[';
  for (size_t i = 0; i < s.values.size(); ++i) os << (i ? ", " : "") << s.values[i];
  return os << ']';
}

// A dtype as torch prints a tensor's dtype() (c10's TypeMeta name, the demangled C++ type on Linux: float,
// c10::BFloat16), where torch's own messages for the same mistake do. (A ScalarType itself prints as torch's
// ScalarType does, Float, BFloat16, through the header-only operator<<.)
inline const char* type_meta_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float";
    case ScalarType::Double: return "double";
    case ScalarType::Half: return "c10::Half";
    case ScalarType::BFloat16: return "c10::BFloat16";
    case ScalarType::Long: return "long int";
    case ScalarType::Int: return "int";
    case ScalarType::Short: return "short int";
    case ScalarType::Char: return "signed char";
    case ScalarType::Byte: return "unsigned char";
    case ScalarType::Bool: return "bool";
    case ScalarType::UInt16: return "short unsigned int";
    case ScalarType::UInt32: return "unsigned int";
    case ScalarType::UInt64: return "long unsigned int";
    case ScalarType::ComplexHalf: return "c10::complex<c10::Half>";
    case ScalarType::ComplexFloat: return "c10::complex<float>";
    case ScalarType::ComplexDouble: return "c10::complex<double>";
    case ScalarType::Float8_e5m2: return "c10::Float8_e5m2";
    case ScalarType::Float8_e4m3fn: return "c10::Float8_e4m3fn";
    case ScalarType::Float8_e5m2fnuz: return "c10::Float8_e5m2fnuz";
    case ScalarType::Float8_e4m3fnuz: return "c10::Float8_e4m3fnuz";
    default: return torch::headeronly::toString(t);
  }
}

// A device as torch prints one: cpu, cuda:0, meta.
inline std::string device_name(const torch::stable::Device& device) {
  using torch::headeronly::DeviceType;
  const char* type = "unknown";
  switch (device.type()) {
    case DeviceType::CPU: type = "cpu"; break;
    case DeviceType::CUDA: type = "cuda"; break;
    case DeviceType::HIP: type = "hip"; break;
    case DeviceType::XPU: type = "xpu"; break;
    case DeviceType::MPS: type = "mps"; break;
    case DeviceType::Meta: type = "meta"; break;
    case DeviceType::XLA: type = "xla"; break;
    case DeviceType::HPU: type = "hpu"; break;
    case DeviceType::MTIA: type = "mtia"; break;
    case DeviceType::Lazy: type = "lazy"; break;
    case DeviceType::PrivateUse1: type = "privateuseone"; break;
    default: break;
  }
  return device.has_index() ? std::string(type) + ":" + std::to_string(device.index()) : std::string(type);
}

// ---------------------------------------------------------------------------------------------------------------
// Tensors through the C shim's direct calls, which skip the boxed dispatcher: the per-call cost of a view or an
// allocation stays that of the regular ABI's.

inline int64_t product(IntHeaderOnlyArrayRef values) {
  int64_t p = 1;
  for (const int64_t v : values) p *= v;
  return p;
}

// torch's contiguous strides for `sizes` (a size-0 or size-1 dim counts as 1).
inline std::vector<int64_t> contiguous_strides(IntHeaderOnlyArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t extent = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = extent;
    extent *= std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

// A view of t's memory with the given sizes and strides, starting `offset` elements past t's first element. Not
// an autograd view: a fresh tensor that never requires grad (every caller is below autograd).
inline Tensor reinterpret(const Tensor& t, IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides,
                          int64_t offset = 0) {
  AtenTensorHandle view = nullptr;
  check(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                       offset, &view),
        "attnx: a view");
  return Tensor(view);
}

// An uninitialised tensor with the given sizes and strides, dtype and device.
inline Tensor empty_strided(IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides, ScalarType dtype,
                            const torch::stable::Device& device) {
  AtenTensorHandle out = nullptr;
  check(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                 torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype)),
                                 torch::stable::detail::to<int32_t>(torch::stable::detail::from(device.type())),
                                 device.index(), &out),
        "attnx: empty_strided");
  return Tensor(out);
}

// An uninitialised contiguous tensor.
inline Tensor empty(IntHeaderOnlyArrayRef sizes, ScalarType dtype, const torch::stable::Device& device) {
  return empty_strided(sizes, contiguous_strides(sizes), dtype, device);
}

inline void copy_into(const Tensor& dst, const Tensor& src) {
  check(aoti_torch_copy_(dst.get(), src.get(), /*non_blocking=*/0), "attnx: copy_");
}

// t in `dtype`: t itself when it already is, else a contiguous converted copy.
inline Tensor to(const Tensor& t, ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  Tensor converted = empty(t.sizes(), dtype, t.device());
  copy_into(converted, t);
  return converted;
}

// a - alpha * b, and a + b, through the C shim, whose alpha is a double: aten::sub and aten::add take theirs as
// a Scalar, which the stable dispatcher cannot pass. The kernels compute a - alpha * b as a + (-alpha) * b, so
// add (alpha = -1) is the sum itself, bit for bit, signed zeros, infinities and NaN included.
inline Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0) {
  AtenTensorHandle out = nullptr;
  check(aoti_torch_aten_subtract_Tensor(a.get(), b.get(), alpha, &out), "attnx: aten::sub");
  return Tensor(out);
}

inline Tensor add(const Tensor& a, const Tensor& b) {
  return sub(a, b, -1.0);
}

// t.fill_(value).
inline void fill(const Tensor& t, double value) {
  check(aoti_torch_aten_fill__Scalar(t.get(), value), "attnx: aten::fill_");
}

// A 0-dim CPU float64 tensor: how a Scalar argument reaches an op through the stable dispatcher, which cannot
// pass Scalars. The elementwise ops' Tensor overloads (mul.Tensor, masked_fill.Tensor, clamp_min.Tensor) take it
// on any device as a CPU scalar that keeps the other operand's floating dtype; not every op does (clamp.Tensor
// with two CPU scalars on CUDA does not), and an integer tensor combined with it becomes float64.
inline Tensor scalar(double value) {
  AtenTensorHandle out = nullptr;
  check(aoti_torch_scalar_to_tensor_float64(value, &out), "attnx: a scalar");
  return Tensor(out);
}

// ---------------------------------------------------------------------------------------------------------------
// Any op through the dispatcher (torch_call_dispatcher), for what the shim has no direct call for.

namespace detail {
// An argument as the boxed stack holds it: integers widened to int64 (an int's 4 bytes would not be
// sign-extended), everything else as torch::stable::detail::from converts it (a tensor as a new reference).
template <typename T>
StableIValue box(const T& value) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return torch::stable::detail::from(static_cast<int64_t>(value));
  } else {
    return torch::stable::detail::from(value);
  }
}
}  // namespace detail

// Calls `name`.`overload` with `args` and returns its first N outputs: a Tensor for N = 1, an array of them
// otherwise, nothing for N = 0. N must be the op's number of outputs (the rest would not be released). Errors
// are raised with the op's own message (stable::check).
//
// Every argument of the schema is passed, defaults included, each in the C++ type of its schema type: an
// optional one (`Tensor?`, `int[1]?`, `ScalarType?`) as a std::optional (the stack holds an optional as a
// pointer to its value: a bare value there is read as an address), a list as a std::vector, a Scalar not at
// all (see scalar()).
template <size_t N = 1, typename... Args>
auto call(const char* name, const char* overload, const Args&... args) {
  constexpr size_t kArgs = sizeof...(Args);
  std::array<StableIValue, (kArgs > N ? kArgs : N) + 1> stack{detail::box(args)...};
  dispatch(name, overload, stack.data(), name);
  if constexpr (N == 1) {
    return torch::stable::detail::to<Tensor>(stack[0]);
  } else {
    std::array<Tensor, N> out;
    for (size_t i = 0; i < N; ++i) out[i] = torch::stable::detail::to<Tensor>(stack[i]);
    if constexpr (N > 0) return out;
  }
}

}  // namespace attnx::stable
