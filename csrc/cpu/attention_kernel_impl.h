// attnx: attnx::attention's CPU kernel: flash-attention tiling with an online softmax, GEMMs on gemm.h.
//
// Included once per ISA level by a TU that has defined CPU_CAPABILITY (see cpu/attention_kernel.h); defines
// attnx::cpu::CPU_CAPABILITY::attention_kernel.
//
// A work item is a block of query tiles (BQ rows each) of one (b, h). For each tile of BK keys, transposed
// once for the whole block, and each query tile that the masks leave anything of: one GEMM computes the
// (BQ, BK) scores, vectorised passes over each row add the masks read in place, take the row max and the
// exp and row sum of the online softmax, and a second GEMM adds P V into the block's fp32 (fp64 for fp64)
// accumulators. With dropout, each row's probabilities are dropped after the softmax's row sum (the Philox
// stream of attnx/philox.h, regenerated per element), before the P V GEMM. Scores never exist beyond one
// (BQ, BK) tile per thread, so extra memory is the per-thread scratch plus O(B * S / BK) and O(mask tiles)
// skip flags; out and lse are written once per row at the end. Decoding with grouped KV heads (L = 1,
// H > Hkv, no attn_mask or dropout) is the exception: a work item is one (b, kv head), its one tile the
// query rows of the group's H / Hkv heads, which share each key tile (run_group_item).
//
// Packed sequences (AttentionParams::varlen, attnx::varlen_attention) are batches of their own lengths: a
// work item is a block of one sequence's query tiles (blocks past a shorter sequence's queries are empty),
// its rows offset by the sequence's first row (seq_range), so no tile crosses a sequence and the work is the
// sum of Lq_b * Lk_b. A paged cache's key and value tiles are gathered through the block table (gather_pages)
// instead of being read in place.

#include "cpu/vec.h"
// dot16.h and gemm.h after vec.h: they are built on Vec<float>, and gemm.h's pair products on dot16.h.
#include "cpu/dot16.h"
#include "cpu/tiles.h"
// gemm.h after tiles.h, whose products its pair products run on in the AMX variants.
#include "cpu/gemm.h"

namespace attnx::cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename acc_t>
constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

// Elements per 64-byte line; scratch regions start on a line and score rows are padded to whole lines.
template <typename acc_t>
constexpr int64_t kLine = 64 / sizeof(acc_t);

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// ---------------------------------------------------------------------------------------------------------------
// Masks: read in place through their own strides, in their own dtype.

// The additive value of one mask element: bool true = masked out (-inf), a float is added as it is.
template <typename acc_t, typename mask_t>
inline acc_t mask_value(mask_t x) {
  if constexpr (std::is_same_v<mask_t, bool>) {
    // -inf's bits under an all-ones or all-zeros mask: branch-free, so loops over bool masks vectorise.
    using bits_t = std::conditional_t<sizeof(acc_t) == 4, uint32_t, uint64_t>;
    const acc_t neg_inf = kNegInf<acc_t>;
    bits_t bits;
    std::memcpy(&bits, &neg_inf, sizeof(bits));
    bits &= bits_t(0) - static_cast<bits_t>(x);
    acc_t value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  } else {
    return static_cast<acc_t>(x);
  }
}

// Calls f(ptr) with the mask pointer cast to its element type.
template <typename F>
inline void visit_mask(int32_t kind, const void* ptr, F&& f) {
  switch (kind) {
    case kMaskBool:
      f(static_cast<const bool*>(ptr));
      break;
    case kMaskFloat16:
      f(static_cast<const torch::headeronly::Half*>(ptr));
      break;
    case kMaskBFloat16:
      f(static_cast<const torch::headeronly::BFloat16*>(ptr));
      break;
    case kMaskFloat32:
      f(static_cast<const float*>(ptr));
      break;
    case kMaskFloat64:
      f(static_cast<const double*>(ptr));
      break;
    default:
      break;
  }
}

// out[j] = mask_value(m[j * stride]) (+ add[j] when add is not null), for j < n. The unit-stride loop is kept
// apart so that the compiler vectorises it.
template <typename acc_t, typename mask_t>
void mask_to_bias(const mask_t* m, int64_t stride, int64_t n, const acc_t* add, acc_t* out) {
  if (stride == 1) {
    if (add) {
      for (int64_t j = 0; j < n; ++j) out[j] = mask_value<acc_t>(m[j]) + add[j];
    } else {
      for (int64_t j = 0; j < n; ++j) out[j] = mask_value<acc_t>(m[j]);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = mask_value<acc_t>(m[j * stride]) + (add ? add[j] : acc_t(0));
  }
}

// True when every element of the (rows, cols) block is masked out (bool true or a float -inf). Stops at the
// first element that is not, so a mask with finite values costs one read per tile.
template <typename acc_t, typename mask_t>
bool block_masked(const mask_t* m, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols) {
  // A broadcast dim repeats the same elements: one row (column) of it decides.
  if (row_stride == 0) rows = std::min<int64_t>(rows, 1);
  if (col_stride == 0) cols = std::min<int64_t>(cols, 1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (mask_value<acc_t>(m[r * row_stride + c * col_stride]) != kNegInf<acc_t>) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Tile GEMMs and their operands.
//
// The tiles run on gemm.h's micro-kernels: the row-major C (+)= A B, with neither transposes nor alpha, so
// queries are packed pre-scaled and each key tile is transposed into (D, BK). fp64 tiles, used for
// reference-grade results rather than speed, run on a vectorised loop.

// C (M, N) = A (M, K) @ B (K, N) (+ C when add_c), row-major with leading dimensions.
template <typename acc_t>
inline void tile_gemm(int64_t M, int64_t N, int64_t K, const acc_t* A, int64_t lda, const acc_t* B,
                      int64_t ldb, acc_t* C, int64_t ldc, bool add_c, acc_t* row_max = nullptr) {
  if constexpr (std::is_same_v<acc_t, float>) {
    gemm(M, N, K, A, lda, B, ldb, C, ldc, add_c, row_max);
  } else {
    gemm(M, N, K, A, lda, B, ldb, C, ldc, add_c);  // float64's product gives no maxima: never asked for
  }
}

// s[j] = q . k[j] for the n rows k[j] = k + j * ldk of length D: one query row against the key rows
// (decoding). A GEMM with a single column would be vectorised along that column; this is vectorised along D,
// four rows at a time.
template <typename acc_t>
void dot_rows(const acc_t* q, const acc_t* k, int64_t ldk, int64_t n, int64_t D, acc_t* s) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const acc_t* k0 = k + j * ldk;
    V a0(acc_t(0)), a1(acc_t(0)), a2(acc_t(0)), a3(acc_t(0));
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      const V qv = V::loadu(q + d);
      a0 = fmadd(qv, V::loadu(k0 + d), a0);
      a1 = fmadd(qv, V::loadu(k0 + ldk + d), a1);
      a2 = fmadd(qv, V::loadu(k0 + 2 * ldk + d), a2);
      a3 = fmadd(qv, V::loadu(k0 + 3 * ldk + d), a3);
    }
    acc_t r[4] = {reduce_sum(a0), reduce_sum(a1), reduce_sum(a2), reduce_sum(a3)};
    for (; d < D; ++d) {
      for (int i = 0; i < 4; ++i) r[i] += q[d] * k0[i * ldk + d];
    }
    for (int i = 0; i < 4; ++i) s[j + i] = r[i];
  }
  for (; j < n; ++j) {
    const acc_t* kj = k + j * ldk;
    V a(acc_t(0));
    int64_t d = 0;
    for (; d + W <= D; d += W) a = fmadd(V::loadu(q + d), V::loadu(kj + d), a);
    acc_t r = reduce_sum(a);
    for (; d < D; ++d) r += q[d] * kj[d];
    s[j] = r;
  }
}

// transpose() (dst (cols, rows) = src (rows, cols)^T) is vec.h's.

// ---------------------------------------------------------------------------------------------------------------
// bfloat16 operands as pairs (dot16.h), for the kernels of TUs that multiply them so: the inputs' bits, never
// rounded; only P (and in the backward dS) is rounded to bfloat16 for its product, as PyTorch's CPU and GPU
// kernels do.

inline uint32_t bf16_bits(torch::headeronly::BFloat16 x) {
  return x.x;
}
inline uint32_t bf16_bits(uint16_t x) {
  return x;
}

// dst (rows, ceil(cols / 2)) pairs, leading dimension ld, = src (rows, cols) read through its strides; an odd
// row's last pair has a zero high half.
template <typename src_t>
void pack_pairs(const src_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                uint32_t* dst, int64_t ld) {
  static_assert(sizeof(src_t) == sizeof(uint16_t), "pairs of 16-bit elements, copied as their bits");
  for (int64_t r = 0; r < rows; ++r) {
    const src_t* s = src + r * row_stride;
    uint32_t* d = dst + r * ld;
    if (col_stride == 1) {
      // Contiguous elements are their pairs' bytes already (the lower-addressed one in the low half). Not
      // called without a pair: a head dim of 0 or 1 may come with null pointers, which memcpy never takes.
      if (cols > 1) std::memcpy(d, s, cols / 2 * sizeof(uint32_t));
    } else {
      for (int64_t c = 0; c + 1 < cols; c += 2) {
        d[c / 2] = bf16_bits(s[c * col_stride]) | bf16_bits(s[(c + 1) * col_stride]) << 16;
      }
    }
    if (cols % 2) d[cols / 2] = bf16_bits(s[(cols - 1) * col_stride]);
  }
}

// The row pairs of src (rows, cols): dst (ceil(rows / 2), cols), leading dimension ld, with dst[t][c] the
// pair (src[2t][c], src[2t + 1][c]): P V's B operand. An odd last row pairs with zeros.
template <typename src_t>
void pack_row_pairs(const src_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                    uint32_t* dst, int64_t ld) {
  for (int64_t t = 0; 2 * t < rows; ++t) {
    const src_t* a = src + 2 * t * row_stride;
    uint32_t* d = dst + t * ld;
    if (2 * t + 1 == rows) {
      for (int64_t c = 0; c < cols; ++c) d[c] = bf16_bits(a[c * col_stride]);
    } else if (col_stride == 1) {
      const src_t* b = a + row_stride;
      for (int64_t c = 0; c < cols; ++c) d[c] = bf16_bits(a[c]) | bf16_bits(b[c]) << 16;
    } else {
      const src_t* b = a + row_stride;
      for (int64_t c = 0; c < cols; ++c)
        d[c] = bf16_bits(a[c * col_stride]) | bf16_bits(b[c * col_stride]) << 16;
    }
  }
}

#if ATTNX_DOT_BF16
// s[j] = alpha (q . k[j]) for the n key rows k[j] = k + j * ldk of D2 pairs each: dot_rows for pairs.
inline void dot_rows_pairs(const uint32_t* q, const uint32_t* k, int64_t ldk, int64_t n, int64_t D2,
                           float alpha, float* s) {
  using V = Vec<float>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const uint32_t* k0 = k + j * ldk;
    V a[4] = {V(0.0f), V(0.0f), V(0.0f), V(0.0f)};
    for (int64_t d = 0; d < D2; d += W) {
      const int t = static_cast<int>(std::min<int64_t>(W, D2 - d));
      const Pairs qv = t == W ? Pairs::loadu(q + d) : Pairs::loadu(q + d, t);
      for (int i = 0; i < 4; ++i) {
        a[i] =
            dot_pairs(a[i], qv, t == W ? Pairs::loadu(k0 + i * ldk + d) : Pairs::loadu(k0 + i * ldk + d, t));
      }
    }
    for (int i = 0; i < 4; ++i) s[j + i] = reduce_sum(a[i]) * alpha;
  }
  for (; j < n; ++j) {
    const uint32_t* kj = k + j * ldk;
    V a(0.0f);
    for (int64_t d = 0; d < D2; d += W) {
      const int t = static_cast<int>(std::min<int64_t>(W, D2 - d));
      a = dot_pairs(a, t == W ? Pairs::loadu(q + d) : Pairs::loadu(q + d, t),
                    t == W ? Pairs::loadu(kj + d) : Pairs::loadu(kj + d, t));
    }
    s[j] = reduce_sum(a) * alpha;
  }
}

// O (nq, Dv) += P (nq, nk) V (nk, Dv) with P rounded to bfloat16 (into pp, leading dimension ldp, unless
// `rounded` says it is there already) and V as row pairs (vp, leading dimension ldv). An odd last key is
// added on its own, in float32: its pair's other row is a key outside this tile's range (or padding), which a
// zero probability must not multiply, as a NaN or an infinity there would turn 0 into NaN.
inline void pv_pairs(const float* s, int64_t lds, int64_t nq, int64_t nk, const uint32_t* vp, int64_t ldv,
                     int64_t Dv, uint32_t* pp, int64_t ldp, bool rounded, float* o, int64_t ldo) {
  if (!rounded) {
    for (int64_t i = 0; i < nq; ++i) to_bf16_pairs(s + i * lds, nk, pp + i * ldp);
  }
  gemm_pairs(nq, Dv, nk / 2, pp, ldp, vp, ldv, o, ldo, /*add_c=*/true, 1.0f);
  if (nk % 2) {
    const uint32_t* last = vp + (nk / 2) * ldv;
    for (int64_t i = 0; i < nq; ++i) {
      const float pi = dot16::bits_to_float(pp[i * ldp + nk / 2] << 16);
      float* oi = o + i * ldo;
      for (int64_t c = 0; c < Dv; ++c) oi[c] = std::fma(pi, dot16::bits_to_float(last[c] << 16), oi[c]);
    }
  }
}
#endif

// dst (rows, cols), leading dimension ld, = factor * src (rows, cols) read through its strides, converted.
template <typename scalar_t, typename acc_t>
void pack_block(const scalar_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                acc_t factor, acc_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* s = src + r * row_stride;
    acc_t* d = dst + r * ld;
    if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<acc_t>(s[c]) * factor;
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<acc_t>(s[c * col_stride]) * factor;
    }
  }
}

// A GEMM operand: a pointer and a leading dimension.
template <typename acc_t>
struct Operand {
  const acc_t* ptr;
  int64_t ld;
};

// The (rows, cols) block at src as a B operand. Read in place when it is already in the accumulator type with
// contiguous rows that do not overlap (leading dimension >= cols); otherwise converted into `pack`.
template <typename scalar_t, typename acc_t>
Operand<acc_t> b_operand(const scalar_t* src, int64_t row_stride, int64_t col_stride, int64_t rows,
                         int64_t cols, acc_t* pack) {
  const int64_t dense_ld = std::max<int64_t>(cols, 1);
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    const bool rows_ok =
        rows == 1 || (row_stride >= dense_ld && row_stride <= std::numeric_limits<int>::max());
    if ((cols == 1 || col_stride == 1) && rows_ok) return {src, rows == 1 ? dense_ld : row_stride};
  }
  pack_block(src, row_stride, col_stride, rows, cols, acc_t(1), pack, dense_ld);
  return {pack, dense_ld};
}

// K^T for a (rows, cols) key block: kt (cols, rows) with leading dimension ld_kt. Transposed straight from
// the input when its rows are contiguous in the accumulator type, else packed into `pack` first.
template <typename scalar_t, typename acc_t>
void transpose_keys(const scalar_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                    acc_t* pack, acc_t* kt, int64_t ld_kt) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (cols == 1 || col_stride == 1) {
      transpose(src, row_stride, kt, ld_kt, rows, cols);
      return;
    }
  }
  pack_block(src, row_stride, col_stride, rows, cols, acc_t(1), pack, cols);
  transpose(pack, cols, kt, ld_kt, rows, cols);
}

// ---------------------------------------------------------------------------------------------------------------
// Row passes over one (BQ, BK) score tile, vectorised with vec.h (whose vexp is the softmax's exp: ATen's
// exp_u20, within 20 ulp over the softmax's range, x <= 0, which the float tolerances absorb).

// A row's last, partial vector (n < size() lanes) through the passes below: loaded masked, its lanes >= n
// replaced by `fill` (-inf for the max, 0 for the sum), so that a row length that is not a multiple of the
// vector width (S = 77, 197) costs one more vector instead of a scalar loop of up to size() - 1 std::exp.
// float on AVX2 / AVX-512 (masked loads and a lane select); fp64 and the portable vectors keep scalar tails.
#if defined(ATTNX_VEC_AVX512) || defined(ATTNX_VEC_AVX2)
template <typename acc_t>
constexpr bool kVectorTail = std::is_same_v<acc_t, float>;
#else
template <typename acc_t>
constexpr bool kVectorTail = false;
#endif

// s[j] += bias[j] for lo <= j < hi (bias may be null: scores unchanged), s[j] += -inf for j < lo and
// hi <= j < n (keys outside the row's key range: adding keeps a NaN score NaN, as in the reference); returns
// max_j s[j], NaN if any is NaN.
template <typename acc_t>
acc_t add_bias_and_max(acc_t* s, const acc_t* bias, int64_t lo, int64_t hi, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  V vmax(kNegInf<acc_t>);
  acc_t m = kNegInf<acc_t>;
  for (int64_t j = 0; j < lo; ++j) {
    s[j] += kNegInf<acc_t>;
    m = nan_max(m, s[j]);
  }
  const int64_t lim = hi;
  int64_t j = lo;
  // Four running maxima, four vectors a step: one running maximum is a dependency chain of max and the
  // NaN fix-up per vector, which made this pass latency-bound. The max of a set is the same in any order.
  V vmax1(kNegInf<acc_t>), vmax2(kNegInf<acc_t>), vmax3(kNegInf<acc_t>);
  if (bias) {
    for (; j + 4 * W <= lim; j += 4 * W) {
      const V x0 = V::loadu(s + j) + V::loadu(bias + j);
      const V x1 = V::loadu(s + j + W) + V::loadu(bias + j + W);
      const V x2 = V::loadu(s + j + 2 * W) + V::loadu(bias + j + 2 * W);
      const V x3 = V::loadu(s + j + 3 * W) + V::loadu(bias + j + 3 * W);
      x0.store(s + j);
      x1.store(s + j + W);
      x2.store(s + j + 2 * W);
      x3.store(s + j + 3 * W);
      vmax = maximum(vmax, x0);
      vmax1 = maximum(vmax1, x1);
      vmax2 = maximum(vmax2, x2);
      vmax3 = maximum(vmax3, x3);
    }
    for (; j + W <= lim; j += W) {
      const V x = V::loadu(s + j) + V::loadu(bias + j);
      x.store(s + j);
      vmax = maximum(vmax, x);
    }
  } else {
    for (; j + 4 * W <= lim; j += 4 * W) {
      vmax = maximum(vmax, V::loadu(s + j));
      vmax1 = maximum(vmax1, V::loadu(s + j + W));
      vmax2 = maximum(vmax2, V::loadu(s + j + 2 * W));
      vmax3 = maximum(vmax3, V::loadu(s + j + 3 * W));
    }
    for (; j + W <= lim; j += W) vmax = maximum(vmax, V::loadu(s + j));
  }
  vmax = maximum(maximum(vmax, vmax1), maximum(vmax2, vmax3));
#if defined(ATTNX_VEC_AVX512) || defined(ATTNX_VEC_AVX2)
  if constexpr (kVectorTail<acc_t>) {
    if (j < lim) {
      const int t = static_cast<int>(lim - j);
      V x = V::loadu(s + j, t);
      if (bias) {
        x = x + V::loadu(bias + j, t);
        x.store(s + j, t);
      }
      vmax = maximum(vmax, lanes_below_or(x, t, kNegInf<acc_t>));
      j = lim;
    }
  }
#endif
  m = nan_max(m, reduce_max(vmax));
  for (; j < lim; ++j) {
    if (bias) s[j] += bias[j];
    m = nan_max(m, s[j]);
  }
  for (; j < n; ++j) {
    s[j] += kNegInf<acc_t>;
    m = nan_max(m, s[j]);
  }
  return m;
}

// s[j] = cap * tanh(s[j] / cap) for j < n: soft-capping, on the scaled scores before the masks.
template <typename acc_t>
void softcap_row(acc_t* s, int64_t n, acc_t cap) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V vcap(cap);
  int64_t j = 0;
  for (; j + W <= n; j += W) (vtanh(V::loadu(s + j) / vcap) * vcap).store(s + j);
  for (; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}

// s[j] = exp(s[j] - base) for j < n; returns the sum of the results.
template <typename acc_t>
acc_t exp_and_sum(acc_t* s, int64_t n, acc_t base) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V vbase(base);
  V vsum(acc_t(0));
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const V e = vexp(V::loadu(s + j) - vbase);
    e.store(s + j);
    vsum = vsum + e;
  }
#if defined(ATTNX_VEC_AVX512) || defined(ATTNX_VEC_AVX2)
  if constexpr (kVectorTail<acc_t>) {
    if (j < n) {
      const int t = static_cast<int>(n - j);
      const V e = vexp(V::loadu(s + j, t) - vbase);
      e.store(s + j, t);
      vsum = vsum + lanes_below_or(e, t, acc_t(0));
      j = n;
    }
  }
#endif
  acc_t sum = reduce_sum(vsum);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - base);
    sum += s[j];
  }
  return sum;
}

#if ATTNX_DOT_BF16
// exp(s[j] - base) for j < n, rounded into dst as ceil(n / 2) pairs (the high half of an odd last one 0);
// returns the sum of the unrounded results, as exp_and_sum does. One pass instead of exp_and_sum's and
// to_bf16_pairs', and s is left as it is but for the last, partial step's elements.
inline float exp_sum_pairs(float* s, int64_t n, float base, uint32_t* dst) {
  using V = Vec<float>;
  constexpr int64_t W = V::size();
  const V vbase(base);
  V vsum(0.0f);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const V e0 = vexp_for_bf16(V::loadu(s + j) - vbase), e1 = vexp_for_bf16(V::loadu(s + j + W) - vbase);
    vsum = vsum + e0;
    vsum = vsum + e1;
    store_bf16_pairs(e0, e1, dst + j / 2);
  }
  const float tail = exp_and_sum(s + j, n - j, base);
  to_bf16_pairs(s + j, n - j, dst + j / 2);
  return reduce_sum(vsum) + tail;
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Dropout (attnx/philox.h): one Philox block serves four consecutive keys of a row, and a row's blocks are
// generated together, round by round over arrays, so that the compiler vectorises them (32x32->64-bit
// multiplies are vpmuludq); a scalar loop over attnx::philox4x32_10 costs more than the attention itself.

// Elements per call of dropout_draws, and the Philox blocks that cover them at any alignment.
constexpr int64_t kDropoutChunk = 64;
constexpr int kDropoutBlocks = kDropoutChunk / 4 + 1;

// The dropout stream's draws of elements [e, e + n), n <= kDropoutChunk: returns u with u[j] the draw of
// element e + j, pointing into buf. attnx::dropout_block's Philox4x32-10 over the covering blocks, written
// out as structure-of-arrays rounds (tests check it bit for bit against the reference's Philox).
inline const uint32_t* dropout_draws(const AttentionParams& p, uint64_t e, int64_t n,
                                     uint32_t (&buf)[4 * kDropoutBlocks]) {
  uint32_t x[kDropoutBlocks], y[kDropoutBlocks], z[kDropoutBlocks], w[kDropoutBlocks];
  const uint64_t g0 = e >> 2;
  const int nb = static_cast<int>(((e + static_cast<uint64_t>(n) - 1) >> 2) - g0 + 1);
  for (int i = 0; i < nb; ++i) {
    const uint64_t g = g0 + static_cast<uint64_t>(i);
    x[i] = static_cast<uint32_t>(g);
    y[i] = static_cast<uint32_t>(g >> 32);
    z[i] = p.dropout_offset[0];
    w[i] = p.dropout_offset[1];
  }
  uint32_t k0 = p.dropout_seed[0], k1 = p.dropout_seed[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    for (int i = 0; i < nb; ++i) {
      const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * x[i];
      const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * z[i];
      const uint32_t nx = static_cast<uint32_t>(p1 >> 32) ^ y[i] ^ k0;
      const uint32_t nz = static_cast<uint32_t>(p0 >> 32) ^ w[i] ^ k1;
      y[i] = static_cast<uint32_t>(p1);
      w[i] = static_cast<uint32_t>(p0);
      x[i] = nx;
      z[i] = nz;
    }
  }
  for (int i = 0; i < nb; ++i) {
    buf[4 * i] = x[i];
    buf[4 * i + 1] = y[i];
    buf[4 * i + 2] = z[i];
    buf[4 * i + 3] = w[i];
  }
  return buf + (e & 3);
}

// Calls f(j0, m, u) for consecutive chunks [j0, j0 + m) of keys s0 .. s0 + n - 1 of the (B, H, L, S) row
// `row` = (b * H + h) * L + l, u[j] being the draw of key s0 + j0 + j.
template <typename F>
inline void for_each_dropout_chunk(const AttentionParams& p, int64_t row, int64_t s0, int64_t n, F&& f) {
  const uint64_t e = static_cast<uint64_t>(row) * static_cast<uint64_t>(p.kv_len) + static_cast<uint64_t>(s0);
  uint32_t buf[4 * kDropoutBlocks];
  for (int64_t j0 = 0; j0 < n; j0 += kDropoutChunk) {
    const int64_t m = std::min(kDropoutChunk, n - j0);
    f(j0, m, dropout_draws(p, e + static_cast<uint64_t>(j0), m, buf));
  }
}

// x[j] = kept ? x[j] * scale : 0 for the probabilities of keys [s0, s0 + n) of row `row`.
template <typename acc_t>
void dropout_row(const AttentionParams& p, int64_t row, int64_t s0, int64_t n, acc_t scale, acc_t* x) {
  const uint32_t threshold = p.dropout_threshold;
  for_each_dropout_chunk(p, row, s0, n, [&](int64_t j0, int64_t m, const uint32_t* u) {
    acc_t* xs = x + j0;
    for (int64_t j = 0; j < m; ++j) xs[j] = u[j] < threshold ? xs[j] * scale : acc_t(0);
  });
}

// f[j] = kept ? scale : 0 for keys [s0, s0 + n) of row `row`.
template <typename acc_t>
void dropout_factors(const AttentionParams& p, int64_t row, int64_t s0, int64_t n, acc_t scale, acc_t* f) {
  const uint32_t threshold = p.dropout_threshold;
  for_each_dropout_chunk(p, row, s0, n, [&](int64_t j0, int64_t m, const uint32_t* u) {
    acc_t* fs = f + j0;
    for (int64_t j = 0; j < m; ++j) fs[j] = u[j] < threshold ? scale : acc_t(0);
  });
}

template <typename acc_t>
void scale_row(acc_t* x, int64_t n, acc_t factor) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V vf(factor);
  int64_t j = 0;
  for (; j + W <= n; j += W) (V::loadu(x + j) * vf).store(x + j);
  for (; j < n; ++j) x[j] *= factor;
}

// ---------------------------------------------------------------------------------------------------------------
// Which keys rows see (attnx/key_range.h) and which kv head a query head reads.

// S_b: the valid keys of batch b, of the kv_len keys it stores.
inline int64_t batch_kv_len(const AttentionParams& p, const void* key_lengths, int64_t b, int64_t kv_len) {
  if (p.key_lengths_kind == kKeyLengthsNone) return kv_len;
  const int64_t i = b * p.key_lengths_stride;
  const int64_t n = p.key_lengths_kind == kKeyLengthsInt32
                        ? int64_t{static_cast<const int32_t*>(key_lengths)[i]}
                        : static_cast<const int64_t*>(key_lengths)[i];
  return range_kv_len(n, kv_len);
}

inline int64_t batch_kv_len(const AttentionParams& p, const void* key_lengths, int64_t b) {
  return batch_kv_len(p, key_lengths, b, p.kv_len);
}

// Where batch b's rows are: one (B, H, L, D) batch, or one packed sequence (AttentionParams::varlen). A tile
// never crosses a sequence: each is its own (1, H, q_len, D) problem, offset by q_begin and k_begin rows.
struct SeqRange {
  int64_t q_begin;  // its first query row (and row of out and lse): 0 without varlen
  int64_t q_len;    // L_b: its query rows
  int64_t k_begin;  // its first key (value) row: 0 without varlen, and with pages (the block table's)
  int64_t k_slot;   // the keys it stores: S, or cu_seqlens_k[b + 1] - cu_seqlens_k[b]
  int64_t kv_len;   // S_b: those it sees (k_slot cut to key_lengths[b])
};

inline SeqRange seq_range(const AttentionParams& p, const AttentionPointers& d, int64_t b) {
  if (p.varlen == 0) return {0, p.q_len, 0, p.kv_len, batch_kv_len(p, d.key_lengths, b)};
  const auto* cq = static_cast<const int32_t*>(d.cu_seqlens_q);
  const auto* ck = static_cast<const int32_t*>(d.cu_seqlens_k);
  const int64_t q0 = cq[b], k0 = ck[b], slot = int64_t{ck[b + 1]} - k0;
  return {q0, int64_t{cq[b + 1]} - q0, p.page_size > 0 ? 0 : k0, slot,
          batch_kv_len(p, d.key_lengths, b, slot)};
}

// Keys [begin, end): those that rows first .. last (inclusive) of a batch with q_len_b queries and kv_len_b
// valid keys see between them; for first == last, the keys of one row. Empty when begin >= end.
struct KeySpan {
  int64_t begin;
  int64_t end;
};

inline KeySpan row_keys(const AttentionParams& p, int64_t q_len_b, int64_t kv_len_b, int64_t first,
                        int64_t last) {
  return {range_key_begin(first, q_len_b, kv_len_b, p.window_left),
          range_key_end(last, q_len_b, kv_len_b, p.window_right, p.is_causal)};
}

// Rows [s0, s0 + n) of sequence b's paged keys (or values) run by run: f(src, m, j) for each run of m rows
// that are consecutive in one page, src its first row, j its first row's index in [0, n). Row s is row
// s % page_size of page block_table[b, s / page_size], so a tile is gathered page run by page run, never the
// cache. `base` points at the kv head's first page, `st` are the tensor's (page, head, row, column) strides.
template <typename scalar_t, typename F>
void for_each_page_run(const AttentionParams& p, const void* block_table, int64_t b, const scalar_t* base,
                       const int64_t* st, int64_t s0, int64_t n, F&& f) {
  const auto* table = static_cast<const int32_t*>(block_table) + b * p.block_table_stride[0];
  const int64_t ps = p.page_size;
  for (int64_t j = 0; j < n;) {
    const int64_t s = s0 + j, r = s % ps, m = std::min(n - j, ps - r);
    const int64_t page = table[(s / ps) * p.block_table_stride[1]];
    f(base + page * st[0] + r * st[2], m, j);
    j += m;
  }
}

// The paged rows [s0, s0 + n), converted into dst (n, cols) with leading dimension cols.
template <typename scalar_t, typename acc_t>
void gather_pages(const AttentionParams& p, const void* block_table, int64_t b, const scalar_t* base,
                  const int64_t* st, int64_t s0, int64_t n, int64_t cols, acc_t* dst) {
  for_each_page_run(p, block_table, b, base, st, s0, n, [&](const scalar_t* src, int64_t m, int64_t j) {
    pack_block(src, st[2], st[3], m, cols, acc_t(1), dst + j * cols, cols);
  });
}

// The kv head that query head h reads (grouped KV heads: a group of H / Hkv query heads shares one).
inline int64_t kv_head(const AttentionParams& p, int64_t h) {
  return h / (p.heads / p.kv_heads);
}

// ---------------------------------------------------------------------------------------------------------------
// The tiling plan and the per-thread scratch.

// The tiles of a plan for p: with a block-sparse mask, its blocks (cut at L and S, where a single block holds
// every row or key), so that a tile pair is one block and its class is one read; else `queries` by `keys`.
inline void tile_sizes(const AttentionParams& p, int64_t queries, int64_t keys, int64_t* bq, int64_t* bk) {
  if (p.has_block_map) {
    queries = p.block_q;
    keys = p.block_k;
  }
  *bq = std::clamp<int64_t>(p.q_len, 1, queries);
  *bk = std::clamp<int64_t>(p.kv_len, 1, keys);
}

// Sets the scores of a row's n keys whose bit is set in its block's bit row (words `stride` apart) to -inf:
// the keys a PARTIAL block masks out for that row.
template <typename acc_t>
void mask_out_bits(acc_t* row, const int32_t* words, int64_t stride, int64_t n) {
  for (int64_t w = 0; 32 * w < n; ++w) {
    uint32_t bits = static_cast<uint32_t>(words[w * stride]);
    if (n - 32 * w < 32) bits &= (uint32_t{1} << (n - 32 * w)) - 1;
    for (; bits != 0; bits &= bits - 1) {
      row[32 * w + __builtin_ctz(bits)] = -std::numeric_limits<acc_t>::infinity();
    }
  }
}

struct Plan {
  int64_t bq;        // query rows per tile
  int64_t bk;        // keys per tile
  int64_t q_tiles;   // ceil(L / bq)
  int64_t k_tiles;   // ceil(S / bk)
  int64_t block;     // query tiles per work item (see run_item)
  int64_t blocks;    // ceil(q_tiles / block): work items per (b, h)
  int64_t ld_s;      // row stride of the score tile and of the transposed key tile
  int64_t bh_m;      // attn_mask's distinct (b, h) pairs: B*H, H, B or 1 as its strides broadcast
  int64_t heads_m;   // attn_mask's distinct heads: H, or 1 when broadcast over heads
  bool mask_shared;  // attn_mask varies along L and several (b, h) share it
  int64_t group;     // > 1: grouped-KV decoding, the group's query heads stacked as the rows of one tile
};

Plan make_plan(const AttentionParams& p, size_t acc_size) {
  Plan plan{};
  const int64_t B = p.batch, H = p.heads, L = p.q_len, S = p.kv_len;
  const int64_t threads = num_threads();
  // A (bq, bk) tile of 128 queries by 512 keys: 512 keys keep the P V GEMM deep and the (bq, bk) scores
  // (256 KiB in fp32) in L2; 128 rows (rather than 256) waste less on tiles that causality cuts in two and
  // measured as fast without masks. Short sequences take one tile.
  tile_sizes(p, 128, 512, &plan.bq, &plan.bk);
  plan.q_tiles = (L + plan.bq - 1) / plan.bq;
  plan.k_tiles = (S + plan.bk - 1) / plan.bk;
  plan.heads_m = p.attn_mask_stride[1] == 0 ? 1 : H;
  plan.bh_m = (p.attn_mask_stride[0] == 0 ? 1 : B) * plan.heads_m;
  // A work item is `block` consecutive query tiles of one (b, h), whose transposed key tiles it shares: up to
  // 8 (1024 rows, whose packed queries and accumulators take 1024 * (D + Dv) * 4 bytes, 512 KiB at D = 64).
  // An attn_mask that varies along L but is shared by several (b, h) is re-read by each of them: items then
  // cover 512 rows and go out query-block first, so that the mask rows that consecutive items read (512 rows
  // by S) are still in cache. Blocks shrink until there are 4 items per thread, to balance the load (rows
  // under is_causal see different numbers of keys).
  plan.mask_shared = p.attn_mask_kind != kMaskNone && p.attn_mask_stride[2] != 0 && plan.bh_m < B * H;
  plan.block = plan.mask_shared ? 4 : 8;
  while (plan.block > 1 && B * H * ((plan.q_tiles + plan.block - 1) / plan.block) < 4 * threads) {
    plan.block /= 2;
  }
  plan.block = std::clamp<int64_t>(plan.block, 1, std::max<int64_t>(plan.q_tiles, 1));
  plan.blocks = (plan.q_tiles + plan.block - 1) / plan.block;
  // Whole 64-byte lines per row, and an odd number of them: a power-of-two row stride would map every row of
  // the tile onto the same cache sets.
  // Decoding (L = 1) with grouped KV heads: a work item is one (b, kv head), its tile the G = H / Hkv query
  // heads that share it, one row each, so that each key tile is read once per group instead of once per
  // query head (what SDPA's enable_gqa path does; run_group_item says how the rows meet it). Only
  // where nothing per head but the queries and out enters a row: no attn_mask (its rows are per head), no
  // dropout (its stream is per (b, h) row) and no block map (its blocks may be per head); sinks are per head
  // in write_rows, which is per head anyway. And only with at least one (b, kv head) per thread: fewer items
  // than threads would leave threads idle that per-head items keep busy.
  plan.group = 1;
  if (L == 1 && p.kv_heads > 0 && H > p.kv_heads && p.attn_mask_kind == kMaskNone && p.dropout == 0 &&
      p.varlen == 0 && !p.has_block_map && B * p.kv_heads >= threads) {
    plan.group = H / p.kv_heads;
    plan.bq = plan.group;
  }
  const int64_t line = 64 / static_cast<int64_t>(acc_size);
  int64_t lines = round_up(plan.bk, line) / line;
  if (lines % 2 == 0) ++lines;
  plan.ld_s = lines * line;
  return plan;
}

template <typename acc_t>
struct Scratch {
  AlignedBuffer<acc_t> storage;
  acc_t* q;          // (rows, D) the item's queries, pre-scaled
  acc_t* o;          // (rows, Dv) the item's output accumulators
  acc_t* k;          // (bk, D) key tile converted, when it cannot be transposed in place
  acc_t* kt;         // (D, ld_s) transposed key tile
  acc_t* v;          // (bk, Dv) value tile converted, when the GEMM cannot read it in place
  acc_t* s;          // (bq, ld_s) scores, then probabilities
  acc_t* row_bias;   // (bk,) one row's mask bias
  acc_t* tile_bias;  // (bk,) key padding bias, plus attn_mask's row when that is broadcast over queries
  acc_t* max_lanes;  // (bq, Vec size) the score product's row maxima (gemm.h's RowMax)
  SoftmaxRow<acc_t>* rows;  // (rows,) online-softmax state
  // With bfloat16 pairs (AttentionCpu::kPairs), the operands instead of q, k, kt and v (which are then
  // empty):
  AlignedBuffer<uint32_t> pair_storage;
  uint32_t* qp = nullptr;             // (rows, D2) the item's queries, unscaled (the score GEMM scales)
  uint32_t* kp = nullptr;             // (bk, D2) the key tile's rows
  uint32_t* ktp = nullptr;            // (D2, ld_s) the key tile transposed
  uint32_t* vp = nullptr;             // (ceil(bk / 2), Dv) the value tile's row pairs
  uint32_t* pp = nullptr;             // (bq, ld_p) a tile's probabilities, rounded
  AlignedBuffer<uint16_t> page_rows;  // (bk, max(D, Dv)) a paged tile's rows, gathered
  int64_t ld_p = 0;

  Scratch(const AttentionParams& p, const Plan& plan, bool pairs) {
    const int64_t D = p.head_dim, Dv = p.v_head_dim, bq = plan.bq, bk = plan.bk;
    const int64_t rows_n = bq * plan.block;
    const int64_t line = kLine<acc_t>;
    const int64_t dq = pairs ? 0 : D, dv = pairs ? 0 : Dv;
    constexpr int kRegions = 10;
    const int64_t sizes[kRegions] = {rows_n * dq, rows_n * Dv, bk * dq, dq * plan.ld_s,
                                     bk * dv,     bq * plan.ld_s, bk,   bk,
                                     2 * rows_n,  bq * Vec<acc_t>::size()};
    int64_t total = 0;
    for (int64_t n : sizes) total += round_up(n, line);
    storage = AlignedBuffer<acc_t>(total);
    acc_t* next = storage.data();
    acc_t* regions[kRegions];
    for (int i = 0; i < kRegions; ++i) {
      regions[i] = next;
      next += round_up(sizes[i], line);
    }
    q = regions[0], o = regions[1], k = regions[2], kt = regions[3], v = regions[4], s = regions[5];
    row_bias = regions[6], tile_bias = regions[7];
    static_assert(sizeof(SoftmaxRow<acc_t>) == 2 * sizeof(acc_t), "SoftmaxRow must be two accumulators");
    rows = reinterpret_cast<SoftmaxRow<acc_t>*>(regions[8]);
    max_lanes = regions[9];
    if (!pairs) return;
    const int64_t D2 = (D + 1) / 2, bk2 = (bk + 1) / 2;
    ld_p = round_up(bk2, 16);
    const int64_t pair_sizes[5] = {rows_n * D2, bk * D2, D2 * plan.ld_s, bk2 * Dv, bq * ld_p};
    int64_t pair_total = 0;
    for (int64_t n : pair_sizes) pair_total += round_up(n, 16);
    pair_storage = AlignedBuffer<uint32_t>(pair_total);
    uint32_t* at = pair_storage.data();
    uint32_t** pair_regions[5] = {&qp, &kp, &ktp, &vp, &pp};
    for (int i = 0; i < 5; ++i) {
      *pair_regions[i] = at;
      at += round_up(pair_sizes[i], 16);
    }
    if (p.page_size > 0) page_rows = AlignedBuffer<uint16_t>(bk * std::max(D, Dv));
  }
};

// The tiles that the masks remove entirely, found once per call so that a kernel skips them without reading
// the masks again: key tile kt of batch b under key_padding_mask, and the (query tile qt, key tile kt) pair
// of attn_mask's (b, h) slice (tiles above the causal diagonal included). Computed once per distinct mask
// slice: an (L, S) mask is scanned once for all (b, h), each scan stopping at the tile's first unmasked
// element. The forward and the backward kernels tile alike (Plan / BackwardPlan: bq, bk, q_tiles, k_tiles,
// bh_m, heads_m) and share it. Memory: O(B * S / bk) and O(mask slices * tiles) flags.
template <typename acc_t>
class TileSkipFlags {
 public:
  TileSkipFlags() = default;

  template <typename Plan>
  TileSkipFlags(const AttentionParams& p, const void* attn_mask, const void* key_padding_mask,
                const void* block_map, const void* block_bits, const Plan& plan)
      : q_tiles_(plan.q_tiles),
        k_tiles_(plan.k_tiles),
        heads_m_(plan.heads_m),
        mask_batch_broadcast_(p.attn_mask_stride[0] == 0),
        block_map_(p.has_block_map ? static_cast<const int32_t*>(block_map) : nullptr),
        block_bits_(static_cast<const int32_t*>(block_bits)) {
    std::copy(p.block_map_stride, p.block_map_stride + 4, block_map_stride_);
    std::copy(p.block_bits_stride, p.block_bits_stride + 3, block_bits_stride_);
    const int64_t L = p.q_len, S = p.kv_len, bq = plan.bq, bk = plan.bk, qt_n = plan.q_tiles,
                  kt_n = plan.k_tiles;
    if (p.key_padding_mask_kind != kMaskNone) {
      padding_storage_ = AlignedBuffer<bool>(p.batch * kt_n);
      bool* flags = padding_storage_.data();
      const int64_t* st = p.key_padding_mask_stride;
      visit_mask(p.key_padding_mask_kind, key_padding_mask, [&](auto m) {
        for (int64_t b = 0; b < p.batch; ++b) {
          for (int64_t kt = 0; kt < kt_n; ++kt) {
            const int64_t k0 = kt * bk;
            flags[b * kt_n + kt] =
                block_masked<acc_t>(m + b * st[0] + k0 * st[1], 0, st[1], 1, std::min(bk, S - k0));
          }
        }
      });
      padding_ = flags;
    }
    if (p.attn_mask_kind != kMaskNone) {
      mask_storage_ = AlignedBuffer<bool>(plan.bh_m * qt_n * kt_n);
      bool* flags = mask_storage_.data();
      const int64_t* st = p.attn_mask_stride;
      visit_mask(p.attn_mask_kind, attn_mask, [&](auto m) {
        parallel_for(0, plan.bh_m * qt_n, 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t bh = i / qt_n, qt = i % qt_n;
            const int64_t b = bh / plan.heads_m, h = bh % plan.heads_m;
            const int64_t q0 = qt * bq, nq = std::min(bq, L - q0);
            for (int64_t kt = 0; kt < kt_n; ++kt) {
              const int64_t k0 = kt * bk;
              bool masked = p.is_causal && k0 > q0 + nq - 1;
              if (!masked) {
                masked = block_masked<acc_t>(m + b * st[0] + h * st[1] + q0 * st[2] + k0 * st[3], st[2],
                                             st[3], nq, std::min(bk, S - k0));
              }
              flags[i * kt_n + kt] = masked;
            }
          }
        });
      });
      mask_ = flags;
    }
  }

  // key_padding_mask removes every key of tile kt in batch b.
  bool padding_skips(int64_t b, int64_t kt) const { return padding_ && padding_[b * k_tiles_ + kt]; }

  // attn_mask removes every (query, key) pair of tile pair (qt, kt) of head (b, h).
  bool mask_skips(int64_t b, int64_t h, int64_t qt, int64_t kt) const {
    if (!mask_) return false;
    const int64_t bh_m = (mask_batch_broadcast_ ? 0 : b) * heads_m_ + (heads_m_ == 1 ? 0 : h);
    return mask_[(bh_m * q_tiles_ + qt) * k_tiles_ + kt];
  }

  // The block-sparse mask's entry for tile pair (qt, kt) of head (b, h), whose tiles are its blocks (the
  // plans make them so): kBlockEmpty, kBlockFull (also without a block map) or an index into block_bits.
  int32_t block_class(int64_t b, int64_t h, int64_t qt, int64_t kt) const {
    if (!block_map_) return kBlockFull;
    const int64_t* st = block_map_stride_;
    return block_map_[b * st[0] + h * st[1] + qt * st[2] + kt * st[3]];
  }

  // Row r of the bit rows block_bits[index] (bit set: key masked out); words block_bits_word_stride() apart.
  const int32_t* block_bits_row(int32_t index, int64_t r) const {
    return block_bits_ + index * block_bits_stride_[0] + r * block_bits_stride_[1];
  }
  int64_t block_bits_word_stride() const { return block_bits_stride_[2]; }

 private:
  AlignedBuffer<bool> padding_storage_, mask_storage_;
  const bool* padding_ = nullptr;  // null without key_padding_mask
  const bool* mask_ = nullptr;     // null without attn_mask
  int64_t q_tiles_ = 0, k_tiles_ = 0, heads_m_ = 1;
  bool mask_batch_broadcast_ = false;
  const int32_t* block_map_ = nullptr;  // null without a block map
  const int32_t* block_bits_ = nullptr;
  int64_t block_map_stride_[4] = {}, block_bits_stride_[3] = {};
};

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

template <typename scalar_t>
class AttentionCpu {
 public:
  using acc_t = typename AccType<scalar_t>::type;
  // bfloat16 inputs multiplied as pairs where the TU has the products (dot16.h): queries, keys and values
  // keep their bits, P is rounded to bfloat16 for P V, scores and accumulators are float32.
  static constexpr bool kPairs = kDotBf16 && std::is_same_v<scalar_t, torch::headeronly::BFloat16>;
  using op_t = std::conditional_t<kPairs, uint32_t, acc_t>;  // the tile GEMMs' operand elements

  AttentionCpu(const AttentionParams& p, const AttentionPointers& d)
      : p_(p),
        d_(d),
        plan_(make_plan(p, sizeof(acc_t))),
        scale_(split_value<acc_t>(p.scale, p.scale_lo)),
        dropout_scale_(split_value<acc_t>(p.dropout_scale, p.dropout_scale_lo)),
        softcap_(split_value<acc_t>(p.softcap, p.softcap_lo)) {}

  void run() {
    const int64_t B = p_.batch, H = p_.heads;
    const int64_t items = plan_.group > 1 ? B * p_.kv_heads : B * H * plan_.blocks;
    if (items == 0) return;
    skip_ = TileSkipFlags<acc_t>(p_, d_.attn_mask, d_.key_padding_mask, d_.block_map, d_.block_bits, plan_);

    // Items are handed out one at a time from a shared counter. Under is_causal the last query blocks see
    // the most keys: they go first, so that the short ones fill in at the end. A shared mask orders items
    // query-block first (see make_plan); otherwise a (b, h)'s blocks follow each other.
    std::atomic<int64_t> next{0};
    const int64_t threads = std::min<int64_t>(num_threads(), items);
    parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      Scratch<acc_t> ws(p_, plan_, kPairs);
      for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
        if (plan_.group > 1) {
          run_group_item(i / p_.kv_heads, i % p_.kv_heads, ws);
          continue;
        }
        int64_t bh, blk;
        if (p_.is_causal) {
          blk = plan_.blocks - 1 - i / (B * H);
          bh = i % (B * H);
        } else if (plan_.mask_shared) {
          blk = i / (B * H);
          bh = i % (B * H);
        } else {
          bh = i / plan_.blocks;
          blk = i % plan_.blocks;
        }
        run_item(bh / H, bh % H, blk, ws);
      }
    });
  }

 private:
  bool tile_skipped(int64_t b, int64_t h, int64_t qt, int64_t kt) const {
    return skip_.padding_skips(b, kt) || skip_.mask_skips(b, h, qt, kt) ||
           skip_.block_class(b, h, qt, kt) == kBlockEmpty;
  }

  // The key padding bias of keys [k0, k0 + nk) of batch b into ws.tile_bias, plus attn_mask's row when that
  // is the same for every query. Returns the bias that every row of the tile shares, or null.
  const acc_t* shared_bias(int64_t b, int64_t h, int64_t k0, int64_t nk, Scratch<acc_t>& ws) const {
    const bool padding = p_.key_padding_mask_kind != kMaskNone;
    const bool mask_row_shared = p_.attn_mask_kind != kMaskNone && p_.attn_mask_stride[2] == 0;
    if (!padding && !mask_row_shared) return nullptr;
    if (padding) {
      const int64_t* st = p_.key_padding_mask_stride;
      visit_mask(p_.key_padding_mask_kind, d_.key_padding_mask, [&](auto m) {
        mask_to_bias<acc_t>(m + b * st[0] + k0 * st[1], st[1], nk, nullptr, ws.tile_bias);
      });
    }
    if (mask_row_shared) {
      // The reference adds attn_mask before key_padding_mask; so does this, to round alike.
      const int64_t* st = p_.attn_mask_stride;
      visit_mask(p_.attn_mask_kind, d_.attn_mask, [&](auto m) {
        mask_to_bias<acc_t>(m + b * st[0] + h * st[1] + k0 * st[3], st[3], nk,
                            padding ? ws.tile_bias : nullptr, ws.tile_bias);
      });
    }
    return ws.tile_bias;
  }

  // Query tiles [blk * block, ...) of (b, h). The loop over key tiles is outside the loop over query tiles:
  // each key tile is transposed (and value tile converted) once for up to `block` query tiles, and stays in
  // cache while they use it; the queries and accumulators of the block stay in L2. Only the key tiles that
  // the block's key range reaches are visited (is_causal, key lengths, the window: a window of w keys costs
  // O(w), not O(S), per row).
  void run_item(int64_t b, int64_t h, int64_t blk, Scratch<acc_t>& ws) {
    const SeqRange seq = seq_range(p_, d_, b);
    const int64_t L = seq.q_len, Dv = p_.v_head_dim;
    const int64_t bq = plan_.bq;
    // Blocks past a shorter sequence's queries are empty (plan_.q_tiles is the longest sequence's).
    const int64_t qt_begin = blk * plan_.block, qt_end = std::min((L + bq - 1) / bq, qt_begin + plan_.block);
    if (qt_begin >= qt_end) return;
    const int64_t r0 = qt_begin * bq, rows_n = std::min(L, qt_end * bq) - r0;  // the item's query rows
    const int64_t *qs = p_.q_stride, *ks = p_.k_stride, *vs = p_.v_stride;
    const bool mask_rows = p_.attn_mask_kind != kMaskNone && p_.attn_mask_stride[2] != 0;
    const bool paged = p_.page_size > 0;
    const int64_t hk = kv_head(p_, h);
    const int64_t kv_len_b = seq.kv_len;

    const auto* q =
        static_cast<const scalar_t*>(d_.query) + b * qs[0] + h * qs[1] + (seq.q_begin + r0) * qs[2];
    // Paged: the kv head's rows in page 0, indexed per page by gather_pages.
    const auto* k =
        static_cast<const scalar_t*>(d_.key) + (paged ? 0 : b * ks[0]) + hk * ks[1] + seq.k_begin * ks[2];
    const auto* v =
        static_cast<const scalar_t*>(d_.value) + (paged ? 0 : b * vs[0]) + hk * vs[1] + seq.k_begin * vs[2];
    pack_queries(q, qs[2], qs[3], rows_n, ws);
    for (int64_t i = 0; i < rows_n; ++i) ws.rows[i] = softmax_row_init<acc_t>();
    // Zeroed accumulators let every P V GEMM accumulate, whichever tiles a row skips.
    std::fill_n(ws.o, rows_n * Dv, acc_t(0));

    // A single query row (decoding) reads the keys row by row instead of transposing them: its scores are
    // the dot products of q with each key (dot_rows).
    const bool single_row = rows_n == 1;
    const KeySpan block_keys = row_keys(p_, L, kv_len_b, r0, r0 + rows_n - 1);
    for (int64_t kt = block_keys.begin / plan_.bk, k0 = kt * plan_.bk; k0 < block_keys.end;
         ++kt, k0 += plan_.bk) {
      // Keys past the block's range are outside every row's: the tile is cut there.
      const int64_t nk = std::min(plan_.bk, block_keys.end - k0);
      bool loaded = false;  // ka, va and `shared` hold this key tile
      Operand<op_t> ka{}, va{};
      const acc_t* shared = nullptr;
      for (int64_t qt = qt_begin; qt < qt_end; ++qt) {
        const int64_t q0 = qt * bq, nq = std::min(bq, L - q0);
        const KeySpan tile_keys = row_keys(p_, L, kv_len_b, q0, q0 + nq - 1);
        if (tile_keys.end <= k0 || tile_keys.begin >= k0 + nk || tile_skipped(b, h, qt, kt)) continue;
        const int64_t nk_q = std::min(nk, tile_keys.end - k0);
        if (!loaded) {
          load_tile(b, k, v, k0, nk, single_row, ws, ka, va);
          shared = shared_bias(b, h, k0, nk, ws);
          loaded = true;
        }
        const int32_t block = skip_.block_class(b, h, qt, kt);
        process_tile(b, h, q0 - r0, q0, nq, k0, nk_q, L, kv_len_b, ka, single_row, va, shared, ws, mask_rows,
                     block >= 0 ? block : kBlockFull);
      }
    }
    for (int64_t qt = qt_begin; qt < qt_end; ++qt) {
      const int64_t q0 = qt * bq;
      write_rows(b, h, q0 - r0, seq.q_begin + q0, std::min(bq, L - q0), ws);
    }
  }

  // Grouped-KV decoding (Plan::group): the single query row of the G query heads of kv head hk, batch b, as
  // the G rows of one tile. Each key tile is transposed once for the group; every row sees the same keys
  // (one query position), so the rows differ only in their queries.
  void run_group_item(int64_t b, int64_t hk, Scratch<acc_t>& ws) {
    const int64_t G = plan_.group, Dv = p_.v_head_dim;
    const SeqRange seq = seq_range(p_, d_, b);
    const int64_t L = seq.q_len, kv_len_b = seq.kv_len, h0 = hk * G;
    if (L <= 0) return;
    const int64_t *qs = p_.q_stride, *ks = p_.k_stride, *vs = p_.v_stride;
    const bool paged = p_.page_size > 0;
    const auto* q = static_cast<const scalar_t*>(d_.query) + b * qs[0] + seq.q_begin * qs[2];
    const auto* k =
        static_cast<const scalar_t*>(d_.key) + (paged ? 0 : b * ks[0]) + hk * ks[1] + seq.k_begin * ks[2];
    const auto* v =
        static_cast<const scalar_t*>(d_.value) + (paged ? 0 : b * vs[0]) + hk * vs[1] + seq.k_begin * vs[2];
    // Row g is query head h0 + g: the heads' rows are qs[1] apart.
    pack_queries(q + h0 * qs[1], qs[1], qs[3], G, ws);
    for (int64_t g = 0; g < G; ++g) ws.rows[g] = softmax_row_init<acc_t>();
    std::fill_n(ws.o, G * Dv, acc_t(0));
    const KeySpan keys = row_keys(p_, L, kv_len_b, 0, 0);
    // A few heads of a 16-bit type score the key rows where they lie, as one query row does (dot_rows: the
    // tile is neither converted and transposed nor packed, which costs more than a few rows' products); more
    // heads, and float32, share one transposed tile in a GEMM (on AMX tiles for bfloat16 there). Measured at
    // D = 128 (a 2-core Xeon with AMX), in place against the GEMM: bfloat16 1.4-2.2x faster at 4 heads and
    // 1.1x at 8, float16 1.0-1.1x; float32 0.9-1.15x by the keys' layout; 16 and 32 heads 1.1-2.1x slower.
    const bool keys_as_rows = sizeof(scalar_t) == 2 && G <= 8;
    for (int64_t kt = keys.begin / plan_.bk, k0 = kt * plan_.bk; k0 < keys.end; ++kt, k0 += plan_.bk) {
      const int64_t nk = std::min(plan_.bk, keys.end - k0);
      if (skip_.padding_skips(b, kt)) continue;
      Operand<op_t> ka{}, va{};
      load_tile(b, k, v, k0, nk, keys_as_rows, ws, ka, va);
      const acc_t* shared = shared_bias(b, h0, k0, nk, ws);
      process_tile(b, h0, 0, 0, G, k0, nk, L, kv_len_b, ka, keys_as_rows, va, shared, ws, false, kBlockFull,
                   /*heads_as_rows=*/true);
    }
    for (int64_t g = 0; g < G; ++g) write_rows(b, h0 + g, g, seq.q_begin, 1, ws);
  }

  // Rows [q0, q0 + nq) (at offset i0 in the item's scratch) against keys [k0, k0 + nk): ka holds the keys
  // transposed (D, nk), or as (nk, D) rows when keys_as_rows (one query row, or a few heads' rows); va the
  // values; `shared` the bias common to all rows (see shared_bias); block: the index of the tile's bit rows
  // in block_bits when the block-sparse mask makes it PARTIAL, else kBlockFull. heads_as_rows: the rows are
  // query position q0 of nq consecutive heads from h (run_group_item), without per-head masks or dropout.
  void process_tile(int64_t b, int64_t h, int64_t i0, int64_t q0, int64_t nq, int64_t k0, int64_t nk,
                    int64_t q_len_b, int64_t kv_len_b, const Operand<op_t>& ka, bool keys_as_rows,
                    const Operand<op_t>& va, const acc_t* shared, Scratch<acc_t>& ws, bool mask_rows,
                    int32_t block, bool heads_as_rows = false) {
    const int64_t D = p_.head_dim, Dv = p_.v_head_dim, lds = plan_.ld_s;
    acc_t* s = ws.s;
    // The score product also gives the rows' maxima while its blocks are in cache (gemm.h's RowMax) when
    // nothing changes the scores before the max: no soft-cap, mask bias or block bits. A row whose key range
    // is not the whole tile takes its max itself, below.
    const bool product_max = std::is_same_v<acc_t, float> && D > 0 && !keys_as_rows && softcap_ == acc_t(0) &&
                             block < 0 && !mask_rows && shared == nullptr;
    acc_t* const row_max = product_max ? ws.max_lanes : nullptr;
    // S (nq, nk) = (scale Q) K^T.
    if constexpr (kPairs) {
      const int64_t D2 = (D + 1) / 2;
      if (D > 0 && keys_as_rows) {
        for (int64_t i = 0; i < nq; ++i)
          dot_rows_pairs(ws.qp + (i0 + i) * D2, ka.ptr, ka.ld, nk, D2, scale_, s + i * lds);
      } else if (D > 0) {
        gemm_pairs(nq, nk, D2, ws.qp + i0 * D2, D2, ka.ptr, ka.ld, s, lds, /*add_c=*/false, scale_, row_max);
      }
    } else if (D > 0 && keys_as_rows) {
      for (int64_t i = 0; i < nq; ++i) dot_rows(ws.q + (i0 + i) * D, ka.ptr, ka.ld, nk, D, s + i * lds);
    } else if (D > 0) {
      tile_gemm(nq, nk, D, ws.q + i0 * D, D, ka.ptr, ka.ld, s, lds, /*add_c=*/false, row_max);
    }
    if (D == 0) {
      for (int64_t i = 0; i < nq; ++i) std::fill_n(s + i * lds, nk, acc_t(0) * scale_);
    }

    for (int64_t i = 0; i < nq; ++i) {
      acc_t* row = s + i * lds;
      if (softcap_ > acc_t(0)) softcap_row(row, nk, softcap_);
      if (block >= 0) mask_out_bits(row, skip_.block_bits_row(block, i), skip_.block_bits_word_stride(), nk);
      const acc_t* bias = shared;
      if (mask_rows) {
        const int64_t* st = p_.attn_mask_stride;
        visit_mask(p_.attn_mask_kind, d_.attn_mask, [&](auto m) {
          mask_to_bias<acc_t>(m + b * st[0] + h * st[1] + (q0 + i) * st[2] + k0 * st[3], st[3], nk, shared,
                              ws.row_bias);
        });
        bias = ws.row_bias;
      }
      const int64_t l = heads_as_rows ? q0 : q0 + i;
      const KeySpan keys = row_keys(p_, q_len_b, kv_len_b, l, l);
      const int64_t hi = std::clamp<int64_t>(keys.end - k0, 0, nk);
      const int64_t lo = std::clamp<int64_t>(keys.begin - k0, 0, hi);
      const acc_t tile_max = row_max && lo == 0 && hi == nk
                                 ? reduce_max(Vec<acc_t>::loadu(row_max + i * Vec<acc_t>::size()))
                                 : add_bias_and_max(row, bias, lo, hi, nk);
      SoftmaxRow<acc_t>& state = ws.rows[i0 + i];
      const SoftmaxStep<acc_t> step = softmax_step(state, tile_max);
      acc_t tile_sum;
      if constexpr (kPairs) {
        // P rounded for P V in the same pass, unless dropout changes it after.
        tile_sum = p_.dropout ? exp_and_sum(row, nk, step.base)
                              : exp_sum_pairs(row, nk, step.base, ws.pp + i * ws.ld_p);
      } else {
        tile_sum = exp_and_sum(row, nk, step.base);
      }
      state = softmax_advance(state, step, tile_sum);
      if (step.alpha != acc_t(1)) scale_row(ws.o + (i0 + i) * Dv, Dv, step.alpha);
      // Dropout after the row sum: the softmax normalises by the undropped mass (lse is undropped), and only
      // the probabilities that multiply V are dropped and rescaled.
      if (p_.dropout) dropout_row(p_, (b * p_.heads + h) * p_.q_len + q0 + i, k0, nk, dropout_scale_, row);
    }

    // O (nq, Dv) += P V.
    if constexpr (kPairs) {
      if (Dv > 0)
        pv_pairs(s, lds, nq, nk, va.ptr, va.ld, Dv, ws.pp, ws.ld_p, !p_.dropout, ws.o + i0 * Dv, Dv);
    } else if (Dv > 0) {
      tile_gemm(nq, Dv, nk, s, lds, va.ptr, va.ld, ws.o + i0 * Dv, Dv, /*add_c=*/true);
    }
  }

  // The item's rows (rows, D) of the queries at q (row and column strides rs, cs) as the score GEMM's A
  // operand: pre-scaled float (the scale goes into the queries once, instead of into every score), or
  // unscaled pairs (the pair GEMM scales its result: a scaled query would be rounded to bfloat16).
  void pack_queries(const scalar_t* q, int64_t rs, int64_t cs, int64_t rows, Scratch<acc_t>& ws) const {
    if constexpr (kPairs) {
      pack_pairs(q, rs, cs, rows, p_.head_dim, ws.qp, (p_.head_dim + 1) / 2);
    } else {
      pack_block(q, rs, cs, rows, p_.head_dim, scale_, ws.q, p_.head_dim);
    }
  }

  // Keys [k0, k0 + nk) of batch b at k (the kv head's first row, or first page row when paged) and their
  // values at v, as the tile GEMMs' B operands: the keys transposed (D, nk) or, when keys_as_rows, as (nk, D)
  // rows; values (nk, Dv). Read in place where the GEMM can, else converted (or, with kPairs, paired) into
  // ws; a paged tile is gathered through the block table.
  void load_tile(int64_t b, const scalar_t* k, const scalar_t* v, int64_t k0, int64_t nk, bool keys_as_rows,
                 Scratch<acc_t>& ws, Operand<op_t>& ka, Operand<op_t>& va) const {
    const int64_t D = p_.head_dim, Dv = p_.v_head_dim, lds = plan_.ld_s;
    const int64_t *ks = p_.k_stride, *vs = p_.v_stride;
    const bool paged = p_.page_size > 0;
    // Key rows (nk, cols) gathered or packed in scratch as the score product's operand: as they are, or
    // transposed into kt.
    const auto key_operand = [&](op_t* rows, int64_t cols, op_t* kt) -> Operand<op_t> {
      if (keys_as_rows) return {rows, cols};
      transpose(rows, cols, kt, lds, nk, cols);
      return {kt, lds};
    };
    if constexpr (kPairs) {
      const int64_t D2 = (D + 1) / 2;
      const scalar_t* const rows = paged ? k : k + k0 * ks[2];  // unpaged: the tile's first key row
      if (D > 0 && !paged && D % 2 == 0 && ks[3] == 1 && ks[2] % 2 == 0 &&
          reinterpret_cast<uintptr_t>(rows) % sizeof(uint32_t) == 0) {
        // Key rows of an even number of contiguous elements, each starting on a 4-byte boundary, are pairs
        // in memory already (pack_pairs's layout, the lower element in the low half): read in place by
        // decoding, transposed straight from the input otherwise, not copied first.
        const auto* pairs = reinterpret_cast<const uint32_t*>(rows);
        if (keys_as_rows) {
          ka = {pairs, ks[2] / 2};
        } else {
          transpose(pairs, ks[2] / 2, ws.ktp, lds, nk, D2);
          ka = {ws.ktp, lds};
        }
      } else if (D > 0) {
        if (paged) {
          for_each_page_run(p_, d_.block_table, b, k, ks, k0, nk,
                            [&](const scalar_t* src, int64_t m, int64_t j) {
                              pack_pairs(src, ks[2], ks[3], m, D, ws.kp + j * D2, D2);
                            });
        } else {
          pack_pairs(rows, ks[2], ks[3], nk, D, ws.kp, D2);
        }
        ka = key_operand(ws.kp, D2, ws.ktp);
      }
      if (Dv > 0) {
        if (paged) {
          // A pair of rows may straddle two pages: the rows are gathered first.
          uint16_t* rows = ws.page_rows.data();
          for_each_page_run(p_, d_.block_table, b, v, vs, k0, nk,
                            [&](const scalar_t* src, int64_t m, int64_t j) {
                              for (int64_t r = 0; r < m; ++r) {
                                for (int64_t c = 0; c < Dv; ++c)
                                  rows[(j + r) * Dv + c] = src[r * vs[2] + c * vs[3]].x;
                              }
                            });
          pack_row_pairs(rows, Dv, 1, nk, Dv, ws.vp, Dv);
        } else {
          pack_row_pairs(v + k0 * vs[2], vs[2], vs[3], nk, Dv, ws.vp, Dv);
        }
        va = {ws.vp, Dv};
      }
    } else if (paged) {
      if (D > 0) {
        gather_pages(p_, d_.block_table, b, k, ks, k0, nk, D, ws.k);
        ka = key_operand(ws.k, D, ws.kt);
      }
      if (Dv > 0) {
        gather_pages(p_, d_.block_table, b, v, vs, k0, nk, Dv, ws.v);
        va = {ws.v, Dv};
      }
    } else {
      if (D > 0 && keys_as_rows) {
        ka = b_operand(k + k0 * ks[2], ks[2], ks[3], nk, D, ws.k);
      } else if (D > 0) {
        transpose_keys(k + k0 * ks[2], ks[2], ks[3], nk, D, ws.k, ws.kt, lds);
        ka = {ws.kt, lds};
      }
      if (Dv > 0) va = b_operand(v + k0 * vs[2], vs[2], vs[3], nk, Dv, ws.v);
    }
  }

  // Rows [q0, q0 + nq) of out and lse (rows of the packed tensors with varlen), from the item's scratch at
  // offset i0.
  void write_rows(int64_t b, int64_t h, int64_t i0, int64_t q0, int64_t nq, Scratch<acc_t>& ws) const {
    const int64_t Dv = p_.v_head_dim;
    const int64_t *os = p_.out_stride, *ls = p_.lse_stride;
    auto* out = static_cast<scalar_t*>(d_.out) + b * os[0] + h * os[1];
    auto* lse = static_cast<acc_t*>(d_.lse) + b * ls[0] + h * ls[1];
    const bool sink = p_.has_sinks != 0;
    const acc_t sink_logit = sink ? static_cast<const acc_t*>(d_.sinks)[h] : acc_t(0);
    for (int64_t i = 0; i < nq; ++i) {
      const SoftmaxRow<acc_t> row = ws.rows[i0 + i];
      const int64_t l = q0 + i;
      lse[l * ls[2]] = sink ? softmax_lse_sink(row, sink_logit) : softmax_lse(row);
      scalar_t* dst = out + l * os[2];
      if (softmax_row_empty(row)) {
        // Every key masked: out is 0 (written as such: a NaN or inf value times p = 0 may sit in ws.o).
        for (int64_t j = 0; j < Dv; ++j) dst[j * os[3]] = scalar_t(0);
        continue;
      }
      acc_t* o = ws.o + (i0 + i) * Dv;
      scale_row(o, Dv, sink ? softmax_out_scale_sink(row, sink_logit) : softmax_out_scale(row));
      for (int64_t j = 0; j < Dv; ++j) dst[j * os[3]] = static_cast<scalar_t>(o[j]);
    }
  }

  const AttentionParams& p_;
  const AttentionPointers& d_;
  Plan plan_;
  const acc_t scale_;
  const acc_t dropout_scale_;  // 1 / (1 - p) when p_.dropout
  const acc_t softcap_;        // 0: no soft-capping
  TileSkipFlags<acc_t> skip_;
};

}  // namespace

void attention_kernel(const AttentionParams& p, const AttentionPointers& ptr,
                      torch::headeronly::ScalarType dtype) {
#if ATTNX_DOT_BF16 == 2
  // The emulation differs from DEFAULT in bfloat16's products alone: the other dtypes run DEFAULT's kernels,
  // which this unit then does not compile again.
  if (dtype != torch::headeronly::ScalarType::BFloat16) return DEFAULT::attention_kernel(p, ptr, dtype);
  AttentionCpu<torch::headeronly::BFloat16>(p, ptr).run();
#else
  dispatch_float_types(dtype, "attnx::attention",
                       [&](auto tag) { AttentionCpu<decltype(tag)>(p, ptr).run(); });
#endif
}

}  // namespace CPU_CAPABILITY
}  // namespace attnx::cpu
