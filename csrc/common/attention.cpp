// attnx: argument checks and tensors -> AttentionParams for attnx::attention (see attention.h), on the LibTorch
// stable ABI. Outputs are made with the shim's direct calls; the little math done here (sinks' conversion and
// gradient, the mask gradient's dtype) goes through torch's ops.
#include "common/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/stable.h"

namespace attnx {

namespace {

using stable::device_name;
using stable::Sizes;
using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::stable::Device;

bool is_attention_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::BFloat16 || t == ScalarType::Half;
}

MaskKind mask_kind(const std::optional<Tensor>& mask) {
  if (!mask) return kMaskNone;
  switch (mask->scalar_type()) {
    case ScalarType::Bool:
      return kMaskBool;
    case ScalarType::Half:
      return kMaskFloat16;
    case ScalarType::BFloat16:
      return kMaskBFloat16;
    case ScalarType::Float:
      return kMaskFloat32;
    case ScalarType::Double:
      return kMaskFloat64;
    default:
      ATTNX_CHECK(
          false,
          "attnx::attention: expected a mask of dtype bool, float16, bfloat16, float32 or float64, got ",
          mask->scalar_type());
  }
}

void check_mask_dtype_and_device(const Tensor& mask, const char* name, const Tensor& query) {
  const ScalarType t = mask.scalar_type();
  ATTNX_CHECK(
      t == ScalarType::Bool || is_attention_dtype(t), "attnx::attention: expected ", name,
      " of dtype bool (True = masked out) or a floating dtype (added to the scores: float16, bfloat16, "
      "float32 or float64), got ",
      t);
  ATTNX_CHECK(mask.device() == query.device(), "attnx::attention: expected ", name, " on query's device ",
              device_name(query.device()), ", got ", device_name(mask.device()));
}

// attn_mask's strides as a (B, H, L, S) tensor, 0 on broadcast dims. Checks its shape on the way.
void attn_mask_strides(const Tensor& mask, int64_t B, int64_t H, int64_t L, int64_t S, int64_t* out) {
  const auto shape_error = [&]() {
    return stable::str("attnx::attention: expected attn_mask of shape (L, S) = (", L, ", ", S,
                       "), (B*H, L, S) = (", B * H, ", ", L, ", ", S,
                       ") or 4-D broadcastable to (B, H, L, S) = (", B, ", ", H, ", ", L, ", ", S, "), got ",
                       Sizes{mask.sizes()});
  };
  const int64_t target[4] = {B, H, L, S};
  if (mask.dim() == 2) {
    ATTNX_CHECK(mask.size(0) == L && mask.size(1) == S, shape_error());
    out[0] = out[1] = 0;
    out[2] = mask.stride(0);
    out[3] = mask.stride(1);
  } else if (mask.dim() == 3) {
    // nn.MultiheadAttention's (B*H, L, S): row b*H + h is (b, h), so the first dim splits into (B, H) as a
    // view.
    ATTNX_CHECK(mask.size(0) == B * H && mask.size(1) == L && mask.size(2) == S, shape_error());
    out[0] = H * mask.stride(0);
    out[1] = mask.stride(0);
    out[2] = mask.stride(1);
    out[3] = mask.stride(2);
  } else {
    ATTNX_CHECK(mask.dim() == 4, shape_error());
    for (int d = 0; d < 4; ++d) {
      ATTNX_CHECK(mask.size(d) == target[d] || mask.size(d) == 1, shape_error());
      out[d] = mask.stride(d);
    }
  }
  // A dim of size 1 is never stepped along: stride 0 says "broadcast" to the kernels, whatever stride it had.
  for (int d = 0; d < 4; ++d) {
    if (target[d] == 1 || (mask.dim() == 4 && mask.size(d) == 1)) out[d] = 0;
  }
}

void check_dropout_args(double dropout_p, const std::optional<Tensor>& dropout_seed) {
  // Written so that NaN fails too. p == 1 is allowed, as in F.dropout: every probability is dropped.
  ATTNX_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "attnx::attention: expected dropout_p in [0, 1], got ",
              dropout_p);
  if (dropout_seed) {
    const Tensor& t = *dropout_seed;
    ATTNX_CHECK(t.device().is_cpu() && t.scalar_type() == ScalarType::Long && t.dim() == 1 && t.size(0) == 2,
                "attnx::attention: expected dropout_seed to be a CPU int64 tensor (seed, offset) of shape "
                "(2,), got a ",
                device_name(t.device()), " ", t.scalar_type(), " tensor of shape ", Sizes{t.sizes()});
  } else {
    ATTNX_CHECK(dropout_p == 0.0,
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

ScalarType attention_acc_dtype(ScalarType dtype) {
  return dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

void check_attention_args(const Tensor& query, const Tensor& key, const Tensor& value,
                          const std::optional<Tensor>& attn_mask,
                          const std::optional<Tensor>& key_padding_mask, double dropout_p,
                          const std::optional<Tensor>& dropout_seed, int64_t window_left,
                          int64_t window_right, const std::optional<Tensor>& key_lengths,
                          std::optional<double> softcap, const std::optional<Tensor>& sinks) {
  ATTNX_CHECK(query.dim() == 4, "attnx::attention: expected query of shape (B, H, L, D), got a ", query.dim(),
              "-D tensor of shape ", Sizes{query.sizes()});
  ATTNX_CHECK(key.dim() == 4, "attnx::attention: expected key of shape (B, Hkv, S, D), got a ", key.dim(),
              "-D tensor of shape ", Sizes{key.sizes()});
  ATTNX_CHECK(value.dim() == 4, "attnx::attention: expected value of shape (B, Hkv, S, Dv), got a ",
              value.dim(), "-D tensor of shape ", Sizes{value.sizes()});
  ATTNX_CHECK(is_attention_dtype(query.scalar_type()),
              "attnx::attention: expected query of dtype float32, float64, bfloat16 or float16, got ",
              query.scalar_type());
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{key, "key"}, {value, "value"}}) {
    ATTNX_CHECK(t.scalar_type() == query.scalar_type(), "attnx::attention: expected ", name,
                " of query's dtype ", query.scalar_type(), ", got ", t.scalar_type());
    ATTNX_CHECK(t.device() == query.device(), "attnx::attention: expected ", name, " on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
  }

  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  ATTNX_CHECK(key.size(0) == B && key.size(3) == D,
              "attnx::attention: expected key of shape (B, Hkv, S, D) = (", B, ", Hkv, S, ", D,
              ") to match query's B and D, got ", Sizes{key.sizes()});
  ATTNX_CHECK(Hkv > 0 ? H % Hkv == 0 : H == 0,
              "attnx::attention: expected the number of key/value heads (Hkv = ", Hkv,
              ") to divide the number of query heads (H = ", H, ")");
  ATTNX_CHECK(value.size(0) == B && value.size(1) == Hkv && value.size(2) == S,
              "attnx::attention: expected value of shape (B, Hkv, S, Dv) = (", B, ", ", Hkv, ", ", S,
              ", Dv) to match query's B and key's Hkv and S, got ", Sizes{value.sizes()});

  if (attn_mask) {
    check_mask_dtype_and_device(*attn_mask, "attn_mask", query);
    int64_t unused[4];
    attn_mask_strides(*attn_mask, B, H, L, S, unused);
  }
  if (key_padding_mask) {
    check_mask_dtype_and_device(*key_padding_mask, "key_padding_mask", query);
    ATTNX_CHECK(
        key_padding_mask->dim() == 2 && key_padding_mask->size(0) == B && key_padding_mask->size(1) == S,
        "attnx::attention: expected key_padding_mask of shape (B, S) = (", B, ", ", S, "), got ",
        Sizes{key_padding_mask->sizes()});
  }
  check_dropout_args(dropout_p, dropout_seed);
  ATTNX_CHECK(window_left >= -1 && window_right >= -1,
              "attnx::attention: expected window_left and window_right >= -1 (-1 = unbounded), got (",
              window_left, ", ", window_right, ")");
  if (key_lengths) {
    const Tensor& t = *key_lengths;
    ATTNX_CHECK(t.scalar_type() == ScalarType::Int || t.scalar_type() == ScalarType::Long,
                "attnx::attention: expected key_lengths of dtype int32 or int64, got ", t.scalar_type());
    ATTNX_CHECK(t.dim() == 1 && t.size(0) == B, "attnx::attention: expected key_lengths of shape (B,) = (", B,
                ",), got ", Sizes{t.sizes()});
    ATTNX_CHECK(t.device() == query.device(), "attnx::attention: expected key_lengths on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
    // Read where that costs no device sync. On a GPU the kernels clamp into [0, S] instead.
    if (t.device().is_cpu()) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t n = t.scalar_type() == ScalarType::Int
                              ? int64_t{t.const_data_ptr<int32_t>()[b * t.stride(0)]}
                              : t.const_data_ptr<int64_t>()[b * t.stride(0)];
        ATTNX_CHECK(n >= 0 && n <= S, "attnx::attention: expected key_lengths in [0, S] = [0, ", S,
                    "], got key_lengths[", b, "] = ", n);
      }
    }
  }
  if (softcap) {
    ATTNX_CHECK(std::isfinite(*softcap) && *softcap > 0.0,
                "attnx::attention: expected softcap to be a finite number > 0 (None: no soft-capping), got ",
                *softcap);
  }
  if (sinks) {
    const Tensor& t = *sinks;
    ATTNX_CHECK(is_attention_dtype(t.scalar_type()),
                "attnx::attention: expected sinks of a floating dtype (float16, bfloat16, float32 or "
                "float64), got ",
                t.scalar_type());
    ATTNX_CHECK(t.dim() == 1 && t.size(0) == H, "attnx::attention: expected sinks of shape (H,) = (", H,
                ",), got ", Sizes{t.sizes()});
    ATTNX_CHECK(t.device() == query.device(), "attnx::attention: expected sinks on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
  }
}

namespace {

// Sizes, the strides of query, key, value and masks, the masks' data pointers, is_causal and the scale: what
// the forward and the backward read alike. Arguments must have passed check_attention_args.
AttentionParams attention_params(const Tensor& query, const Tensor& key, const Tensor& value,
                                 const std::optional<Tensor>& attn_mask,
                                 const std::optional<Tensor>& key_padding_mask, bool is_causal,
                                 std::optional<double> scale, double dropout_p,
                                 const std::optional<Tensor>& dropout_seed, int64_t window_left,
                                 int64_t window_right, const std::optional<Tensor>& key_lengths,
                                 std::optional<double> softcap, bool has_sinks, const void** attn_mask_ptr,
                                 const void** key_padding_mask_ptr, const void** key_lengths_ptr) {
  AttentionParams p{};
  // Each size() or stride() is a call into the shim: the arrays are read once.
  const IntHeaderOnlyArrayRef q_sizes = query.sizes(), k_sizes = key.sizes();
  const IntHeaderOnlyArrayRef q_strides = query.strides(), k_strides = key.strides(), v_strides = value.strides();
  p.batch = q_sizes[0];
  p.heads = q_sizes[1];
  p.q_len = q_sizes[2];
  p.kv_len = k_sizes[2];
  p.head_dim = q_sizes[3];
  p.v_head_dim = value.size(3);
  p.kv_heads = k_sizes[1];
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = q_strides[d];
    p.k_stride[d] = k_strides[d];
    p.v_stride[d] = v_strides[d];
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
    const Tensor& t = *dropout_seed;
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
    p.key_lengths_kind = key_lengths->scalar_type() == ScalarType::Int ? kKeyLengthsInt32 : kKeyLengthsInt64;
    p.key_lengths_stride = key_lengths->stride(0);
    *key_lengths_ptr = key_lengths->const_data_ptr();
  }
  p.has_sinks = has_sinks ? 1 : 0;
  if (softcap) split_scale(*softcap, &p.softcap, &p.softcap_lo);
  return p;
}

// sinks as the kernels read them: (H,) in the accumulator dtype, contiguous. A copy of H values only when
// they are stored otherwise.
std::optional<Tensor> sinks_for_kernels(const std::optional<Tensor>& sinks, ScalarType dtype) {
  if (!sinks) return std::nullopt;
  const ScalarType acc = attention_acc_dtype(dtype);
  if (sinks->scalar_type() == acc && sinks->stride(0) == 1) return sinks;
  Tensor converted = stable::empty(sinks->sizes(), acc, sinks->device());
  stable::copy_into(converted, *sinks);
  return converted;
}

// A (B, H, N, E) tensor laid out in memory as (B, N, H, E), the layout of out and of the gradients.
Tensor empty_bnhe(int64_t B, int64_t H, int64_t N, int64_t E, ScalarType dtype, const Device& device) {
  const int64_t sizes[4] = {B, H, N, E};
  const std::vector<int64_t> bnhe = stable::contiguous_strides({B, N, H, E});
  const int64_t strides[4] = {bnhe[0], bnhe[2], bnhe[1], bnhe[3]};
  return stable::empty_strided(sizes, strides, dtype, device);
}

void check_backward_tensor(const Tensor& t, const char* name, IntHeaderOnlyArrayRef shape, const char* shape_name,
                           ScalarType dtype, const Tensor& query) {
  ATTNX_CHECK(t.sizes().equals(shape), "attnx::attention_backward: expected ", name, " of shape ", shape_name,
              " = ", Sizes{shape}, ", got ", Sizes{t.sizes()});
  ATTNX_CHECK(t.scalar_type() == dtype, "attnx::attention_backward: expected ", name, " of dtype ", dtype,
              ", got ", t.scalar_type());
  ATTNX_CHECK(t.device() == query.device(), "attnx::attention_backward: expected ", name, " on query's device ",
              device_name(query.device()), ", got ", device_name(t.device()));
}

}  // namespace

AttentionProblem prepare_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const std::optional<Tensor>& attn_mask,
                                   const std::optional<Tensor>& key_padding_mask, bool is_causal,
                                   std::optional<double> scale, double dropout_p,
                                   const std::optional<Tensor>& dropout_seed, int64_t window_left,
                                   int64_t window_right, const std::optional<Tensor>& key_lengths,
                                   std::optional<double> softcap, const std::optional<Tensor>& sinks) {
  check_attention_args(query, key, value, attn_mask, key_padding_mask, dropout_p, dropout_seed, window_left,
                       window_right, key_lengths, softcap, sinks);
  AttentionProblem pb{};
  pb.params = attention_params(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                               dropout_seed, window_left, window_right, key_lengths, softcap,
                               sinks.has_value(), &pb.attn_mask, &pb.key_padding_mask, &pb.key_lengths);
  pb.sinks_acc = sinks_for_kernels(sinks, query.scalar_type());
  pb.sinks = pb.sinks_acc ? pb.sinks_acc->const_data_ptr() : nullptr;
  AttentionParams& p = pb.params;

  // (B, L, H, Dv) memory: the multi-head caller views out as (B, L, H*Dv) for its output projection.
  const ScalarType dtype = query.scalar_type();
  const Device device = query.device();
  pb.out = empty_bnhe(p.batch, p.heads, p.q_len, p.v_head_dim, dtype, device);
  pb.lse = stable::empty({p.batch, p.heads, p.q_len}, attention_acc_dtype(dtype), device);
  const IntHeaderOnlyArrayRef out_strides = pb.out.strides(), lse_strides = pb.lse.strides();
  for (int d = 0; d < 4; ++d) p.out_stride[d] = out_strides[d];
  for (int d = 0; d < 3; ++d) p.lse_stride[d] = lse_strides[d];

  pb.dtype = dtype;
  pb.query = query.const_data_ptr();
  pb.key = key.const_data_ptr();
  pb.value = value.const_data_ptr();
  return pb;
}

AttentionBackwardProblem prepare_attention_backward(const Tensor& grad_out, const Tensor& query,
                                                    const Tensor& key, const Tensor& value,
                                                    const Tensor& out, const Tensor& lse,
                                                    const std::optional<Tensor>& attn_mask,
                                                    const std::optional<Tensor>& key_padding_mask,
                                                    bool is_causal, std::optional<double> scale,
                                                    double dropout_p,
                                                    const std::optional<Tensor>& dropout_seed,
                                                    int64_t window_left, int64_t window_right,
                                                    const std::optional<Tensor>& key_lengths,
                                                    std::optional<double> softcap,
                                                    const std::optional<Tensor>& sinks) {
  check_attention_args(query, key, value, attn_mask, key_padding_mask, dropout_p, dropout_seed, window_left,
                       window_right, key_lengths, softcap, sinks);
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  const ScalarType dtype = query.scalar_type();
  const int64_t out_shape[4] = {B, H, L, Dv}, lse_shape[3] = {B, H, L};
  check_backward_tensor(grad_out, "grad_out", out_shape, "(B, H, L, Dv)", dtype, query);
  check_backward_tensor(out, "out", out_shape, "(B, H, L, Dv)", dtype, query);
  check_backward_tensor(lse, "lse", lse_shape, "(B, H, L)", attention_acc_dtype(dtype), query);

  AttentionBackwardProblem pb{};
  AttentionBackwardParams& bp = pb.params;
  bp.fwd = attention_params(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                            dropout_seed, window_left, window_right, key_lengths, softcap, sinks.has_value(),
                            &pb.attn_mask, &pb.key_padding_mask, &pb.key_lengths);
  pb.sinks_acc = sinks_for_kernels(sinks, dtype);
  pb.sinks = pb.sinks_acc ? pb.sinks_acc->const_data_ptr() : nullptr;
  // The gradients take out's layout, (B, N, H, E) in memory: a multi-head caller's in-projection gradient
  // reads them as (B, N, H*E) views.
  const Device device = query.device();
  pb.grad_query = empty_bnhe(B, H, L, D, dtype, device);
  pb.grad_key = empty_bnhe(B, Hkv, S, D, dtype, device);
  pb.grad_value = empty_bnhe(B, Hkv, S, Dv, dtype, device);
  const IntHeaderOnlyArrayRef out_strides = out.strides(), grad_out_strides = grad_out.strides(),
                              grad_query_strides = pb.grad_query.strides(),
                              grad_key_strides = pb.grad_key.strides(),
                              grad_value_strides = pb.grad_value.strides(), lse_strides = lse.strides();
  for (int d = 0; d < 4; ++d) {
    bp.fwd.out_stride[d] = out_strides[d];
    bp.grad_out_stride[d] = grad_out_strides[d];
    bp.grad_query_stride[d] = grad_query_strides[d];
    bp.grad_key_stride[d] = grad_key_strides[d];
    bp.grad_value_stride[d] = grad_value_strides[d];
  }
  for (int d = 0; d < 3; ++d) bp.fwd.lse_stride[d] = lse_strides[d];

  pb.dtype = dtype;
  pb.grad_out = grad_out.const_data_ptr();
  pb.query = query.const_data_ptr();
  pb.key = key.const_data_ptr();
  pb.value = value.const_data_ptr();
  pb.out = out.const_data_ptr();
  pb.lse = lse.const_data_ptr();
  return pb;
}

MaskGradShape mask_grad_shape(const Tensor& attn_mask, int64_t B, int64_t H) {
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

Tensor mask_grad_from_buffer(const Tensor& buffer, const Tensor& attn_mask) {
  const IntHeaderOnlyArrayRef sizes = attn_mask.sizes();
  const Tensor view = stable::reinterpret(buffer, sizes, stable::contiguous_strides(sizes));
  return stable::to(view, attn_mask.scalar_type());
}

Tensor sinks_grad(const Tensor& grad_out, const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  using stable::call;
  const ScalarType acc = lse.scalar_type();
  const std::optional<ScalarType> same_dtype;
  const Tensor delta = call("aten::sum", "dim_IntList",
                            call("aten::mul", "Tensor", stable::to(grad_out, acc), stable::to(out, acc)),
                            std::optional(std::vector<int64_t>{-1}), false, same_dtype);  // (B, H, L)
  // A row that sees no key has lse = +inf: its sink's probability exp(sink - inf) is 0, as its out is 0
  // whatever the sink.
  const Tensor sinks_acc = stable::to(sinks, acc);
  const int64_t sizes[3] = {1, sinks_acc.size(0), 1}, strides[3] = {0, sinks_acc.stride(0), 0};
  const Tensor sink_rows = stable::reinterpret(sinks_acc, sizes, strides);  // (1, H, 1)
  const Tensor p_sink = call("aten::exp", "", torch::stable::subtract(sink_rows, lse));
  const Tensor grad = call("aten::sum", "dim_IntList", call("aten::mul", "Tensor", p_sink, delta),
                           std::optional(std::vector<int64_t>{0, 2}), false, same_dtype);
  return stable::to(call("aten::neg", "", grad), sinks.scalar_type());
}

}  // namespace attnx
