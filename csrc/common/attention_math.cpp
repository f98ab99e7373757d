// attnx: attention in plain ATen ops, for what needs the (B, H, L, S) probabilities anyway: the attention
// weights mha returns when asked, and attention_backward on backends without a fused backward kernel.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "common/attention.h"

namespace attnx {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// (B, Hkv, G * L, E) view of a (B, H, L, E) tensor whose H = Hkv * G query heads are grouped by kv head, so
// that one batched GEMM against (B, Hkv, ...) keys serves a whole group without repeating the keys. A copy
// only when the strides do not allow the view (the math path materialises (B, H, L, S) anyway).
at::Tensor group_rows(const at::Tensor& t, int64_t kv_heads) {
  const int64_t B = t.size(0), H = t.size(1), L = t.size(2), E = t.size(3);
  return t.reshape({B, kv_heads, (H / kv_heads) * L, E});
}

// The inverse of group_rows for a result of shape (B, Hkv, G * L, E): (B, H, L, E).
at::Tensor ungroup_rows(const at::Tensor& t, int64_t heads) {
  return t.reshape({t.size(0), heads, t.size(2) * t.size(1) / heads, t.size(3)});
}

// The bool (B, 1, L, S) tensor of the keys each row sees at all (is_causal, key_lengths, the window; see
// attnx/key_range.h), or an undefined tensor when every key is seen.
at::Tensor key_range_mask(int64_t B, int64_t L, int64_t S, bool is_causal, int64_t window_left,
                          int64_t window_right, const std::optional<at::Tensor>& key_lengths,
                          const at::TensorOptions& options) {
  if (!is_causal && window_left < 0 && window_right < 0 && !key_lengths) return at::Tensor();
  const auto long_opts = options.dtype(at::kLong);
  const at::Tensor lengths =
      key_lengths ? key_lengths->to(at::kLong).clamp(0, S).view({B, 1, 1, 1}) : at::full({B, 1, 1, 1}, S, long_opts);
  const at::Tensor row = at::arange(L, long_opts).view({1, 1, L, 1});
  const at::Tensor col = at::arange(S, long_opts).view({1, 1, 1, S});
  at::Tensor seen = col < lengths;
  const at::Tensor diagonal = row + lengths - L;
  if (window_left >= 0) seen = seen & (col >= diagonal - window_left);
  if (window_right >= 0) seen = seen & (col <= diagonal + window_right);
  if (is_causal) seen = seen & (col <= row);
  return seen;
}

// key (or value) with the rows at or past each batch's key length zeroed: those keys are never read (a
// static cache's unfilled slots may hold NaN, which 0 * NaN would carry into the products). A copy, only with
// key_lengths.
at::Tensor valid_keys(const at::Tensor& t, const std::optional<at::Tensor>& key_lengths) {
  if (!key_lengths) return t;
  const at::Tensor beyond = at::arange(t.size(2), key_lengths->options().dtype(at::kLong)).view({1, 1, -1, 1}) >=
                            key_lengths->to(at::kLong).view({-1, 1, 1, 1});
  return t.masked_fill(beyond, 0);
}

// The scaled scores scale * Q K^T, (B, H, L, S) in the accumulator dtype, soft-capped when softcap is set.
at::Tensor capped_scores(const at::Tensor& query, const at::Tensor& key, at::ScalarType acc, double scale,
                         std::optional<double> softcap) {
  const int64_t H = query.size(1), Hkv = key.size(1);
  at::Tensor scores =
      ungroup_rows(at::matmul(group_rows(query.to(acc), Hkv), key.to(acc).transpose(-2, -1)), H).mul_(scale);
  if (softcap) scores.div_(*softcap).tanh_().mul_(*softcap);
  return scores;
}

// scores (B, H, L, S) with the masks added in place: the keys a row does not see and bool True are -inf,
// float masks added.
at::Tensor add_masks(at::Tensor scores, const std::optional<at::Tensor>& attn_mask,
                     const std::optional<at::Tensor>& key_padding_mask, bool is_causal, int64_t window_left,
                     int64_t window_right, const std::optional<at::Tensor>& key_lengths) {
  const int64_t B = scores.size(0), H = scores.size(1), L = scores.size(2), S = scores.size(3);
  const auto acc = scores.scalar_type();
  const auto add_mask = [&](const at::Tensor& mask) {
    if (mask.scalar_type() == at::kBool) {
      scores.masked_fill_(mask, -kInf);
    } else {
      scores.add_(mask.to(acc));
    }
  };
  if (attn_mask) add_mask(attn_mask->dim() == 3 ? attn_mask->view({B, H, L, S}) : *attn_mask);
  if (key_padding_mask) add_mask(key_padding_mask->view({B, 1, 1, S}));
  const at::Tensor seen =
      key_range_mask(B, L, S, is_causal, window_left, window_right, key_lengths, scores.options());
  if (seen.defined()) scores.masked_fill_(seen.logical_not(), -kInf);
  return scores;
}

double default_scale(const at::Tensor& query, std::optional<double> scale) {
  return scale ? *scale : (query.size(3) > 0 ? 1.0 / std::sqrt(double(query.size(3))) : 1.0);
}

}  // namespace

at::Tensor attention_weights_exact(const at::Tensor& query, const at::Tensor& key, at::ScalarType acc,
                                   const std::optional<at::Tensor>& attn_mask,
                                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                   double scale) {
  // softmax normalises by each row's maximum and sum, as torch's does: a dominant score gives exactly 1,
  // where exp(score - lse) would carry lse's rounding error (2^-12 in float32 at |score| ~ 4e3). An all -inf
  // row gives NaN, as torch's softmax.
  return at::softmax(
      add_masks(capped_scores(query, key, acc, scale, std::nullopt), attn_mask, key_padding_mask, is_causal, -1,
                -1, std::nullopt),
      -1);
}

namespace {

// FlashAttention-2's backward in whole-tensor form: P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
// dQ = scale dS K, dK = scale dS^T Q (dS times the soft-cap's derivative 1 - tanh^2 when capped). Correct
// everywhere, fast nowhere: it stores P and dS. Grouped KV heads: each group's rows run as one GEMM against
// their kv head (group_rows), so dK and dV come out summed over the group.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_math(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, std::optional<double> scale,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed, int64_t window_left, int64_t window_right,
    const std::optional<at::Tensor>& key_lengths, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks, bool grad_attn_mask) {
  // The fused kernels' checks, and gradients allocated in their layout.
  AttentionBackwardProblem pb = prepare_attention_backward(grad_out, query, key, value, out, lse, attn_mask,
                                                           key_padding_mask, is_causal, scale, dropout_p,
                                                           dropout_seed, window_left, window_right,
                                                           key_lengths, softcap, sinks);
  TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0, "attnx::attention_backward: dropout has no backward on ",
                              query.device().type(), " yet (the CPU kernel has one)");
  const double s = default_scale(query, scale);
  const auto acc = lse.scalar_type();
  const int64_t H = query.size(1), Hkv = key.size(1);
  const at::Tensor key_read = valid_keys(key, key_lengths), value_read = valid_keys(value, key_lengths);
  const at::Tensor q = group_rows(query.to(acc), Hkv), k = key_read.to(acc);
  const at::Tensor d_out = group_rows(grad_out.to(acc), Hkv);
  const at::Tensor capped = capped_scores(query, key_read, acc, s, softcap);
  const at::Tensor p = group_rows(
      add_masks(capped.clone(), attn_mask, key_padding_mask, is_causal, window_left, window_right, key_lengths)
          .sub_(lse.unsqueeze(-1))
          .exp_(),
      Hkv);
  const at::Tensor delta = group_rows((grad_out.to(acc) * out.to(acc)).sum(-1, /*keepdim=*/true), Hkv);
  at::Tensor ds = p * (at::matmul(d_out, value_read.to(acc).transpose(-2, -1)) - delta);  // (B, Hkv, G*L, S)
  at::Tensor mask_grad;
  if (grad_attn_mask && attn_mask && attn_mask->scalar_type() != at::kBool) {
    const MaskGradShape g = mask_grad_shape(*attn_mask, query.size(0), H);
    // Contiguous in the mask's shape, as the CPU kernel and the fake return it (sum_to_size gives a view of
    // ds when the mask broadcasts along nothing).
    mask_grad = mask_grad_from_buffer(
        ungroup_rows(ds, H).sum_to_size({g.size[0], g.size[1], g.size[2], g.size[3]}).contiguous(), *attn_mask);
  }
  if (softcap) ds.mul_(1.0 - group_rows(capped, Hkv).div(*softcap).square());
  pb.grad_value.copy_(at::matmul(p.transpose(-2, -1), d_out));
  pb.grad_query.copy_(ungroup_rows(at::matmul(ds, k), H).mul_(s));
  pb.grad_key.copy_(at::matmul(ds.transpose(-2, -1), q).mul_(s));
  return {pb.grad_query, pb.grad_key, pb.grad_value, mask_grad.defined() ? mask_grad : query.new_empty({0}),
          sinks ? sinks_grad(grad_out, out, lse, *sinks) : query.new_empty({0})};
}

}  // namespace
}  // namespace attnx

// Backends with a fused backward kernel (CPU) register their own, which the dispatcher prefers.
TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("attention_backward", &attnx::attention_backward_math);
}
