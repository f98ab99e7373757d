// attnx: helpers for code on the LibTorch stable ABI (torch/csrc/stable), which reaches torch through a C API.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
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
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/compat.h"

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

// Raises `message` as a RuntimeError, noted for torch < 2.13 (common/compat.h).
[[noreturn]] inline void raise(std::string message) {
  compat::raised_message() = message;
  throw std::runtime_error(std::move(message));
}

// The error of a call into torch's C API that failed without a message (torch < 2.13): which call failed.
struct CallFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raises the error of a failed call into torch's C API (a shim call, a dispatcher call whose op raised) as a
// RuntimeError that carries the op's own message. (torch's STABLE_TORCH_ERROR_CODE_CHECK also prints the
// backtrace to stderr and appends its own call site to the message.) Where torch < 2.13 does not pass the
// message on, the exception says so.
inline void check(AOTITorchError error, const char* what) {
  if (error == TORCH_SUCCESS) return;
  if (const char* message = compat::torch_error_message()) raise(error_message(message));
  std::string failed = std::string(what) + " failed (torch < 2.13 logs the error to stderr)";
  compat::raised_message() = failed;
  throw CallFailed(std::move(failed));
}

// Runs f, naming `op` in the error of a call into torch that failed without a message inside it (torch
// < 2.13: "attnx::linear: aten::mm.out failed ..."). Where torch passes messages on, it changes nothing.
template <typename F>
decltype(auto) naming(const char* op, F&& f) {
  try {
    return f();
  } catch (const CallFailed& e) {
    raise(std::string(op) + ": " + e.what());
  }
}

// Calls `name`.`overload` on a boxed stack through the dispatcher, raising its error as check() does; under
// torch < 2.13, an error that attnx's own code raised below the call keeps its message (common/compat.h).
// `what` names the call in that error; by default the op, `name`.`overload`.
inline void dispatch(const char* name, const char* overload, StableIValue* stack,
                     const char* what = nullptr) {
  compat::raised_message().clear();
  const AOTITorchError error = torch_call_dispatcher(name, overload, stack, TORCH_ABI_VERSION);
  if (error == TORCH_SUCCESS) return;
  const char* message = compat::torch_error_message();
  if (message == nullptr && !compat::raised_message().empty()) raise(std::string(compat::raised_message()));
  check(error, what ? what : (std::string(name) + (*overload ? "." : "") + overload).c_str());
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
// Shapes.

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

// Whether a tensor of these sizes and strides covers a dense block of memory without overlaps, in some order
// of its dims (torch's is_non_overlapping_and_dense): then a tensor with the same strides holds every element
// once.
inline bool non_overlapping_and_dense(IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that are stepped along
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] != 1) dims.emplace_back(strides[d], sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Boxed stacks: an op's arguments in and out of the StableIValue stack the dispatcher hands a boxed kernel.
// Both take over references as TORCH_BOX does (a tensor unboxed is owned by the caller from then on).

// Checks a boxed kernel's argument and output counts against its C++ side (TORCH_BOX's check).
inline void check_stack(const char* op, uint64_t num_args, uint64_t expected_args, uint64_t num_outputs,
                        uint64_t expected_outputs) {
  ATTNX_CHECK(num_args == expected_args && num_outputs == expected_outputs, op,
              ": the registered schema has ", num_args, " arguments and ", num_outputs,
              " outputs, the kernel takes ", expected_args, " and returns ", expected_outputs);
}

namespace detail {
template <typename Tuple, size_t... I>
auto tuple_head(const Tuple& t, std::index_sequence<I...> /*unused*/) {
  return std::tie(std::get<I>(t)...);
}
}  // namespace detail

// The first N references of a tuple of references.
template <size_t N, typename Tuple>
auto tuple_head(const Tuple& t) {
  return detail::tuple_head(t, std::make_index_sequence<N>());
}

// stack[0], stack[1], ... into the references of `fields` (a std::tie of a struct's fields, say), in order.
template <typename... T>
void unbox(const StableIValue* stack, std::tuple<T&...> fields) {
  std::apply(
      [&](T&... field) {
        size_t i = 0;
        ((field = torch::stable::detail::to<T>(stack[i++])), ...);
      },
      fields);
}

// ---------------------------------------------------------------------------------------------------------------
// Any op through the dispatcher (torch_call_dispatcher), for what the shim has no direct call for. Only
// common/aten.h calls torch's ops this way; attnx's own ops are called by the code that defines them.

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
// all (see aten::scalar_tensor in common/aten.h).
template <size_t N = 1, typename... Args>
auto call(const char* name, const char* overload, const Args&... args) {
  constexpr size_t kArgs = sizeof...(Args);
  std::array<StableIValue, (kArgs > N ? kArgs : N) + 1> stack{detail::box(args)...};
  dispatch(name, overload, stack.data());
  if constexpr (N == 1) {
    return torch::stable::detail::to<Tensor>(stack[0]);
  } else {
    std::array<Tensor, N> out;
    for (size_t i = 0; i < N; ++i) out[i] = torch::stable::detail::to<Tensor>(stack[i]);
    if constexpr (N > 0) return out;
  }
}

}  // namespace attnx::stable
