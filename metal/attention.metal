// attnx: attnx::attention's Metal forward kernels, for float32, float16 and bfloat16 (accumulating in float).
//
// Both read query, key, value and the masks in place through AttentionParams' strides (the B=1 transpose,
// packed in-projection views, stride-0 broadcast), run the online softmax of attnx/softmax.h, and write out
// through its strides and the float32 lse. A fully masked row gets out 0 and lse +inf.
//   attention_vector  L <= kVectorMaxQueries (or head dims above kTiledMaxHeadDim): one threadgroup per
//                     (b*h, query row). Lane i holds elements i, i + 32, ... of the query and of the output
//                     accumulator; simdgroup g scores keys g, g + kVectorSimdgroups, ... (simd_sum of the
//                     lanes' partial dot products) with its own running max and sum; the simdgroups' partial
//                     rows are merged through threadgroup memory at the end. A bandwidth kernel, MLX's
//                     sdpa_vector scheme.
//   attention_tiled   longer queries: one threadgroup per (b*h, kTiledRows query rows). Simdgroup g holds the
//                     queries and output accumulators of rows 8g .. 8g + 7 as 8x8 simdgroup matrices; per
//                     tile of kTiledKeys keys, K and then V are staged in threadgroup memory as float, the
//                     scores S = Q K^T and the output update O += P V are simdgroup matrix products, and the
//                     softmax runs lane-per-key on S in threadgroup memory (simd_max / simd_sum per row).
//                     Rows are rescaled through a per-simdgroup 8x8 scratch, so nothing depends on which lane
//                     holds which element of a simdgroup matrix.
// Features are parameters of both kernels (AttentionParams), never separate kernels:
//   - grouped KV heads: query head h reads kv head h / (H / kv_heads) in place, through k_stride[1] and
//     v_stride[1]; nothing is repeated or copied;
//   - key ranges (attnx/key_range.h): per-batch key lengths (int32 or int64, clamped into [0, S]: a GPU
//     cannot report a bad length without a sync), the bottom-right window and the top-left is_causal give
//     each row one key interval, and a block of rows one interval too (both ends grow with the row). The
//     vector kernel loops over its row's interval only; the tiled kernel over the key tiles of its block's
//     interval, with the keys outside a row's own interval masked element by element. Cost grows with the
//     window, not with S;
//   - soft-capping: softcap * tanh(x / softcap) on the scaled score x, before the masks are added;
//   - sinks: one logit per query head that joins the softmax denominator at the end (row_end below).
// Skipped work besides: keys (vector) or key tiles (tiled) that key_padding_mask removes entirely. Any other
// masked score is -inf and contributes exp(-inf) = 0, so NaN in a mask or an input propagates to its row as
// in the reference. A row that sees no key gets out 0 and lse +inf, with or without a sink.
#include "attnx/key_range.h"
#include "common.h"

namespace attnx {

using namespace metal_config;

// Element offset of (b, h) in a tensor with (B, H, ...) strides.
inline int64_t bh_offset(const constant int64_t* stride, int64_t b, int64_t h) {
  return b * stride[0] + h * stride[1];
}

// The key/value head that query head h reads: heads / kv_heads consecutive query heads share one.
inline int64_t kv_head(int64_t h, int64_t heads, int64_t kv_heads) {
  return h / (heads / kv_heads);
}

// S_b, the keys batch b has: key_lengths[index] (int32 or int64, per `kind`) clamped into [0, S], or S.
inline int64_t batch_kv_len(int32_t kind, const device uchar* key_lengths, int64_t index, int64_t kv_len) {
  switch (kind) {
    case kKeyLengthsInt32:
      return range_kv_len(int64_t(((const device int32_t*)key_lengths)[index]), kv_len);
    case kKeyLengthsInt64:
      return range_kv_len(((const device int64_t*)key_lengths)[index], kv_len);
    default:
      return kv_len;
  }
}

// A scaled score after soft-capping (cap > 0), before the masks are added. precise::tanh: the fast-math tanh
// is not specified to saturate cleanly for large |x|, and the cap exists for exactly those scores.
inline float soft_cap(float x, float cap) {
  return cap > 0.0f ? cap * metal::precise::tanh(x / cap) : x;
}

// How a finished row becomes its output and lse: out = accumulator * factor (written as 0 for an empty row,
// without reading the accumulator).
struct RowEnd {
  bool empty;
  float factor;
  float lse;
};

// With a sink, the row's denominator is l + exp(sink - m) (softmax.h's *_sink functions, shared with the
// other backends): an empty row keeps out 0 and lse +inf, sink or not (the reference's rule), and a NaN or
// +inf score keeps its NaN out.
inline RowEnd row_end(SoftmaxRow<float> row, bool has_sink, float sink) {
  RowEnd end;
  end.empty = softmax_row_empty(row);
  end.factor = has_sink ? softmax_out_scale_sink(row, sink) : softmax_out_scale(row);
  end.lse = has_sink ? softmax_lse_sink(row, sink) : softmax_lse(row);
  return end;
}

template <typename T, int kBucket>
kernel void attention_vector(const device T* query [[buffer(0)]], const device T* key [[buffer(1)]],
                             const device T* value [[buffer(2)]], const device uchar* attn_mask [[buffer(3)]],
                             const device uchar* key_padding_mask [[buffer(4)]], device T* out [[buffer(5)]],
                             device float* lse [[buffer(6)]], const device uchar* key_lengths [[buffer(7)]],
                             const device float* sinks [[buffer(8)]],
                             const constant AttentionParams& p [[buffer(9)]], ATTNX_THREAD_POSITIONS) {
  constexpr int kCols = kBucket / kSimdWidth;  // query and output elements per lane
  // Each simdgroup's output accumulator and (max, sum), merged at the end.
  ATTNX_THREADGROUP_ARRAY(float, o_s, (kVectorSimdgroups * kBucket));
  ATTNX_THREADGROUP_ARRAY(float, stats_s, (2 * kVectorSimdgroups));

  const int64_t l = tgid.x, bh = tgid.y;
  const int64_t b = bh / p.heads, h = bh % p.heads, hkv = kv_head(h, p.heads, p.kv_heads);
  const int64_t D = p.head_dim, Dv = p.v_head_dim;
  const float scale = p.scale, softcap = p.softcap;
  const device T* q = query + bh_offset(p.q_stride, b, h) + l * p.q_stride[2];
  const device T* k = key + bh_offset(p.k_stride, b, hkv);
  const device T* v = value + bh_offset(p.v_stride, b, hkv);
  const int64_t am_row = bh_offset(p.attn_mask_stride, b, h) + l * p.attn_mask_stride[2];
  const int64_t kpm_row = b * p.key_padding_mask_stride[0];

  float qv[kCols], o[kCols];
  for (int i = 0; i < kCols; ++i) {
    const int64_t d = lane + i * kSimdWidth;
    qv[i] = d < D ? float(q[d * p.q_stride[3]]) : 0.0f;
    o[i] = 0.0f;
  }

  SoftmaxRow<float> row = softmax_row_init<float>();
  // The row's keys (key lengths, window, is_causal): the loop visits nothing else.
  const int64_t kv_len_b = batch_kv_len(p.key_lengths_kind, key_lengths, b * p.key_lengths_stride, p.kv_len);
  const int64_t key_begin = range_key_begin(l, p.q_len, kv_len_b, p.window_left);
  const int64_t key_end = range_key_end(l, p.q_len, kv_len_b, p.window_right, p.is_causal);
  for (int64_t s = key_begin + sg; s < key_end; s += kVectorSimdgroups) {
    // scores + (attn_mask + key_padding_mask), summed in the reference's order. s is the simdgroup's: every
    // branch below is uniform across its lanes.
    float bias = 0.0f;
    if (p.key_padding_mask_kind != kMaskNone) {
      bias =
          mask_value(p.key_padding_mask_kind, key_padding_mask, kpm_row + s * p.key_padding_mask_stride[1]);
      if (bias == -INFINITY) continue;  // a padded key: masked for every query, never scored
    }
    if (p.attn_mask_kind != kMaskNone) {
      bias = mask_value(p.attn_mask_kind, attn_mask, am_row + s * p.attn_mask_stride[3]) + bias;
    }
    float partial = 0.0f;
    for (int i = 0; i < kCols; ++i) {
      const int64_t d = lane + i * kSimdWidth;
      if (d < D) partial += qv[i] * float(k[s * p.k_stride[2] + d * p.k_stride[3]]);
    }
    const float score = soft_cap(simd_sum(partial) * scale, softcap) + bias;
    const SoftmaxStep<float> step = softmax_step(row, score);
    const float pr = softmax_exp(score - step.base);
    row = softmax_advance(row, step, pr);
    for (int i = 0; i < kCols; ++i) {
      const int64_t c = lane + i * kSimdWidth;
      const float vc = c < Dv ? float(v[s * p.v_stride[2] + c * p.v_stride[3]]) : 0.0f;
      o[i] = o[i] * step.alpha + pr * vc;
    }
  }

  // Merge the simdgroups' partial rows: m = max m_g, l = sum l_g exp(m_g - m), o = sum o_g exp(m_g - m).
  for (int i = 0; i < kCols; ++i) o_s[sg * kBucket + lane + i * kSimdWidth] = o[i];
  if (lane == 0) {
    stats_s[2 * sg] = row.max;
    stats_s[2 * sg + 1] = row.sum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  SoftmaxRow<float> merged = softmax_row_init<float>();
  for (int g = 0; g < kVectorSimdgroups; ++g) merged.max = nan_max(merged.max, stats_s[2 * g]);
  const float base = safe_max(merged.max);
  float weight[kVectorSimdgroups];
  for (int g = 0; g < kVectorSimdgroups; ++g) {
    // A simdgroup that saw no unmasked key contributes nothing (its o may hold 0 * inf = NaN).
    weight[g] = stats_s[2 * g] == -INFINITY ? 0.0f : softmax_exp(stats_s[2 * g] - base);
    if (stats_s[2 * g] != -INFINITY) merged.sum += stats_s[2 * g + 1] * weight[g];
  }
  const RowEnd end = row_end(merged, p.has_sinks != 0, p.has_sinks != 0 ? sinks[h] : 0.0f);
  device T* dst = out + bh_offset(p.out_stride, b, h) + l * p.out_stride[2];
  for (int64_t c = tid; c < Dv; c += kVectorThreads) {
    float acc = 0.0f;
    for (int g = 0; g < kVectorSimdgroups; ++g) {
      if (weight[g] != 0.0f) acc += o_s[g * kBucket + c] * weight[g];
    }
    // Written as 0, not as acc * 0: acc may hold 0 * inf = NaN from masked keys of an infinite value.
    dst[c * p.out_stride[3]] = T(end.empty ? 0.0f : acc * end.factor);
  }
  if (tid == 0) lse[bh_offset(p.lse_stride, b, h) + l * p.lse_stride[2]] = end.lse;
}

template <typename T, int kBucket>
kernel void attention_tiled(const device T* query [[buffer(0)]], const device T* key [[buffer(1)]],
                            const device T* value [[buffer(2)]], const device uchar* attn_mask [[buffer(3)]],
                            const device uchar* key_padding_mask [[buffer(4)]], device T* out [[buffer(5)]],
                            device float* lse [[buffer(6)]], const device uchar* key_lengths [[buffer(7)]],
                            const device float* sinks [[buffer(8)]],
                            const constant AttentionParams& p [[buffer(9)]], ATTNX_THREAD_POSITIONS) {
  constexpr int kFrags = kBucket / 8;  // 8x8 matrices along the head dim
  constexpr int ld = kBucket + 4;      // row stride of the staged tiles (padding against bank conflicts)
  static_assert(kTiledRows == kTiledKeys, "kv_s also stages the query and output rows");
  static_assert(kTiledKeys == kSimdWidth, "the softmax runs one key per lane");
  // kv_s: Q, then each K and V tile, then O. s_s: scores, then probabilities. x_s: each simdgroup's 8x8
  // scratch. alpha_s: each row's rescale factor in the current tile.
  ATTNX_THREADGROUP_ARRAY(float, kv_s, (kTiledKeys * ld));
  ATTNX_THREADGROUP_ARRAY(float, s_s, (kTiledRows * kTiledKeys));
  ATTNX_THREADGROUP_ARRAY(float, x_s, (kTiledSimdgroups * 64));
  ATTNX_THREADGROUP_ARRAY(float, alpha_s, kTiledRows);

  const int64_t q0 = int64_t(tgid.x) * kTiledRows, bh = tgid.y;
  const int64_t b = bh / p.heads, h = bh % p.heads, hkv = kv_head(h, p.heads, p.kv_heads);
  const int64_t L = p.q_len, D = p.head_dim, Dv = p.v_head_dim;
  const int64_t rows = L - q0 < kTiledRows ? L - q0 : int64_t(kTiledRows);  // query rows of this threadgroup
  const float scale = p.scale, softcap = p.softcap;
  const device T* q = query + bh_offset(p.q_stride, b, h);
  const device T* k = key + bh_offset(p.k_stride, b, hkv);
  const device T* v = value + bh_offset(p.v_stride, b, hkv);
  const int64_t am_base = bh_offset(p.attn_mask_stride, b, h);
  const int64_t kpm_base = b * p.key_padding_mask_stride[0];

  // The threadgroup's queries, zero past D and past L, into the simdgroups' Q matrices.
  for (int e = tid; e < kTiledRows * kBucket; e += kTiledThreads) {
    const int r = e / kBucket, d = e % kBucket;
    kv_s[r * ld + d] = r < rows && d < D ? float(q[(q0 + r) * p.q_stride[2] + d * p.q_stride[3]]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 qm[kFrags], om[kFrags];
  for (int j = 0; j < kFrags; ++j) {
    simdgroup_load(qm[j], kv_s + sg * 8 * ld + j * 8, ld);
    om[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }

  // The simdgroup's 8 rows: row r is query q0 + 8 sg + r. Their statistics are uniform across the lanes.
  SoftmaxRow<float> st[8];
  for (int r = 0; r < 8; ++r) st[r] = softmax_row_init<float>();
  threadgroup float* s_rows = s_s + sg * 8 * kTiledKeys;
  bool o_started = false;  // some tile has been added to O (uniform: every simdgroup sees the same tiles)

  // The keys of the threadgroup's rows (key lengths, window, is_causal): from its first row's first key to
  // its last row's last, since both ends grow with the row. Only these tiles are visited (uniformly: the
  // interval is the threadgroup's); keys outside a row's own interval are masked in the softmax below.
  const int64_t kv_len_b = batch_kv_len(p.key_lengths_kind, key_lengths, b * p.key_lengths_stride, p.kv_len);
  const int64_t kv_begin = range_key_begin(q0, L, kv_len_b, p.window_left);
  const int64_t kv_end = range_key_end(q0 + rows - 1, L, kv_len_b, p.window_right, p.is_causal);
  for (int64_t k0 = kv_begin; k0 < kv_end; k0 += kTiledKeys) {
    const int nk = kv_end - k0 < kTiledKeys ? int(kv_end - k0) : int(kTiledKeys);
    const int64_t key_index = k0 + lane;  // the key of this lane in the softmax

    // key_padding_mask is the same for every row: every simdgroup reads the same elements, so a tile it
    // removes entirely is skipped by the whole threadgroup (before any barrier).
    float padding = 0.0f;
    if (p.key_padding_mask_kind != kMaskNone) {
      padding = int(lane) < nk ? mask_value(p.key_padding_mask_kind, key_padding_mask,
                                            kpm_base + key_index * p.key_padding_mask_stride[1])
                               : -INFINITY;
      if (simd_all(padding == -INFINITY)) continue;
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with kv_s (Q or last V)
    for (int e = tid; e < kTiledKeys * kBucket; e += kTiledThreads) {
      const int j = e / kBucket, d = e % kBucket;
      kv_s[j * ld + d] = j < nk && d < D ? float(k[(k0 + j) * p.k_stride[2] + d * p.k_stride[3]]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S = Q K^T for the simdgroup's rows, 8 keys at a time (K read transposed: (d, key)).
    for (int kb = 0; kb < kTiledKeys / 8; ++kb) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int j = 0; j < kFrags; ++j) {
        simdgroup_float8x8 kt;
        simdgroup_load(kt, kv_s + kb * 8 * ld + j * 8, ld, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc, qm[j], kt, acc);
      }
      simdgroup_store(acc, s_rows + kb * 8, kTiledKeys);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax, one key per lane, row by row (each row is a uniform branch).
    bool rescale = false;
    for (int r = 0; r < 8; ++r) {
      const int64_t row = sg * 8 + r, l = q0 + row;
      float pr = 0.0f, alpha = 1.0f;
      if (row < rows) {
        float s = -INFINITY;  // keys past the tile's end contribute exp(-inf) = 0
        if (int(lane) < nk) {
          float bias = padding;
          if (p.attn_mask_kind != kMaskNone) {
            bias = mask_value(p.attn_mask_kind, attn_mask,
                              am_base + l * p.attn_mask_stride[2] + key_index * p.attn_mask_stride[3]) +
                   padding;
          }
          s = soft_cap(s_rows[r * kTiledKeys + lane] * scale, softcap) + bias;
          const int64_t row_begin = range_key_begin(l, L, kv_len_b, p.window_left);
          const int64_t row_end_key = range_key_end(l, L, kv_len_b, p.window_right, p.is_causal);
          if (key_index < row_begin || key_index >= row_end_key) s += -INFINITY;  // adding keeps NaN NaN
        }
        const SoftmaxStep<float> step = softmax_step(st[r], simd_max(s));
        pr = softmax_exp(s - step.base);
        const float tile_sum = simd_sum(pr);
        st[r] = softmax_advance(st[r], step, tile_sum);
        // simd_max may skip a NaN lane (fmax semantics); the sum never does. A row whose scores so far are
        // NaN or -inf would otherwise look fully masked (out 0) instead of NaN as in the reference.
        if (is_nan(tile_sum) && st[r].max == -INFINITY) st[r].max = tile_sum;
        alpha = step.alpha;
      }
      rescale = rescale || alpha != 1.0f;
      s_rows[r * kTiledKeys + lane] = pr;
      if (lane == 0) alpha_s[row] = alpha;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // O *= alpha row by row, through the scratch: a simdgroup matrix is opaque, its lane layout unspecified.
    // Before the first tile that reached O there is nothing to rescale (alpha is 0 there).
    if (rescale && o_started) {
      threadgroup float* x = x_s + sg * 64;
      for (int j = 0; j < kFrags; ++j) {
        simdgroup_store(om[j], x, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = lane; e < 64; e += kSimdWidth) x[e] *= alpha_s[sg * 8 + e / 8];
        simdgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_load(om[j], x, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);  // loaded before the next store overwrites x
      }
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading K
    for (int e = tid; e < kTiledKeys * kBucket; e += kTiledThreads) {
      const int j = e / kBucket, c = e % kBucket;
      // Zeros past the last key matter: their probabilities are 0, and 0 * (poison) would not be.
      kv_s[j * ld + c] = j < nk && c < Dv ? float(v[(k0 + j) * p.v_stride[2] + c * p.v_stride[3]]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // O += P V.
    o_started = true;
    for (int kb = 0; kb < kTiledKeys / 8; ++kb) {
      simdgroup_float8x8 pm;
      simdgroup_load(pm, s_rows + kb * 8, kTiledKeys);
      for (int j = 0; j < kFrags; ++j) {
        simdgroup_float8x8 vm;
        simdgroup_load(vm, kv_s + kb * 8 * ld + j * 8, ld);
        simdgroup_multiply_accumulate(om[j], pm, vm, om[j]);
      }
    }
  }

  // out = O / l and lse = m + log(l) per row, O through the simdgroup's own rows of kv_s.
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading V
  for (int j = 0; j < kFrags; ++j) simdgroup_store(om[j], kv_s + sg * 8 * ld + j * 8, ld);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  device T* o_base = out + bh_offset(p.out_stride, b, h);
  device float* lse_base = lse + bh_offset(p.lse_stride, b, h);
  const float sink = p.has_sinks != 0 ? sinks[h] : 0.0f;
  for (int r = 0; r < 8; ++r) {
    const int64_t row = sg * 8 + r, l = q0 + row;
    if (row >= rows) break;
    const RowEnd end = row_end(st[r], p.has_sinks != 0, sink);
    for (int64_t c = lane; c < Dv; c += kSimdWidth) {
      // Written as 0, not as o * 0: o may hold 0 * inf = NaN from masked keys of an infinite value.
      o_base[l * p.out_stride[2] + c * p.out_stride[3]] =
          T(end.empty ? 0.0f : kv_s[row * ld + c] * end.factor);
    }
    if (lane == 0) lse_base[l * p.lse_stride[2]] = end.lse;
  }
}

// Host names: attention_<kernel>_d<bucket>_<dtype>, bucket = max(D, Dv) rounded up (metal_plan.h).
// clang-format off
#define ATTNX_INSTANTIATE_ATTENTION_TYPE(variant, bucket, type, name) \
  ATTNX_INSTANTIATE_KERNEL("attention_" #variant "_d" #bucket "_" name, attention_##variant, type, bucket)
#define ATTNX_INSTANTIATE_ATTENTION(variant, bucket)                     \
  ATTNX_INSTANTIATE_ATTENTION_TYPE(variant, bucket, float, "float32")   \
  ATTNX_INSTANTIATE_ATTENTION_TYPE(variant, bucket, half, "float16")    \
  ATTNX_INSTANTIATE_ATTENTION_TYPE(variant, bucket, bfloat, "bfloat16")

ATTNX_INSTANTIATE_ATTENTION(vector, 32)
ATTNX_INSTANTIATE_ATTENTION(vector, 64)
ATTNX_INSTANTIATE_ATTENTION(vector, 128)
ATTNX_INSTANTIATE_ATTENTION(vector, 256)
ATTNX_INSTANTIATE_ATTENTION(tiled, 32)
ATTNX_INSTANTIATE_ATTENTION(tiled, 64)
ATTNX_INSTANTIATE_ATTENTION(tiled, 128)
// clang-format on

}  // namespace attnx
