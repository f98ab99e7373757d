// attnx: attention in whole-tensor math, for what needs the (B, H, L, S) probabilities anyway: the attention
// weights mha returns when asked, and attention_backward on backends without a fused backward kernel. On the
// LibTorch stable ABI: views are the shim's reinterpret (computed here from sizes and strides), the math is
// torch's ops through the dispatcher. Compiled into every backend's library (setup.py's COMMON): the CUDA
// backward falls back to it; its registration is common/attention_backward_math.cpp's, in the CPU library.
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "common/aten.h"
#include "common/attention.h"
#include "common/key_range_mask.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {

namespace {

using torch::stable::Device;

constexpr double kInf = std::numeric_limits<double>::infinity();

// a @ b for (B, N, n, m) and (B, N, m, p) tensors, computed as aten::matmul computes it (one bmm over the
// B * N matrices, each operand reshaped to 3-D: a view where its strides allow) but called as bmm: matmul's
// own expand and reshape would run as autograd views under the dispatcher, a microsecond each.
Tensor matmul4(const Tensor& a, const Tensor& b) {
  const int64_t B = a.size(0), N = a.size(1), n = a.size(2), m = a.size(3), p = b.size(3);
  const int64_t a3[3] = {B * N, n, m}, b3[3] = {B * N, m, p}, out[4] = {B, N, n, p};
  return views::view(aten::bmm(views::reshape(a, a3), views::reshape(b, b3)), out);
}

// key_lengths as a (B, 1, 1, 1) int64 tensor.
Tensor lengths_4d(const Tensor& key_lengths) {
  const Tensor lengths = aten::to(key_lengths, ScalarType::Long);
  const int64_t sizes[4] = {lengths.size(0), 1, 1, 1};
  return views::reshape(lengths, sizes);
}

// (B, Hkv, G * L, E) view of a (B, H, L, E) tensor whose H = Hkv * G query heads are grouped by kv head, so
// that one batched GEMM against (B, Hkv, ...) keys serves a whole group without repeating the keys. A copy
// only when the strides do not allow the view (the math path materialises (B, H, L, S) anyway).
// Without query heads there are no kv heads either, or no rows per kv head (G = 0).
Tensor group_rows(const Tensor& t, int64_t kv_heads) {
  const int64_t B = t.size(0), H = t.size(1), L = t.size(2), E = t.size(3);
  const int64_t sizes[4] = {B, kv_heads, (kv_heads > 0 ? H / kv_heads : 1) * L, E};
  return views::reshape(t, sizes);
}

// The inverse of group_rows for a result of shape (B, Hkv, G * L, E): (B, H, L, E). L is given: G * L is 0
// when H is.
Tensor ungroup_rows(const Tensor& t, int64_t heads, int64_t rows) {
  const int64_t sizes[4] = {t.size(0), heads, rows, t.size(3)};
  return views::reshape(t, sizes);
}

// key (or value) with the rows at or past each batch's key length zeroed: those keys are never read (a
// static cache's unfilled slots may hold NaN, which 0 * NaN would carry into the products). A copy, only with
// key_lengths.
Tensor valid_keys(const Tensor& t, const std::optional<Tensor>& key_lengths) {
  if (!key_lengths) return t;
  const Tensor row = views::view(positions(0, t.size(2), t.device()), {1, 1, t.size(2), 1});
  return aten::masked_fill(t, aten::ge(row, lengths_4d(*key_lengths)), 0.0);
}

// The scaled scores scale * Q K^T, (B, H, L, S) in the accumulator dtype, soft-capped when softcap is set.
Tensor capped_scores(const Tensor& query, const Tensor& key, ScalarType acc, double scale,
                     std::optional<double> softcap) {
  const int64_t H = query.size(1), Hkv = key.size(1);
  const Tensor scores = ungroup_rows(
      matmul4(group_rows(aten::to(query, acc), Hkv), views::transpose(aten::to(key, acc), -2, -1)), H,
      query.size(2));
  aten::mul_(scores, scale);
  if (softcap) {
    aten::div_(scores, *softcap);
    aten::tanh_(scores);
    aten::mul_(scores, *softcap);
  }
  return scores;
}

// scores (B, H, L, S) with the options' masks applied: the keys a row does not see and bool True are -inf,
// float masks added.
Tensor add_masks(Tensor scores, const AttentionOptions& o) {
  const int64_t B = scores.size(0), H = scores.size(1), L = scores.size(2), S = scores.size(3);
  const ScalarType acc = scores.scalar_type();
  const auto add_mask = [&](const Tensor& mask) {
    if (mask.scalar_type() == ScalarType::Bool) {
      aten::masked_fill_(scores, mask, -kInf);
    } else {
      scores = aten::add(scores, aten::to(mask, acc));
    }
  };
  if (o.attn_mask) {
    const int64_t sizes[4] = {B, H, L, S};
    add_mask(o.attn_mask->dim() == 3 ? views::reshape(*o.attn_mask, sizes) : *o.attn_mask);
  }
  if (o.key_padding_mask) {
    const int64_t sizes[4] = {B, 1, 1, S};
    add_mask(views::reshape(*o.key_padding_mask, sizes));
  }
  if (const std::optional<Tensor> seen = key_range_mask(B, L, S, o.is_causal, o.window_left, o.window_right,
                                                        o.key_lengths, 0, L, scores.device())) {
    aten::masked_fill_(scores, aten::logical_not(*seen), -kInf);
  }
  return scores;
}

}  // namespace

Tensor attention_weights_exact(const Tensor& query, const Tensor& key, ScalarType acc,
                               const AttentionOptions& options, double scale) {
  // softmax normalises by each row's maximum and sum, as torch's does: a dominant score gives exactly 1,
  // where exp(score - lse) would carry lse's rounding error (2^-12 in float32 at |score| ~ 4e3). An all -inf
  // row gives NaN, as torch's softmax.
  return aten::softmax(add_masks(capped_scores(query, key, acc, scale, options.softcap), options), -1);
}

// FlashAttention-2's backward in whole-tensor form: P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
// dQ = scale dS K, dK = scale dS^T Q (dS times the soft-cap's derivative 1 - tanh^2 when capped). Correct
// everywhere, fast nowhere: it stores P and dS. Grouped KV heads: each group's rows run as one GEMM against
// their kv head (group_rows), so dK and dV come out summed over the group.
void run_attention_backward_math(AttentionBackwardProblem& pb) {
  const AttentionOptions& o = pb.options;
  // (A RuntimeError: the stable ABI carries no other exception type.)
  ATTNX_CHECK(o.dropout_p == 0.0, "attnx::attention_backward: dropout has no backward on ",
              stable::device_name(Device(pb.query.device().type())), " yet (the CPU kernel has one)");
  ATTNX_CHECK(!o.block_map, "attnx::attention_backward: block_map has no backward on ",
              stable::device_name(Device(pb.query.device().type())), " yet (the CPU kernel has one)");
  const double s = attention_scale(o, pb.query.size(3));
  const ScalarType acc = pb.lse.scalar_type();
  const int64_t H = pb.query.size(1), Hkv = pb.key.size(1), L = pb.query.size(2);
  const Tensor key_read = valid_keys(pb.key, o.key_lengths), value_read = valid_keys(pb.value, o.key_lengths);
  const Tensor q = group_rows(aten::to(pb.query, acc), Hkv), k = aten::to(key_read, acc);
  const Tensor grad_out_acc = aten::to(pb.grad_out, acc);
  const Tensor d_out = group_rows(grad_out_acc, Hkv);
  const Tensor capped = capped_scores(pb.query, key_read, acc, s, o.softcap);
  const Tensor masked = add_masks(aten::clone(capped), o);
  const Tensor p = group_rows(aten::exp(aten::sub(masked, views::unsqueeze(pb.lse, -1))), Hkv);
  const Tensor delta = group_rows(aten::sum(aten::mul(grad_out_acc, aten::to(pb.out, acc)), {-1}, true), Hkv);
  const Tensor dp = matmul4(d_out, views::transpose(aten::to(value_read, acc), -2, -1));
  Tensor ds = aten::mul(p, aten::sub(dp, delta));  // (B, Hkv, G*L, S)
  if (pb.grad_attn_mask) {
    const int64_t* g = pb.params.grad_attn_mask_size;
    // Contiguous in the mask's shape, as the CPU kernel and the fake return it (sum_to_size gives a view of
    // ds when the mask broadcasts along nothing).
    const Tensor summed =
        aten::contiguous(aten::sum_to_size(ungroup_rows(ds, H, L), std::vector<int64_t>(g, g + 4)));
    pb.grad_attn_mask_out = mask_grad_from_buffer(summed, *o.attn_mask);
  }
  if (o.softcap) {
    // Out of place: the mask's gradient may be ds itself (a mask of the scores' full shape and dtype).
    const Tensor tanh = aten::div(group_rows(capped, Hkv), *o.softcap);
    ds = aten::mul(ds, aten::sub(aten::scalar_tensor(1.0), aten::square(tanh)));
  }
  const Tensor grad_query = ungroup_rows(matmul4(ds, k), H, L);
  aten::mul_(grad_query, s);
  const Tensor grad_key = matmul4(views::transpose(ds, -2, -1), q);
  aten::mul_(grad_key, s);
  aten::copy_(pb.grad_value, matmul4(views::transpose(p, -2, -1), d_out));
  aten::copy_(pb.grad_query, grad_query);
  aten::copy_(pb.grad_key, grad_key);
}

}  // namespace attnx
