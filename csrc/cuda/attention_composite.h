// attnx: attnx::attention's composite for head dims above the CUDA kernels' kMaxHeadDim, in torch's ops
// (common/aten.h, views from common/views.h): no ATen or c10 header.
//
// Device-agnostic on purpose: cuda/attention.cpp runs it on CUDA tensors, and the same code runs on CPU
// tensors, so that it can be checked against the float64 reference without a GPU. Sums and differences are
// out of place (aten::add / aten::sub, see aten.h); the key ranges come from common/key_range_mask.h.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/aten.h"
#include "common/attention.h"
#include "common/key_range_mask.h"
#include "common/views.h"

namespace attnx::cuda {

// Every op goes through common/aten.h, so that an error (out of memory, say) reaches the caller with torch's
// own message.
namespace composite {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// A mask as the additive term it stands for, in the accumulator dtype: bool true = -inf, a float as it is.
inline Tensor additive(const Tensor& mask, ScalarType acc) {
  if (mask.scalar_type() == ScalarType::Bool) {
    const Tensor zeros = aten::empty(mask.sizes(), acc, mask.device());
    aten::zero_(zeros);
    aten::masked_fill_(zeros, mask, -INFINITY);
    return zeros;
  }
  return aten::to(mask, acc);
}

}  // namespace composite

// Head dims above the kernel's kMaxHeadDim: the reference's formula on torch's ops (cuBLAS GEMMs), over
// chunks of queries sized so that the scores of one chunk, (B, H, rows, S) in the accumulator dtype, stay
// within 256 MiB. Nothing (B, H, L, S)-sized exists; masks are sliced per chunk, never merged beyond one
// chunk. Slower than a fused kernel, but such head dims are rare. The sums are out of place, so a chunk holds
// up to three score-sized tensors at once (the scores, the masks' sum and the new scores).
//
// The kernels' features, the kernels' way: grouped KV heads as a (B, Hkv, G * rows, D) view of each query
// chunk against the (B, Hkv, ...) keys and values (one batched GEMM per group, keys never repeated); the key
// range as a bool mask of the chunk that removes keys outright (as the kernels, which never read them: a NaN
// there does not reach the output); soft-capping before the masks; the sink in the logsumexp.
inline void attention_composite(AttentionProblem& pb) {
  using namespace composite;
  const AttentionParams& p = pb.params;
  const AttentionOptions& o = pb.options;
  const int64_t B = p.batch, H = p.heads, Hkv = p.kv_heads, L = p.q_len, S = p.kv_len;
  const int64_t G = Hkv > 0 ? H / Hkv : 1;  // query heads per kv head
  const ScalarType acc = pb.lse.scalar_type();  // the accumulator dtype
  const double s = attention_scale(o, p.head_dim);
  const int64_t row_bytes = std::max<int64_t>(B * H * S * static_cast<int64_t>(pb.lse.element_size()), 1);
  const int64_t rows = std::clamp<int64_t>((int64_t{256} << 20) / row_bytes, 1, std::max<int64_t>(L, 1));
  const torch::stable::Device device = pb.query.device();

  std::optional<Tensor> mask4;  // attn_mask as a 4-D view broadcastable to (B, H, L, S)
  if (o.attn_mask) {
    const Tensor& m = *o.attn_mask;
    if (m.dim() == 2) {
      mask4 = views::unsqueeze(views::unsqueeze(m, 0), 0);
    } else if (m.dim() == 3) {
      mask4 = views::view(m, {B, H, m.size(1), m.size(2)});
    } else {
      mask4 = m;
    }
  }
  std::optional<Tensor> padding;  // (B, 1, 1, S)
  if (o.key_padding_mask) padding = views::reshape(additive(*o.key_padding_mask, acc), {B, 1, 1, S});
  std::optional<Tensor> sinks;  // (1, H, 1, 1) in the accumulator dtype
  if (pb.sinks_acc) sinks = views::view(*pb.sinks_acc, {1, H, 1, 1});
  // (B, Hkv, D, S) and (B, Hkv, S, Dv)
  const Tensor kt = views::transpose(aten::to(pb.key, acc), -2, -1);
  const Tensor v = aten::to(pb.value, acc);

  for (int64_t l0 = 0; l0 < L; l0 += rows) {
    const int64_t n = std::min(rows, L - l0);
    // (B, H, n, D) -> (B, Hkv, G * n, D): the G query heads of a kv head are consecutive.
    const Tensor qg =
        views::reshape(aten::to(views::narrow(pb.query, 2, l0, n), acc), {B, Hkv, G * n, p.head_dim});
    Tensor scores = views::view(aten::matmul(qg, kt), {B, H, n, S});
    aten::mul_(scores, s);
    if (o.softcap) {
      aten::div_(scores, *o.softcap);
      aten::tanh_(scores);
      aten::mul_(scores, *o.softcap);
    }
    // scores + (attn_mask + key_padding_mask), summed in the reference's order; then the keys the rows do not
    // see at all.
    if (mask4 || padding) {
      const int64_t bias_sizes[2] = {n, S};
      Tensor bias = aten::new_zeros(scores, bias_sizes);
      if (mask4)
        bias = aten::add(bias, additive(mask4->size(2) == 1 ? *mask4 : views::narrow(*mask4, 2, l0, n), acc));
      if (padding) bias = aten::add(bias, *padding);
      scores = aten::add(scores, bias);
    }
    if (const std::optional<Tensor> seen = key_range_mask(B, L, S, p.is_causal, p.window_left, p.window_right,
                                                          o.key_lengths, l0, n, device)) {
      aten::masked_fill_(scores, aten::logical_not(*seen), -INFINITY);
    }
    // -inf for a row that sees no key
    Tensor lse = aten::logsumexp(scores, {-1}, /*keepdim=*/true);
    const Tensor empty = aten::isneginf(lse);
    if (sinks) lse = aten::logaddexp(lse, *sinks);
    scores = aten::sub(scores, lse);  // the probabilities, in place of the scores from here on
    aten::exp_(scores);
    aten::masked_fill_(scores, empty, 0.0);
    const Tensor o_rows =
        views::view(aten::matmul(views::view(scores, {B, Hkv, G * n, S}), v), {B, H, n, p.v_head_dim});
    aten::copy_(views::narrow(pb.out, 2, l0, n), o_rows);
    const Tensor lse_rows = views::view(lse, {B, H, n});
    aten::masked_fill_(lse_rows, views::view(empty, {B, H, n}), INFINITY);
    aten::copy_(views::narrow(pb.lse, 2, l0, n), lse_rows);
  }
}

}  // namespace attnx::cuda
