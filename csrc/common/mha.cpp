// attnx: attnx::mha, the whole nn.MultiheadAttention forward in one dispatch.
//
// It is a composition of attnx's own ops (linear, attention) called through the dispatcher, so one definition
// serves every backend that has those kernels (registered as CompositeExplicitAutograd below). No step copies
// q, k, v or the masks except where the semantics add keys (bias_k/bias_v, add_zero_attn), and nothing of size
// [B, H, L, S] exists unless the caller asks for the attention weights.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace attnx {
namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor attnx_linear(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnx::linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op.call(input, weight, bias);
}

std::tuple<at::Tensor, at::Tensor> attnx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const OptTensor& attn_mask, const OptTensor& key_padding_mask,
                                             bool is_causal) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnx::attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptTensor&, const OptTensor&, bool,
                                                    std::optional<double>, double, const OptTensor&)>();
  return op.call(q, k, v, attn_mask, key_padding_mask, is_causal, std::nullopt, 0.0, std::nullopt);
}

OptTensor rows(const OptTensor& t, int64_t start, int64_t length) {
  return t ? OptTensor(t->narrow(0, start, length)) : std::nullopt;
}

// The same memory seen the same way: then one GEMM against the packed weight serves both.
bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.is_same(b) || (a.data_ptr() == b.data_ptr() && a.sizes().equals(b.sizes()) &&
                          a.strides().equals(b.strides()) && a.dtype() == b.dtype());
}

// One more key column that is never masked: False for a bool mask, 0 for a float one.
OptTensor pad_key(const OptTensor& mask) {
  return mask ? OptTensor(at::constant_pad_nd(*mask, {0, 1}, 0)) : std::nullopt;
}

// (N, B, E) -> (B, H, N, E / H), a view.
at::Tensor split_heads(const at::Tensor& t, int64_t num_heads) {
  return t.unflatten(2, {num_heads, t.size(2) / num_heads}).permute({1, 2, 0, 3});
}

// Attention weights recomputed from lse: exp(scaled masked scores - lse), (B, H, L, S). Only for callers that
// asked for them. Fully masked rows (lse = +inf) give NaN, as torch's softmax of an all -inf row does.
at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                             const OptTensor& attn_mask, const OptTensor& key_padding_mask, bool is_causal) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const auto acc = lse.scalar_type();
  at::Tensor scores = at::matmul(q.to(acc), k.to(acc).transpose(-2, -1)).mul_(1.0 / std::sqrt(double(q.size(3))));
  const auto add_mask = [&](const at::Tensor& mask) {
    if (mask.scalar_type() == at::kBool) {
      scores.masked_fill_(mask, -std::numeric_limits<double>::infinity());
    } else {
      scores.add_(mask.to(acc));
    }
  };
  if (attn_mask) add_mask(attn_mask->dim() == 3 ? attn_mask->view({B, H, L, S}) : *attn_mask);
  if (key_padding_mask) add_mask(key_padding_mask->view({B, 1, 1, S}));
  if (is_causal) add_mask(at::ones({L, S}, q.options().dtype(at::kBool)).triu(1));
  at::Tensor weights = scores.sub_(lse.unsqueeze(-1)).exp_();
  return weights.masked_fill_(lse.isposinf().unsqueeze(-1), std::numeric_limits<double>::quiet_NaN());
}

void check_mha_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
                    const OptTensor& in_proj_weight, const OptTensor& q_proj_weight,
                    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
                    const OptTensor& bias_v, const OptTensor& key_padding_mask, const OptTensor& attn_mask,
                    const OptTensor& static_k, const OptTensor& static_v) {
  TORCH_CHECK(query.dim() == 3, "attnx::mha: expected query of shape (L, B, E), got ", query.sizes());
  const int64_t L = query.size(0), B = query.size(1), E = query.size(2);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) == B && value.size(1) == B &&
                  key.size(0) == value.size(0),
              "attnx::mha: expected key (S, B, kdim) and value (S, B, vdim) with B = ", B, ", got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(num_heads > 0 && E % num_heads == 0, "attnx::mha: expected embed_dim (", E,
              ") divisible by num_heads (", num_heads, ")");
  const bool separate = q_proj_weight && k_proj_weight && v_proj_weight;
  TORCH_CHECK(in_proj_weight.has_value() != separate,
              "attnx::mha: expected either in_proj_weight or all three of q/k/v_proj_weight");
  TORCH_CHECK(bias_k.has_value() == bias_v.has_value(), "attnx::mha: expected bias_k and bias_v together");
  TORCH_CHECK(!bias_k || (!static_k && !static_v), "attnx::mha: bias_k/bias_v cannot be added to static_k/static_v");
  const int64_t H = num_heads, head_dim = E / num_heads;
  for (const auto& s : {static_k, static_v}) {
    TORCH_CHECK(!s || (s->dim() == 3 && s->size(0) == B * H && s->size(2) == head_dim),
                "attnx::mha: expected static_k/static_v of shape (B*H, S, head_dim) = (", B * H, ", S, ", head_dim,
                "), got ", s->sizes());
  }
  const int64_t S = static_k ? static_k->size(1) : key.size(0);
  if (key_padding_mask) {
    TORCH_CHECK(key_padding_mask->dim() == 2 && key_padding_mask->size(0) == B && key_padding_mask->size(1) == S,
                "attnx::mha: expected key_padding_mask of shape (B, S) = (", B, ", ", S, "), got ",
                key_padding_mask->sizes());
  }
  if (attn_mask) {
    const bool ok = (attn_mask->dim() == 2 && attn_mask->size(0) == L && attn_mask->size(1) == S) ||
                    (attn_mask->dim() == 3 && attn_mask->size(0) == B * H && attn_mask->size(1) == L &&
                     attn_mask->size(2) == S);
    TORCH_CHECK(ok, "attnx::mha: expected attn_mask of shape (L, S) = (", L, ", ", S, ") or (B*H, L, S) = (", B * H,
                ", ", L, ", ", S, "), got ", attn_mask->sizes());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
    const OptTensor& in_proj_weight, const OptTensor& in_proj_bias, const OptTensor& q_proj_weight,
    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
    const OptTensor& bias_v, bool add_zero_attn, const at::Tensor& out_proj_weight, const OptTensor& out_proj_bias,
    const OptTensor& key_padding_mask_in, const OptTensor& attn_mask_in, bool is_causal, const OptTensor& static_k,
    const OptTensor& static_v, bool need_weights, bool average_attn_weights) {
  check_mha_args(query, key, value, num_heads, in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, bias_k,
                 bias_v, key_padding_mask_in, attn_mask_in, static_k, static_v);
  const int64_t B = query.size(1), E = query.size(2), H = num_heads;
  OptTensor key_padding_mask = key_padding_mask_in, attn_mask = attn_mask_in;

  // In-projections. Packed self-attention is one GEMM whose (L, B, 3E) output q, k and v are strided views of;
  // projections that static_k / static_v replace are not computed at all.
  const auto weight = [&](int64_t i, const OptTensor& separate) {
    return in_proj_weight ? in_proj_weight->narrow(0, i * E, E) : *separate;
  };
  at::Tensor q, k, v;
  const bool need_k = !static_k, need_v = !static_v;
  if (in_proj_weight && need_k && need_v && same_view(query, key) && same_view(key, value)) {
    const at::Tensor qkv = attnx_linear(query, *in_proj_weight, in_proj_bias);
    q = qkv.narrow(2, 0, E);
    k = qkv.narrow(2, E, E);
    v = qkv.narrow(2, 2 * E, E);
  } else {
    q = attnx_linear(query, weight(0, q_proj_weight), rows(in_proj_bias, 0, E));
    if (in_proj_weight && need_k && need_v && same_view(key, value)) {
      const at::Tensor kv = attnx_linear(key, in_proj_weight->narrow(0, E, 2 * E), rows(in_proj_bias, E, 2 * E));
      k = kv.narrow(2, 0, E);
      v = kv.narrow(2, E, E);
    } else {
      if (need_k) k = attnx_linear(key, weight(1, k_proj_weight), rows(in_proj_bias, E, E));
      if (need_v) v = attnx_linear(value, weight(2, v_proj_weight), rows(in_proj_bias, 2 * E, E));
    }
  }

  // bias_k / bias_v: one learned key and value appended to every sequence (never masked).
  if (bias_k) {
    k = at::cat({k, bias_k->reshape({1, 1, E}).expand({1, B, E})}, 0);
    v = at::cat({v, bias_v->reshape({1, 1, E}).expand({1, B, E})}, 0);
    attn_mask = pad_key(attn_mask);
    key_padding_mask = pad_key(key_padding_mask);
  }

  // (B, H, N, head_dim) views; static_k / static_v arrive as (B*H, S, head_dim).
  at::Tensor q4 = split_heads(q, H);
  at::Tensor k4 = static_k ? static_k->unflatten(0, {B, H}) : split_heads(k, H);
  at::Tensor v4 = static_v ? static_v->unflatten(0, {B, H}) : split_heads(v, H);

  // add_zero_attn: one all-zero key and value appended (never masked).
  if (add_zero_attn) {
    k4 = at::constant_pad_nd(k4, {0, 0, 0, 1}, 0);
    v4 = at::constant_pad_nd(v4, {0, 0, 0, 1}, 0);
    attn_mask = pad_key(attn_mask);
    key_padding_mask = pad_key(key_padding_mask);
  }

  auto [attn, lse] = attnx_attention(q4, k4, v4, attn_mask, key_padding_mask, is_causal);
  // Release the projections before the out projection allocates its output, so that peak memory is the
  // projections plus the attention output, never the projections plus two outputs.
  q = k = v = v4 = at::Tensor();
  if (!need_weights) q4 = k4 = at::Tensor();

  // attn is (B, H, L, head_dim) laid out as (B, L, H, head_dim), so its (L, B, E) form is a view.
  at::Tensor out = attnx_linear(attn.permute({2, 0, 1, 3}).flatten(2), out_proj_weight, out_proj_bias);

  at::Tensor weights;
  if (need_weights) {
    weights = attention_weights(q4, k4, lse, attn_mask, key_padding_mask, is_causal);
    if (average_attn_weights) weights = weights.mean(1);
    weights = weights.to(query.scalar_type());
  } else {
    weights = at::empty({0}, query.options());
  }
  return {out, lse, weights};
}

}  // namespace
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) { m.impl("mha", &attnx::mha); }
