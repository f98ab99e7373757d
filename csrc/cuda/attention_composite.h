// attnx: attnx::attention's composite for head dims above the CUDA kernels' kMaxHeadDim, in torch's ops
// through the stable ABI (common/stable.h): no ATen or c10 header.
//
// Device-agnostic on purpose: attention_cuda.cpp runs it on CUDA tensors, and the same code runs on CPU
// tensors, so that it can be checked against the float64 reference without a GPU.
//
// The stable dispatcher passes no Scalar, which shapes three things here. A scalar operand is a 0-dim CPU
// float64 tensor (stable::scalar) given to the op's Tensor overload: mul_, div_, clamp_min, clamp_max and
// masked_fill_ take one beside CUDA tensors (binary ops accept one CPU scalar; masked_fill_ reads its value
// on the host), clamp.Tensor does not (it has no CPU-scalar exception: both bounds would have to be on the
// device). add and sub take their alpha as a Scalar, so sums and differences go through the C shim's
// subtract, whose alpha is a double, out of place. And arange takes only Scalars, so positions are a
// cumulative sum, in float64, which holds every position here exactly.
#pragma once

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/attention.h"
#include "common/stable.h"

namespace attnx::cuda {

// Every op goes through stable::call or stable::check, so that an error (out of memory, say) reaches the
// caller with torch's own message.
namespace composite {

using stable::call;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Helpers named apart from torch::stable's ops (argument-dependent lookup would find those too).

inline Tensor shaped(const Tensor& t, std::vector<int64_t> sizes) {
  return call("aten::view", "", t, sizes);
}

inline Tensor narrowed(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  return call("aten::narrow", "", t, dim, start, length);
}

// t.to(dtype): t itself when it is in dtype already, else a copy in t's memory layout.
inline Tensor converted(const Tensor& t, ScalarType dtype) {
  return call("aten::to", "dtype", t, dtype, /*non_blocking=*/false, /*copy=*/false,
              std::optional<torch::headeronly::MemoryFormat>());
}

using stable::fill;

// (n,) float64 on `device`: first, first + 1, ..., first + n - 1 (arange's values), as the cumulative sum of
// [first, 1, 1, ...]. Exact while the values stay below 2^53 in magnitude, which key_range_seen ensures.
inline Tensor positions(int64_t first, int64_t n, const torch::stable::Device& device) {
  const Tensor steps = stable::empty({n}, ScalarType::Double, device);
  fill(steps, 1.0);
  if (n > 0) fill(narrowed(steps, 0, 0, 1), static_cast<double>(first));
  return call("aten::cumsum", "", steps, int64_t{0}, std::optional<ScalarType>());
}

// A mask as the additive term it stands for, in the accumulator dtype: bool true = -inf, a float as it is.
inline Tensor additive(const Tensor& mask, ScalarType acc) {
  if (mask.scalar_type() == ScalarType::Bool) {
    const std::vector<int64_t> sizes(mask.sizes().begin(), mask.sizes().end());
    const Tensor zeros =
        call("aten::new_zeros", "", mask, sizes, std::optional<ScalarType>(acc), std::nullopt, std::nullopt,
             std::nullopt);
    call("aten::masked_fill_", "Tensor", zeros, mask, stable::scalar(-INFINITY));
    return zeros;
  }
  return converted(mask, acc);
}

// The bool (B, 1, rows, S) tensor of the keys that query rows l0 .. l0 + rows - 1 see at all
// (attnx/key_range.h: is_causal, per-batch key lengths clamped into [0, S], the bottom-right window), or
// nothing when they see every key.
//
// Row l sees key s when s < len_b, s >= l + len_b - L - window_left, s <= l + len_b - L + window_right and,
// under is_causal, s <= l. The window tests are made on s - len_b (one (B, 1, 1, S) tensor) against
// l - L - window_left and l - L + window_right (one (1, 1, rows, 1) tensor each). A window that reaches past
// every key is the same as no window: window_left >= S and window_right >= L + S pass every key, so they are
// capped there, which keeps every value small enough for float64 to hold exactly (and the host arithmetic
// from overflowing).
inline std::optional<Tensor> key_range_seen(const AttentionParams& p,
                                            const std::optional<Tensor>& key_lengths, int64_t l0,
                                            int64_t rows, const torch::stable::Device& device) {
  const int64_t B = p.batch, L = p.q_len, S = p.kv_len;
  if (!p.is_causal && p.window_left < 0 && p.window_right < 0 && !key_lengths) return std::nullopt;
  Tensor lengths = key_lengths ? converted(*key_lengths, ScalarType::Double)
                               : stable::empty({B}, ScalarType::Double, device);
  if (key_lengths) {
    lengths = call("aten::clamp_min", "Tensor", lengths, stable::scalar(0.0));
    lengths = call("aten::clamp_max", "Tensor", lengths, stable::scalar(static_cast<double>(S)));
  } else {
    fill(lengths, static_cast<double>(S));
  }
  lengths = shaped(lengths, {B, 1, 1, 1});
  const Tensor col = shaped(positions(0, S, device), {1, 1, 1, S});
  Tensor seen = call("aten::lt", "Tensor", col, lengths);  // (B, 1, 1, S)
  if (p.window_left >= 0 || p.window_right >= 0) {
    const Tensor from_end = stable::sub(col, lengths);  // s - len_b, (B, 1, 1, S)
    if (p.window_left >= 0) {
      const int64_t window_left = std::min(p.window_left, S);
      const Tensor first = shaped(positions(l0 - L - window_left, rows, device), {1, 1, rows, 1});
      seen = call("aten::logical_and", "", seen, call("aten::ge", "Tensor", from_end, first));
    }
    if (p.window_right >= 0) {
      const int64_t window_right = std::min(p.window_right, L + S);
      const Tensor last = shaped(positions(l0 - L + window_right, rows, device), {1, 1, rows, 1});
      seen = call("aten::logical_and", "", seen, call("aten::le", "Tensor", from_end, last));
    }
  }
  if (p.is_causal) {
    const Tensor row = shaped(positions(l0, rows, device), {1, 1, rows, 1});
    seen = call("aten::logical_and", "", seen, call("aten::le", "Tensor", col, row));
  }
  return seen;
}

}  // namespace composite

// Head dims above the kernel's kMaxHeadDim: the reference's formula on torch's ops (cuBLAS GEMMs), over
// chunks of queries sized so that the scores of one chunk, (B, H, rows, S) in the accumulator dtype, stay
// within 256 MiB. Nothing (B, H, L, S)-sized exists; masks are sliced per chunk, never merged beyond one
// chunk. Slower than a fused kernel, but such head dims are rare. The sums are out of place (see above), so a
// chunk holds up to three score-sized tensors at once (the scores, the masks' sum and the new scores) where
// in-place sums held two.
//
// The kernels' features, the kernels' way: grouped KV heads as a (B, Hkv, G * rows, D) view of each query
// chunk against the (B, Hkv, ...) keys and values (one batched GEMM per group, keys never repeated); the key
// range as a bool mask of the chunk that removes keys outright (as the kernels, which never read them: a NaN
// there does not reach the output); soft-capping before the masks; the sink in the logsumexp.
inline void attention_composite(const torch::stable::Tensor& query, const torch::stable::Tensor& key,
                                const torch::stable::Tensor& value,
                                const std::optional<torch::stable::Tensor>& attn_mask,
                                const std::optional<torch::stable::Tensor>& key_padding_mask,
                                const std::optional<torch::stable::Tensor>& key_lengths,
                                std::optional<double> scale, std::optional<double> softcap,
                                AttentionProblem& pb) {
  using namespace composite;
  const AttentionParams& p = pb.params;
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, L = p.q_len, S = p.kv_len;
  const int64_t G = Hkv > 0 ? H / Hkv : 1;  // query heads per kv head
  const ScalarType acc = pb.lse.scalar_type();  // the accumulator dtype
  const double s = scale ? *scale : (p.head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(p.head_dim)) : 1.0);
  const int64_t row_bytes = std::max<int64_t>(B * H * S * static_cast<int64_t>(pb.lse.element_size()), 1);
  const int64_t rows = std::clamp<int64_t>((int64_t{256} << 20) / row_bytes, 1, std::max<int64_t>(L, 1));
  const torch::stable::Device device = query.device();

  std::optional<Tensor> mask4;  // attn_mask as a 4-D view broadcastable to (B, H, L, S)
  if (attn_mask) {
    if (attn_mask->dim() == 2) {
      mask4 = call("aten::unsqueeze", "", call("aten::unsqueeze", "", *attn_mask, int64_t{0}), int64_t{0});
    } else if (attn_mask->dim() == 3) {
      mask4 = call("aten::unflatten", "int", *attn_mask, int64_t{0}, std::vector<int64_t>{B, H});
    } else {
      mask4 = *attn_mask;
    }
  }
  std::optional<Tensor> padding;  // (B, 1, 1, S)
  if (key_padding_mask) padding = shaped(additive(*key_padding_mask, acc), {B, 1, 1, S});
  std::optional<Tensor> sinks;  // (1, H, 1, 1) in the accumulator dtype
  if (pb.sinks_acc) sinks = shaped(*pb.sinks_acc, {1, H, 1, 1});
  // (B, Hkv, D, S) and (B, Hkv, S, Dv)
  const Tensor kt = call("aten::transpose", "int", converted(key, acc), int64_t{-2}, int64_t{-1});
  const Tensor v = converted(value, acc);
  const Tensor scale_t = stable::scalar(s);

  for (int64_t l0 = 0; l0 < L; l0 += rows) {
    const int64_t n = std::min(rows, L - l0);
    // (B, H, n, D) -> (B, Hkv, G * n, D): the G query heads of a kv head are consecutive.
    const Tensor qg = call("aten::reshape", "", converted(narrowed(query, 2, l0, n), acc),
                           std::vector<int64_t>{B, Hkv, G * n, p.head_dim});
    Tensor scores = shaped(call("aten::matmul", "", qg, kt), {B, H, n, S});
    call("aten::mul_", "Tensor", scores, scale_t);
    if (softcap) {
      const Tensor cap = stable::scalar(*softcap);
      call("aten::div_", "Tensor", scores, cap);
      call("aten::tanh_", "", scores);
      call("aten::mul_", "Tensor", scores, cap);
    }
    // scores + (attn_mask + key_padding_mask), summed in the reference's order; then the keys the rows do not
    // see at all.
    if (mask4 || padding) {
      Tensor bias = call("aten::new_zeros", "", scores, std::vector<int64_t>{n, S},
                         std::optional<ScalarType>(), std::nullopt, std::nullopt, std::nullopt);
      if (mask4) {
        bias = stable::add(bias, additive(mask4->size(2) == 1 ? *mask4 : narrowed(*mask4, 2, l0, n), acc));
      }
      if (padding) bias = stable::add(bias, *padding);
      scores = stable::add(scores, bias);
    }
    if (const std::optional<Tensor> seen = key_range_seen(p, key_lengths, l0, n, device)) {
      call("aten::masked_fill_", "Tensor", scores, call("aten::logical_not", "", *seen),
           stable::scalar(-INFINITY));
    }
    // -inf for a row that sees no key
    Tensor lse = call("aten::logsumexp", "", scores, std::vector<int64_t>{-1}, /*keepdim=*/true);
    const Tensor empty = call("aten::isneginf", "", lse);
    if (sinks) lse = call("aten::logaddexp", "", lse, *sinks);
    scores = stable::sub(scores, lse);  // the probabilities, in place of the scores from here on
    call("aten::exp_", "", scores);
    call("aten::masked_fill_", "Tensor", scores, empty, stable::scalar(0.0));
    const Tensor o = shaped(call("aten::matmul", "", shaped(scores, {B, Hkv, G * n, S}), v),
                            {B, H, n, p.v_head_dim});
    stable::copy_into(narrowed(pb.out, 2, l0, n), o);
    const Tensor lse_rows = call("aten::squeeze", "dim", lse, int64_t{-1});
    call("aten::masked_fill_", "Tensor", lse_rows, call("aten::squeeze", "dim", empty, int64_t{-1}),
         stable::scalar(INFINITY));
    stable::copy_into(narrowed(pb.lse, 2, l0, n), lse_rows);
  }
}

}  // namespace attnx::cuda
