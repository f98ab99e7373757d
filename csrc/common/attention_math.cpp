// attnx: attention in whole-tensor math, for what needs the (B, H, L, S) probabilities anyway: the attention
// weights mha returns when asked, and attention_backward on backends without a fused backward kernel. On the
// LibTorch stable ABI: views are the shim's reinterpret (computed here from sizes and strides), the math is
// torch's ops through the dispatcher.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common/attention.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {

namespace {

using stable::call;
using stable::reinterpret;
using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::stable::Device;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------------------------
// The few ops whose ATen form takes a Scalar, which the stable dispatcher cannot pass.

using stable::add;
using stable::sub;

// a @ b for (B, N, n, m) and (B, N, m, p) tensors, computed as aten::matmul computes it (one bmm over the
// B * N matrices, each operand reshaped to 3-D: a view where its strides allow) but called as bmm: matmul's
// own expand and reshape would run as autograd views under the dispatcher, a microsecond each.
Tensor matmul4(const Tensor& a, const Tensor& b) {
  const int64_t B = a.size(0), N = a.size(1), n = a.size(2), m = a.size(3), p = b.size(3);
  const int64_t a3[3] = {B * N, n, m}, b3[3] = {B * N, m, p}, out[4] = {B, N, n, p};
  return views::view(call("aten::bmm", "", views::reshape(a, a3), views::reshape(b, b3)), out);
}

// A 0-dim int64 tensor on `device`, for an integer op's Tensor overload (a float64 scalar would promote it).
Tensor int_scalar(int64_t value, const Device& device) {
  AtenTensorHandle out = nullptr;
  int32_t dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(ScalarType::Long));
  int32_t device_type = torch::stable::detail::to<int32_t>(torch::stable::detail::from(device.type()));
  stable::check(aoti_torch_aten_full(nullptr, 0, static_cast<double>(value), &dtype, nullptr, &device_type,
                                     device.index(), nullptr, &out),
                "attnx: aten::full");
  return Tensor(out);
}

// A (1, 1, rows, cols) tensor on `device` with value(r, c) at (r, c), in int64 or bool: what arange and
// broadcasting build, made on the host (arange takes Scalars) and copied over once.
template <typename T, typename F>
Tensor grid(int64_t rows, int64_t cols, const Device& device, F value) {
  const ScalarType dtype = std::is_same_v<T, bool> ? ScalarType::Bool : ScalarType::Long;
  const int64_t sizes[4] = {1, 1, rows, cols};
  const Tensor host = stable::empty(sizes, dtype, Device(torch::headeronly::DeviceType::CPU));
  T* data = static_cast<T*>(host.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) data[r * cols + c] = value(r, c);
  }
  if (device.type() == torch::headeronly::DeviceType::CPU) return host;
  const Tensor on_device = stable::empty(sizes, dtype, device);
  stable::copy_into(on_device, host);
  return on_device;
}

// key_lengths as a (B, 1, 1, 1) int64 tensor.
Tensor lengths_4d(const Tensor& key_lengths) {
  const Tensor lengths = stable::to(key_lengths, ScalarType::Long);
  const int64_t sizes[4] = {lengths.size(0), 1, 1, 1};
  return views::reshape(lengths, sizes);
}

// t summed over its last dim, kept as size 1.
Tensor rowsum(const Tensor& t) {
  return call("aten::sum", "dim_IntList", t, std::optional(std::vector<int64_t>{-1}), true,
              std::optional<ScalarType>());
}

Tensor logical_and(const Tensor& a, const Tensor& b) {
  return call("aten::logical_and", "", a, b);
}

// ---------------------------------------------------------------------------------------------------------------

// (B, Hkv, G * L, E) view of a (B, H, L, E) tensor whose H = Hkv * G query heads are grouped by kv head, so
// that one batched GEMM against (B, Hkv, ...) keys serves a whole group without repeating the keys. A copy
// only when the strides do not allow the view (the math path materialises (B, H, L, S) anyway).
Tensor group_rows(const Tensor& t, int64_t kv_heads) {
  const int64_t B = t.size(0), H = t.size(1), L = t.size(2), E = t.size(3);
  const int64_t sizes[4] = {B, kv_heads, (H / kv_heads) * L, E};
  return views::reshape(t, sizes);
}

// The inverse of group_rows for a result of shape (B, Hkv, G * L, E): (B, H, L, E).
Tensor ungroup_rows(const Tensor& t, int64_t heads) {
  const int64_t sizes[4] = {t.size(0), heads, t.size(2) * t.size(1) / heads, t.size(3)};
  return views::reshape(t, sizes);
}

// The bool tensor of the keys each row sees at all (is_causal, key_lengths, the window; see
// attnx/key_range.h), broadcastable to (B, 1, L, S), or nothing when every key is seen. With
// d = s - l + L (a key's place past the row's diagonal for a full sequence), row l sees key s when
// s < len, d + window_left >= len, d - window_right <= len and, causal, s <= l.
std::optional<Tensor> key_range_mask(int64_t L, int64_t S, bool is_causal, int64_t window_left,
                                     int64_t window_right, const std::optional<Tensor>& key_lengths,
                                     const Device& device) {
  if (!is_causal && window_left < 0 && window_right < 0 && !key_lengths) return std::nullopt;
  if (!key_lengths) {
    // Every batch has S keys: one (L, S) pattern, built on the host.
    return grid<bool>(L, S, device, [&](int64_t l, int64_t s) {
      const int64_t d = s - l + L;
      return (window_left < 0 || d + window_left >= S) && (window_right < 0 || d - window_right <= S) &&
             (!is_causal || s <= l);
    });
  }
  const Tensor lengths = call("aten::clamp", "Tensor", lengths_4d(*key_lengths),
                              std::optional<Tensor>(int_scalar(0, device)),
                              std::optional<Tensor>(int_scalar(S, device)));
  const Tensor col = grid<int64_t>(1, S, device, [](int64_t, int64_t s) { return s; });
  Tensor seen = call("aten::lt", "Tensor", col, lengths);
  if (window_left >= 0) {
    const Tensor first =
        grid<int64_t>(L, S, device, [&](int64_t l, int64_t s) { return s - l + L + window_left; });
    seen = logical_and(seen, call("aten::ge", "Tensor", first, lengths));
  }
  if (window_right >= 0) {
    const Tensor last =
        grid<int64_t>(L, S, device, [&](int64_t l, int64_t s) { return s - l + L - window_right; });
    seen = logical_and(seen, call("aten::le", "Tensor", last, lengths));
  }
  if (is_causal) {
    seen = logical_and(seen, grid<bool>(L, S, device, [](int64_t l, int64_t s) { return s <= l; }));
  }
  return seen;
}

// key (or value) with the rows at or past each batch's key length zeroed: those keys are never read (a
// static cache's unfilled slots may hold NaN, which 0 * NaN would carry into the products). A copy, only with
// key_lengths.
Tensor valid_keys(const Tensor& t, const std::optional<Tensor>& key_lengths) {
  if (!key_lengths) return t;
  const Tensor row = grid<int64_t>(t.size(2), 1, t.device(), [](int64_t s, int64_t) { return s; });
  const Tensor beyond = call("aten::ge", "Tensor", row, lengths_4d(*key_lengths));
  return call("aten::masked_fill", "Tensor", t, beyond, stable::scalar(0.0));
}

// The scaled scores scale * Q K^T, (B, H, L, S) in the accumulator dtype, soft-capped when softcap is set.
Tensor capped_scores(const Tensor& query, const Tensor& key, ScalarType acc, double scale,
                     std::optional<double> softcap) {
  const int64_t H = query.size(1), Hkv = key.size(1);
  const Tensor scores = ungroup_rows(matmul4(group_rows(stable::to(query, acc), Hkv),
                                          views::transpose(stable::to(key, acc), -2, -1)),
                                     H);
  call("aten::mul_", "Tensor", scores, stable::scalar(scale));
  if (softcap) {
    const Tensor cap = stable::scalar(*softcap);
    call("aten::div_", "Tensor", scores, cap);
    call("aten::tanh_", "", scores);
    call("aten::mul_", "Tensor", scores, cap);
  }
  return scores;
}

// scores (B, H, L, S) with the masks applied: the keys a row does not see and bool True are -inf, float masks
// added.
Tensor add_masks(Tensor scores, const std::optional<Tensor>& attn_mask,
                 const std::optional<Tensor>& key_padding_mask, bool is_causal, int64_t window_left,
                 int64_t window_right, const std::optional<Tensor>& key_lengths) {
  const int64_t B = scores.size(0), H = scores.size(1), L = scores.size(2), S = scores.size(3);
  const ScalarType acc = scores.scalar_type();
  const Tensor minus_inf = stable::scalar(-kInf);
  const auto add_mask = [&](const Tensor& mask) {
    if (mask.scalar_type() == ScalarType::Bool) {
      call("aten::masked_fill_", "Tensor", scores, mask, minus_inf);
    } else {
      scores = add(scores, stable::to(mask, acc));
    }
  };
  if (attn_mask) {
    const int64_t sizes[4] = {B, H, L, S};
    add_mask(attn_mask->dim() == 3 ? views::reshape(*attn_mask, sizes) : *attn_mask);
  }
  if (key_padding_mask) {
    const int64_t sizes[4] = {B, 1, 1, S};
    add_mask(views::reshape(*key_padding_mask, sizes));
  }
  const std::optional<Tensor> seen =
      key_range_mask(L, S, is_causal, window_left, window_right, key_lengths, scores.device());
  if (seen) call("aten::masked_fill_", "Tensor", scores, call("aten::logical_not", "", *seen), minus_inf);
  return scores;
}

double default_scale(const Tensor& query, std::optional<double> scale) {
  return scale ? *scale : (query.size(3) > 0 ? 1.0 / std::sqrt(double(query.size(3))) : 1.0);
}

}  // namespace

Tensor attention_weights_exact(const Tensor& query, const Tensor& key, ScalarType acc,
                               const std::optional<Tensor>& attn_mask,
                               const std::optional<Tensor>& key_padding_mask, bool is_causal, double scale) {
  // softmax normalises by each row's maximum and sum, as torch's does: a dominant score gives exactly 1,
  // where exp(score - lse) would carry lse's rounding error (2^-12 in float32 at |score| ~ 4e3). An all -inf
  // row gives NaN, as torch's softmax.
  const Tensor scores = add_masks(capped_scores(query, key, acc, scale, std::nullopt), attn_mask,
                                  key_padding_mask, is_causal, -1, -1, std::nullopt);
  return call("aten::softmax", "int", scores, -1, std::optional<ScalarType>());
}

namespace {

// FlashAttention-2's backward in whole-tensor form: P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
// dQ = scale dS K, dK = scale dS^T Q (dS times the soft-cap's derivative 1 - tanh^2 when capped). Correct
// everywhere, fast nowhere: it stores P and dS. Grouped KV heads: each group's rows run as one GEMM against
// their kv head (group_rows), so dK and dV come out summed over the group.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> attention_backward_math(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& out,
    const Tensor& lse, const std::optional<Tensor>& attn_mask, const std::optional<Tensor>& key_padding_mask,
    bool is_causal, std::optional<double> scale, double dropout_p, const std::optional<Tensor>& dropout_seed,
    int64_t window_left, int64_t window_right, const std::optional<Tensor>& key_lengths,
    std::optional<double> softcap, const std::optional<Tensor>& sinks, bool grad_attn_mask) {
  // The fused kernels' checks, and gradients allocated in their layout.
  AttentionBackwardProblem pb = prepare_attention_backward(grad_out, query, key, value, out, lse, attn_mask,
                                                           key_padding_mask, is_causal, scale, dropout_p,
                                                           dropout_seed, window_left, window_right,
                                                           key_lengths, softcap, sinks);
  // (A RuntimeError: the stable ABI carries no other exception type.)
  ATTNX_CHECK(dropout_p == 0.0, "attnx::attention_backward: dropout has no backward on ",
              stable::device_name(Device(query.device().type())), " yet (the CPU kernel has one)");
  const double s = default_scale(query, scale);
  const ScalarType acc = lse.scalar_type();
  const int64_t H = query.size(1), Hkv = key.size(1);
  const Tensor key_read = valid_keys(key, key_lengths), value_read = valid_keys(value, key_lengths);
  const Tensor q = group_rows(stable::to(query, acc), Hkv), k = stable::to(key_read, acc);
  const Tensor grad_out_acc = stable::to(grad_out, acc);
  const Tensor d_out = group_rows(grad_out_acc, Hkv);
  const Tensor capped = capped_scores(query, key_read, acc, s, softcap);
  const Tensor masked = add_masks(call("aten::clone", "", capped, std::nullopt), attn_mask, key_padding_mask,
                                  is_causal, window_left, window_right, key_lengths);
  const Tensor p = group_rows(call("aten::exp", "", sub(masked, views::unsqueeze(lse, -1))), Hkv);
  const Tensor delta = group_rows(rowsum(call("aten::mul", "Tensor", grad_out_acc, stable::to(out, acc))), Hkv);
  const Tensor dp = matmul4(d_out, views::transpose(stable::to(value_read, acc), -2, -1));
  Tensor ds = call("aten::mul", "Tensor", p, sub(dp, delta));  // (B, Hkv, G*L, S)
  std::optional<Tensor> mask_grad;
  if (grad_attn_mask && attn_mask && attn_mask->scalar_type() != ScalarType::Bool) {
    const MaskGradShape g = mask_grad_shape(*attn_mask, query.size(0), H);
    // Contiguous in the mask's shape, as the CPU kernel and the fake return it (sum_to_size gives a view of
    // ds when the mask broadcasts along nothing).
    const Tensor summed = call("aten::sum_to_size", "", ungroup_rows(ds, H),
                               std::vector<int64_t>(g.size, g.size + 4));
    Tensor buffer = summed;
    if (!summed.is_contiguous()) {
      buffer = stable::empty(summed.sizes(), summed.scalar_type(), summed.device());
      stable::copy_into(buffer, summed);
    }
    mask_grad = mask_grad_from_buffer(buffer, *attn_mask);
  }
  if (softcap) {
    // Out of place: the mask's gradient may be ds itself (a mask of the scores' full shape and dtype).
    const Tensor tanh = call("aten::div", "Tensor", group_rows(capped, Hkv), stable::scalar(*softcap));
    ds = call("aten::mul", "Tensor", ds, sub(stable::scalar(1.0), call("aten::square", "", tanh)));
  }
  const Tensor grad_query = ungroup_rows(matmul4(ds, k), H);
  call("aten::mul_", "Tensor", grad_query, stable::scalar(s));
  const Tensor grad_key = matmul4(views::transpose(ds, -2, -1), q);
  call("aten::mul_", "Tensor", grad_key, stable::scalar(s));
  stable::copy_into(pb.grad_value, matmul4(views::transpose(p, -2, -1), d_out));
  stable::copy_into(pb.grad_query, grad_query);
  stable::copy_into(pb.grad_key, grad_key);
  const auto empty = [&] {
    const int64_t zero = 0;
    return stable::empty(IntHeaderOnlyArrayRef(&zero, 1), query.scalar_type(), query.device());
  };
  return {pb.grad_query, pb.grad_key, pb.grad_value, mask_grad ? *mask_grad : empty(),
          sinks ? sinks_grad(grad_out, out, lse, *sinks) : empty()};
}

}  // namespace
}  // namespace attnx

// Backends with a fused backward kernel (CPU) register their own, which the dispatcher prefers.
STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("attention_backward", TORCH_BOX(&attnx::attention_backward_math));
}
