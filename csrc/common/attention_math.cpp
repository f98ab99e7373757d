// attnx: attention in plain ATen ops, for what needs the (B, H, L, S) probabilities anyway: the attention
// weights mha returns when asked, and attention_backward on backends without a fused backward kernel.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "common/attention.h"

namespace attnx {

at::Tensor attention_probabilities(const at::Tensor& query, const at::Tensor& key, const at::Tensor& lse,
                                   const std::optional<at::Tensor>& attn_mask,
                                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                   double scale) {
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), S = key.size(2);
  const auto acc = lse.scalar_type();
  at::Tensor scores = at::matmul(query.to(acc), key.to(acc).transpose(-2, -1)).mul_(scale);
  const auto add_mask = [&](const at::Tensor& mask) {
    if (mask.scalar_type() == at::kBool) {
      scores.masked_fill_(mask, -std::numeric_limits<double>::infinity());
    } else {
      scores.add_(mask.to(acc));
    }
  };
  if (attn_mask) add_mask(attn_mask->dim() == 3 ? attn_mask->view({B, H, L, S}) : *attn_mask);
  if (key_padding_mask) add_mask(key_padding_mask->view({B, 1, 1, S}));
  if (is_causal) add_mask(at::ones({L, S}, query.options().dtype(at::kBool)).triu(1));
  // A fully masked row has scores -inf and lse +inf: exp(-inf) = 0, never NaN.
  return scores.sub_(lse.unsqueeze(-1)).exp_();
}

namespace {

// FlashAttention-2's backward in whole-tensor form: P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
// dQ = scale dS K, dK = scale dS^T Q. Correct everywhere, fast nowhere: it stores P and dS.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_math(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, std::optional<double> scale,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  // The fused kernels' checks, and gradients allocated in their layout.
  AttentionBackwardProblem pb = prepare_attention_backward(grad_out, query, key, value, out, lse, attn_mask,
                                                           key_padding_mask, is_causal, scale, dropout_p,
                                                           dropout_seed);
  TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0, "attnx::attention_backward: dropout has no backward on ",
                              query.device().type(), " yet (the CPU kernel has one)");
  const double s = scale ? *scale : 1.0 / std::sqrt(double(query.size(3)));
  const auto acc = lse.scalar_type();
  const at::Tensor q = query.to(acc), k = key.to(acc), d_out = grad_out.to(acc);
  const at::Tensor p = attention_probabilities(query, key, lse, attn_mask, key_padding_mask, is_causal, s);
  const at::Tensor delta = (d_out * out.to(acc)).sum(-1, /*keepdim=*/true);
  const at::Tensor ds = p * (at::matmul(d_out, value.to(acc).transpose(-2, -1)) - delta);
  pb.grad_value.copy_(at::matmul(p.transpose(-2, -1), d_out));
  pb.grad_query.copy_(at::matmul(ds, k).mul_(s));
  pb.grad_key.copy_(at::matmul(ds.transpose(-2, -1), q).mul_(s));
  return {pb.grad_query, pb.grad_key, pb.grad_value};
}

}  // namespace
}  // namespace attnx

// Backends with a fused backward kernel (CPU) register their own, which the dispatcher prefers.
TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("attention_backward", &attnx::attention_backward_math);
}
