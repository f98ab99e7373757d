// attnx: autograd for attnx::mha (and mha_backward's double-backward guard), registered on the ops' Autograd key
// for every backend.
//
// A forward that needs gradients runs attnx::mha_forward (mha's outputs plus attention's inputs and output) and
// its backward one attnx::mha_backward: two dispatches for a whole layer, and nothing of size (B, H, L, S)
// saved. Without gradients to compute, the call goes straight to attnx::mha, which frees the projections as
// soon as it can. In C++ for the reason linear's autograd is: a Python autograd kernel costs ~10 us per call,
// grad mode or not, as much as the whole op at small shapes.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>

namespace attnx {
namespace {

using OptTensor = std::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using MhaOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using MhaForwardOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// mha's arguments, in schema order: the one list the typed op handles below share (mha_backward takes them with
// batch_first moved to its end).
#define ATTNX_MHA_COMMON_PARAMS                                                                                    \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, int64_t num_heads,                      \
      const OptTensor &in_proj_weight, const OptTensor &in_proj_bias, const OptTensor &q_proj_weight,             \
      const OptTensor &k_proj_weight, const OptTensor &v_proj_weight, const OptTensor &bias_k,                    \
      const OptTensor &bias_v, bool add_zero_attn, const at::Tensor &out_proj_weight,                            \
      const OptTensor &out_proj_bias, const OptTensor &key_padding_mask, const OptTensor &attn_mask,              \
      bool is_causal, const OptTensor &static_k, const OptTensor &static_v, bool need_weights,                     \
      bool average_attn_weights, double dropout_p, const OptTensor &dropout_seed
#define ATTNX_MHA_PARAMS ATTNX_MHA_COMMON_PARAMS, bool batch_first
#define ATTNX_MHA_COMMON_ARGS                                                                                      \
  query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight,        \
      bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias, key_padding_mask, attn_mask, is_causal,      \
      static_k, static_v, need_weights, average_attn_weights, dropout_p, dropout_seed
#define ATTNX_MHA_ARGS ATTNX_MHA_COMMON_ARGS, batch_first
// The types of mha's arguments up to dropout_seed, which mha_backward takes in the same order (its batch_first
// comes last, after mha_forward's outputs).
#define ATTNX_MHA_COMMON_TYPES                                                                                     \
  const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, const OptTensor&,            \
      const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool,              \
      const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool, const OptTensor&,            \
      const OptTensor&, bool, bool, double, const OptTensor&
#define ATTNX_MHA_TYPES ATTNX_MHA_COMMON_TYPES, bool

const c10::TypedOperatorHandle<MhaOutputs(ATTNX_MHA_TYPES)>& mha_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("attnx::mha", "").typed<MhaOutputs(ATTNX_MHA_TYPES)>();
  return op;
}

const c10::TypedOperatorHandle<MhaForwardOutputs(ATTNX_MHA_TYPES)>& mha_forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnx::mha_forward", "")
                             .typed<MhaForwardOutputs(ATTNX_MHA_TYPES)>();
  return op;
}

const auto& mha_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnx::mha_backward", "")
          .typed<std::vector<at::Tensor>(const at::Tensor&, const OptTensor&, ATTNX_MHA_COMMON_TYPES,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, at::IntArrayRef, bool)>();
  return op;
}

// mha's tensor arguments in schema order, and where each one's gradient sits in mha_backward's result (-1:
// none, for the masks). Autograd's backward returns one entry per argument of the forward.
constexpr int kNumArgs = 24;
constexpr std::array<int, kNumArgs> kGradSlot = {
    0, 1, 2, /*num_heads*/ -1, 3, 4, 5, 6, 7, 8, 9, /*add_zero_attn*/ -1, 10, 11,
    /*key_padding_mask*/ -1, /*attn_mask*/ 14, /*is_causal*/ -1, 12, 13, /*need_weights*/ -1, /*average*/ -1,
    /*dropout_p*/ -1, /*dropout_seed*/ -1, /*batch_first*/ -1};
constexpr int kKeyPaddingMaskArg = 14;

// The saved optional arguments come back as undefined tensors where they were absent.
OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

class MhaFunction : public torch::autograd::Function<MhaFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, ATTNX_MHA_PARAMS) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse, weights, q, k, v, attn] = mha_forward_op().call(ATTNX_MHA_ARGS);
    const auto or_undefined = [](const OptTensor& t) { return t.value_or(at::Tensor()); };
    ctx->save_for_backward({query, key, value, or_undefined(in_proj_weight), or_undefined(in_proj_bias),
                            or_undefined(q_proj_weight), or_undefined(k_proj_weight), or_undefined(v_proj_weight),
                            or_undefined(bias_k), or_undefined(bias_v), out_proj_weight, or_undefined(out_proj_bias),
                            or_undefined(key_padding_mask), or_undefined(attn_mask), or_undefined(static_k),
                            or_undefined(static_v), q, k, v, attn, lse, or_undefined(dropout_seed)});
    ctx->saved_data["num_heads"] = num_heads;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["flags"] = std::vector<bool>{add_zero_attn, is_causal, need_weights, average_attn_weights,
                                                 query.is_same(key) && key.is_same(value), batch_first};
    // Present optional tensor arguments, in order: they alone have autograd edges (needs_input_grad's index).
    std::vector<int64_t> edge(kNumArgs, -1);
    const OptTensor tensors[kNumArgs] = {query,         key,          value,         std::nullopt,  in_proj_weight,
                                         in_proj_bias,  q_proj_weight, k_proj_weight, v_proj_weight, bias_k,
                                         bias_v,        std::nullopt, out_proj_weight, out_proj_bias,
                                         key_padding_mask, attn_mask, std::nullopt,  static_k,      static_v,
                                         std::nullopt,  std::nullopt,  std::nullopt,  dropout_seed,
                                         std::nullopt};
    for (int64_t i = 0, next = 0; i < kNumArgs; ++i) {
      if (tensors[i] && tensors[i]->defined()) edge[i] = next++;
    }
    ctx->saved_data["edge"] = edge;
    // One call: each call replaces the set the previous one marked.
    ctx->mark_non_differentiable(need_weights ? variable_list{lse} : variable_list{lse, weights});
    ctx->set_materialize_grads(false);
    return {out, lse, weights};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<int64_t> edge = ctx->saved_data["edge"].toIntVector();
    const auto needs = [&](int arg) { return edge[arg] >= 0 && ctx->needs_input_grad(edge[arg]); };
    TORCH_CHECK(!needs(kKeyPaddingMaskArg),
                "attnx.mha: no gradient for a float key_padding_mask, which requires grad. Detach it, or pass it "
                "as part of a float attn_mask, whose gradient attnx computes.");
    variable_list result(kNumArgs);
    const at::Tensor& grad_weights = grads[2];
    if (!grads[0].defined() && !grad_weights.defined()) return result;

    const auto saved = ctx->get_saved_variables();
    const c10::List<bool> flags = ctx->saved_data["flags"].toBoolList();
    const bool add_zero_attn = flags[0], is_causal = flags[1], need_weights = flags[2], average = flags[3];
    const bool one_input = flags[4], batch_first = flags[5];
    const at::Tensor& query = saved[0];
    const at::Tensor& out_proj_weight = saved[10];
    // out is (L, B, E), or (B, L, E) with batch_first: query's first two dims either way.
    const at::Tensor grad_out = grads[0].defined()
                                    ? grads[0]
                                    : at::zeros({query.size(0), query.size(1), out_proj_weight.size(0)},
                                                out_proj_weight.options());
    std::vector<int64_t> output_mask(15, 0);
    for (int arg = 0; arg < kNumArgs; ++arg) {
      if (kGradSlot[arg] >= 0) output_mask[kGradSlot[arg]] = needs(arg);
    }
    if (one_input) output_mask[0] = output_mask[0] || output_mask[1] || output_mask[2];

    // One tensor as query, key and value goes in three times, so that mha_backward sees it as one.
    const std::vector<at::Tensor> g = mha_backward_op().call(
        grad_out, opt(grad_weights), query, one_input ? query : saved[1], one_input ? query : saved[2],
        ctx->saved_data["num_heads"].toInt(), opt(saved[3]), opt(saved[4]), opt(saved[5]), opt(saved[6]),
        opt(saved[7]), opt(saved[8]), opt(saved[9]), add_zero_attn, out_proj_weight, opt(saved[11]), opt(saved[12]),
        opt(saved[13]), is_causal, opt(saved[14]), opt(saved[15]), need_weights, average,
        ctx->saved_data["dropout_p"].toDouble(), opt(saved[21]), saved[16], saved[17], saved[18], saved[19],
        saved[20], output_mask, batch_first);
    for (int arg = 0; arg < kNumArgs; ++arg) {
      const int slot = kGradSlot[arg];
      if (slot >= 0 && output_mask[slot] && !(one_input && (slot == 1 || slot == 2))) result[arg] = g[slot];
    }
    return result;
  }
};

MhaOutputs mha_autograd(ATTNX_MHA_PARAMS) {
  const auto requires_grad = [](const OptTensor& t) { return t && t->defined() && t->requires_grad(); };
  const bool differentiable =
      at::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad() || requires_grad(in_proj_weight) ||
       requires_grad(in_proj_bias) || requires_grad(q_proj_weight) || requires_grad(k_proj_weight) ||
       requires_grad(v_proj_weight) || requires_grad(bias_k) || requires_grad(bias_v) ||
       out_proj_weight.requires_grad() || requires_grad(out_proj_bias) || requires_grad(key_padding_mask) ||
       requires_grad(attn_mask) || requires_grad(static_k) || requires_grad(static_v));
  if (!differentiable) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return mha_op().call(ATTNX_MHA_ARGS);
  }
  const variable_list out = MhaFunction::apply(ATTNX_MHA_ARGS);
  return {out[0], out[1], out[2]};
}

// mha_backward is not differentiable: its outputs carry a node that fails loudly where a double backward
// (create_graph=True, then a second backward) reaches it, rather than gradients silently missing a term.
#define ATTNX_MHA_BACKWARD_PARAMS                                                                                  \
  const at::Tensor &grad_out, const OptTensor &grad_weights, ATTNX_MHA_COMMON_PARAMS, const at::Tensor &q,        \
      const at::Tensor &k, const at::Tensor &v, const at::Tensor &attn, const at::Tensor &lse,                    \
      at::IntArrayRef output_mask, bool batch_first
#define ATTNX_MHA_BACKWARD_ARGS \
  grad_out, grad_weights, ATTNX_MHA_COMMON_ARGS, q, k, v, attn, lse, output_mask, batch_first

class MhaBackwardFunction : public torch::autograd::Function<MhaBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, ATTNX_MHA_BACKWARD_PARAMS) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return mha_backward_op().call(ATTNX_MHA_BACKWARD_ARGS);
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    TORCH_CHECK(false, "attnx.mha: double backward is not implemented (attnx::mha_backward is not differentiable)");
    return {};
  }
};

std::vector<at::Tensor> mha_backward_autograd(ATTNX_MHA_BACKWARD_PARAMS) {
  const auto requires_grad = [](const OptTensor& t) { return t && t->defined() && t->requires_grad(); };
  const bool differentiable =
      at::GradMode::is_enabled() &&
      (grad_out.requires_grad() || requires_grad(grad_weights) || query.requires_grad() || key.requires_grad() ||
       value.requires_grad() || requires_grad(in_proj_weight) || requires_grad(in_proj_bias) ||
       requires_grad(q_proj_weight) || requires_grad(k_proj_weight) || requires_grad(v_proj_weight) ||
       requires_grad(bias_k) || requires_grad(bias_v) || out_proj_weight.requires_grad() ||
       requires_grad(out_proj_bias) || requires_grad(key_padding_mask) || requires_grad(attn_mask) ||
       requires_grad(static_k) || requires_grad(static_v) || q.requires_grad() || k.requires_grad() ||
       v.requires_grad() || attn.requires_grad() || lse.requires_grad());
  if (!differentiable) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return mha_backward_op().call(ATTNX_MHA_BACKWARD_ARGS);
  }
  return MhaBackwardFunction::apply(ATTNX_MHA_BACKWARD_ARGS);
}

}  // namespace
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, Autograd, m) {
  m.impl("mha", &attnx::mha_autograd);
  m.impl("mha_backward", &attnx::mha_backward_autograd);
}
