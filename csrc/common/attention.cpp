// attnx: argument checks, tensors -> AttentionParams and AttentionPointers, and the problems' unboxing and
// boxing for attnx::attention and attnx::attention_backward (see attention.h), on the LibTorch stable ABI;
// also the checks and helpers that common/varlen_attention.cpp shares. Outputs are made with the shim's
// direct calls; the little math done here (sinks' conversion and gradient, the mask gradient's dtype) goes
// through torch's ops (common/aten.h).
#include "common/attention.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "common/aten.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {

namespace {

using stable::device_name;
using stable::Sizes;
using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::stable::Device;

constexpr const char* kOp = "attnx::attention";

}  // namespace

namespace detail {

bool is_attention_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::BFloat16 || t == ScalarType::Half;
}

void split_scale(double value, float* hi, float* lo) {
  *hi = static_cast<float>(value);
  *lo = std::isfinite(*hi) ? static_cast<float>(value - static_cast<double>(*hi)) : 0.0f;
}

void check_query_key_value_dtypes_and_devices(const char* op, const Tensor& query, const Tensor& key,
                                              const Tensor& value) {
  ATTNX_CHECK(is_attention_dtype(query.scalar_type()), op,
              ": expected query of dtype float32, float64, bfloat16 or float16, got ", query.scalar_type());
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{key, "key"}, {value, "value"}}) {
    ATTNX_CHECK(t.scalar_type() == query.scalar_type(), op, ": expected ", name, " of query's dtype ",
                query.scalar_type(), ", got ", t.scalar_type());
    ATTNX_CHECK(t.device() == query.device(), op, ": expected ", name, " on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
  }
}

void check_kv_heads(const char* op, int64_t H, int64_t Hkv) {
  ATTNX_CHECK(Hkv > 0 ? H % Hkv == 0 : H == 0, op, ": expected the number of key/value heads (Hkv = ", Hkv,
              ") to divide the number of query heads (H = ", H, ")");
}

void check_window(const char* op, int64_t window_left, int64_t window_right) {
  ATTNX_CHECK(window_left >= -1 && window_right >= -1, op,
              ": expected window_left and window_right >= -1 (-1 = unbounded), got (", window_left, ", ",
              window_right, ")");
}

void check_softcap_and_sinks(const char* op, const std::optional<double>& softcap,
                             const std::optional<Tensor>& sinks, int64_t H, const Tensor& query) {
  if (softcap) {
    ATTNX_CHECK(std::isfinite(*softcap) && *softcap > 0.0, op,
                ": expected softcap to be a finite number > 0 (None: no soft-capping), got ", *softcap);
  }
  if (sinks) {
    const Tensor& t = *sinks;
    ATTNX_CHECK(is_attention_dtype(t.scalar_type()), op,
                ": expected sinks of a floating dtype (float16, bfloat16, float32 or float64), got ",
                t.scalar_type());
    ATTNX_CHECK(t.dim() == 1 && t.size(0) == H, op, ": expected sinks of shape (H,) = (", H, ",), got ",
                Sizes{t.sizes()});
    ATTNX_CHECK(t.device() == query.device(), op, ": expected sinks on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
  }
}

}  // namespace detail

namespace {

using detail::is_attention_dtype;
using detail::split_scale;

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

// The block-sparse mask (AttentionParams::has_block_map). Its entries are read where that costs no device
// sync (on the CPU): each must be kBlockEmpty, kBlockFull or a row of block_bits.
void check_block_mask(const std::optional<Tensor>& block_map, const std::optional<Tensor>& block_bits,
                      int64_t block_q, int64_t block_k, int64_t B, int64_t H, int64_t L, int64_t S,
                      const Tensor& query) {
  if (!block_map) {
    ATTNX_CHECK(!block_bits, "attnx::attention: expected block_bits only with a block_map, got block_bits "
                "and no block_map");
    return;
  }
  ATTNX_CHECK(block_q > 0 && block_k > 0, "attnx::attention: expected block_q and block_k > 0, got (",
              block_q, ", ", block_k, ")");
  const int64_t q_blocks = (L + block_q - 1) / block_q, k_blocks = (S + block_k - 1) / block_k;
  const Tensor& m = *block_map;
  ATTNX_CHECK(m.scalar_type() == ScalarType::Int, "attnx::attention: expected block_map of dtype int32, got ",
              m.scalar_type());
  ATTNX_CHECK(m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) && (m.size(1) == H || m.size(1) == 1) &&
                  m.size(2) == q_blocks && m.size(3) == k_blocks,
              "attnx::attention: expected block_map of shape (B or 1, H or 1, ceil(L / block_q), ceil(S / "
              "block_k)) = (",
              B, " or 1, ", H, " or 1, ", q_blocks, ", ", k_blocks, "), got ", Sizes{m.sizes()});
  ATTNX_CHECK(m.device() == query.device(), "attnx::attention: expected block_map on query's device ",
              device_name(query.device()), ", got ", device_name(m.device()));
  int64_t partial_blocks = 0;
  if (block_bits) {
    const Tensor& t = *block_bits;
    const int64_t words = (block_k + 31) / 32;
    ATTNX_CHECK(t.scalar_type() == ScalarType::Int,
                "attnx::attention: expected block_bits of dtype int32, got ", t.scalar_type());
    ATTNX_CHECK(t.dim() == 3 && t.size(1) == block_q && t.size(2) == words,
                "attnx::attention: expected block_bits of shape (P, block_q, ceil(block_k / 32)) = (P, ",
                block_q, ", ", words, "), got ", Sizes{t.sizes()});
    ATTNX_CHECK(t.device() == query.device(), "attnx::attention: expected block_bits on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
    partial_blocks = t.size(0);
  }
  if (!m.device().is_cpu()) return;
  const int32_t* data = m.const_data_ptr<int32_t>();
  const IntHeaderOnlyArrayRef st = m.strides(), sz = m.sizes();
  for (int64_t b = 0; b < sz[0]; ++b) {
    for (int64_t h = 0; h < sz[1]; ++h) {
      for (int64_t i = 0; i < sz[2]; ++i) {
        const int32_t* row = data + b * st[0] + h * st[1] + i * st[2];
        for (int64_t j = 0; j < sz[3]; ++j) {
          const int32_t v = row[j * st[3]];
          ATTNX_CHECK(v == kBlockEmpty || v == kBlockFull || (v >= 0 && v < partial_blocks),
                      "attnx::attention: expected block_map entries of -1 (no key seen), -2 (every key seen) "
                      "or an index into block_bits' ",
                      partial_blocks, " blocks, got block_map[", b, ", ", h, ", ", i, ", ", j, "] = ", v);
        }
      }
    }
  }
}

}  // namespace

ScalarType attention_acc_dtype(ScalarType dtype) {
  return dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

void check_attention_args(const Tensor& query, const Tensor& key, const Tensor& value,
                          const AttentionOptions& options) {
  const auto& [attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed, window_left,
               window_right, key_lengths, softcap, sinks, block_map, block_bits, block_q, block_k] = options;
  ATTNX_CHECK(query.dim() == 4, "attnx::attention: expected query of shape (B, H, L, D), got a ", query.dim(),
              "-D tensor of shape ", Sizes{query.sizes()});
  ATTNX_CHECK(key.dim() == 4, "attnx::attention: expected key of shape (B, Hkv, S, D), got a ", key.dim(),
              "-D tensor of shape ", Sizes{key.sizes()});
  ATTNX_CHECK(value.dim() == 4, "attnx::attention: expected value of shape (B, Hkv, S, Dv), got a ",
              value.dim(), "-D tensor of shape ", Sizes{value.sizes()});
  detail::check_query_key_value_dtypes_and_devices(kOp, query, key, value);

  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  ATTNX_CHECK(key.size(0) == B && key.size(3) == D,
              "attnx::attention: expected key of shape (B, Hkv, S, D) = (", B, ", Hkv, S, ", D,
              ") to match query's B and D, got ", Sizes{key.sizes()});
  detail::check_kv_heads(kOp, H, Hkv);
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
  detail::check_window(kOp, window_left, window_right);
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
  detail::check_softcap_and_sinks(kOp, softcap, sinks, H, query);
  check_block_mask(block_map, block_bits, block_q, block_k, B, H, L, S, query);
}

namespace {

// Sizes and strides, the masks' and key lengths' layouts, the scale, dropout and the key range: what the
// forward and the backward read alike; the input pointers into `ptr` (the outputs' are the caller's).
// Arguments must have passed check_attention_args.
AttentionParams attention_params(const Tensor& query, const Tensor& key, const Tensor& value,
                                 const AttentionOptions& o, AttentionPointers& ptr) {
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
  ptr.query = query.const_data_ptr();
  ptr.key = key.const_data_ptr();
  ptr.value = value.const_data_ptr();

  p.attn_mask_kind = mask_kind(o.attn_mask);
  p.key_padding_mask_kind = mask_kind(o.key_padding_mask);
  ptr.attn_mask = nullptr;
  ptr.key_padding_mask = nullptr;
  if (o.attn_mask) {
    attn_mask_strides(*o.attn_mask, p.batch, p.heads, p.q_len, p.kv_len, p.attn_mask_stride);
    ptr.attn_mask = o.attn_mask->const_data_ptr();
  }
  if (o.key_padding_mask) {
    for (int d = 0; d < 2; ++d) {
      p.key_padding_mask_stride[d] = o.key_padding_mask->size(d) == 1 ? 0 : o.key_padding_mask->stride(d);
    }
    ptr.key_padding_mask = o.key_padding_mask->const_data_ptr();
  }
  p.is_causal = o.is_causal ? 1 : 0;
  split_scale(attention_scale(o, p.head_dim), &p.scale, &p.scale_lo);

  if (o.dropout_p > 0.0) {
    // Read on the host: the seed is a CPU tensor, so a CUDA launch needs no device sync for it.
    const Tensor& t = *o.dropout_seed;
    const int64_t* v = t.const_data_ptr<int64_t>();
    const uint64_t seed = static_cast<uint64_t>(v[0]), offset = static_cast<uint64_t>(v[t.stride(0)]);
    p.dropout = 1;
    p.dropout_seed[0] = static_cast<uint32_t>(seed);
    p.dropout_seed[1] = static_cast<uint32_t>(seed >> 32);
    p.dropout_offset[0] = static_cast<uint32_t>(offset);
    p.dropout_offset[1] = static_cast<uint32_t>(offset >> 32);
    // floor((1 - p) * 2^32), computed in double as the reference does (the product by 2^32 is exact), so
    // every backend keeps the same elements. A p so small that 1 - p rounds to 1 keeps all but 2^-32.
    const double keep = (1.0 - o.dropout_p) * 4294967296.0;
    p.dropout_threshold = static_cast<uint32_t>(std::min(keep, 4294967295.0));
    p.dropout_p = static_cast<float>(o.dropout_p);
    split_scale(o.dropout_p < 1.0 ? 1.0 / (1.0 - o.dropout_p) : 0.0, &p.dropout_scale, &p.dropout_scale_lo);
  }

  p.window_left = o.window_left;
  p.window_right = o.window_right;
  ptr.key_lengths = nullptr;
  if (o.key_lengths) {
    p.key_lengths_kind =
        o.key_lengths->scalar_type() == ScalarType::Int ? kKeyLengthsInt32 : kKeyLengthsInt64;
    p.key_lengths_stride = o.key_lengths->stride(0);
    ptr.key_lengths = o.key_lengths->const_data_ptr();
  }
  p.has_sinks = o.sinks ? 1 : 0;
  if (o.softcap) split_scale(*o.softcap, &p.softcap, &p.softcap_lo);
  ptr.block_map = nullptr;
  ptr.block_bits = nullptr;
  if (o.block_map) {
    p.has_block_map = 1;
    p.block_q = o.block_q;
    p.block_k = o.block_k;
    const Tensor& m = *o.block_map;
    for (int d = 0; d < 4; ++d) p.block_map_stride[d] = m.size(d) == 1 ? 0 : m.stride(d);
    ptr.block_map = m.const_data_ptr();
    if (o.block_bits) {
      for (int d = 0; d < 3; ++d) p.block_bits_stride[d] = o.block_bits->stride(d);
      ptr.block_bits = o.block_bits->const_data_ptr();
      p.block_partial = static_cast<int32_t>(o.block_bits->size(0));
    }
  }
  return p;
}

// A (B, H, N, E) tensor laid out in memory as (B, N, H, E), the layout of out and of the gradients.
Tensor empty_bnhe(int64_t B, int64_t H, int64_t N, int64_t E, ScalarType dtype, const Device& device) {
  const int64_t sizes[4] = {B, H, N, E};
  const std::vector<int64_t> bnhe = stable::contiguous_strides({B, N, H, E});
  const int64_t strides[4] = {bnhe[0], bnhe[2], bnhe[1], bnhe[3]};
  return aten::empty_strided(sizes, strides, dtype, device);
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

void copy_strides(const Tensor& t, int64_t* out) {
  const IntHeaderOnlyArrayRef strides = t.strides();
  std::copy(strides.begin(), strides.end(), out);
}

}  // namespace

namespace detail {

std::optional<Tensor> sinks_for_kernels(const std::optional<Tensor>& sinks, ScalarType dtype) {
  if (!sinks) return std::nullopt;
  const ScalarType acc = attention_acc_dtype(dtype);
  if (sinks->scalar_type() == acc && sinks->stride(0) == 1) return sinks;
  const Tensor converted = aten::empty(sinks->sizes(), acc, sinks->device());
  aten::copy_(converted, *sinks);
  return converted;
}

Tensor sinks_grad(const Tensor& grad_out, const Tensor& out, const Tensor& lse_rows, const Tensor& sinks) {
  const ScalarType acc = lse_rows.scalar_type();
  const Tensor delta = aten::sum(aten::mul(aten::to(grad_out, acc), aten::to(out, acc)), {-1});
  // A row that sees no key has lse = +inf: its sink's probability exp(sink - inf) is 0, as its out is 0
  // whatever the sink.
  const Tensor sinks_acc = aten::to(sinks, acc);
  // sinks in lse_rows' shape, broadcast along every dim but the heads': (1, H, 1) for attention's (B, H, L)
  // rows, (1, H) for varlen's (total_q, H).
  const size_t dims = lse_rows.dim() == 3 ? 3 : 2;
  const int64_t sizes[3] = {1, sinks_acc.size(0), 1}, strides[3] = {0, sinks_acc.stride(0), 0};
  const Tensor sink_rows =
      views::reinterpret(sinks_acc, IntHeaderOnlyArrayRef(sizes, dims), IntHeaderOnlyArrayRef(strides, dims));
  const Tensor p_sink = aten::exp(aten::sub(sink_rows, lse_rows));
  std::vector<int64_t> row_dims = dims == 3 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{0};
  return aten::to(aten::neg(aten::sum(aten::mul(p_sink, delta), std::move(row_dims))), sinks.scalar_type());
}

}  // namespace detail

namespace {
using detail::sinks_for_kernels;
}  // namespace

// (The problems are built at the end, member by member from locals: a default-constructed stable Tensor is an
// allocation in the shim, which a decoding step would pay for each one.)
AttentionProblem prepare_attention(Tensor query, Tensor key, Tensor value, AttentionOptions options,
                                   std::optional<std::pair<Tensor, Tensor>> outputs) {
  check_attention_args(query, key, value, options);
  AttentionPointers ptr{};
  AttentionParams p = attention_params(query, key, value, options, ptr);
  const ScalarType dtype = query.scalar_type();
  std::optional<Tensor> sinks_acc = sinks_for_kernels(options.sinks, dtype);
  ptr.sinks = sinks_acc ? sinks_acc->const_data_ptr() : nullptr;

  // (B, L, H, Dv) memory: the multi-head caller views out as (B, L, H*Dv) for its output projection.
  const Device device = query.device();
  const bool outputs_given = outputs.has_value();
  if (!outputs) {
    outputs.emplace(empty_bnhe(p.batch, p.heads, p.q_len, p.v_head_dim, dtype, device),
                    aten::empty({p.batch, p.heads, p.q_len}, attention_acc_dtype(dtype), device));
  }
  auto& [out, lse] = *outputs;
  copy_strides(out, p.out_stride);
  copy_strides(lse, p.lse_stride);
  ptr.out = out.mutable_data_ptr();
  ptr.lse = lse.mutable_data_ptr();
  return AttentionProblem{
      std::move(query),     std::move(key), std::move(value), std::move(options), p, ptr, dtype,
      std::move(sinks_acc), std::move(out), std::move(lse), outputs_given};
}

AttentionBackwardProblem prepare_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
                                                    Tensor out, Tensor lse, AttentionOptions options,
                                                    bool grad_attn_mask) {
  check_attention_args(query, key, value, options);
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  const ScalarType dtype = query.scalar_type();
  const int64_t out_shape[4] = {B, H, L, Dv}, lse_shape[3] = {B, H, L};
  check_backward_tensor(grad_out, "grad_out", out_shape, "(B, H, L, Dv)", dtype, query);
  check_backward_tensor(out, "out", out_shape, "(B, H, L, Dv)", dtype, query);
  check_backward_tensor(lse, "lse", lse_shape, "(B, H, L)", attention_acc_dtype(dtype), query);

  AttentionBackwardParams bp{};
  AttentionBackwardPointers ptr{};
  bp.fwd = attention_params(query, key, value, options, ptr.fwd);
  std::optional<Tensor> sinks_acc = sinks_for_kernels(options.sinks, dtype);
  ptr.fwd.sinks = sinks_acc ? sinks_acc->const_data_ptr() : nullptr;
  const bool want_mask_grad =
      grad_attn_mask && options.attn_mask && options.attn_mask->scalar_type() != ScalarType::Bool;
  if (want_mask_grad) {
    const std::array<int64_t, 4> g = mask_grad_shape(*options.attn_mask, B, H);
    std::copy(g.begin(), g.end(), bp.grad_attn_mask_size);
  }
  // The gradients take out's layout, (B, N, H, E) in memory: a multi-head caller's in-projection gradient
  // reads them as (B, N, H*E) views.
  const Device device = query.device();
  Tensor grad_query = empty_bnhe(B, H, L, D, dtype, device);
  Tensor grad_key = empty_bnhe(B, Hkv, S, D, dtype, device);
  Tensor grad_value = empty_bnhe(B, Hkv, S, Dv, dtype, device);
  copy_strides(lse, bp.fwd.lse_stride);
  detail::describe_backward_tensors(bp, ptr, copy_strides, grad_out, out, lse, grad_query, grad_key,
                                    grad_value);
  return AttentionBackwardProblem{std::move(grad_out),
                                  std::move(query),
                                  std::move(key),
                                  std::move(value),
                                  std::move(out),
                                  std::move(lse),
                                  std::move(options),
                                  want_mask_grad,
                                  bp,
                                  ptr,
                                  dtype,
                                  std::move(sinks_acc),
                                  std::move(grad_query),
                                  std::move(grad_key),
                                  std::move(grad_value),
                                  std::nullopt};
}

// The tensors are taken from the stack as they are (to<Tensor>), not through default-constructed ones (see
// prepare_attention).
AttentionProblem AttentionProblem::unbox(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  using torch::stable::detail::to;
  AttentionOptions options =
      detail::unbox_options<AttentionOptions>(kOp, stack, num_args, num_outputs,
                                              /*tensors=*/3, /*trailing=*/0, /*outputs=*/2);
  return prepare_attention(to<Tensor>(stack[0]), to<Tensor>(stack[1]), to<Tensor>(stack[2]),
                           std::move(options));
}

AttentionKernelProblem AttentionKernelProblem::unbox(StableIValue* stack, uint64_t num_args,
                                                     uint64_t num_outputs) {
  using torch::stable::detail::to;
  AttentionOptions options =
      detail::unbox_options<AttentionOptions>("attnx::_attention_kernel", stack, num_args, num_outputs,
                                              /*tensors=*/3, /*trailing=*/1, /*outputs=*/1);
  // The outputs are allocated as the call would allocate them: a backend's plan may read their strides.
  return AttentionKernelProblem{prepare_attention(to<Tensor>(stack[0]), to<Tensor>(stack[1]),
                                                  to<Tensor>(stack[2]), std::move(options)),
                                to<bool>(stack[num_args - 1]), {}};
}

AttentionBackwardProblem AttentionBackwardProblem::unbox(StableIValue* stack, uint64_t num_args,
                                                         uint64_t num_outputs) {
  using torch::stable::detail::to;
  AttentionOptions options =
      detail::unbox_options<AttentionOptions>("attnx::attention_backward", stack, num_args, num_outputs,
                                              /*tensors=*/6, /*trailing=*/1, /*outputs=*/5);
  // grad_attn_mask, the argument after the options: the stack's last.
  return prepare_attention_backward(to<Tensor>(stack[0]), to<Tensor>(stack[1]), to<Tensor>(stack[2]),
                                    to<Tensor>(stack[3]), to<Tensor>(stack[4]), to<Tensor>(stack[5]),
                                    std::move(options), to<bool>(stack[num_args - 1]));
}

void AttentionBackwardProblem::box(StableIValue* stack) const {
  using torch::stable::detail::from;
  // Distinct empty tensors where a gradient was not asked for: outputs never alias each other.
  stack[0] = from(grad_query);
  stack[1] = from(grad_key);
  stack[2] = from(grad_value);
  ATTNX_CHECK(!grad_attn_mask || grad_attn_mask_out, "attnx::attention_backward: the ",
              stable::device_name(query.device()), " kernel did not compute attn_mask's gradient");
  stack[3] = from(grad_attn_mask ? *grad_attn_mask_out : aten::new_empty_output(query));
  stack[4] = from(options.sinks ? detail::sinks_grad(grad_out, out, lse, *options.sinks)
                                : aten::new_empty_output(query));
}

std::array<Tensor, 2> call_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                     const AttentionOptions& options) {
  return std::apply(
      [&](const auto&... o) { return stable::call<2>("attnx::_attention", "", query, key, value, o...); },
      AttentionOptions::fields(options));
}

std::array<Tensor, 5> call_attention_backward(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                                              const Tensor& value, const Tensor& out, const Tensor& lse,
                                              const AttentionOptions& options, bool grad_attn_mask) {
  return std::apply(
      [&](const auto&... o) {
        return stable::call<5>("attnx::attention_backward", "", grad_out, query, key, value, out, lse, o...,
                               grad_attn_mask);
      },
      AttentionOptions::fields(options));
}

std::array<int64_t, 4> mask_grad_shape(const Tensor& attn_mask, int64_t B, int64_t H) {
  if (attn_mask.dim() == 2) return {1, 1, attn_mask.size(0), attn_mask.size(1)};
  if (attn_mask.dim() == 3) return {B, H, attn_mask.size(1), attn_mask.size(2)};
  return {attn_mask.size(0), attn_mask.size(1), attn_mask.size(2), attn_mask.size(3)};
}

Tensor mask_grad_from_buffer(const Tensor& buffer, const Tensor& attn_mask) {
  const IntHeaderOnlyArrayRef sizes = attn_mask.sizes();
  return aten::to(views::reinterpret(buffer, sizes, stable::contiguous_strides(sizes)),
                  attn_mask.scalar_type());
}

}  // namespace attnx
