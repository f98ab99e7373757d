// attnx: autograd for attnx::attention and attnx::attention_backward, registered on the ops' Autograd key for
// every backend.
//
// attention's backward is one attnx::attention_backward, which recomputes the probabilities from the saved lse:
// autograd saves the inputs, out, lse, the masks and the dropout seed, nothing of size (B, H, L, S). Without
// gradients to compute, the call goes straight to the kernel. In C++ for the reason linear's autograd is: a
// Python autograd kernel runs on every call, grad mode or not (~4.5 us here), as much as the whole op at
// decoding shapes, where SDPA pays nothing of the kind.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace attnx {
namespace {

using OptTensor = std::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using AttentionOutputs = std::tuple<at::Tensor, at::Tensor>;
using AttentionBackwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// attention's arguments from attn_mask on, in schema order; attention_backward takes them in the same order,
// after grad_out, query, key, value, out and lse (and grad_attn_mask after them).
#define ATTNX_ATTENTION_OPTIONS                                                                                    \
  const OptTensor &attn_mask, const OptTensor &key_padding_mask, bool is_causal, std::optional<double> scale,     \
      double dropout_p, const OptTensor &dropout_seed, int64_t window_left, int64_t window_right,                 \
      const OptTensor &key_lengths, std::optional<double> softcap, const OptTensor &sinks
#define ATTNX_ATTENTION_OPTION_ARGS                                                                                \
  attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed, window_left, window_right, key_lengths, \
      softcap, sinks
#define ATTNX_ATTENTION_OPTION_TYPES                                                                               \
  const OptTensor&, const OptTensor&, bool, std::optional<double>, double, const OptTensor&, int64_t, int64_t,    \
      const OptTensor&, std::optional<double>, const OptTensor&

const c10::TypedOperatorHandle<AttentionOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                ATTNX_ATTENTION_OPTION_TYPES)>&
attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnx::attention", "")
                             .typed<AttentionOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    ATTNX_ATTENTION_OPTION_TYPES)>();
  return op;
}

const c10::TypedOperatorHandle<AttentionBackwardOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        ATTNX_ATTENTION_OPTION_TYPES, bool)>&
attention_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnx::attention_backward", "")
          .typed<AttentionBackwardOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, ATTNX_ATTENTION_OPTION_TYPES, bool)>();
  return op;
}

bool requires_grad(const OptTensor& t) { return t && t->defined() && t->requires_grad(); }

// The saved optional arguments come back as undefined tensors where they were absent.
OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
at::Tensor or_undefined(const OptTensor& t) { return t.value_or(at::Tensor()); }

// attention's arguments (14) and the positions of those with a gradient.
constexpr int kNumArgs = 14;
constexpr int kAttnMaskArg = 3, kSinksArg = 13;

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, ATTNX_ATTENTION_OPTIONS) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = attention_op().call(query, key, value, ATTNX_ATTENTION_OPTION_ARGS);
    // Everything the backward recomputes the probabilities and the dropout mask from; nothing of size
    // (B, H, L, S).
    ctx->save_for_backward({query, key, value, out, lse, or_undefined(attn_mask), or_undefined(key_padding_mask),
                            or_undefined(dropout_seed), or_undefined(key_lengths), or_undefined(sinks)});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["window"] = std::vector<int64_t>{window_left, window_right};
    ctx->saved_data["softcap"] = softcap;
    // Decided here, from the argument as given: the backward raises whenever a float key_padding_mask
    // requires grad, whichever gradients it is asked for.
    ctx->saved_data["padding_mask_requires_grad"] = requires_grad(key_padding_mask);
    // Autograd edges exist for the present tensor arguments only, in order: needs_input_grad's index of
    // attn_mask and sinks (-1: absent). A bool attn_mask has an edge but never a gradient.
    const bool float_mask = attn_mask && attn_mask->defined() && attn_mask->scalar_type() != at::kBool;
    int64_t edge = 3;
    const int64_t mask_edge = attn_mask && attn_mask->defined() ? edge++ : -1;
    for (const OptTensor* t : {&key_padding_mask, &dropout_seed, &key_lengths}) {
      if (*t && (*t)->defined()) ++edge;
    }
    const int64_t sinks_edge = sinks && sinks->defined() ? edge : -1;
    ctx->saved_data["mask_edge"] = float_mask ? mask_edge : int64_t{-1};
    ctx->saved_data["sinks_edge"] = sinks_edge;
    // Like SDPA's logsumexp: an output for the backward (and for combining partial attentions), not a path for
    // gradients; marking it keeps a loss that uses it from silently missing that term.
    ctx->mark_non_differentiable({lse});
    // lse has no gradient to materialise; a missing grad_out is made below, as zeros.
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!ctx->saved_data["padding_mask_requires_grad"].toBool(),
                "attnx.attention: no gradient for a float key_padding_mask, which requires grad. Detach it, or pass "
                "it as a (B, 1, 1, S) attn_mask, whose gradient attnx computes.");
    const int64_t mask_edge = ctx->saved_data["mask_edge"].toInt();
    const int64_t sinks_edge = ctx->saved_data["sinks_edge"].toInt();
    const bool want_q = ctx->needs_input_grad(0), want_k = ctx->needs_input_grad(1);
    const bool want_v = ctx->needs_input_grad(2);
    const bool want_mask = mask_edge >= 0 && ctx->needs_input_grad(mask_edge);
    const bool want_sinks = sinks_edge >= 0 && ctx->needs_input_grad(sinks_edge);
    variable_list result(kNumArgs);
    if (!(want_q || want_k || want_v || want_mask || want_sinks)) return result;

    const auto saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[3];
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const std::vector<int64_t> window = ctx->saved_data["window"].toIntVector();
    auto [dq, dk, dv, dmask, dsinks] = attention_backward_op().call(
        grad_out, saved[0], saved[1], saved[2], out, saved[4], opt(saved[5]), opt(saved[6]),
        ctx->saved_data["is_causal"].toBool(), ctx->saved_data["scale"].toOptional<double>(),
        ctx->saved_data["dropout_p"].toDouble(), opt(saved[7]), window[0], window[1], opt(saved[8]),
        ctx->saved_data["softcap"].toOptional<double>(), opt(saved[9]), want_mask);
    if (want_q) result[0] = std::move(dq);
    if (want_k) result[1] = std::move(dk);
    if (want_v) result[2] = std::move(dv);
    if (want_mask) result[kAttnMaskArg] = std::move(dmask);
    if (want_sinks) result[kSinksArg] = std::move(dsinks);
    return result;
  }
};

AttentionOutputs attention_autograd(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    ATTNX_ATTENTION_OPTIONS) {
  // dropout_seed and key_lengths are integer tensors: they never require grad.
  const bool differentiable = at::GradMode::is_enabled() &&
                              (query.requires_grad() || key.requires_grad() || value.requires_grad() ||
                               requires_grad(attn_mask) || requires_grad(key_padding_mask) || requires_grad(sinks));
  if (!differentiable) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_op().call(query, key, value, ATTNX_ATTENTION_OPTION_ARGS);
  }
  const variable_list out = AttentionFunction::apply(query, key, value, ATTNX_ATTENTION_OPTION_ARGS);
  return {out[0], out[1]};
}

// attention_backward is not differentiable: its outputs carry a node that fails loudly where a double backward
// (create_graph=True, then a second backward) reaches it, rather than gradients silently missing a term.
class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_out, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value, const at::Tensor& out,
                               const at::Tensor& lse, ATTNX_ATTENTION_OPTIONS, bool grad_attn_mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dq, dk, dv, dmask, dsinks] = attention_backward_op().call(
        grad_out, query, key, value, out, lse, ATTNX_ATTENTION_OPTION_ARGS, grad_attn_mask);
    return {dq, dk, dv, dmask, dsinks};
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    TORCH_CHECK(false,
                "attnx.attention: double backward is not implemented (attnx::attention_backward is not "
                "differentiable)");
    return {};
  }
};

AttentionBackwardOutputs attention_backward_autograd(const at::Tensor& grad_out, const at::Tensor& query,
                                                     const at::Tensor& key, const at::Tensor& value,
                                                     const at::Tensor& out, const at::Tensor& lse,
                                                     ATTNX_ATTENTION_OPTIONS, bool grad_attn_mask) {
  const bool differentiable =
      at::GradMode::is_enabled() &&
      (grad_out.requires_grad() || query.requires_grad() || key.requires_grad() || value.requires_grad() ||
       out.requires_grad() || lse.requires_grad() || requires_grad(attn_mask) || requires_grad(key_padding_mask) ||
       requires_grad(sinks));
  if (!differentiable) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_backward_op().call(grad_out, query, key, value, out, lse, ATTNX_ATTENTION_OPTION_ARGS,
                                        grad_attn_mask);
  }
  const variable_list g = AttentionBackwardFunction::apply(grad_out, query, key, value, out, lse,
                                                           ATTNX_ATTENTION_OPTION_ARGS, grad_attn_mask);
  return {g[0], g[1], g[2], g[3], g[4]};
}

}  // namespace
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, Autograd, m) {
  m.impl("attention", &attnx::attention_autograd);
  m.impl("attention_backward", &attnx::attention_backward_autograd);
}
