// attnx: torch's ops as the glue calls them, typed and named as ATen names them: the one boundary between
// attnx's C++ and torch's operators. Allocations, copies and the few ops the C shim has a direct call for
// skip the boxed dispatcher (their per-call cost stays the regular ABI's); every other op goes through it
// (stable::call), with each schema argument spelled out once, here. Views are computed, not called: views.h.
//
// The stable dispatcher cannot pass a Scalar, which shapes three things. A scalar operand is a 0-dim CPU
// float64 tensor (scalar_tensor) given to the op's Tensor overload: mul, div and masked_fill take one beside
// tensors of any device and keep the other operand's floating dtype (an integer tensor combined with it
// becomes float64). clamp, clamp_min and clamp_max refuse a CPU bound beside a CUDA tensor (seen on torch
// 2.11): their bounds are 0-dim tensors on the tensor's device (full), and clamp is the one wrapped. add and
// sub take alpha as a Scalar: they go through the shim's subtract, whose alpha is a double. And arange takes
// Scalars only, so position ranges are built otherwise (common/key_range_mask.h).
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/Layout.h>
#include <torch/headeronly/core/MemoryFormat.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/stable.h"

namespace attnx::aten {

using stable::call;
using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::headeronly::ScalarType;
using torch::stable::Device;
using torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;

namespace detail {
template <typename T>
int32_t code(T value) {
  return torch::stable::detail::to<int32_t>(torch::stable::detail::from(value));
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------------------------
// Tensors, copies and fills: the C shim's direct calls.

inline Tensor empty_strided(IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides, ScalarType dtype,
                            const Device& device) {
  AtenTensorHandle out = nullptr;
  stable::check(
      aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                               detail::code(dtype), detail::code(device.type()), device.index(), &out),
      "attnx: empty_strided");
  return Tensor(out);
}

// A contiguous uninitialised tensor.
inline Tensor empty(IntHeaderOnlyArrayRef sizes, ScalarType dtype, const Device& device) {
  return empty_strided(sizes, stable::contiguous_strides(sizes), dtype, device);
}

// torch.empty_like(t) (memory_format=preserve): t's strides when t is dense and non-overlapping, allocated
// directly; otherwise torch's own choice of layout, through the dispatcher.
inline Tensor empty_like(const Tensor& t) {
  const IntHeaderOnlyArrayRef sizes = t.sizes(), strides = t.strides();
  if (stable::non_overlapping_and_dense(sizes, strides)) {
    return empty_strided(sizes, strides, t.scalar_type(), t.device());
  }
  return call("aten::empty_like", "", t, std::optional<ScalarType>(),
              std::optional<torch::headeronly::Layout>(), std::optional<Device>(), std::optional<bool>(),
              std::optional<torch::headeronly::MemoryFormat>());
}

// like.new_empty(sizes): contiguous, like's dtype and device.
inline Tensor new_empty(const Tensor& like, IntHeaderOnlyArrayRef sizes) {
  return empty(sizes, like.scalar_type(), like.device());
}

// The (0,) tensor that stands for an output not asked for (a distinct one per call: outputs never alias).
inline Tensor new_empty_output(const Tensor& like) {
  const int64_t zero = 0;
  return new_empty(like, IntHeaderOnlyArrayRef(&zero, 1));
}

inline void fill_(const Tensor& t, double value) {
  stable::check(aoti_torch_aten_fill__Scalar(t.get(), value), "attnx: aten::fill_");
}

inline void zero_(const Tensor& t) {
  fill_(t, 0.0);
}

inline Tensor new_zeros(const Tensor& like, IntHeaderOnlyArrayRef sizes) {
  const Tensor t = new_empty(like, sizes);
  zero_(t);
  return t;
}

// dst.copy_(src), src broadcast to dst's shape.
inline void copy_(const Tensor& dst, const Tensor& src) {
  stable::check(aoti_torch_copy_(dst.get(), src.get(), /*non_blocking=*/0), "attnx: aten::copy_");
}

// t.to(dtype): t itself when it is in dtype already, else a contiguous converted copy.
inline Tensor to(const Tensor& t, ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  const Tensor converted = empty(t.sizes(), dtype, t.device());
  copy_(converted, t);
  return converted;
}

// t.contiguous(): t itself when it is contiguous, else a copy.
inline Tensor contiguous(const Tensor& t) {
  if (t.is_contiguous()) return t;
  const Tensor copy = empty(t.sizes(), t.scalar_type(), t.device());
  copy_(copy, t);
  return copy;
}

// A 0-dim CPU float64 tensor: how a Scalar reaches an op's Tensor overload (see the top of this file).
inline Tensor scalar_tensor(double value) {
  AtenTensorHandle out = nullptr;
  stable::check(aoti_torch_scalar_to_tensor_float64(value, &out), "attnx: a scalar");
  return Tensor(out);
}

// torch.full(sizes, value, dtype, device).
inline Tensor full(IntHeaderOnlyArrayRef sizes, double value, ScalarType dtype, const Device& device) {
  AtenTensorHandle out = nullptr;
  int32_t dtype_code = detail::code(dtype), device_code = detail::code(device.type());
  stable::check(aoti_torch_aten_full(sizes.data(), static_cast<int64_t>(sizes.size()), value, &dtype_code,
                                     nullptr, &device_code, device.index(), nullptr, &out),
                "attnx: aten::full");
  return Tensor(out);
}

// a - alpha * b, computed as a + (-alpha) * b by torch's kernels: so add is the sum itself, bit for bit.
inline Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0) {
  AtenTensorHandle out = nullptr;
  stable::check(aoti_torch_aten_subtract_Tensor(a.get(), b.get(), alpha, &out), "attnx: aten::sub");
  return Tensor(out);
}

inline Tensor add(const Tensor& a, const Tensor& b) {
  return sub(a, b, -1.0);
}

// dst += src, dst keeping its layout.
inline void add_(const Tensor& dst, const Tensor& src) {
  copy_(dst, add(dst, src));
}

// F.pad(t, pad, value=value), constant mode: pad lists (before, after) pairs from the last dim backwards.
inline Tensor pad(const Tensor& t, IntHeaderOnlyArrayRef pad, double value = 0.0) {
  AtenTensorHandle out = nullptr;
  stable::check(
      aoti_torch_aten_pad(t.get(), pad.data(), static_cast<int64_t>(pad.size()), "constant", &value, &out),
      "attnx: aten::pad");
  return Tensor(out);
}

// ---------------------------------------------------------------------------------------------------------------
// Ops through the dispatcher.

inline Tensor mul(const Tensor& a, const Tensor& b) {
  return call("aten::mul", "Tensor", a, b);
}
inline Tensor mul(const Tensor& a, double b) {
  return mul(a, scalar_tensor(b));
}
inline Tensor div(const Tensor& a, double b) {
  return call("aten::div", "Tensor", a, scalar_tensor(b));
}
// In place. (Each returns its first argument as a new handle, released here.)
inline void mul_(const Tensor& a, double b) {
  call("aten::mul_", "Tensor", a, scalar_tensor(b));
}
inline void div_(const Tensor& a, double b) {
  call("aten::div_", "Tensor", a, scalar_tensor(b));
}
inline void tanh_(const Tensor& t) {
  call("aten::tanh_", "", t);
}
inline void exp_(const Tensor& t) {
  call("aten::exp_", "", t);
}
inline void masked_fill_(const Tensor& t, const Tensor& mask, double value) {
  call("aten::masked_fill_", "Tensor", t, mask, scalar_tensor(value));
}
inline Tensor clone(const Tensor& t) {
  return call("aten::clone", "", t, std::optional<torch::headeronly::MemoryFormat>());
}
inline Tensor neg(const Tensor& t) {
  return call("aten::neg", "", t);
}
inline Tensor square(const Tensor& t) {
  return call("aten::square", "", t);
}
inline Tensor exp(const Tensor& t) {
  return call("aten::exp", "", t);
}
inline Tensor tanh(const Tensor& t) {
  return call("aten::tanh", "", t);
}

inline Tensor masked_fill(const Tensor& t, const Tensor& mask, double value) {
  return call("aten::masked_fill", "Tensor", t, mask, scalar_tensor(value));
}
// t.clamp(min, max) with tensor bounds on t's device (clamp.Tensor takes no CPU scalar beside a GPU tensor).
inline Tensor clamp(const Tensor& t, const Tensor& min, const Tensor& max) {
  return call("aten::clamp", "Tensor", t, OptTensor(min), OptTensor(max));
}

inline Tensor lt(const Tensor& a, const Tensor& b) {
  return call("aten::lt", "Tensor", a, b);
}
inline Tensor le(const Tensor& a, const Tensor& b) {
  return call("aten::le", "Tensor", a, b);
}
inline Tensor ge(const Tensor& a, const Tensor& b) {
  return call("aten::ge", "Tensor", a, b);
}
inline Tensor logical_and(const Tensor& a, const Tensor& b) {
  return call("aten::logical_and", "", a, b);
}
inline Tensor logical_not(const Tensor& t) {
  return call("aten::logical_not", "", t);
}
inline Tensor isposinf(const Tensor& t) {
  return call("aten::isposinf", "", t);
}
inline Tensor isneginf(const Tensor& t) {
  return call("aten::isneginf", "", t);
}

// t.sum(dims, keepdim), in t's dtype.
inline Tensor sum(const Tensor& t, std::vector<int64_t> dims, bool keepdim = false) {
  return call("aten::sum", "dim_IntList", t, std::optional(std::move(dims)), keepdim,
              std::optional<ScalarType>());
}
// torch.sum(t, dims, out=out).
inline void sum_out(const Tensor& out, const Tensor& t, std::vector<int64_t> dims) {
  call("aten::sum", "IntList_out", t, std::optional(std::move(dims)), false, std::optional<ScalarType>(),
       out);
}
inline Tensor mean(const Tensor& t, std::vector<int64_t> dims) {
  return call("aten::mean", "dim", t, std::optional(std::move(dims)), false, std::optional<ScalarType>());
}
inline Tensor sum_to_size(const Tensor& t, std::vector<int64_t> sizes) {
  return call("aten::sum_to_size", "", t, std::move(sizes));
}
inline Tensor logsumexp(const Tensor& t, std::vector<int64_t> dims, bool keepdim) {
  return call("aten::logsumexp", "", t, std::move(dims), keepdim);
}
inline Tensor logaddexp(const Tensor& a, const Tensor& b) {
  return call("aten::logaddexp", "", a, b);
}
// torch's FlashAttention-2 forward (aten::_flash_attention_forward; CUDA builds of torch) on (B, L, H, D)
// query, key and value (grouped KV heads allowed), no dropout: out (B, L, H, D) as empty_like(query) and lse
// (B, H, L) float32. The window is FlashAttention-2's (nullopt: unbounded). torch's schema has grown at its
// end (torch 2.10 ends at alibi_slopes, later ones add block_table and num_splits): every argument of the
// newest is passed, and the entries after them read as None to a torch that has more. (The public
// _scaled_dot_product_flash_attention returns SymInts between tensors, which the stable dispatcher of
// torch 2.10 to 2.14 converts with the wrong types: "Expected Tensor but got Int".)
inline std::array<Tensor, 2> flash_attention_forward(const Tensor& query, const Tensor& key,
                                                     const Tensor& value, double scale,
                                                     std::optional<int64_t> window_left,
                                                     std::optional<int64_t> window_right) {
  using stable::detail::box;
  std::array<StableIValue, 24> stack;
  stack.fill(torch::stable::detail::from(std::nullopt));
  const StableIValue args[] = {box(query), box(key), box(value), box(OptTensor()), box(OptTensor()),
                               box(query.size(1)), box(key.size(1)), box(0.0), box(false), box(false),
                               box(std::optional<double>(scale)), box(window_left), box(window_right)};
  std::copy(std::begin(args), std::end(args), stack.begin());
  stable::dispatch("aten::_flash_attention_forward", "", stack.data());
  // (output, softmax_logsumexp, rng_state, unused, debug_attn_mask): the last three released here.
  std::array<Tensor, 5> out;
  for (size_t i = 0; i < out.size(); ++i) out[i] = torch::stable::detail::to<Tensor>(stack[i]);
  return {out[0], out[1]};
}
inline Tensor softmax(const Tensor& t, int64_t dim) {
  return call("aten::softmax", "int", t, dim, std::optional<ScalarType>());
}
inline Tensor cumsum(const Tensor& t, int64_t dim) {
  return call("aten::cumsum", "", t, dim, std::optional<ScalarType>());
}
inline Tensor cat(std::vector<Tensor> tensors, int64_t dim) {
  return call("aten::cat", "", std::move(tensors), dim);
}

inline Tensor mm(const Tensor& a, const Tensor& b) {
  return call("aten::mm", "", a, b);
}
// torch.mm(a, b, out=out).
inline void mm_out(const Tensor& out, const Tensor& a, const Tensor& b) {
  call("aten::mm", "out", a, b, out);
}
// F.linear(input, weight, bias) into out (2-D input: addmm_out(out, bias, input, weight^T), F.linear's GEMM).
inline void linear_out(const Tensor& out, const Tensor& input, const Tensor& weight, const OptTensor& bias) {
  call("aten::linear", "out", input, weight, bias, out);
}
inline Tensor bmm(const Tensor& a, const Tensor& b) {
  return call("aten::bmm", "", a, b);
}
inline Tensor matmul(const Tensor& a, const Tensor& b) {
  return call("aten::matmul", "", a, b);
}

}  // namespace attnx::aten
