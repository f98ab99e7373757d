// attnx: attnx::mha, the whole nn.MultiheadAttention forward in one dispatch.
//
// It is a composition of attnx's own ops (linear, attention) called through the dispatcher, so one definition
// serves every backend that has those kernels (registered as CompositeExplicitAutograd below). No step copies
// q, k, v or the masks except where the semantics add keys (bias_k/bias_v, add_zero_attn), and nothing of size
// [B, H, L, S] exists unless the caller asks for the attention weights.
//
// On the LibTorch stable ABI. Every view (of the inputs, the projections, the heads) is a shim reinterpret
// computed from sizes and strides (common/views.h): at decoding shapes the dispatcher is paid for the GEMMs and
// the attention kernel only.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>
#include <torch/csrc/stable/library.h>
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

#include "common/attention.h"
#include "common/linear.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {
namespace {

using OptTensor = std::optional<Tensor>;
using stable::call;
using stable::Sizes;
using torch::headeronly::IntHeaderOnlyArrayRef;

Tensor attnx_linear(const Tensor& input, const Tensor& weight, const OptTensor& bias) {
  return call("attnx::_linear", "", input, weight, bias);
}

// attnx::attention's out and lse.
std::array<Tensor, 2> attnx_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const OptTensor& attn_mask, const OptTensor& key_padding_mask,
                                      bool is_causal, double dropout_p, const OptTensor& dropout_seed) {
  const std::optional<double> none;
  return call<2>("attnx::_attention", "", q, k, v, attn_mask, key_padding_mask, is_causal, none, dropout_p,
                 dropout_seed, -1, -1, OptTensor(), none, OptTensor());
}

// attention_backward's gradients of q, k, v and, when grad_attn_mask, of attn_mask.
struct AttentionGrads {
  Tensor query, key, value;
  OptTensor mask;
};

AttentionGrads attnx_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& out, const Tensor& lse,
                                        const OptTensor& attn_mask, const OptTensor& key_padding_mask,
                                        bool is_causal, double dropout_p, const OptTensor& dropout_seed,
                                        bool grad_attn_mask) {
  const std::optional<double> none;
  const std::array<Tensor, 5> g =
      call<5>("attnx::attention_backward", "", grad_out, q, k, v, out, lse, attn_mask, key_padding_mask,
              is_causal, none, dropout_p, dropout_seed, -1, -1, OptTensor(), none, OptTensor(), grad_attn_mask);
  return {g[0], g[1], g[2], grad_attn_mask ? OptTensor(g[3]) : std::nullopt};
}

// ---------------------------------------------------------------------------------------------------------------
// Tensors and the ops whose ATen form takes a Scalar, which the stable dispatcher cannot pass.

Tensor alloc(IntHeaderOnlyArrayRef sizes, const Tensor& like) {
  return stable::empty(sizes, like.scalar_type(), like.device());
}

// The empty (0,) tensor that stands for an output not asked for.
Tensor empty_output(const Tensor& like) {
  const int64_t zero = 0;
  return alloc(IntHeaderOnlyArrayRef(&zero, 1), like);
}

Tensor zeros(IntHeaderOnlyArrayRef sizes, const Tensor& like) {
  const Tensor t = alloc(sizes, like);
  stable::fill(t, 0.0);
  return t;
}

// mask with `extra` key columns appended: False for a bool mask, 0 for a float one.
Tensor pad_columns(const Tensor& mask, IntHeaderOnlyArrayRef pad) {
  double value = 0.0;
  AtenTensorHandle out = nullptr;
  stable::check(
      aoti_torch_aten_pad(mask.get(), pad.data(), static_cast<int64_t>(pad.size()), "constant", &value, &out),
      "attnx: aten::pad");
  return Tensor(out);
}

Tensor mm(const Tensor& a, const Tensor& b) {
  return call("aten::mm", "", a, b);
}

// out = a @ b, into out's memory.
void mm_out(const Tensor& out, const Tensor& a, const Tensor& b) {
  call("aten::mm", "out", a, b, out);
}

// c += a @ b in place, c a 2-D (rows) tensor: what addmm_ runs. aten::addmm takes beta and alpha as Scalars;
// aten::linear.out with c as both its bias and its out is addmm_out(c, c, a, b), addmm_ itself.
void addmm_in_place(const Tensor& c, const Tensor& a, const Tensor& b) {
  call("aten::linear", "out", a, views::transpose(b, 0, 1), OptTensor(c), c);
}

using stable::sub;

// dst += src, dst keeping its layout.
void add_in_place(const Tensor& dst, const Tensor& src) {
  stable::copy_into(dst, stable::add(dst, src));
}

// t summed over `dims`.
Tensor sum_dims(const Tensor& t, std::vector<int64_t> dims, bool keepdim = false) {
  return call("aten::sum", "dim_IntList", t, std::optional(std::move(dims)), keepdim,
              std::optional<ScalarType>());
}

// ---------------------------------------------------------------------------------------------------------------

// Whether a and b are one tensor, as at::Tensor::is_same: the C API has no such call, but
// aoti_torch_get_sizes points into the tensor itself, so two handles of one tensor see one sizes array and
// two tensors two.
bool is_same(const Tensor& a, const Tensor& b) {
  return a.get() == b.get() || a.sizes().data() == b.sizes().data();
}

OptTensor rows(const OptTensor& t, int64_t start, int64_t length) {
  return t ? OptTensor(views::narrow(*t, 0, start, length)) : std::nullopt;
}

// Whether in-projections that read the same input run as one GEMM against the packed weight rows. Not on the
// CPU: there the packed (3E x E) or (2E x E) GEMM measured 0.92-1.11x the separate (E x E) ones depending on
// the shape, while the separate GEMMs, run at once in shares per thread (run_gemms_in_shares), beat the same
// GEMMs one after another.
bool pack_in_projections(const Tensor& input) {
  return !input.is_cpu();
}

// The same memory seen the same way: then one GEMM against the packed weight serves both.
bool same_view(const Tensor& a, const Tensor& b) {
  return is_same(a, b) || (a.data_ptr() == b.data_ptr() && a.sizes().equals(b.sizes()) &&
                           a.strides().equals(b.strides()) && a.scalar_type() == b.scalar_type());
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

// Attention weights, (B, H, L, S) in lse's dtype, normalised exactly as torch's softmax (not from lse: see
// attention_weights_exact). Only for callers that asked for them. Fully masked rows give NaN, as torch's.
Tensor attention_weights(const Tensor& q, const Tensor& k, const Tensor& lse, const OptTensor& attn_mask,
                         const OptTensor& key_padding_mask, bool is_causal) {
  const double scale = 1.0 / std::sqrt(double(q.size(3)));
  return attention_weights_exact(q, k, lse.scalar_type(), attn_mask, key_padding_mask, is_causal, scale);
}

// query, key and value as the caller passed them: (L, B, E), (S, B, kdim), (S, B, vdim), or with batch_first
// (B, L, E), (B, S, kdim), (B, S, vdim).
void check_mha_args(const Tensor& query, const Tensor& key, const Tensor& value, int64_t num_heads,
                    const OptTensor& in_proj_weight, const OptTensor& q_proj_weight,
                    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
                    const OptTensor& bias_v, const OptTensor& key_padding_mask, const OptTensor& attn_mask,
                    const OptTensor& static_k, const OptTensor& static_v, bool batch_first) {
  const int64_t seq = batch_first ? 1 : 0, batch = 1 - seq;
  ATTNX_CHECK(query.dim() == 3, "attnx::mha: expected query of shape ", batch_first ? "(B, L, E)" : "(L, B, E)",
              ", got ", Sizes{query.sizes()});
  const int64_t L = query.size(seq), B = query.size(batch), E = query.size(2);
  ATTNX_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(batch) == B && value.size(batch) == B &&
                  key.size(seq) == value.size(seq),
              "attnx::mha: expected key ", batch_first ? "(B, S, kdim)" : "(S, B, kdim)", " and value ",
              batch_first ? "(B, S, vdim)" : "(S, B, vdim)", " with B = ", B, ", got ", Sizes{key.sizes()},
              " and ", Sizes{value.sizes()});
  ATTNX_CHECK(num_heads > 0 && E % num_heads == 0, "attnx::mha: expected embed_dim (", E,
              ") divisible by num_heads (", num_heads, ")");
  const bool separate = q_proj_weight && k_proj_weight && v_proj_weight;
  ATTNX_CHECK(in_proj_weight.has_value() != separate,
              "attnx::mha: expected either in_proj_weight or all three of q/k/v_proj_weight");
  ATTNX_CHECK(bias_k.has_value() == bias_v.has_value(), "attnx::mha: expected bias_k and bias_v together");
  ATTNX_CHECK(!bias_k || (!static_k && !static_v),
              "attnx::mha: bias_k/bias_v cannot be added to static_k/static_v");
  const int64_t H = num_heads, head_dim = E / num_heads;
  for (const OptTensor* s : {&static_k, &static_v}) {
    ATTNX_CHECK(!*s || ((*s)->dim() == 3 && (*s)->size(0) == B * H && (*s)->size(2) == head_dim),
                "attnx::mha: expected static_k/static_v of shape (B*H, S, head_dim) = (", B * H, ", S, ",
                head_dim, "), got ", Sizes{(*s)->sizes()});
  }
  const int64_t S = static_k ? static_k->size(1) : key.size(seq);
  if (key_padding_mask) {
    ATTNX_CHECK(key_padding_mask->dim() == 2 && key_padding_mask->size(0) == B && key_padding_mask->size(1) == S,
                "attnx::mha: expected key_padding_mask of shape (B, S) = (", B, ", ", S, "), got ",
                Sizes{key_padding_mask->sizes()});
  }
  if (attn_mask) {
    const bool ok = (attn_mask->dim() == 2 && attn_mask->size(0) == L && attn_mask->size(1) == S) ||
                    (attn_mask->dim() == 3 && attn_mask->size(0) == B * H && attn_mask->size(1) == L &&
                     attn_mask->size(2) == S);
    ATTNX_CHECK(ok, "attnx::mha: expected attn_mask of shape (L, S) = (", L, ", ", S, ") or (B*H, L, S) = (",
                B * H, ", ", L, ", ", S, "), got ", Sizes{attn_mask->sizes()});
  }
}

// Appends `extra` never-masked key columns to a mask: False for a bool mask, 0 for a float one.
OptTensor pad_keys(const OptTensor& mask, int64_t extra) {
  if (!mask || extra <= 0) return mask;
  const int64_t pad[2] = {0, extra};
  return pad_columns(*mask, pad);
}

// The sequence-first (N, B, F) form of mha's query, key and value: batch_first (B, N, F) arguments as their
// transposes, views whose strides the projections and kernels read as they are (no copy). A tensor passed as
// several arguments stays one tensor, so that self-attention is still recognised (one packed GEMM forward off
// the CPU, one gradient backward).
struct SeqFirst {
  Tensor query, key, value;
};

SeqFirst seq_first(const Tensor& query, const Tensor& key, const Tensor& value, bool batch_first) {
  if (!batch_first) return {query, key, value};
  const Tensor q = views::transpose(query, 0, 1);
  const Tensor k = is_same(key, query) ? q : views::transpose(key, 0, 1);
  const Tensor v = is_same(value, key) ? k : is_same(value, query) ? q : views::transpose(value, 0, 1);
  return {q, k, v};
}

// What the forward hands to the backward: the attention problem as attnx::attention saw it. (Optional: an
// empty stable Tensor is still a handle to allocate.)
struct MhaState {
  OptTensor out, lse, weights;
  OptTensor q, k, v;  // (B, H, L, Dh), (B, H, S', Dh), (B, H, S', Dh): attention's inputs, appended keys included
  OptTensor attn;     // (B, H, L, Dh) in memory order (B, L, H, Dh): attention's output
};

MhaState mha_forward_impl(const Tensor& query_in, const Tensor& key_in, const Tensor& value_in, int64_t num_heads,
                          const OptTensor& in_proj_weight, const OptTensor& in_proj_bias,
                          const OptTensor& q_proj_weight, const OptTensor& k_proj_weight,
                          const OptTensor& v_proj_weight, const OptTensor& bias_k, const OptTensor& bias_v,
                          bool add_zero_attn, const Tensor& out_proj_weight, const OptTensor& out_proj_bias,
                          const OptTensor& key_padding_mask_in, const OptTensor& attn_mask_in, bool is_causal,
                          const OptTensor& static_k, const OptTensor& static_v, bool need_weights,
                          bool average_attn_weights, double dropout_p, const OptTensor& dropout_seed,
                          bool batch_first, bool keep_for_backward) {
  // The views taken here (of the inputs, the projections, the weights) are internal reinterprets, not autograd
  // views, and no output aliases an input: nothing here needs autograd's view tracking, under inference_mode
  // or not.
  check_mha_args(query_in, key_in, value_in, num_heads, in_proj_weight, q_proj_weight, k_proj_weight,
                 v_proj_weight, bias_k, bias_v, key_padding_mask_in, attn_mask_in, static_k, static_v, batch_first);
  const SeqFirst seq = seq_first(query_in, key_in, value_in, batch_first);
  const Tensor &query = seq.query, &key = seq.key, &value = seq.value;
  // Weights after dropout would need the (B, H, L, S) keep mask; attnx.functional runs that case by
  // composition.
  ATTNX_CHECK(!need_weights || dropout_p == 0.0,
              "attnx::mha: need_weights with dropout_p > 0 is not supported (the weights are recomputed from lse "
              "without the dropout mask)");
  const int64_t B = query.size(1), E = query.size(2), H = num_heads;
  const int64_t appended = int64_t(bias_k.has_value()) + int64_t(add_zero_attn);
  const OptTensor key_padding_mask = pad_keys(key_padding_mask_in, appended);
  const OptTensor attn_mask = pad_keys(attn_mask_in, appended);

  // In-projections. Packed self-attention (off the CPU) is one GEMM whose (L, B, 3E) output q, k and v are
  // strided views of; projections that static_k / static_v replace are not computed at all.
  const auto weight = [&](int64_t i, const OptTensor& separate) {
    return in_proj_weight ? views::narrow(*in_proj_weight, 0, i * E, E) : *separate;
  };
  OptTensor q, k, v;
  const bool need_k = !static_k, need_v = !static_v;
  const bool pack = in_proj_weight && need_k && need_v && pack_in_projections(query);
  if (pack && same_view(query, key) && same_view(key, value)) {
    const Tensor qkv = attnx_linear(query, *in_proj_weight, in_proj_bias);
    q = views::narrow(qkv, 2, 0, E);
    k = views::narrow(qkv, 2, E, E);
    v = views::narrow(qkv, 2, 2 * E, E);
  } else if (!pack && query.is_cpu()) {
    // The separate GEMMs are independent: shared out among the threads at once, each thread's part on one
    // thread of BLAS, they beat the same GEMMs one after another on all threads (run_gemms_in_shares).
    std::vector<LinearGemm> gemms;
    gemms.reserve(3);
    gemms.push_back(plan_linear(query, weight(0, q_proj_weight), rows(in_proj_bias, 0, E)));
    if (need_k) gemms.push_back(plan_linear(key, weight(1, k_proj_weight), rows(in_proj_bias, E, E)));
    if (need_v) gemms.push_back(plan_linear(value, weight(2, v_proj_weight), rows(in_proj_bias, 2 * E, E)));
    run_gemms_in_shares(gemms);
    q = gemms[0].out;
    if (need_k) k = gemms[1].out;
    if (need_v) v = gemms.back().out;
  } else {
    q = attnx_linear(query, weight(0, q_proj_weight), rows(in_proj_bias, 0, E));
    if (pack && same_view(key, value)) {
      const Tensor kv =
          attnx_linear(key, views::narrow(*in_proj_weight, 0, E, 2 * E), rows(in_proj_bias, E, 2 * E));
      k = views::narrow(kv, 2, 0, E);
      v = views::narrow(kv, 2, E, E);
    } else {
      if (need_k) k = attnx_linear(key, weight(1, k_proj_weight), rows(in_proj_bias, E, E));
      if (need_v) v = attnx_linear(value, weight(2, v_proj_weight), rows(in_proj_bias, 2 * E, E));
    }
  }

  // bias_k / bias_v: one learned key and value appended to every sequence (never masked).
  if (bias_k) {
    const auto append = [&](const Tensor& t, const Tensor& bias) {
      const int64_t row_sizes[3] = {1, 1, E};
      const Tensor row = views::reshape(bias, row_sizes);
      const int64_t sizes[3] = {1, B, E}, strides[3] = {row.stride(0), 0, row.stride(2)};  // expand
      return call("aten::cat", "", std::vector<Tensor>{t, stable::reinterpret(row, sizes, strides)}, 0);
    };
    k = append(*k, *bias_k);
    v = append(*v, *bias_v);
  }

  // (B, H, N, head_dim) views; static_k / static_v arrive as (B*H, S, head_dim).
  MhaState state;
  OptTensor q4 = split_heads(*q, H);
  OptTensor k4 = static_k ? unflatten_heads(*static_k, B, H) : split_heads(*k, H);
  OptTensor v4 = static_v ? unflatten_heads(*static_v, B, H) : split_heads(*v, H);

  // add_zero_attn: one all-zero key and value appended (never masked).
  if (add_zero_attn) {
    const int64_t pad[4] = {0, 0, 0, 1};
    k4 = pad_columns(*k4, pad);
    v4 = pad_columns(*v4, pad);
  }

  const auto [attn, lse] =
      attnx_attention(*q4, *k4, *v4, attn_mask, key_padding_mask, is_causal, dropout_p, dropout_seed);
  if (keep_for_backward) {
    // An op's outputs may not alias its inputs: static_k / static_v used as they are stay with the caller, and
    // the backward reads them from there (empty here).
    state.q = q4;
    state.k = static_k && !add_zero_attn ? empty_output(*q4) : *k4;
    state.v = static_v && !add_zero_attn ? empty_output(*q4) : *v4;
    state.attn = attn;
  }
  // Release the projections before the out projection allocates its output, so that peak memory is the
  // projections plus the attention output, never the projections plus two outputs.
  q.reset();
  k.reset();
  v.reset();
  v4.reset();
  if (!need_weights) {
    q4.reset();
    k4.reset();
  }

  // attn is (B, H, L, head_dim) laid out as (B, L, H, head_dim), so its (L, B, E) form is a view, and linear
  // writes out in that memory order: (L, B, E) with the strides of a (B, L, E) tensor, whose batch_first
  // (B, L, E) form is again a view.
  const int64_t order[4] = {2, 0, 1, 3}, flat[3] = {attn.size(2), attn.size(0), attn.size(1) * attn.size(3)};
  const Tensor out =
      attnx_linear(views::reshape(views::permute(attn, order), flat), out_proj_weight, out_proj_bias);
  state.out = batch_first ? views::transpose(out, 0, 1) : out;
  state.lse = lse;

  if (need_weights) {
    Tensor weights = attention_weights(*q4, *k4, lse, attn_mask, key_padding_mask, is_causal);
    if (average_attn_weights) {
      weights = call("aten::mean", "dim", weights, std::optional(std::vector<int64_t>{1}), false,
                     std::optional<ScalarType>());
    }
    state.weights = stable::to(weights, query.scalar_type());
  } else {
    state.weights = empty_output(query);
  }
  return state;
}

std::tuple<Tensor, Tensor, Tensor> mha(const Tensor& query, const Tensor& key, const Tensor& value,
                                       int64_t num_heads, const OptTensor& in_proj_weight,
                                       const OptTensor& in_proj_bias, const OptTensor& q_proj_weight,
                                       const OptTensor& k_proj_weight, const OptTensor& v_proj_weight,
                                       const OptTensor& bias_k, const OptTensor& bias_v, bool add_zero_attn,
                                       const Tensor& out_proj_weight, const OptTensor& out_proj_bias,
                                       const OptTensor& key_padding_mask, const OptTensor& attn_mask,
                                       bool is_causal, const OptTensor& static_k, const OptTensor& static_v,
                                       bool need_weights, bool average_attn_weights, double dropout_p,
                                       const OptTensor& dropout_seed, bool batch_first) {
  MhaState s = mha_forward_impl(query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight,
                                k_proj_weight, v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight,
                                out_proj_bias, key_padding_mask, attn_mask, is_causal, static_k, static_v,
                                need_weights, average_attn_weights, dropout_p, dropout_seed, batch_first,
                                /*keep_for_backward=*/false);
  return {*s.out, *s.lse, *s.weights};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mha_forward(
    const Tensor& query, const Tensor& key, const Tensor& value, int64_t num_heads,
    const OptTensor& in_proj_weight, const OptTensor& in_proj_bias, const OptTensor& q_proj_weight,
    const OptTensor& k_proj_weight, const OptTensor& v_proj_weight, const OptTensor& bias_k,
    const OptTensor& bias_v, bool add_zero_attn, const Tensor& out_proj_weight, const OptTensor& out_proj_bias,
    const OptTensor& key_padding_mask, const OptTensor& attn_mask, bool is_causal, const OptTensor& static_k,
    const OptTensor& static_v, bool need_weights, bool average_attn_weights, double dropout_p,
    const OptTensor& dropout_seed, bool batch_first) {
  MhaState s = mha_forward_impl(query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight,
                                k_proj_weight, v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight,
                                out_proj_bias, key_padding_mask, attn_mask, is_causal, static_k, static_v,
                                need_weights, average_attn_weights, dropout_p, dropout_seed, batch_first,
                                /*keep_for_backward=*/true);
  return {*s.out, *s.lse, *s.weights, *s.q, *s.k, *s.v, *s.attn};
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
                      const Tensor& lse, const OptTensor& attn_mask, const OptTensor& key_padding_mask,
                      bool is_causal, const Tensor& grad_q, const Tensor& grad_k, const OptTensor& grad_mask) {
  const ScalarType acc = lse.scalar_type();
  const Tensor p = attention_weights(q, k, lse, attn_mask, key_padding_mask, is_causal);
  Tensor dp = stable::to(grad_weights, acc);
  if (average_attn_weights) {  // mean over heads
    dp = call("aten::div", "Tensor", views::unsqueeze(dp, 1), stable::scalar(double(q.size(1))));
  }
  const Tensor rowsum = sum_dims(call("aten::mul", "Tensor", dp, p), {-1}, /*keepdim=*/true);
  const Tensor ds = call("aten::mul", "Tensor", p, sub(dp, rowsum));
  // A fully masked row's weights are NaN whatever q and k are: no gradient flows from them.
  call("aten::masked_fill_", "Tensor", ds, views::unsqueeze(call("aten::isposinf", "", lse), -1),
       stable::scalar(0.0));
  if (grad_mask) {
    const int64_t flat[3] = {ds.size(0) * ds.size(1), ds.size(2), ds.size(3)};
    const Tensor g = grad_mask->dim() == 2 ? sum_dims(ds, {0, 1}) : views::reshape(ds, flat);
    add_in_place(*grad_mask, stable::to(g, grad_mask->scalar_type()));
  }
  const Tensor scale = stable::scalar(1.0 / std::sqrt(double(q.size(3))));
  const Tensor dq = call("aten::matmul", "", ds, stable::to(k, acc));
  call("aten::mul_", "Tensor", dq, scale);
  add_in_place(grad_q, stable::to(dq, grad_q.scalar_type()));
  const Tensor dk = call("aten::matmul", "", views::transpose(ds, -2, -1), stable::to(q, acc));
  call("aten::mul_", "Tensor", dk, scale);
  add_in_place(grad_k, stable::to(dk, grad_k.scalar_type()));
}

std::vector<Tensor> mha_backward(
    const Tensor& grad_out_in, const OptTensor& grad_weights, const Tensor& query_in, const Tensor& key_in,
    const Tensor& value_in, int64_t num_heads, const OptTensor& in_proj_weight, const OptTensor& in_proj_bias,
    const OptTensor& q_proj_weight, const OptTensor& k_proj_weight, const OptTensor& v_proj_weight,
    const OptTensor& bias_k, const OptTensor& bias_v, bool add_zero_attn, const Tensor& out_proj_weight,
    const OptTensor& out_proj_bias, const OptTensor& key_padding_mask_in, const OptTensor& attn_mask_in,
    bool is_causal, const OptTensor& static_k, const OptTensor& static_v, bool need_weights,
    bool average_attn_weights, double dropout_p, const OptTensor& dropout_seed, const Tensor& q,
    const Tensor& k_saved, const Tensor& v_saved, const Tensor& attn, const Tensor& lse,
    const std::vector<int64_t>& output_mask_in, bool batch_first) {
  check_mha_args(query_in, key_in, value_in, num_heads, in_proj_weight, q_proj_weight, k_proj_weight,
                 v_proj_weight, bias_k, bias_v, key_padding_mask_in, attn_mask_in, static_k, static_v, batch_first);
  // Sequence-first views from here on; the input gradients are transposed back at the end.
  const SeqFirst seq = seq_first(query_in, key_in, value_in, batch_first);
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
  const OptTensor key_padding_mask = pad_keys(key_padding_mask_in, appended);
  const OptTensor attn_mask = pad_keys(attn_mask_in, appended);
  ATTNX_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && attn.dim() == 4 && q.size(0) == B &&
                  q.size(1) == H && q.size(2) == L && k.size(2) == S + appended,
              "attnx::mha_backward: expected q, k, v and attn as attnx::mha_forward returned them");
  std::vector<OptTensor> grads(kNumMhaGrads);

  // Out projection: out = attn @ out_proj_weight^T + out_proj_bias, rows in (batch, position) order.
  const Tensor grad_out_rows = batch_major_rows(grad_out);  // (B*L, E)
  if (wanted(kGradOutProjWeight)) {
    grads[kGradOutProjWeight] = mm(views::transpose(grad_out_rows, 0, 1), head_rows(attn));
  }
  if (out_proj_bias && wanted(kGradOutProjBias)) grads[kGradOutProjBias] = sum_dims(grad_out_rows, {0});
  const int64_t blhd[4] = {B, L, H, Dh}, order[4] = {0, 2, 1, 3};
  OptTensor grad_attn = views::permute(views::view(mm(grad_out_rows, out_proj_weight), blhd), order);

  // Attention, probabilities recomputed from lse.
  // A float attn_mask (a learned bias) gets dS summed as the mask broadcasts, from the fused backward.
  const bool mask_grad = wanted(kGradAttnMask) && attn_mask && attn_mask->scalar_type() != ScalarType::Bool;
  AttentionGrads attention_grads = attnx_attention_backward(
      *grad_attn, q, k, v, attn, lse, attn_mask, key_padding_mask, is_causal, dropout_p, dropout_seed, mask_grad);
  OptTensor grad_q = std::move(attention_grads.query), grad_k = std::move(attention_grads.key),
            grad_v = std::move(attention_grads.value);
  const OptTensor grad_mask = std::move(attention_grads.mask);
  if (grad_weights && grad_weights->defined() && grad_weights->numel() > 0) {
    ATTNX_CHECK(need_weights, "attnx::mha_backward: got grad_weights for a call without need_weights");
    add_weights_grad(*grad_weights, average_attn_weights, q, k, lse, attn_mask, key_padding_mask, is_causal,
                     *grad_q, *grad_k, grad_mask);
  }
  // The columns of the appended keys (bias_k, add_zero_attn) were padding, not the caller's mask: cut off, and
  // copied once so that the gradient is contiguous in the mask's shape, the one layout the fake kernel states.
  if (mask_grad) {
    grads[kGradAttnMask] = appended ? views::contiguous(views::narrow(*grad_mask, -1, 0, S)) : *grad_mask;
  }
  grad_attn.reset();

  // Appended keys: the zero key has no parameter; bias_k / bias_v sit at position S of every sequence.
  if (bias_k) {
    const auto appended_grad = [&](const Tensor& grad) {
      const int64_t one_row[3] = {1, 1, E};
      return views::reshape(sum_dims(views::select(grad, 2, S), {0}), one_row);
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
    grads[kGradStaticK] = views::contiguous(views::reshape(*grad_k, static_sizes));
  }
  if (static_v && wanted(kGradStaticV)) {
    grads[kGradStaticV] = views::contiguous(views::reshape(*grad_v, static_sizes));
  }

  // In-projections: proj = input @ weight^T + bias for each of q, k, v that was projected.
  const OptTensor grad_proj[3] = {head_rows(*grad_q), static_k ? OptTensor() : head_rows(*grad_k),
                                  static_v ? OptTensor() : head_rows(*grad_v)};
  grad_q.reset();
  grad_k.reset();
  grad_v.reset();
  const Tensor* inputs[3] = {&query, &key, &value};
  const OptTensor* separate[3] = {&q_proj_weight, &k_proj_weight, &v_proj_weight};
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
    return every_block ? alloc(like.sizes(), like) : zeros(like.sizes(), like);
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
        g = views::transpose(alloc(sizes, dproj), 0, 1);
        mm_out(rows_to_write(*g), dproj, w);
      } else {
        addmm_in_place(rows_to_write(*g), dproj, w);
      }
    }
    if (in_proj_weight) {
      if (wanted(kGradInProjWeight)) {
        OptTensor& grad_weight = grads[kGradInProjWeight];
        if (!grad_weight) grad_weight = packed_grad(*in_proj_weight);
        mm_out(views::narrow(*grad_weight, 0, i * E, E), views::transpose(dproj, 0, 1), rows_of(i));
      }
    } else if (wanted(MhaGrad(kGradQProjWeight + i))) {
      grads[kGradQProjWeight + i] = mm(views::transpose(dproj, 0, 1), rows_of(i));
    }
    if (in_proj_bias && wanted(kGradInProjBias)) {
      OptTensor& grad_bias = grads[kGradInProjBias];
      if (!grad_bias) grad_bias = packed_grad(*in_proj_bias);
      call("aten::sum", "IntList_out", dproj, std::optional(std::vector<int64_t>{0}), false,
           std::optional<ScalarType>(), views::narrow(*grad_bias, 0, i * E, E));
    }
  }
  // Requested gradients of inputs that no projection read (a key replaced by static_k) are zero.
  for (int64_t i = 0; i < 3; ++i) {
    if (wanted_input[i] && !grads[kGradQuery + i]) {
      const int64_t sizes[3] = {B, inputs[i]->size(0), inputs[i]->size(2)};
      grads[kGradQuery + i] = views::transpose(zeros(sizes, *inputs[i]), 0, 1);
    }
  }
  if (in_proj_weight && wanted(kGradInProjWeight) && !grads[kGradInProjWeight]) {
    grads[kGradInProjWeight] = zeros(in_proj_weight->sizes(), *in_proj_weight);
  }
  for (int64_t i = 0; i < 3; ++i) {
    if (!in_proj_weight && wanted(MhaGrad(kGradQProjWeight + i)) && !grads[kGradQProjWeight + i]) {
      grads[kGradQProjWeight + i] = zeros(separate[i]->value().sizes(), separate[i]->value());
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
  for (const OptTensor& g : grads) result.push_back(g ? *g : empty_output(query));
  return result;
}

}  // namespace
}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("_mha", TORCH_BOX(&attnx::mha));
  m.impl("mha_forward", TORCH_BOX(&attnx::mha_forward));
  m.impl("mha_backward", TORCH_BOX(&attnx::mha_backward));
}
