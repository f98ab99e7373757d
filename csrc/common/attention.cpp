// attnx: argument checks and ATen -> AttentionParams for attnx::attention (see attention.h).
#include "common/attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace attnx {

namespace {

bool is_attention_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

MaskKind mask_kind(const std::optional<at::Tensor>& mask) {
  if (!mask) return kMaskNone;
  switch (mask->scalar_type()) {
    case at::kBool:
      return kMaskBool;
    case at::kHalf:
      return kMaskFloat16;
    case at::kBFloat16:
      return kMaskBFloat16;
    case at::kFloat:
      return kMaskFloat32;
    case at::kDouble:
      return kMaskFloat64;
    default:
      TORCH_CHECK(
          false,
          "attnx::attention: expected a mask of dtype bool, float16, bfloat16, float32 or float64, got ",
          mask->scalar_type());
  }
}

void check_mask_dtype_and_device(const at::Tensor& mask, const char* name, const at::Tensor& query) {
  const at::ScalarType t = mask.scalar_type();
  TORCH_CHECK(
      t == at::kBool || is_attention_dtype(t), "attnx::attention: expected ", name,
      " of dtype bool (True = masked out) or a floating dtype (added to the scores: float16, bfloat16, "
      "float32 or float64), got ",
      t);
  TORCH_CHECK(mask.device() == query.device(), "attnx::attention: expected ", name, " on query's device ",
              query.device(), ", got ", mask.device());
}

// attn_mask's strides as a (B, H, L, S) tensor, 0 on broadcast dims. Checks its shape on the way.
void attn_mask_strides(const at::Tensor& mask, int64_t B, int64_t H, int64_t L, int64_t S, int64_t* out) {
  const auto shape_error = [&]() {
    return c10::str("attnx::attention: expected attn_mask of shape (L, S) = (", L, ", ", S,
                    "), (B*H, L, S) = (", B * H, ", ", L, ", ", S,
                    ") or 4-D broadcastable to (B, H, L, S) = (", B, ", ", H, ", ", L, ", ", S, "), got ",
                    mask.sizes());
  };
  const int64_t target[4] = {B, H, L, S};
  if (mask.dim() == 2) {
    TORCH_CHECK(mask.size(0) == L && mask.size(1) == S, shape_error());
    out[0] = out[1] = 0;
    out[2] = mask.stride(0);
    out[3] = mask.stride(1);
  } else if (mask.dim() == 3) {
    // nn.MultiheadAttention's (B*H, L, S): row b*H + h is (b, h), so the first dim splits into (B, H) as a
    // view.
    TORCH_CHECK(mask.size(0) == B * H && mask.size(1) == L && mask.size(2) == S, shape_error());
    out[0] = H * mask.stride(0);
    out[1] = mask.stride(0);
    out[2] = mask.stride(1);
    out[3] = mask.stride(2);
  } else {
    TORCH_CHECK(mask.dim() == 4, shape_error());
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK(mask.size(d) == target[d] || mask.size(d) == 1, shape_error());
      out[d] = mask.stride(d);
    }
  }
  // A dim of size 1 is never stepped along: stride 0 says "broadcast" to the kernels, whatever stride it had.
  for (int d = 0; d < 4; ++d) {
    if (target[d] == 1 || (mask.dim() == 4 && mask.size(d) == 1)) out[d] = 0;
  }
}

void check_dropout_args(double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  // Written so that NaN fails too. p == 1 is allowed, as in F.dropout: every probability is dropped.
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "attnx::attention: expected dropout_p in [0, 1], got ",
              dropout_p);
  if (dropout_seed) {
    const at::Tensor& t = *dropout_seed;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == 2,
                "attnx::attention: expected dropout_seed to be a CPU int64 tensor (seed, offset) of shape "
                "(2,), got a ",
                t.device(), " ", t.scalar_type(), " tensor of shape ", t.sizes());
  } else {
    TORCH_CHECK(dropout_p == 0.0,
                "attnx::attention: expected dropout_seed, a CPU int64 tensor (seed, offset) of shape (2,), "
                "when dropout_p > 0 (attnx.attention draws one from torch's generator), got None with "
                "dropout_p = ",
                dropout_p);
  }
}

// The unevaluated float sum hi + lo closest to `scale` (see AttentionParams::scale).
void split_scale(double scale, float* hi, float* lo) {
  *hi = static_cast<float>(scale);
  *lo = std::isfinite(*hi) ? static_cast<float>(scale - static_cast<double>(*hi)) : 0.0f;
}

}  // namespace

at::ScalarType attention_acc_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

void check_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask,
                          const std::optional<at::Tensor>& key_padding_mask, double dropout_p,
                          const std::optional<at::Tensor>& dropout_seed, int64_t window_left,
                          int64_t window_right, const std::optional<at::Tensor>& key_lengths,
                          std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 4, "attnx::attention: expected query of shape (B, H, L, D), got a ", query.dim(),
              "-D tensor of shape ", query.sizes());
  TORCH_CHECK(key.dim() == 4, "attnx::attention: expected key of shape (B, Hkv, S, D), got a ", key.dim(),
              "-D tensor of shape ", key.sizes());
  TORCH_CHECK(value.dim() == 4, "attnx::attention: expected value of shape (B, Hkv, S, Dv), got a ",
              value.dim(), "-D tensor of shape ", value.sizes());
  TORCH_CHECK(is_attention_dtype(query.scalar_type()),
              "attnx::attention: expected query of dtype float32, float64, bfloat16 or float16, got ",
              query.scalar_type());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{key, "key"}, {value, "value"}}) {
    TORCH_CHECK(t.scalar_type() == query.scalar_type(), "attnx::attention: expected ", name,
                " of query's dtype ", query.scalar_type(), ", got ", t.scalar_type());
    TORCH_CHECK(t.device() == query.device(), "attnx::attention: expected ", name, " on query's device ",
                query.device(), ", got ", t.device());
  }

  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  TORCH_CHECK(key.size(0) == B && key.size(3) == D,
              "attnx::attention: expected key of shape (B, Hkv, S, D) = (", B, ", Hkv, S, ", D,
              ") to match query's B and D, got ", key.sizes());
  TORCH_CHECK(Hkv > 0 ? H % Hkv == 0 : H == 0,
              "attnx::attention: expected the number of key/value heads (Hkv = ", Hkv,
              ") to divide the number of query heads (H = ", H, ")");
  TORCH_CHECK(value.size(0) == B && value.size(1) == Hkv && value.size(2) == S,
              "attnx::attention: expected value of shape (B, Hkv, S, Dv) = (", B, ", ", Hkv, ", ", S,
              ", Dv) to match query's B and key's Hkv and S, got ", value.sizes());

  if (attn_mask) {
    check_mask_dtype_and_device(*attn_mask, "attn_mask", query);
    int64_t unused[4];
    attn_mask_strides(*attn_mask, B, H, L, S, unused);
  }
  if (key_padding_mask) {
    check_mask_dtype_and_device(*key_padding_mask, "key_padding_mask", query);
    TORCH_CHECK(
        key_padding_mask->dim() == 2 && key_padding_mask->size(0) == B && key_padding_mask->size(1) == S,
        "attnx::attention: expected key_padding_mask of shape (B, S) = (", B, ", ", S, "), got ",
        key_padding_mask->sizes());
  }
  check_dropout_args(dropout_p, dropout_seed);
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "attnx::attention: expected window_left and window_right >= -1 (-1 = unbounded), got (",
              window_left, ", ", window_right, ")");
  if (key_lengths) {
    const at::Tensor& t = *key_lengths;
    TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                "attnx::attention: expected key_lengths of dtype int32 or int64, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "attnx::attention: expected key_lengths of shape (B,) = (", B,
                ",), got ", t.sizes());
    TORCH_CHECK(t.device() == query.device(), "attnx::attention: expected key_lengths on query's device ",
                query.device(), ", got ", t.device());
    // Read where that costs no device sync. On a GPU the kernels clamp into [0, S] instead.
    if (t.device().is_cpu()) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = t.scalar_type() == at::kInt ? int64_t{t.const_data_ptr<int32_t>()[b * t.stride(0)]}
                                                      : t.const_data_ptr<int64_t>()[b * t.stride(0)];
        TORCH_CHECK(n >= 0 && n <= S, "attnx::attention: expected key_lengths in [0, S] = [0, ", S,
                    "], got key_lengths[", b, "] = ", n);
      }
    }
  }
  if (softcap) {
    TORCH_CHECK(std::isfinite(*softcap) && *softcap > 0.0,
                "attnx::attention: expected softcap to be a finite number > 0 (None: no soft-capping), got ",
                *softcap);
  }
  if (sinks) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK(is_attention_dtype(t.scalar_type()),
                "attnx::attention: expected sinks of a floating dtype (float16, bfloat16, float32 or "
                "float64), got ",
                t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == H, "attnx::attention: expected sinks of shape (H,) = (", H,
                ",), got ", t.sizes());
    TORCH_CHECK(t.device() == query.device(), "attnx::attention: expected sinks on query's device ",
                query.device(), ", got ", t.device());
  }
}

namespace {

// Sizes, the strides of query, key, value and masks, the masks' data pointers, is_causal and the scale: what
// the forward and the backward read alike. Arguments must have passed check_attention_args.
AttentionParams attention_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const std::optional<at::Tensor>& attn_mask,
                                 const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                 std::optional<double> scale, double dropout_p,
                                 const std::optional<at::Tensor>& dropout_seed, int64_t window_left,
                                 int64_t window_right, const std::optional<at::Tensor>& key_lengths,
                                 std::optional<double> softcap, bool has_sinks, const void** attn_mask_ptr,
                                 const void** key_padding_mask_ptr, const void** key_lengths_ptr) {
  AttentionParams p{};
  p.batch = query.size(0);
  p.heads = query.size(1);
  p.q_len = query.size(2);
  p.kv_len = key.size(2);
  p.head_dim = query.size(3);
  p.v_head_dim = value.size(3);
  p.kv_heads = key.size(1);
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = query.stride(d);
    p.k_stride[d] = key.stride(d);
    p.v_stride[d] = value.stride(d);
  }

  p.attn_mask_kind = mask_kind(attn_mask);
  p.key_padding_mask_kind = mask_kind(key_padding_mask);
  *attn_mask_ptr = nullptr;
  *key_padding_mask_ptr = nullptr;
  if (attn_mask) {
    attn_mask_strides(*attn_mask, p.batch, p.heads, p.q_len, p.kv_len, p.attn_mask_stride);
    *attn_mask_ptr = attn_mask->const_data_ptr();
  }
  if (key_padding_mask) {
    for (int d = 0; d < 2; ++d) {
      p.key_padding_mask_stride[d] = key_padding_mask->size(d) == 1 ? 0 : key_padding_mask->stride(d);
    }
    *key_padding_mask_ptr = key_padding_mask->const_data_ptr();
  }
  p.is_causal = is_causal ? 1 : 0;
  // D == 0: every score is an empty sum, 0 whatever the scale; 1 keeps 0 * scale finite.
  const double s = scale ? *scale : (p.head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(p.head_dim)) : 1.0);
  split_scale(s, &p.scale, &p.scale_lo);

  if (dropout_p > 0.0) {
    // Read on the host: the seed is a CPU tensor, so a CUDA launch needs no device sync for it.
    const at::Tensor& t = *dropout_seed;
    const int64_t* v = t.const_data_ptr<int64_t>();
    const uint64_t seed = static_cast<uint64_t>(v[0]), offset = static_cast<uint64_t>(v[t.stride(0)]);
    p.dropout = 1;
    p.dropout_seed[0] = static_cast<uint32_t>(seed);
    p.dropout_seed[1] = static_cast<uint32_t>(seed >> 32);
    p.dropout_offset[0] = static_cast<uint32_t>(offset);
    p.dropout_offset[1] = static_cast<uint32_t>(offset >> 32);
    // floor((1 - p) * 2^32), computed in double as the reference does (the product by 2^32 is exact), so
    // every backend keeps the same elements. A p so small that 1 - p rounds to 1 keeps all but 2^-32.
    const double keep = (1.0 - dropout_p) * 4294967296.0;
    p.dropout_threshold = static_cast<uint32_t>(std::min(keep, 4294967295.0));
    p.dropout_p = static_cast<float>(dropout_p);
    split_scale(dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0, &p.dropout_scale, &p.dropout_scale_lo);
  }

  p.window_left = window_left;
  p.window_right = window_right;
  *key_lengths_ptr = nullptr;
  if (key_lengths) {
    p.key_lengths_kind = key_lengths->scalar_type() == at::kInt ? kKeyLengthsInt32 : kKeyLengthsInt64;
    p.key_lengths_stride = key_lengths->stride(0);
    *key_lengths_ptr = key_lengths->const_data_ptr();
  }
  p.has_sinks = has_sinks ? 1 : 0;
  if (softcap) split_scale(*softcap, &p.softcap, &p.softcap_lo);
  return p;
}

// sinks as the kernels read them: (H,) in the accumulator dtype, contiguous. A copy of H values only when
// they are stored otherwise.
at::Tensor sinks_for_kernels(const std::optional<at::Tensor>& sinks, at::ScalarType dtype) {
  if (!sinks) return at::Tensor();
  return sinks->to(attention_acc_dtype(dtype)).contiguous();
}

// A (B, H, N, E) tensor laid out in memory as (B, N, H, E), the layout of out and of the gradients.
at::Tensor empty_bnhe(int64_t B, int64_t H, int64_t N, int64_t E, const at::TensorOptions& options) {
  return at::empty({B, N, H, E}, options).transpose(1, 2);
}

void check_backward_tensor(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                           const char* shape_name, at::ScalarType dtype, const at::Tensor& query) {
  TORCH_CHECK(t.sizes() == shape, "attnx::attention_backward: expected ", name, " of shape ", shape_name,
              " = ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, "attnx::attention_backward: expected ", name, " of dtype ", dtype,
              ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == query.device(), "attnx::attention_backward: expected ", name,
              " on query's device ", query.device(), ", got ", t.device());
}

}  // namespace

AttentionProblem prepare_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   const std::optional<at::Tensor>& attn_mask,
                                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                   std::optional<double> scale, double dropout_p,
                                   const std::optional<at::Tensor>& dropout_seed, int64_t window_left,
                                   int64_t window_right, const std::optional<at::Tensor>& key_lengths,
                                   std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  check_attention_args(query, key, value, attn_mask, key_padding_mask, dropout_p, dropout_seed, window_left,
                       window_right, key_lengths, softcap, sinks);
  AttentionProblem pb{};
  pb.params = attention_params(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                               dropout_seed, window_left, window_right, key_lengths, softcap,
                               sinks.has_value(), &pb.attn_mask, &pb.key_padding_mask, &pb.key_lengths);
  pb.sinks_acc = sinks_for_kernels(sinks, query.scalar_type());
  pb.sinks = sinks ? pb.sinks_acc.const_data_ptr() : nullptr;
  AttentionParams& p = pb.params;

  // (B, L, H, Dv) memory: the multi-head caller views out as (B, L, H*Dv) for its output projection.
  pb.out = empty_bnhe(p.batch, p.heads, p.q_len, p.v_head_dim, query.options());
  pb.lse =
      at::empty({p.batch, p.heads, p.q_len}, query.options().dtype(attention_acc_dtype(query.scalar_type())));
  for (int d = 0; d < 4; ++d) p.out_stride[d] = pb.out.stride(d);
  for (int d = 0; d < 3; ++d) p.lse_stride[d] = pb.lse.stride(d);

  pb.dtype = query.scalar_type();
  pb.query = query.const_data_ptr();
  pb.key = key.const_data_ptr();
  pb.value = value.const_data_ptr();
  return pb;
}

AttentionBackwardProblem prepare_attention_backward(const at::Tensor& grad_out, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& value,
                                                    const at::Tensor& out, const at::Tensor& lse,
                                                    const std::optional<at::Tensor>& attn_mask,
                                                    const std::optional<at::Tensor>& key_padding_mask,
                                                    bool is_causal, std::optional<double> scale,
                                                    double dropout_p,
                                                    const std::optional<at::Tensor>& dropout_seed,
                                                    int64_t window_left, int64_t window_right,
                                                    const std::optional<at::Tensor>& key_lengths,
                                                    std::optional<double> softcap,
                                                    const std::optional<at::Tensor>& sinks) {
  check_attention_args(query, key, value, attn_mask, key_padding_mask, dropout_p, dropout_seed, window_left,
                       window_right, key_lengths, softcap, sinks);
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  const at::ScalarType dtype = query.scalar_type();
  check_backward_tensor(grad_out, "grad_out", {B, H, L, Dv}, "(B, H, L, Dv)", dtype, query);
  check_backward_tensor(out, "out", {B, H, L, Dv}, "(B, H, L, Dv)", dtype, query);
  check_backward_tensor(lse, "lse", {B, H, L}, "(B, H, L)", attention_acc_dtype(dtype), query);

  AttentionBackwardProblem pb{};
  AttentionBackwardParams& bp = pb.params;
  bp.fwd = attention_params(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                            dropout_seed, window_left, window_right, key_lengths, softcap, sinks.has_value(),
                            &pb.attn_mask, &pb.key_padding_mask, &pb.key_lengths);
  pb.sinks_acc = sinks_for_kernels(sinks, dtype);
  pb.sinks = sinks ? pb.sinks_acc.const_data_ptr() : nullptr;
  // The gradients take out's layout, (B, N, H, E) in memory: a multi-head caller's in-projection gradient
  // reads them as (B, N, H*E) views.
  pb.grad_query = empty_bnhe(B, H, L, D, query.options());
  pb.grad_key = empty_bnhe(B, Hkv, S, D, query.options());
  pb.grad_value = empty_bnhe(B, Hkv, S, Dv, query.options());
  for (int d = 0; d < 4; ++d) {
    bp.fwd.out_stride[d] = out.stride(d);
    bp.grad_out_stride[d] = grad_out.stride(d);
    bp.grad_query_stride[d] = pb.grad_query.stride(d);
    bp.grad_key_stride[d] = pb.grad_key.stride(d);
    bp.grad_value_stride[d] = pb.grad_value.stride(d);
  }
  for (int d = 0; d < 3; ++d) bp.fwd.lse_stride[d] = lse.stride(d);

  pb.dtype = dtype;
  pb.grad_out = grad_out.const_data_ptr();
  pb.query = query.const_data_ptr();
  pb.key = key.const_data_ptr();
  pb.value = value.const_data_ptr();
  pb.out = out.const_data_ptr();
  pb.lse = lse.const_data_ptr();
  return pb;
}

MaskGradShape mask_grad_shape(const at::Tensor& attn_mask, int64_t B, int64_t H) {
  MaskGradShape g{};
  if (attn_mask.dim() == 2) {
    g = {{1, 1, attn_mask.size(0), attn_mask.size(1)}};
  } else if (attn_mask.dim() == 3) {
    g = {{B, H, attn_mask.size(1), attn_mask.size(2)}};
  } else {
    for (int d = 0; d < 4; ++d) g.size[d] = attn_mask.size(d);
  }
  return g;
}

at::Tensor mask_grad_from_buffer(const at::Tensor& buffer, const at::Tensor& attn_mask) {
  return buffer.view(attn_mask.sizes()).to(attn_mask.scalar_type());
}

at::Tensor sinks_grad(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& sinks) {
  const auto acc = lse.scalar_type();
  const at::Tensor delta = (grad_out.to(acc) * out.to(acc)).sum(-1);  // (B, H, L)
  // A row that sees no key has lse = +inf: its sink's probability exp(sink - inf) is 0, as its out is 0
  // whatever the sink.
  const at::Tensor p_sink = (sinks.to(acc).view({1, -1, 1}) - lse).exp_();
  return (p_sink * delta).sum({0, 2}).neg_().to(sinks.scalar_type());
}

}  // namespace attnx
