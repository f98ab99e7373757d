// attnx: attnx::attention's composite for head dims above the CUDA kernels' kMaxHeadDim, in ATen ops only.
//
// Device-agnostic on purpose: attention_cuda.cpp runs it on CUDA tensors, and tests/test_cuda_emulation.py
// compiles this header for the CPU and checks it against the float64 reference, so that it is verified
// without a GPU too.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "common/attention.h"

namespace attnx::cuda {

// A mask as the additive term it stands for, in the accumulator dtype: bool true = -inf, a float as it is.
inline at::Tensor additive(const at::Tensor& mask, at::ScalarType acc) {
  if (mask.scalar_type() == at::kBool) {
    return at::zeros(mask.sizes(), mask.options().dtype(acc)).masked_fill_(mask, -INFINITY);
  }
  return mask.to(acc);
}

// The bool (B, 1, rows, S) tensor of the keys that query rows l0 .. l0 + rows - 1 see at all
// (attnx/key_range.h: is_causal, per-batch key lengths clamped into [0, S], the bottom-right window), or an
// undefined tensor when they see every key.
inline at::Tensor key_range_seen(const AttentionParams& p, const std::optional<at::Tensor>& key_lengths,
                                 int64_t l0, int64_t rows, const at::TensorOptions& options) {
  const int64_t B = p.batch, L = p.q_len, S = p.kv_len;
  if (!p.is_causal && p.window_left < 0 && p.window_right < 0 && !key_lengths) return at::Tensor();
  const auto long_opts = options.dtype(at::kLong);
  const at::Tensor lengths = key_lengths ? key_lengths->to(at::kLong).clamp(0, S).view({B, 1, 1, 1})
                                         : at::full({B, 1, 1, 1}, S, long_opts);
  const at::Tensor row = at::arange(l0, l0 + rows, long_opts).view({1, 1, rows, 1});
  const at::Tensor col = at::arange(S, long_opts).view({1, 1, 1, S});
  at::Tensor seen = col < lengths;
  const at::Tensor diagonal = row + lengths - L;  // the key position of each query row
  if (p.window_left >= 0) seen = seen & (col >= diagonal - p.window_left);
  if (p.window_right >= 0) seen = seen & (col <= diagonal + p.window_right);
  if (p.is_causal) seen = seen & (col <= row);
  return seen;
}

// Head dims above the kernel's kMaxHeadDim: the reference's formula on ATen ops (cuBLAS GEMMs), over chunks
// of queries sized so that the scores of one chunk, (B, H, rows, S) in the accumulator dtype, stay within 256
// MiB. Nothing (B, H, L, S)-sized exists; masks are sliced per chunk, never merged beyond one chunk. Slower
// than a fused kernel, but such head dims are rare.
//
// The kernels' features, the kernels' way: grouped KV heads as a (B, Hkv, G * rows, D) view of each query
// chunk against the (B, Hkv, ...) keys and values (one batched GEMM per group, keys never repeated); the key
// range as a bool mask of the chunk that removes keys outright (as the kernels, which never read them: a NaN
// there does not reach the output); soft-capping before the masks; the sink in the logsumexp.
inline void attention_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const std::optional<at::Tensor>& attn_mask,
                                const std::optional<at::Tensor>& key_padding_mask,
                                const std::optional<at::Tensor>& key_lengths, std::optional<double> scale,
                                std::optional<double> softcap, AttentionProblem& pb) {
  const AttentionParams& p = pb.params;
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, L = p.q_len, S = p.kv_len;
  const int64_t G = Hkv > 0 ? H / Hkv : 1;  // query heads per kv head
  const at::ScalarType acc = pb.lse.scalar_type();  // the accumulator dtype
  const double s = scale ? *scale : (p.head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(p.head_dim)) : 1.0);
  const int64_t row_bytes = std::max<int64_t>(B * H * S * static_cast<int64_t>(c10::elementSize(acc)), 1);
  const int64_t rows = std::clamp<int64_t>((int64_t{256} << 20) / row_bytes, 1, std::max<int64_t>(L, 1));

  std::optional<at::Tensor> mask4;  // attn_mask as a 4-D view broadcastable to (B, H, L, S)
  if (attn_mask) {
    mask4 = attn_mask->dim() == 2   ? attn_mask->unsqueeze(0).unsqueeze(0)
            : attn_mask->dim() == 3 ? attn_mask->unflatten(0, {B, H})
                                    : *attn_mask;
  }
  std::optional<at::Tensor> padding;  // (B, 1, 1, S)
  if (key_padding_mask) padding = additive(*key_padding_mask, acc).view({B, 1, 1, S});
  std::optional<at::Tensor> sinks;  // (1, H, 1, 1) in the accumulator dtype
  if (pb.sinks_acc.defined()) sinks = pb.sinks_acc.view({1, H, 1, 1});
  const at::Tensor kt = key.to(acc).transpose(-2, -1);  // (B, Hkv, D, S)
  const at::Tensor v = value.to(acc);                     // (B, Hkv, S, Dv)

  for (int64_t l0 = 0; l0 < L; l0 += rows) {
    const int64_t n = std::min(rows, L - l0);
    // (B, H, n, D) -> (B, Hkv, G * n, D): the G query heads of a kv head are consecutive.
    const at::Tensor qg = query.narrow(2, l0, n).to(acc).reshape({B, Hkv, G * n, p.head_dim});
    at::Tensor scores = at::matmul(qg, kt).view({B, H, n, S}).mul_(s);
    if (softcap) scores.div_(*softcap).tanh_().mul_(*softcap);
    // scores + (attn_mask + key_padding_mask), summed in the reference's order; then the keys the rows do not
    // see at all.
    if (mask4 || padding) {
      at::Tensor bias = at::zeros({n, S}, scores.options());
      if (mask4) bias = bias + additive(mask4->size(2) == 1 ? *mask4 : mask4->narrow(2, l0, n), acc);
      if (padding) bias = bias + *padding;
      scores.add_(bias);
    }
    const at::Tensor seen = key_range_seen(p, key_lengths, l0, n, scores.options());
    if (seen.defined()) scores.masked_fill_(seen.logical_not(), -INFINITY);
    at::Tensor lse = at::logsumexp(scores, -1, /*keepdim=*/true);  // -inf for a row that sees no key
    const at::Tensor empty = lse.isneginf();
    if (sinks) lse = at::logaddexp(lse, *sinks);
    at::Tensor probs = scores.sub_(lse).exp_().masked_fill_(empty, 0);
    const at::Tensor o = at::matmul(probs.view({B, Hkv, G * n, S}), v).view({B, H, n, p.v_head_dim});
    pb.out.narrow(2, l0, n).copy_(o);
    pb.lse.narrow(2, l0, n).copy_(lse.squeeze(-1).masked_fill_(empty.squeeze(-1), INFINITY));
  }
}

}  // namespace attnx::cuda
