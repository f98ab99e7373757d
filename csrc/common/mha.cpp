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

#include "common/attention.h"
#include "common/linear.h"
#include "common/stable_bridge.h"

namespace attnx {
namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor attnx_linear(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnx::_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op.call(input, weight, bias);
}

std::tuple<at::Tensor, at::Tensor> attnx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const OptTensor& attn_mask, const OptTensor& key_padding_mask,
                                             bool is_causal, double dropout_p, const OptTensor& dropout_seed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnx::_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptTensor&, const OptTensor&, bool,
                                                    std::optional<double>, double, const OptTensor&, int64_t,
                                                    int64_t, const OptTensor&, std::optional<double>,
                                                    const OptTensor&)>();
  return op.call(q, k, v, attn_mask, key_padding_mask, is_causal, std::nullopt, dropout_p, dropout_seed, -1, -1,
                 std::nullopt, std::nullopt, std::nullopt);
}

// attention_backward's gradients of q, k, v and, when grad_attn_mask, of attn_mask (else undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attnx_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const OptTensor& attn_mask, const OptTensor& key_padding_mask, bool is_causal,
    double dropout_p, const OptTensor& dropout_seed, bool grad_attn_mask) {
  using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnx::attention_backward", "")
                             .typed<Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                          bool, std::optional<double>, double, const OptTensor&, int64_t, int64_t,
                                          const OptTensor&, std::optional<double>, const OptTensor&, bool)>();
  auto [dq, dk, dv, dmask, dsinks] =
      op.call(grad_out, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, std::nullopt, dropout_p,
              dropout_seed, -1, -1, std::nullopt, std::nullopt, std::nullopt, grad_attn_mask);
  return {dq, dk, dv, grad_attn_mask ? dmask : at::Tensor()};
}

OptTensor rows(const OptTensor& t, int64_t start, int64_t length) {
  return t ? OptTensor(t->narrow(0, start, length)) : std::nullopt;
}

// Whether in-projections that read the same input run as one GEMM against the packed weight rows. Not on the
// CPU: there the packed (3E x E) or (2E x E) GEMM measured 0.92-1.11x the separate (E x E) ones depending on
// the shape, while the separate GEMMs, run at once in shares per thread (run_gemms_in_shares), beat the same
// GEMMs one after another.
bool pack_in_projections(const at::Tensor& input) {
  return !input.is_cpu();
}

// The same memory seen the same way: then one GEMM against the packed weight serves both.
bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.is_same(b) || (a.data_ptr() == b.data_ptr() && a.sizes().equals(b.sizes()) &&
                          a.strides().equals(b.strides()) && a.dtype() == b.dtype());
}

// (N, B, E) -> (B, H, N, E / H), a view.
at::Tensor split_heads(const at::Tensor& t, int64_t num_heads) {
  return t.unflatten(2, {num_heads, t.size(2) / num_heads}).permute({1, 2, 0, 3});
}

// Attention weights, (B, H, L, S) in lse's dtype, normalised exactly as torch's softmax (not from lse: see
// attention_weights_exact). Only for callers that asked for them. Fully masked rows give NaN, as torch's.
at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                             const OptTensor& attn_mask, const OptTensor& key_padding_mask, bool is_causal) {
  const double scale = 1.0 / std::sqrt(double(q.size(3)));
  return attention_weights_exact(q, k, lse.scalar_type(), attn_mask, key_padding_mask, is_causal, scale);
}

// query, key and value as the caller passed them: (L, B, E), (S, B, kdim), (S, B, vdim), or with batch_first
// (B, L, E), (B, S, kdim), (B, S, vdim).
void check_mha_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
                    const OptTensor& in_proj_weight, const OptTensor& q_proj_weight,
                    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
                    const OptTensor& bias_v, const OptTensor& key_padding_mask, const OptTensor& attn_mask,
                    const OptTensor& static_k, const OptTensor& static_v, bool batch_first) {
  const int64_t seq = batch_first ? 1 : 0, batch = 1 - seq;
  TORCH_CHECK(query.dim() == 3, "attnx::mha: expected query of shape ", batch_first ? "(B, L, E)" : "(L, B, E)",
              ", got ", query.sizes());
  const int64_t L = query.size(seq), B = query.size(batch), E = query.size(2);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(batch) == B && value.size(batch) == B &&
                  key.size(seq) == value.size(seq),
              "attnx::mha: expected key ", batch_first ? "(B, S, kdim)" : "(S, B, kdim)", " and value ",
              batch_first ? "(B, S, vdim)" : "(S, B, vdim)", " with B = ", B, ", got ", key.sizes(), " and ",
              value.sizes());
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
  const int64_t S = static_k ? static_k->size(1) : key.size(seq);
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

// Appends `extra` never-masked key columns to a mask: False for a bool mask, 0 for a float one.
OptTensor pad_keys(const OptTensor& mask, int64_t extra) {
  return mask && extra > 0 ? OptTensor(at::constant_pad_nd(*mask, {0, extra}, 0)) : mask;
}

// The sequence-first (N, B, F) form of mha's query, key and value: batch_first (B, N, F) arguments as their
// transposes, views whose strides the projections and kernels read as they are (no copy). A tensor passed as
// several arguments stays one tensor, so that self-attention is still recognised (one packed GEMM forward off
// the CPU, one gradient backward).
struct SeqFirst {
  at::Tensor query, key, value;
};

SeqFirst seq_first(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool batch_first) {
  if (!batch_first) return {query, key, value};
  SeqFirst t;
  t.query = query.transpose(0, 1);
  t.key = key.is_same(query) ? t.query : key.transpose(0, 1);
  t.value = value.is_same(key) ? t.key : value.is_same(query) ? t.query : value.transpose(0, 1);
  return t;
}

// What the forward hands to the backward: the attention problem as attnx::attention saw it.
struct MhaState {
  at::Tensor out, lse, weights;
  at::Tensor q, k, v;  // (B, H, L, Dh), (B, H, S', Dh), (B, H, S', Dh): attention's inputs, appended keys included
  at::Tensor attn;     // (B, H, L, Dh) in memory order (B, L, H, Dh): attention's output
};

MhaState mha_forward_impl(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                          int64_t num_heads, const OptTensor& in_proj_weight, const OptTensor& in_proj_bias,
                          const OptTensor& q_proj_weight, const OptTensor& k_proj_weight,
                          const OptTensor& v_proj_weight, const OptTensor& bias_k, const OptTensor& bias_v,
                          bool add_zero_attn, const at::Tensor& out_proj_weight, const OptTensor& out_proj_bias,
                          const OptTensor& key_padding_mask_in, const OptTensor& attn_mask_in, bool is_causal,
                          const OptTensor& static_k, const OptTensor& static_v, bool need_weights,
                          bool average_attn_weights, double dropout_p, const OptTensor& dropout_seed,
                          bool batch_first, bool keep_for_backward) {
  // Below ADInplaceOrView, as mha's autograd kernel calls it: the views taken here (of the inputs, the
  // projections, the weights) are internal, no output aliases an input, so they need no view tracking. Under
  // inference_mode with ordinary (not inference) tensors, that tracking would otherwise run on every view,
  // ~2 us per call at small shapes.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_mha_args(query_in, key_in, value_in, num_heads, in_proj_weight, q_proj_weight, k_proj_weight,
                 v_proj_weight, bias_k, bias_v, key_padding_mask_in, attn_mask_in, static_k, static_v, batch_first);
  const SeqFirst views = seq_first(query_in, key_in, value_in, batch_first);
  const at::Tensor &query = views.query, &key = views.key, &value = views.value;
  // Weights after dropout would need the (B, H, L, S) keep mask; attnx.functional runs that case by
  // composition.
  TORCH_CHECK(!need_weights || dropout_p == 0.0,
              "attnx::mha: need_weights with dropout_p > 0 is not supported (the weights are recomputed from lse "
              "without the dropout mask)");
  const int64_t B = query.size(1), E = query.size(2), H = num_heads;
  const int64_t appended = int64_t(bias_k.has_value()) + int64_t(add_zero_attn);
  const OptTensor key_padding_mask = pad_keys(key_padding_mask_in, appended);
  const OptTensor attn_mask = pad_keys(attn_mask_in, appended);

  // In-projections. Packed self-attention (off the CPU) is one GEMM whose (L, B, 3E) output q, k and v are
  // strided views of; projections that static_k / static_v replace are not computed at all.
  const auto weight = [&](int64_t i, const OptTensor& separate) {
    return in_proj_weight ? in_proj_weight->narrow(0, i * E, E) : *separate;
  };
  at::Tensor q, k, v;
  const bool need_k = !static_k, need_v = !static_v;
  const bool pack = in_proj_weight && need_k && need_v && pack_in_projections(query);
  if (pack && same_view(query, key) && same_view(key, value)) {
    const at::Tensor qkv = attnx_linear(query, *in_proj_weight, in_proj_bias);
    q = qkv.narrow(2, 0, E);
    k = qkv.narrow(2, E, E);
    v = qkv.narrow(2, 2 * E, E);
  } else if (!pack && query.is_cpu()) {
    // The separate GEMMs are independent: shared out among the threads at once, each thread's part on one
    // thread of BLAS, they beat the same GEMMs one after another on all threads (run_gemms_in_shares).
    using bridge::to_aten, bridge::to_stable;
    std::vector<LinearGemm> gemms;
    const auto plan = [&](const at::Tensor& input, const at::Tensor& w, const OptTensor& b) {
      gemms.push_back(plan_linear(to_stable(input), to_stable(w), to_stable(b)));
    };
    plan(query, weight(0, q_proj_weight), rows(in_proj_bias, 0, E));
    if (need_k) plan(key, weight(1, k_proj_weight), rows(in_proj_bias, E, E));
    if (need_v) plan(value, weight(2, v_proj_weight), rows(in_proj_bias, 2 * E, E));
    run_gemms_in_shares(gemms);
    q = to_aten(gemms[0].out);
    if (need_k) k = to_aten(gemms[1].out);
    if (need_v) v = to_aten(gemms.back().out);
  } else {
    q = attnx_linear(query, weight(0, q_proj_weight), rows(in_proj_bias, 0, E));
    if (pack && same_view(key, value)) {
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
  }

  // (B, H, N, head_dim) views; static_k / static_v arrive as (B*H, S, head_dim).
  MhaState state;
  at::Tensor q4 = split_heads(q, H);
  at::Tensor k4 = static_k ? static_k->unflatten(0, {B, H}) : split_heads(k, H);
  at::Tensor v4 = static_v ? static_v->unflatten(0, {B, H}) : split_heads(v, H);

  // add_zero_attn: one all-zero key and value appended (never masked).
  if (add_zero_attn) {
    k4 = at::constant_pad_nd(k4, {0, 0, 0, 1}, 0);
    v4 = at::constant_pad_nd(v4, {0, 0, 0, 1}, 0);
  }

  auto [attn, lse] = attnx_attention(q4, k4, v4, attn_mask, key_padding_mask, is_causal, dropout_p, dropout_seed);
  if (keep_for_backward) {
    // An op's outputs may not alias its inputs: static_k / static_v used as they are stay with the caller, and
    // the backward reads them from there (empty here).
    state.q = q4;
    state.k = static_k && !add_zero_attn ? at::empty({0}, q4.options()) : k4;
    state.v = static_v && !add_zero_attn ? at::empty({0}, q4.options()) : v4;
    state.attn = attn;
  }
  // Release the projections before the out projection allocates its output, so that peak memory is the
  // projections plus the attention output, never the projections plus two outputs.
  q = k = v = v4 = at::Tensor();
  if (!need_weights) q4 = k4 = at::Tensor();

  // attn is (B, H, L, head_dim) laid out as (B, L, H, head_dim), so its (L, B, E) form is a view, and linear
  // writes out in that memory order: (L, B, E) with the strides of a (B, L, E) tensor, whose batch_first
  // (B, L, E) form is again a view.
  state.out = attnx_linear(attn.permute({2, 0, 1, 3}).flatten(2), out_proj_weight, out_proj_bias);
  if (batch_first) state.out = state.out.transpose(0, 1);
  state.lse = lse;

  if (need_weights) {
    at::Tensor weights = attention_weights(q4, k4, lse, attn_mask, key_padding_mask, is_causal);
    if (average_attn_weights) weights = weights.mean(1);
    state.weights = weights.to(query.scalar_type());
  } else {
    state.weights = at::empty({0}, query.options());
  }
  return state;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mha(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
    const OptTensor& in_proj_weight, const OptTensor& in_proj_bias, const OptTensor& q_proj_weight,
    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
    const OptTensor& bias_v, bool add_zero_attn, const at::Tensor& out_proj_weight, const OptTensor& out_proj_bias,
    const OptTensor& key_padding_mask, const OptTensor& attn_mask, bool is_causal, const OptTensor& static_k,
    const OptTensor& static_v, bool need_weights, bool average_attn_weights, double dropout_p,
    const OptTensor& dropout_seed, bool batch_first) {
  MhaState s = mha_forward_impl(query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight,
                                k_proj_weight, v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight,
                                out_proj_bias, key_padding_mask, attn_mask, is_causal, static_k, static_v,
                                need_weights, average_attn_weights, dropout_p, dropout_seed, batch_first,
                                /*keep_for_backward=*/false);
  return {s.out, s.lse, s.weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mha_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
    const OptTensor& in_proj_weight, const OptTensor& in_proj_bias, const OptTensor& q_proj_weight,
    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
    const OptTensor& bias_v, bool add_zero_attn, const at::Tensor& out_proj_weight, const OptTensor& out_proj_bias,
    const OptTensor& key_padding_mask, const OptTensor& attn_mask, bool is_causal, const OptTensor& static_k,
    const OptTensor& static_v, bool need_weights, bool average_attn_weights, double dropout_p,
    const OptTensor& dropout_seed, bool batch_first) {
  MhaState s = mha_forward_impl(query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight,
                                k_proj_weight, v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight,
                                out_proj_bias, key_padding_mask, attn_mask, is_causal, static_k, static_v,
                                need_weights, average_attn_weights, dropout_p, dropout_seed, batch_first,
                                /*keep_for_backward=*/true);
  return {s.out, s.lse, s.weights, s.q, s.k, s.v, s.attn};
}

// ---------------------------------------------------------------------------------------------------------------
// Backward. Gradients flow out -> out projection -> attention (attnx::attention_backward, which recomputes the
// probabilities from lse) -> appended keys -> in-projections. Every GEMM takes rows in (batch, position) order:
// the memory order of attention's outputs and gradients, so those are read without copies; an input or a
// grad_out laid out sequence-first is copied once into that order (as torch's linear backward reshapes).

// Positions of the gradients mha_backward returns (and of the bools in its output_mask).
enum MhaGrad : int64_t {
  kGradQuery, kGradKey, kGradValue, kGradInProjWeight, kGradInProjBias, kGradQProjWeight, kGradKProjWeight,
  kGradVProjWeight, kGradBiasK, kGradBiasV, kGradOutProjWeight, kGradOutProjBias, kGradStaticK, kGradStaticV,
  kGradAttnMask, kNumMhaGrads
};

// (N, B, F) -> (B*N, F) rows in (batch, position) order: a view when the memory allows it, else one copy. (Sizes
// spelled out, not -1, which is ambiguous when F == 0.)
at::Tensor batch_major_rows(const at::Tensor& t) {
  return t.transpose(0, 1).reshape({t.size(0) * t.size(1), t.size(2)});
}

// (B, H, N, Dh) -> (B*N, H*Dh) rows in (batch, position) order; a view for attention's (B, N, H, Dh) layouts.
at::Tensor head_rows(const at::Tensor& t) {
  return t.permute({0, 2, 1, 3}).reshape({t.size(0) * t.size(2), t.size(1) * t.size(3)});
}

// The gradient of the attention weights output flowed back into grad_q and grad_k (in place), and into
// grad_mask (attn_mask's gradient, (L, S') or (B*H, L, S')) when it is defined: the softmax backward
// dS = P * (dP - rowsum(dP * P)) on P recomputed from lse. Only reached when the caller asked for the weights
// and used them, so the (B, H, L, S') tensors it builds are the size of what it asked for.
void add_weights_grad(const at::Tensor& grad_weights, bool average_attn_weights, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& lse, const OptTensor& attn_mask,
                      const OptTensor& key_padding_mask, bool is_causal, at::Tensor& grad_q, at::Tensor& grad_k,
                      at::Tensor& grad_mask) {
  const auto acc = lse.scalar_type();
  const at::Tensor p = attention_weights(q, k, lse, attn_mask, key_padding_mask, is_causal);
  at::Tensor dp = grad_weights.to(acc);
  if (average_attn_weights) dp = dp.unsqueeze(1).div(double(q.size(1)));  // mean over heads
  // A fully masked row's weights are NaN whatever q and k are: no gradient flows from them.
  at::Tensor ds = (p * (dp - (dp * p).sum(-1, /*keepdim=*/true))).masked_fill_(lse.isposinf().unsqueeze(-1), 0);
  if (grad_mask.defined()) {
    const at::Tensor g = grad_mask.dim() == 2 ? ds.sum({0, 1}) : ds.flatten(0, 1);
    grad_mask.add_(g.to(grad_mask.scalar_type()));
  }
  const double scale = 1.0 / std::sqrt(double(q.size(3)));
  grad_q.add_(at::matmul(ds, k.to(acc)).mul_(scale).to(grad_q.scalar_type()));
  grad_k.add_(at::matmul(ds.transpose(-2, -1), q.to(acc)).mul_(scale).to(grad_k.scalar_type()));
}

std::vector<at::Tensor> mha_backward(
    const at::Tensor& grad_out_in, const OptTensor& grad_weights, const at::Tensor& query_in,
    const at::Tensor& key_in, const at::Tensor& value_in, int64_t num_heads, const OptTensor& in_proj_weight,
    const OptTensor& in_proj_bias, const OptTensor& q_proj_weight, const OptTensor& k_proj_weight,
    const OptTensor& v_proj_weight, const OptTensor& bias_k, const OptTensor& bias_v, bool add_zero_attn,
    const at::Tensor& out_proj_weight, const OptTensor& out_proj_bias, const OptTensor& key_padding_mask_in,
    const OptTensor& attn_mask_in, bool is_causal, const OptTensor& static_k, const OptTensor& static_v,
    bool need_weights, bool average_attn_weights, double dropout_p, const OptTensor& dropout_seed,
    const at::Tensor& q, const at::Tensor& k_saved, const at::Tensor& v_saved, const at::Tensor& attn,
    const at::Tensor& lse, at::IntArrayRef output_mask_in, bool batch_first) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in mha_forward_impl
  check_mha_args(query_in, key_in, value_in, num_heads, in_proj_weight, q_proj_weight, k_proj_weight,
                 v_proj_weight, bias_k, bias_v, key_padding_mask_in, attn_mask_in, static_k, static_v, batch_first);
  // Sequence-first views from here on; the input gradients are transposed back at the end.
  const SeqFirst views = seq_first(query_in, key_in, value_in, batch_first);
  const at::Tensor &query = views.query, &key = views.key, &value = views.value;
  const at::Tensor grad_out = batch_first ? grad_out_in.transpose(0, 1) : grad_out_in;
  // static_k / static_v used without an appended zero key are attention's k / v themselves.
  const at::Tensor k = static_k && !add_zero_attn ? static_k->unflatten(0, {query.size(1), num_heads}) : k_saved;
  const at::Tensor v = static_v && !add_zero_attn ? static_v->unflatten(0, {query.size(1), num_heads}) : v_saved;
  TORCH_CHECK(output_mask_in.size() == kNumMhaGrads, "attnx::mha_backward: expected output_mask of ", kNumMhaGrads,
              " entries, got ", output_mask_in.size());
  const auto wanted = [&](MhaGrad g) { return output_mask_in[g] != 0; };
  const int64_t L = query.size(0), B = query.size(1), E = query.size(2), H = num_heads, Dh = E / H;
  const int64_t S = static_k ? static_k->size(1) : key.size(0);
  const int64_t appended = int64_t(bias_k.has_value()) + int64_t(add_zero_attn);
  const OptTensor key_padding_mask = pad_keys(key_padding_mask_in, appended);
  const OptTensor attn_mask = pad_keys(attn_mask_in, appended);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && attn.dim() == 4 && q.size(0) == B && q.size(1) == H &&
                  q.size(2) == L && k.size(2) == S + appended,
              "attnx::mha_backward: expected q, k, v and attn as attnx::mha_forward returned them");
  std::vector<at::Tensor> grads(kNumMhaGrads);

  // Out projection: out = attn @ out_proj_weight^T + out_proj_bias, rows in (batch, position) order.
  const at::Tensor grad_out_rows = batch_major_rows(grad_out);  // (B*L, E)
  if (wanted(kGradOutProjWeight)) grads[kGradOutProjWeight] = grad_out_rows.t().mm(head_rows(attn));
  if (out_proj_bias && wanted(kGradOutProjBias)) grads[kGradOutProjBias] = grad_out_rows.sum(0);
  at::Tensor grad_attn = grad_out_rows.mm(out_proj_weight).view({B, L, H, Dh}).permute({0, 2, 1, 3});

  // Attention, probabilities recomputed from lse.
  // A float attn_mask (a learned bias) gets dS summed as the mask broadcasts, from the fused backward.
  const bool mask_grad = wanted(kGradAttnMask) && attn_mask && attn_mask->scalar_type() != at::kBool;
  auto [grad_q, grad_k, grad_v, grad_mask] =
      attnx_attention_backward(grad_attn, q, k, v, attn, lse, attn_mask, key_padding_mask, is_causal, dropout_p,
                               dropout_seed, mask_grad);
  if (grad_weights && grad_weights->defined() && grad_weights->numel() > 0) {
    TORCH_CHECK(need_weights, "attnx::mha_backward: got grad_weights for a call without need_weights");
    add_weights_grad(*grad_weights, average_attn_weights, q, k, lse, attn_mask, key_padding_mask, is_causal, grad_q,
                     grad_k, grad_mask);
  }
  // The columns of the appended keys (bias_k, add_zero_attn) were padding, not the caller's mask: cut off, and
  // copied once so that the gradient is contiguous in the mask's shape, the one layout the fake kernel states.
  if (mask_grad) grads[kGradAttnMask] = appended ? grad_mask.narrow(-1, 0, S).contiguous() : grad_mask;
  grad_attn.reset();

  // Appended keys: the zero key has no parameter; bias_k / bias_v sit at position S of every sequence.
  if (bias_k) {
    if (wanted(kGradBiasK)) grads[kGradBiasK] = grad_k.select(2, S).sum(0).reshape({1, 1, E});
    if (wanted(kGradBiasV)) grads[kGradBiasV] = grad_v.select(2, S).sum(0).reshape({1, 1, E});
  }
  grad_k = grad_k.narrow(2, 0, S);
  grad_v = grad_v.narrow(2, 0, S);
  // static_k / static_v are (B*H, S, Dh); the gradients are (B, H, S, Dh) in memory order (B, S, H, Dh), which
  // no (B*H, ...) view describes, so reshape copies them once. The copy is made contiguous in every case (also
  // where reshape could return a strided view), so that the output layout is one rule the fake kernel mirrors.
  if (static_k && wanted(kGradStaticK)) grads[kGradStaticK] = grad_k.reshape({B * H, S, Dh}).contiguous();
  if (static_v && wanted(kGradStaticV)) grads[kGradStaticV] = grad_v.reshape({B * H, S, Dh}).contiguous();

  // In-projections: proj = input @ weight^T + bias for each of q, k, v that was projected.
  const at::Tensor grad_proj[3] = {head_rows(grad_q), static_k ? at::Tensor() : head_rows(grad_k),
                                   static_v ? at::Tensor() : head_rows(grad_v)};
  grad_q = grad_k = grad_v = at::Tensor();
  const at::Tensor* inputs[3] = {&query, &key, &value};
  const OptTensor* separate[3] = {&q_proj_weight, &k_proj_weight, &v_proj_weight};
  const auto proj_weight = [&](int64_t i) {
    return in_proj_weight ? in_proj_weight->narrow(0, i * E, E) : separate[i]->value();
  };
  // Called with one tensor as query, key and value (self-attention), its whole gradient goes to grad_query
  // and grad_key / grad_value stay empty: autograd would only add the three up.
  const bool one_input = query.is_same(key) && key.is_same(value);
  const bool wanted_input[3] = {
      wanted(kGradQuery) || (one_input && (wanted(kGradKey) || wanted(kGradValue))),
      !one_input && wanted(kGradKey), !one_input && wanted(kGradValue)};
  at::Tensor input_rows[3];  // each distinct input's rows, gathered once
  const auto rows_of = [&](int64_t i) -> const at::Tensor& {
    int64_t first = i;
    while (first > 0 && inputs[first - 1]->is_same(*inputs[i])) --first;
    if (!input_rows[first].defined()) input_rows[first] = batch_major_rows(*inputs[first]);
    return input_rows[first];
  };
  // The packed in_proj gradients are written block by block; zero-filled first only when a block stays
  // unwritten (a projection that static_k / static_v replaced).
  const bool every_block = grad_proj[0].defined() && grad_proj[1].defined() && grad_proj[2].defined();
  const auto packed_grad = [&](const at::Tensor& like) {
    return every_block ? at::empty(like.sizes(), like.options()) : at::zeros(like.sizes(), like.options());
  };
  for (int64_t i = 0; i < 3; ++i) {
    if (!grad_proj[i].defined()) continue;
    const at::Tensor w = proj_weight(i);
    const int64_t slot = one_input ? kGradQuery : kGradQuery + i;
    if (wanted_input[slot]) {
      at::Tensor& g = grads[slot];
      if (!g.defined()) {
        // (N, B, F) in memory order (B, N, F): the GEMM writes it directly.
        g = at::empty({B, inputs[i]->size(0), inputs[i]->size(2)}, grad_proj[i].options()).transpose(0, 1);
        at::Tensor g_rows = batch_major_rows(g);
        at::mm_out(g_rows, grad_proj[i], w);
      } else {
        batch_major_rows(g).addmm_(grad_proj[i], w);
      }
    }
    if (in_proj_weight) {
      if (wanted(kGradInProjWeight)) {
        at::Tensor& grad_weight = grads[kGradInProjWeight];
        if (!grad_weight.defined()) grad_weight = packed_grad(*in_proj_weight);
        at::Tensor rows_i = grad_weight.narrow(0, i * E, E);
        at::mm_out(rows_i, grad_proj[i].t(), rows_of(i));
      }
    } else if (wanted(MhaGrad(kGradQProjWeight + i))) {
      grads[kGradQProjWeight + i] = grad_proj[i].t().mm(rows_of(i));
    }
    if (in_proj_bias && wanted(kGradInProjBias)) {
      at::Tensor& grad_bias = grads[kGradInProjBias];
      if (!grad_bias.defined()) grad_bias = packed_grad(*in_proj_bias);
      at::Tensor rows_i = grad_bias.narrow(0, i * E, E);
      at::sum_out(rows_i, grad_proj[i], 0);
    }
  }
  // Requested gradients of inputs that no projection read (a key replaced by static_k) are zero.
  for (int64_t i = 0; i < 3; ++i) {
    if (wanted_input[i] && !grads[kGradQuery + i].defined()) {
      grads[kGradQuery + i] =
          at::zeros({B, inputs[i]->size(0), inputs[i]->size(2)}, inputs[i]->options()).transpose(0, 1);
    }
  }
  if (in_proj_weight && wanted(kGradInProjWeight) && !grads[kGradInProjWeight].defined()) {
    grads[kGradInProjWeight] = at::zeros(in_proj_weight->sizes(), in_proj_weight->options());
  }
  for (int64_t i = 0; i < 3; ++i) {
    if (!in_proj_weight && wanted(MhaGrad(kGradQProjWeight + i)) && !grads[kGradQProjWeight + i].defined()) {
      grads[kGradQProjWeight + i] = at::zeros(separate[i]->value().sizes(), separate[i]->value().options());
    }
  }
  // The input gradients in the inputs' (B, N, F) shape; memory order (B, N, F) either way, as written above.
  if (batch_first) {
    for (int64_t i = 0; i < 3; ++i) {
      at::Tensor& g = grads[kGradQuery + i];
      if (g.defined()) g = g.transpose(0, 1);
    }
  }
  // Gradients not asked for (or of absent arguments) are returned as empty tensors.
  for (auto& g : grads) {
    if (!g.defined()) g = at::empty({0}, query.options());
  }
  return grads;
}

}  // namespace
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("_mha", &attnx::mha);
  m.impl("mha_forward", &attnx::mha_forward);
  m.impl("mha_backward", &attnx::mha_backward);
}
