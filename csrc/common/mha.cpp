// attnx: attnx::mha, the whole nn.MultiheadAttention forward in one dispatch, and its backward.
//
// It is a composition of attnx's own ops (linear, attention) called through the dispatcher, so one definition
// serves every backend that has those kernels (registered as CompositeExplicitAutograd below). No step copies
// q, k, v or the masks except where the semantics add keys (bias_k/bias_v, add_zero_attn), and nothing of
// size [B, H, L, S] exists unless the caller asks for the attention weights. Nothing here depends on the
// device: the in-projections are planned here, in one layout for every backend, and run the way the backend
// registered (common/linear.h, run_gemms).
//
// On the LibTorch stable ABI. Every view (of the inputs, the projections, the heads) is a shim reinterpret
// computed from sizes and strides (common/views.h): at decoding shapes the dispatcher is paid for the GEMMs
// and the attention kernel only.
#include "common/mha.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/aten.h"
#include "common/attention.h"
#include "common/linear.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {
namespace {

using OptTensor = std::optional<Tensor>;
using stable::Sizes;
using torch::headeronly::IntHeaderOnlyArrayRef;

// Whether a and b are one tensor, as at::Tensor::is_same: the C API has no such call, but
// aoti_torch_get_sizes points into the tensor itself, so two handles of one tensor see one sizes array and
// two tensors two.
bool is_same(const Tensor& a, const Tensor& b) {
  return a.get() == b.get() || a.sizes().data() == b.sizes().data();
}

OptTensor rows(const OptTensor& t, int64_t start, int64_t length) {
  return t ? OptTensor(views::narrow(*t, 0, start, length)) : std::nullopt;
}

// (N, B, E) -> (B, H, N, E / H), a view.
Tensor split_heads(const Tensor& t, int64_t num_heads) {
  const int64_t sizes[4] = {t.size(0), t.size(1), num_heads, t.size(2) / num_heads}, order[4] = {1, 2, 0, 3};
  return views::permute(views::view(t, sizes), order);
}

// static_k / static_v, (B*H, S, head_dim), as (B, H, S, head_dim): a view.
Tensor unflatten_heads(const Tensor& t, int64_t B, int64_t H) {
  const int64_t sizes[4] = {B, H, t.size(1), t.size(2)};
  return views::view(t, sizes);
}

// The attention options mha runs attention with: its masks (extended over the appended keys) and dropout.
AttentionOptions attention_options(const MhaArgs& a, const OptTensor& attn_mask,
                                   const OptTensor& key_padding_mask) {
  AttentionOptions o;
  o.attn_mask = attn_mask;
  o.key_padding_mask = key_padding_mask;
  o.is_causal = a.is_causal;
  o.dropout_p = a.dropout_p;
  o.dropout_seed = a.dropout_seed;
  return o;
}

// Attention weights, (B, H, L, S) in lse's dtype, normalised exactly as torch's softmax (not from lse: see
// attention_weights_exact). Only for callers that asked for them. Fully masked rows give NaN, as torch's.
Tensor attention_weights(const Tensor& q, const Tensor& k, const Tensor& lse,
                         const AttentionOptions& options) {
  return attention_weights_exact(q, k, lse.scalar_type(), options, attention_scale(options, q.size(3)));
}

// query, key and value as the caller passed them: (L, B, E), (S, B, kdim), (S, B, vdim), or with batch_first
// (B, L, E), (B, S, kdim), (B, S, vdim).
void check_mha_args(const MhaArgs& a) {
  const bool batch_first = a.batch_first;
  const Tensor &query = a.query, &key = a.key, &value = a.value;
  const int64_t seq = batch_first ? 1 : 0, batch = 1 - seq;
  ATTNX_CHECK(query.dim() == 3, "attnx::mha: expected query of shape ", batch_first ? "(B, L, E)" : "(L, B, E)",
              ", got ", Sizes{query.sizes()});
  const int64_t L = query.size(seq), B = query.size(batch), E = query.size(2);
  ATTNX_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(batch) == B && value.size(batch) == B &&
                  key.size(seq) == value.size(seq),
              "attnx::mha: expected key ", batch_first ? "(B, S, kdim)" : "(S, B, kdim)", " and value ",
              batch_first ? "(B, S, vdim)" : "(S, B, vdim)", " with B = ", B, ", got ", Sizes{key.sizes()},
              " and ", Sizes{value.sizes()});
  ATTNX_CHECK(a.num_heads > 0 && E % a.num_heads == 0, "attnx::mha: expected embed_dim (", E,
              ") divisible by num_heads (", a.num_heads, ")");
  const bool separate = a.q_proj_weight && a.k_proj_weight && a.v_proj_weight;
  ATTNX_CHECK(a.in_proj_weight.has_value() != separate,
              "attnx::mha: expected either in_proj_weight or all three of q/k/v_proj_weight");
  ATTNX_CHECK(a.bias_k.has_value() == a.bias_v.has_value(),
              "attnx::mha: expected bias_k and bias_v together");
  ATTNX_CHECK(!a.bias_k || (!a.static_k && !a.static_v),
              "attnx::mha: bias_k/bias_v cannot be added to static_k/static_v");
  const int64_t H = a.num_heads, head_dim = E / a.num_heads;
  for (const OptTensor* s : {&a.static_k, &a.static_v}) {
    ATTNX_CHECK(!*s || ((*s)->dim() == 3 && (*s)->size(0) == B * H && (*s)->size(2) == head_dim),
                "attnx::mha: expected static_k/static_v of shape (B*H, S, head_dim) = (", B * H, ", S, ",
                head_dim, "), got ", Sizes{(*s)->sizes()});
  }
  const int64_t S = a.static_k ? a.static_k->size(1) : key.size(seq);
  if (a.key_padding_mask) {
    const Tensor& m = *a.key_padding_mask;
    ATTNX_CHECK(m.dim() == 2 && m.size(0) == B && m.size(1) == S,
                "attnx::mha: expected key_padding_mask of shape (B, S) = (", B, ", ", S, "), got ",
                Sizes{m.sizes()});
  }
  if (a.attn_mask) {
    const Tensor& m = *a.attn_mask;
    const bool ok = (m.dim() == 2 && m.size(0) == L && m.size(1) == S) ||
                    (m.dim() == 3 && m.size(0) == B * H && m.size(1) == L && m.size(2) == S);
    ATTNX_CHECK(ok, "attnx::mha: expected attn_mask of shape (L, S) = (", L, ", ", S, ") or (B*H, L, S) = (",
                B * H, ", ", L, ", ", S, "), got ", Sizes{m.sizes()});
  }
}

// Appends `extra` never-masked key columns to a mask: False for a bool mask, 0 for a float one.
OptTensor pad_keys(const OptTensor& mask, int64_t extra) {
  if (!mask || extra <= 0) return mask;
  const int64_t pad[2] = {0, extra};
  return aten::pad(*mask, pad);
}

// The sequence-first (N, B, F) form of mha's query, key and value: batch_first (B, N, F) arguments as their
// transposes, views whose strides the projections and kernels read as they are (no copy). A tensor passed as
// several arguments stays one tensor, so that self-attention is still recognised (one input gradient
// backward).
struct SeqFirst {
  Tensor query, key, value;
};

SeqFirst seq_first(const MhaArgs& a) {
  if (!a.batch_first) return {a.query, a.key, a.value};
  const Tensor q = views::transpose(a.query, 0, 1);
  const Tensor k = is_same(a.key, a.query) ? q : views::transpose(a.key, 0, 1);
  const Tensor v = is_same(a.value, a.key)     ? k
                   : is_same(a.value, a.query) ? q
                                               : views::transpose(a.value, 0, 1);
  return {q, k, v};
}

// ---------------------------------------------------------------------------------------------------------------
// In-projections.

// q, k, v (N, B, E) = input @ weight^T + bias for query, key and value, where k (v) is absent when static_k
// (static_v) replaces it: one linear each, against its block of in_proj_weight's rows, each output laid out
// as attnx::linear lays out its own. The layout depends on the arguments only, never on the device (the
// mha_forward fake states it, python/attnx/_fake.py): separate dense outputs, because the CPU kernels read
// rows of a packed (N, B, 3E) output more slowly at power-of-two widths (cache-set conflicts), and how the
// linears run is the backend's (run_linears: the CPU runs them at once, in shares per thread).
struct InProjections {
  OptTensor q, k, v;
};

InProjections in_projections(const MhaArgs& a, const SeqFirst& seq) {
  const int64_t E = seq.query.size(2);
  const auto weight = [&](int64_t i, const OptTensor& separate) {
    return a.in_proj_weight ? views::narrow(*a.in_proj_weight, 0, i * E, E) : *separate;
  };
  std::vector<LinearCall> calls{{seq.query, weight(0, a.q_proj_weight), rows(a.in_proj_bias, 0, E)}};
  if (!a.static_k) calls.push_back({seq.key, weight(1, a.k_proj_weight), rows(a.in_proj_bias, E, E)});
  if (!a.static_v) calls.push_back({seq.value, weight(2, a.v_proj_weight), rows(a.in_proj_bias, 2 * E, E)});
  const std::vector<Tensor> out = run_linears(calls);
  return {out[0], a.static_k ? OptTensor() : out[1], a.static_v ? OptTensor() : out.back()};
}

// ---------------------------------------------------------------------------------------------------------------
// Forward.

// What the forward hands to the backward: the attention problem as attnx::attention saw it. (Optional: an
// empty stable Tensor is still a handle to allocate.)
struct MhaState {
  OptTensor out, lse, weights;
  OptTensor q, k, v;  // (B, H, L, Dh), (B, H, S', Dh), (B, H, S', Dh): attention's inputs, appended keys included
  OptTensor attn;     // (B, H, L, Dh) in memory order (B, L, H, Dh): attention's output
};

MhaState mha_forward_impl(const MhaArgs& a, bool keep_for_backward) {
  // The views taken here (of the inputs, the projections, the weights) are internal reinterprets, not autograd
  // views, and no output aliases an input: nothing here needs autograd's view tracking, under inference_mode
  // or not.
  check_mha_args(a);
  const SeqFirst seq = seq_first(a);
  const Tensor& query = seq.query;
  // Weights after dropout would need the (B, H, L, S) keep mask; attnx.functional runs that case by
  // composition.
  ATTNX_CHECK(
      !a.need_weights || a.dropout_p == 0.0,
      "attnx::mha: need_weights with dropout_p > 0 is not supported (the weights are recomputed from lse "
      "without the dropout mask)");
  const int64_t B = query.size(1), E = query.size(2), H = a.num_heads;
  const int64_t appended = int64_t(a.bias_k.has_value()) + int64_t(a.add_zero_attn);
  const AttentionOptions options =
      attention_options(a, pad_keys(a.attn_mask, appended), pad_keys(a.key_padding_mask, appended));

  auto [q, k, v] = in_projections(a, seq);

  // bias_k / bias_v: one learned key and value appended to every sequence (never masked).
  if (a.bias_k) {
    const auto append = [&](const Tensor& t, const Tensor& bias) {
      const int64_t row_sizes[3] = {1, 1, E};
      const Tensor row = views::reshape(bias, row_sizes);
      const int64_t sizes[3] = {1, B, E}, strides[3] = {row.stride(0), 0, row.stride(2)};  // expand
      return aten::cat({t, views::reinterpret(row, sizes, strides)}, 0);
    };
    k = append(*k, *a.bias_k);
    v = append(*v, *a.bias_v);
  }

  // (B, H, N, head_dim) views; static_k / static_v arrive as (B*H, S, head_dim).
  MhaState state;
  OptTensor q4 = split_heads(*q, H);
  OptTensor k4 = a.static_k ? unflatten_heads(*a.static_k, B, H) : split_heads(*k, H);
  OptTensor v4 = a.static_v ? unflatten_heads(*a.static_v, B, H) : split_heads(*v, H);

  // add_zero_attn: one all-zero key and value appended (never masked).
  if (a.add_zero_attn) {
    const int64_t pad[4] = {0, 0, 0, 1};
    k4 = aten::pad(*k4, pad);
    v4 = aten::pad(*v4, pad);
  }

  const auto [attn, lse] = call_attention(*q4, *k4, *v4, options);
  if (keep_for_backward) {
    // An op's outputs may not alias its inputs: static_k / static_v used as they are stay with the caller, and
    // the backward reads them from there (empty here).
    state.q = q4;
    state.k = a.static_k && !a.add_zero_attn ? aten::new_empty_output(*q4) : *k4;
    state.v = a.static_v && !a.add_zero_attn ? aten::new_empty_output(*q4) : *v4;
    state.attn = attn;
  }
  // Release the projections before the out projection allocates its output, so that peak memory is the
  // projections plus the attention output, never the projections plus two outputs.
  q.reset();
  k.reset();
  v.reset();
  v4.reset();
  if (!a.need_weights) {
    q4.reset();
    k4.reset();
  }

  // attn is (B, H, L, head_dim) laid out as (B, L, H, head_dim), so its (L, B, E) form is a view, and linear
  // writes out in that memory order: (L, B, E) with the strides of a (B, L, E) tensor, whose batch_first
  // (B, L, E) form is again a view.
  const int64_t order[4] = {2, 0, 1, 3}, flat[3] = {attn.size(2), attn.size(0), attn.size(1) * attn.size(3)};
  const Tensor out =
      call_linear(views::reshape(views::permute(attn, order), flat), a.out_proj_weight, a.out_proj_bias);
  state.out = a.batch_first ? views::transpose(out, 0, 1) : out;
  state.lse = lse;

  if (a.need_weights) {
    Tensor weights = attention_weights(*q4, *k4, lse, options);
    if (a.average_attn_weights) weights = aten::mean(weights, {1});
    state.weights = aten::to(weights, query.scalar_type());
  } else {
    state.weights = aten::new_empty_output(query);
  }
  return state;
}

// The boxed kernels of attnx::_mha (keep_for_backward false: out, lse, weights) and attnx::mha_forward
// (true: and q, k, v, attn).
template <bool kKeepForBackward>
void mha_op(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  MhaArgs args;
  const auto fields = MhaArgs::fields(args);
  stable::check_stack("attnx::mha", num_args, std::tuple_size_v<decltype(fields)>, num_outputs,
                      kKeepForBackward ? 7 : 3);
  stable::unbox(stack, fields);
  const MhaState s = mha_forward_impl(args, kKeepForBackward);
  using torch::stable::detail::from;
  const OptTensor outputs[7] = {s.out, s.lse, s.weights, s.q, s.k, s.v, s.attn};
  for (uint64_t i = 0; i < num_outputs; ++i) stack[i] = from(*outputs[i]);
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
Tensor batch_major_rows(const Tensor& t) {
  const int64_t sizes[2] = {t.size(0) * t.size(1), t.size(2)};
  return views::reshape(views::transpose(t, 0, 1), sizes);
}

// The rows of a gradient allocated in (B, N, F) memory order, to be written: always a view.
Tensor rows_to_write(const Tensor& t) {
  const int64_t sizes[2] = {t.size(0) * t.size(1), t.size(2)};
  return views::view(views::transpose(t, 0, 1), sizes);
}

// c += a @ b in place, c a 2-D (rows) tensor: what addmm_ runs. aten::addmm takes beta and alpha as Scalars;
// aten::linear.out with c as both its bias and its out is addmm_out(c, c, a, b), addmm_ itself.
void addmm_in_place(const Tensor& c, const Tensor& a, const Tensor& b) {
  aten::linear_out(c, a, views::transpose(b, 0, 1), c);
}

// (B, H, N, Dh) -> (B*N, H*Dh) rows in (batch, position) order; a view for attention's (B, N, H, Dh) layouts.
Tensor head_rows(const Tensor& t) {
  const int64_t order[4] = {0, 2, 1, 3}, sizes[2] = {t.size(0) * t.size(2), t.size(1) * t.size(3)};
  return views::reshape(views::permute(t, order), sizes);
}

// The gradient of the attention weights output flowed back into grad_q and grad_k (in place), and into
// grad_mask (attn_mask's gradient, (L, S') or (B*H, L, S')) when there is one: the softmax backward
// dS = P * (dP - rowsum(dP * P)) on P recomputed from lse. Only reached when the caller asked for the weights
// and used them, so the (B, H, L, S') tensors it builds are the size of what it asked for.
void add_weights_grad(const Tensor& grad_weights, bool average_attn_weights, const Tensor& q, const Tensor& k,
                      const Tensor& lse, const AttentionOptions& options, const Tensor& grad_q,
                      const Tensor& grad_k, const OptTensor& grad_mask) {
  const ScalarType acc = lse.scalar_type();
  const Tensor p = attention_weights(q, k, lse, options);
  Tensor dp = aten::to(grad_weights, acc);
  if (average_attn_weights) dp = aten::div(views::unsqueeze(dp, 1), double(q.size(1)));  // mean over heads
  const Tensor rowsum = aten::sum(aten::mul(dp, p), {-1}, /*keepdim=*/true);
  const Tensor ds = aten::mul(p, aten::sub(dp, rowsum));
  // A fully masked row's weights are NaN whatever q and k are: no gradient flows from them.
  aten::masked_fill_(ds, views::unsqueeze(aten::isposinf(lse), -1), 0.0);
  if (grad_mask) {
    const int64_t flat[3] = {ds.size(0) * ds.size(1), ds.size(2), ds.size(3)};
    const Tensor g = grad_mask->dim() == 2 ? aten::sum(ds, {0, 1}) : views::reshape(ds, flat);
    aten::add_(*grad_mask, aten::to(g, grad_mask->scalar_type()));
  }
  const double scale = attention_scale(options, q.size(3));
  const Tensor dq = aten::matmul(ds, aten::to(k, acc));
  aten::mul_(dq, scale);
  aten::add_(grad_q, aten::to(dq, grad_q.scalar_type()));
  const Tensor dk = aten::matmul(views::transpose(ds, -2, -1), aten::to(q, acc));
  aten::mul_(dk, scale);
  aten::add_(grad_k, aten::to(dk, grad_k.scalar_type()));
}

std::vector<Tensor> mha_backward(const Tensor& grad_out_in, const OptTensor& grad_weights, const MhaArgs& a,
                                 const Tensor& q, const Tensor& k_saved, const Tensor& v_saved,
                                 const Tensor& attn, const Tensor& lse,
                                 const std::vector<int64_t>& output_mask_in) {
  check_mha_args(a);
  const bool batch_first = a.batch_first, add_zero_attn = a.add_zero_attn;
  const int64_t num_heads = a.num_heads;
  const OptTensor &in_proj_weight = a.in_proj_weight, &in_proj_bias = a.in_proj_bias;
  const OptTensor &static_k = a.static_k, &static_v = a.static_v, &bias_k = a.bias_k;
  // Sequence-first views from here on; the input gradients are transposed back at the end.
  const SeqFirst seq = seq_first(a);
  const Tensor &query = seq.query, &key = seq.key, &value = seq.value;
  const Tensor grad_out = batch_first ? views::transpose(grad_out_in, 0, 1) : grad_out_in;
  // static_k / static_v used without an appended zero key are attention's k / v themselves.
  const Tensor k = static_k && !add_zero_attn ? unflatten_heads(*static_k, query.size(1), num_heads) : k_saved;
  const Tensor v = static_v && !add_zero_attn ? unflatten_heads(*static_v, query.size(1), num_heads) : v_saved;
  ATTNX_CHECK(static_cast<int64_t>(output_mask_in.size()) == kNumMhaGrads,
              "attnx::mha_backward: expected output_mask of ", kNumMhaGrads, " entries, got ",
              output_mask_in.size());
  const auto wanted = [&](MhaGrad g) { return output_mask_in[g] != 0; };
  const int64_t L = query.size(0), B = query.size(1), E = query.size(2), H = num_heads, Dh = E / H;
  const int64_t S = static_k ? static_k->size(1) : key.size(0);
  const int64_t appended = int64_t(bias_k.has_value()) + int64_t(add_zero_attn);
  const AttentionOptions options =
      attention_options(a, pad_keys(a.attn_mask, appended), pad_keys(a.key_padding_mask, appended));
  const OptTensor& attn_mask = options.attn_mask;
  ATTNX_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && attn.dim() == 4 && q.size(0) == B &&
                  q.size(1) == H && q.size(2) == L && k.size(2) == S + appended,
              "attnx::mha_backward: expected q, k, v and attn as attnx::mha_forward returned them");
  std::vector<OptTensor> grads(kNumMhaGrads);

  // Out projection: out = attn @ out_proj_weight^T + out_proj_bias, rows in (batch, position) order.
  const Tensor grad_out_rows = batch_major_rows(grad_out);  // (B*L, E)
  if (wanted(kGradOutProjWeight)) {
    grads[kGradOutProjWeight] = aten::mm(views::transpose(grad_out_rows, 0, 1), head_rows(attn));
  }
  if (a.out_proj_bias && wanted(kGradOutProjBias)) grads[kGradOutProjBias] = aten::sum(grad_out_rows, {0});
  const int64_t blhd[4] = {B, L, H, Dh}, order[4] = {0, 2, 1, 3};
  OptTensor grad_attn = views::permute(views::view(aten::mm(grad_out_rows, a.out_proj_weight), blhd), order);

  // Attention, probabilities recomputed from lse.
  // A float attn_mask (a learned bias) gets dS summed as the mask broadcasts, from the fused backward.
  const bool mask_grad = wanted(kGradAttnMask) && attn_mask && attn_mask->scalar_type() != ScalarType::Bool;
  std::array<Tensor, 5> attention_grads =
      call_attention_backward(*grad_attn, q, k, v, attn, lse, options, mask_grad);
  OptTensor grad_q = std::move(attention_grads[0]), grad_k = std::move(attention_grads[1]),
            grad_v = std::move(attention_grads[2]);
  const OptTensor grad_mask = mask_grad ? OptTensor(std::move(attention_grads[3])) : std::nullopt;
  if (grad_weights && grad_weights->defined() && grad_weights->numel() > 0) {
    ATTNX_CHECK(a.need_weights, "attnx::mha_backward: got grad_weights for a call without need_weights");
    add_weights_grad(*grad_weights, a.average_attn_weights, q, k, lse, options, *grad_q, *grad_k, grad_mask);
  }
  // The columns of the appended keys (bias_k, add_zero_attn) were padding, not the caller's mask: cut off, and
  // copied once so that the gradient is contiguous in the mask's shape, the one layout the fake kernel states.
  if (mask_grad) {
    grads[kGradAttnMask] = appended ? aten::contiguous(views::narrow(*grad_mask, -1, 0, S)) : *grad_mask;
  }
  grad_attn.reset();

  // Appended keys: the zero key has no parameter; bias_k / bias_v sit at position S of every sequence.
  if (bias_k) {
    const auto appended_grad = [&](const Tensor& grad) {
      const int64_t one_row[3] = {1, 1, E};
      return views::reshape(aten::sum(views::select(grad, 2, S), {0}), one_row);
    };
    if (wanted(kGradBiasK)) grads[kGradBiasK] = appended_grad(*grad_k);
    if (wanted(kGradBiasV)) grads[kGradBiasV] = appended_grad(*grad_v);
  }
  grad_k = views::narrow(*grad_k, 2, 0, S);
  grad_v = views::narrow(*grad_v, 2, 0, S);
  // static_k / static_v are (B*H, S, Dh); the gradients are (B, H, S, Dh) in memory order (B, S, H, Dh), which
  // no (B*H, ...) view describes, so reshape copies them once. The copy is made contiguous in every case (also
  // where reshape could return a strided view), so that the output layout is one rule the fake kernel mirrors.
  const int64_t static_sizes[3] = {B * H, S, Dh};
  if (static_k && wanted(kGradStaticK)) {
    grads[kGradStaticK] = aten::contiguous(views::reshape(*grad_k, static_sizes));
  }
  if (static_v && wanted(kGradStaticV)) {
    grads[kGradStaticV] = aten::contiguous(views::reshape(*grad_v, static_sizes));
  }

  // In-projections: proj = input @ weight^T + bias for each of q, k, v that was projected.
  const OptTensor grad_proj[3] = {head_rows(*grad_q), static_k ? OptTensor() : head_rows(*grad_k),
                                  static_v ? OptTensor() : head_rows(*grad_v)};
  grad_q.reset();
  grad_k.reset();
  grad_v.reset();
  const Tensor* inputs[3] = {&query, &key, &value};
  const OptTensor* separate[3] = {&a.q_proj_weight, &a.k_proj_weight, &a.v_proj_weight};
  const auto proj_weight = [&](int64_t i) {
    return in_proj_weight ? views::narrow(*in_proj_weight, 0, i * E, E) : separate[i]->value();
  };
  // Called with one tensor as query, key and value (self-attention), its whole gradient goes to grad_query
  // and grad_key / grad_value stay empty: autograd would only add the three up.
  const bool one_input = is_same(query, key) && is_same(key, value);
  const bool wanted_input[3] = {
      wanted(kGradQuery) || (one_input && (wanted(kGradKey) || wanted(kGradValue))),
      !one_input && wanted(kGradKey), !one_input && wanted(kGradValue)};
  OptTensor input_rows[3];  // each distinct input's rows, gathered once
  const auto rows_of = [&](int64_t i) -> const Tensor& {
    int64_t first = i;
    while (first > 0 && is_same(*inputs[first - 1], *inputs[i])) --first;
    if (!input_rows[first]) input_rows[first] = batch_major_rows(*inputs[first]);
    return *input_rows[first];
  };
  // The packed in_proj gradients are written block by block; zero-filled first only when a block stays
  // unwritten (a projection that static_k / static_v replaced).
  const bool every_block = grad_proj[0] && grad_proj[1] && grad_proj[2];
  const auto packed_grad = [&](const Tensor& like) {
    return every_block ? aten::new_empty(like, like.sizes()) : aten::new_zeros(like, like.sizes());
  };
  for (int64_t i = 0; i < 3; ++i) {
    if (!grad_proj[i]) continue;
    const Tensor& dproj = *grad_proj[i];
    const Tensor w = proj_weight(i);
    const int64_t slot = one_input ? kGradQuery : kGradQuery + i;
    if (wanted_input[slot]) {
      OptTensor& g = grads[slot];
      if (!g) {
        // (N, B, F) in memory order (B, N, F): the GEMM writes it directly.
        const int64_t sizes[3] = {B, inputs[i]->size(0), inputs[i]->size(2)};
        g = views::transpose(aten::new_empty(dproj, sizes), 0, 1);
        aten::mm_out(rows_to_write(*g), dproj, w);
      } else {
        addmm_in_place(rows_to_write(*g), dproj, w);
      }
    }
    if (in_proj_weight) {
      if (wanted(kGradInProjWeight)) {
        OptTensor& grad_weight = grads[kGradInProjWeight];
        if (!grad_weight) grad_weight = packed_grad(*in_proj_weight);
        aten::mm_out(views::narrow(*grad_weight, 0, i * E, E), views::transpose(dproj, 0, 1), rows_of(i));
      }
    } else if (wanted(MhaGrad(kGradQProjWeight + i))) {
      grads[kGradQProjWeight + i] = aten::mm(views::transpose(dproj, 0, 1), rows_of(i));
    }
    if (in_proj_bias && wanted(kGradInProjBias)) {
      OptTensor& grad_bias = grads[kGradInProjBias];
      if (!grad_bias) grad_bias = packed_grad(*in_proj_bias);
      aten::sum_out(views::narrow(*grad_bias, 0, i * E, E), dproj, {0});
    }
  }
  // Requested gradients of inputs that no projection read (a key replaced by static_k) are zero.
  for (int64_t i = 0; i < 3; ++i) {
    if (wanted_input[i] && !grads[kGradQuery + i]) {
      const int64_t sizes[3] = {B, inputs[i]->size(0), inputs[i]->size(2)};
      grads[kGradQuery + i] = views::transpose(aten::new_zeros(*inputs[i], sizes), 0, 1);
    }
  }
  if (in_proj_weight && wanted(kGradInProjWeight) && !grads[kGradInProjWeight]) {
    grads[kGradInProjWeight] = aten::new_zeros(*in_proj_weight, in_proj_weight->sizes());
  }
  for (int64_t i = 0; i < 3; ++i) {
    if (!in_proj_weight && wanted(MhaGrad(kGradQProjWeight + i)) && !grads[kGradQProjWeight + i]) {
      grads[kGradQProjWeight + i] = aten::new_zeros(separate[i]->value(), separate[i]->value().sizes());
    }
  }
  // The input gradients in the inputs' (B, N, F) shape; memory order (B, N, F) either way, as written above.
  if (batch_first) {
    for (int64_t i = 0; i < 3; ++i) {
      OptTensor& g = grads[kGradQuery + i];
      if (g) g = views::transpose(*g, 0, 1);
    }
  }
  // Gradients not asked for (or of absent arguments) are returned as empty tensors.
  std::vector<Tensor> result;
  result.reserve(kNumMhaGrads);
  for (const OptTensor& g : grads) result.push_back(g ? *g : aten::new_empty_output(query));
  return result;
}

// The boxed kernel of attnx::mha_backward: grad_out, grad_weights, mha's arguments but batch_first,
// mha_forward's q, k, v, attn and lse, output_mask, then batch_first (last in the schema, as in mha's).
void mha_backward_op(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  Tensor grad_out, q, k, v, attn, lse;
  OptTensor grad_weights;
  MhaArgs args;
  std::vector<int64_t> output_mask;
  const auto mha_fields = MhaArgs::fields(args);
  constexpr size_t kMhaFields = std::tuple_size_v<decltype(mha_fields)>;
  const auto all_fields =
      std::tuple_cat(std::tie(grad_out, grad_weights), stable::tuple_head<kMhaFields - 1>(mha_fields),
                     std::tie(q, k, v, attn, lse, output_mask, args.batch_first));
  stable::check_stack("attnx::mha_backward", num_args, std::tuple_size_v<decltype(all_fields)>, num_outputs,
                      1);
  stable::unbox(stack, all_fields);
  stack[0] = torch::stable::detail::from(
      mha_backward(grad_out, grad_weights, args, q, k, v, attn, lse, output_mask));
}

}  // namespace
}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("_mha", &attnx::mha_op</*kKeepForBackward=*/false>);
  m.impl("mha_forward", &attnx::mha_op</*kKeepForBackward=*/true>);
  m.impl("mha_backward", &attnx::mha_backward_op);
}
