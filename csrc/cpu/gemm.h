// attnx: the CPU kernels' tile GEMMs: row-major C (M, N) (+)= A (M, K) @ B (K, N) with leading dimensions,
// on register-blocked micro-kernels over vec.h's Vec<float>. Header-only and torch-free; included after
// vec.h and dot16.h, in the same CPU_CAPABILITY namespace.
//
// The tiles are small (M, N, K of 64..512: the forward's (bq, bk) scores against D, the backward's (bk, bq)
// tiles) and their operands already sit in cache, so there is no packing: a micro-kernel keeps an
// (MR, NV vectors) block of C in registers and, for each k, loads NV vectors of B's row k and broadcasts MR
// elements of A's column k. Columns are the outer loop, so a (K, NV vectors) panel of B stays in L1 while it
// meets every row block of A; K is cut into kKc-deep slices so that the panel fits L1 for deep products too
// (the forward's P V, K = 512). Edges: row blocks of 1..MR rows, column blocks of 1..NV vectors whose last
// vector is masked. Blocking per ISA (32 zmm registers for AVX-512, 16 ymm for AVX2), as rows x vectors:
//   AVX-512: 6 x 4, 8 x 3, 12 x 2 (24 accumulators, plus the B vectors and a broadcast: <= 29 registers),
//            4 x 1 (one B vector per row broadcast: more rows only add broadcasts, measured slower at a
//            head dim of 8);  AVX2: 6 x 2, 6 x 1 (12);  portable (16-byte vectors): 6 x 2, 6 x 1 (12).
// The row count grows as the column block narrows, so that a narrow block (a head dim of 40 is 3 vectors, the
// last masked) still keeps 24 accumulators busy, and each loaded B vector serves as many rows as registers
// allow: the B panel is re-read once per row block, so more rows per block mean fewer loads per FMA. Each
// element of C still accumulates over k in order from 0 (or from C), so the blocking never changes a result.
//
// One driver serves two kinds of product (a Product below): float32 elements (FloatProduct: a step of the
// depth is one k, an FMA per lane) and, where the TU has them (dot16.h), bfloat16 pairs (PairProduct: a step
// is two k, A's element a pair and B's row k the (k, k + 1) pairs of its columns, one vdpbf16ps per lane).
// In the amx_bf16 and emulated_amx variants, the pair products run on AMX tiles instead (tiles.h).
#pragma once

#ifndef CPU_CAPABILITY
#error "gemm.h is included by a kernel TU that defines CPU_CAPABILITY"
#endif

namespace attnx::cpu {
namespace CPU_CAPABILITY {
namespace gemm_detail {

#if defined(ATTNX_VEC_AVX512)
constexpr int kNv = 4;
// Rows per micro-kernel for a column block of NV vectors (see the header comment).
constexpr int mr_for(int nv) {
  return nv >= 4 ? 6 : nv == 3 ? 8 : nv == 2 ? 12 : 4;
}
#elif defined(ATTNX_VEC_AVX2)
constexpr int kNv = 2;
constexpr int mr_for(int) {
  return 6;
}
#else
constexpr int kNv = 2;
constexpr int mr_for(int) {
  return 6;
}
#endif
// Depth of one pass over a B panel: 128 rows of 64 floats are 32 KiB, which leaves room in a 48 KiB L1 for
// the A rows that meet it (256-deep slices, 64 KiB, measured slower on the forward's P V at K = 512); a
// product of depth < 2 kKc is not cut.
constexpr int64_t kKc = 128;

// RowMax: a product may also give the maxima of its result's rows, taken while each block of C is still in
// registers or L1, so that the softmax does not read the scores again for them (its row max, when nothing is
// added to the scores first). row_max is (M, W) floats, W = Vec<float>::size(): the product sets a row's W
// lanes to the maxima of the row's values (after alpha) in each lane position, NaN-propagating (maximum);
// the row's max is reduce_max of its lanes. Unused lanes hold -inf.
constexpr float kRowMaxFill = -std::numeric_limits<float>::infinity();

// What a micro-kernel multiplies: per step of the depth, A's element (a_t, broadcast to every lane once per
// row) times a vector of B's row (b_t), added into float32 accumulators.
struct FloatProduct {
  using a_t = float;
  using b_t = float;
  using AVec = Vec<float>;
  using BVec = Vec<float>;
  static AVec broadcast(float a) { return Vec<float>(a); }
  static BVec load(const float* p) { return Vec<float>::loadu(p); }
  static BVec load(const float* p, int n) { return Vec<float>::loadu(p, n); }
  static Vec<float> step(Vec<float> acc, AVec a, BVec b) { return fmadd(a, b, acc); }
};

#if ATTNX_DOT_BF16
struct PairProduct {
  using a_t = uint32_t;
  using b_t = uint32_t;
  using AVec = Pairs;
  using BVec = Pairs;
  static AVec broadcast(uint32_t a) { return Pairs::broadcast(a); }
  static BVec load(const uint32_t* p) { return Pairs::loadu(p); }
  static BVec load(const uint32_t* p, int n) { return Pairs::loadu(p, n); }
  static Vec<float> step(Vec<float> acc, AVec a, BVec b) { return dot_pairs(acc, a, b); }
};
#endif

// C (MR, NV vectors, the last holding `tail` lanes when TAIL) (+)= A (MR, K) @ B (K, same columns), times
// alpha when alpha != 1 (the whole of C then: see gemm_steps). With row_max, each row's stored values are
// also maxed into its lanes there (RowMax below).
template <typename P, int MR, int NV, bool TAIL>
inline void micro(int64_t K, const typename P::a_t* A, int64_t lda, const typename P::b_t* B, int64_t ldb,
                  float* C, int64_t ldc, bool add_c, int tail, float alpha, float* row_max) {
  using V = Vec<float>;
  constexpr int W = V::size();
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (!add_c) {
        acc[i][v] = V(0.0f);
      } else if (TAIL && v == NV - 1) {
        acc[i][v] = V::loadu(C + i * ldc + v * W, tail);
      } else {
        acc[i][v] = V::loadu(C + i * ldc + v * W);
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const typename P::b_t* b = B + k * ldb;
    typename P::BVec bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      bv[v] = (TAIL && v == NV - 1) ? P::load(b + v * W, tail) : P::load(b + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const typename P::AVec a = P::broadcast(A[i * lda + k]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = P::step(acc[i][v], a, bv[v]);
    }
  }
  if (alpha != 1.0f) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = acc[i][v] * V(alpha);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      if (TAIL && v == NV - 1) {
        acc[i][v].store(C + i * ldc + v * W, tail);
      } else {
        acc[i][v].store(C + i * ldc + v * W);
      }
    }
  }
  if (row_max) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      V m = V::loadu(row_max + i * W);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        m = maximum(m, TAIL && v == NV - 1 ? lanes_below_or(acc[i][v], tail, kRowMaxFill) : acc[i][v]);
      m.store(row_max + i * W);
    }
  }
}

template <typename P, int MR, int NV>
inline void micro_tail(int64_t K, const typename P::a_t* A, int64_t lda, const typename P::b_t* B,
                       int64_t ldb, float* C, int64_t ldc, bool add_c, int tail, float alpha,
                       float* row_max) {
  if (tail == Vec<float>::size()) {
    micro<P, MR, NV, false>(K, A, lda, B, ldb, C, ldc, add_c, tail, alpha, row_max);
  } else {
    micro<P, MR, NV, true>(K, A, lda, B, ldb, C, ldc, add_c, tail, alpha, row_max);
  }
}

// The last `rows` (< MR) rows of a column block: a micro-kernel of exactly that many rows.
template <typename P, int R, int NV>
inline void row_edge(int64_t rows, int64_t K, const typename P::a_t* A, int64_t lda, const typename P::b_t* B,
                     int64_t ldb, float* C, int64_t ldc, bool add_c, int tail, float alpha, float* row_max) {
  if constexpr (R > 0) {
    if (rows == R) {
      micro_tail<P, R, NV>(K, A, lda, B, ldb, C, ldc, add_c, tail, alpha, row_max);
    } else {
      row_edge<P, R - 1, NV>(rows, K, A, lda, B, ldb, C, ldc, add_c, tail, alpha, row_max);
    }
  }
}

// A column block of nv vectors over every row block of A.
template <typename P, int NV>
inline void column_block(int64_t M, int64_t K, const typename P::a_t* A, int64_t lda,
                         const typename P::b_t* B, int64_t ldb, float* C, int64_t ldc, bool add_c, int tail,
                         float alpha, float* row_max) {
  constexpr int MR = mr_for(NV);
  constexpr int W = Vec<float>::size();
  const auto lanes = [&](int64_t i) { return row_max ? row_max + i * W : nullptr; };
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    micro_tail<P, MR, NV>(K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, add_c, tail, alpha, lanes(i));
  }
  if (M > i) {
    row_edge<P, MR - 1, NV>(M - i, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, add_c, tail, alpha,
                            lanes(i));
  }
}

// C (M, N) = alpha A (M, K) @ B (K, N), or C += A @ B when add_c (alpha then 1), K in steps of P. Deep
// products run in kKc-step slices, each after the first adding to C; alpha scales the last, which holds the
// whole sum, and row_max (RowMax) reads that one.
template <typename P>
inline void gemm_steps(int64_t M, int64_t N, int64_t K, const typename P::a_t* A, int64_t lda,
                       const typename P::b_t* B, int64_t ldb, float* C, int64_t ldc, bool add_c, float alpha,
                       float* row_max) {
  constexpr int W = Vec<float>::size();
  constexpr int64_t kNr = kNv * W;
  if (M <= 0 || N <= 0) return;
  if (row_max) std::fill_n(row_max, M * W, kRowMaxFill);
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kKc) {
    const int64_t kc = K - k0 < 2 * kKc ? K - k0 : kKc;
    const bool add = add_c || k0 > 0;
    const bool last = kc == K - k0;
    const float a = last ? alpha : 1.0f;
    float* const rm = last ? row_max : nullptr;
    for (int64_t j = 0; j < N; j += kNr) {
      const int64_t nc = std::min<int64_t>(kNr, N - j);
      const int nv = static_cast<int>((nc + W - 1) / W);
      const int tail = static_cast<int>(nc - (nv - 1) * W);
      const typename P::a_t* ap = A + k0;
      const typename P::b_t* bp = B + k0 * ldb + j;
      float* c = C + j;
      switch (nv) {
        case 1:
          column_block<P, 1>(M, kc, ap, lda, bp, ldb, c, ldc, add, tail, a, rm);
          break;
        case 2:
          if constexpr (kNv >= 2) column_block<P, 2>(M, kc, ap, lda, bp, ldb, c, ldc, add, tail, a, rm);
          break;
        case 3:
          if constexpr (kNv >= 3) column_block<P, 3>(M, kc, ap, lda, bp, ldb, c, ldc, add, tail, a, rm);
          break;
        case 4:
          if constexpr (kNv >= 4) column_block<P, 4>(M, kc, ap, lda, bp, ldb, c, ldc, add, tail, a, rm);
          break;
        default:
          break;
      }
    }
    if (kc == K - k0) break;
  }
}

}  // namespace gemm_detail

// C (M, N) = A (M, K) @ B (K, N) (+ C when add_c), row-major with leading dimensions, fp32; row_max: the
// rows' maxima as gemm_detail's RowMax says.
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool add_c, float* row_max = nullptr) {
  gemm_detail::gemm_steps<gemm_detail::FloatProduct>(M, N, K, A, lda, B, ldb, C, ldc, add_c, 1.0f, row_max);
}

#if ATTNX_TILE_BF16
// Whether the pair products run on tiles: the variant the process runs (cpu_capability()) is this TU's
// tile variant.
inline bool use_tiles() {
  static const bool on =
      cpu_capability() == (ATTNX_TILE_BF16 == 1 ? CpuCapability::kAmxBf16 : CpuCapability::kEmulatedAmx);
  return on;
}
#endif

#if ATTNX_DOT_BF16

// C (M, N) = alpha A (M, 2 K) @ B (2 K, N), or C += A @ B when add_c (alpha 1), in float32 from bfloat16
// pairs (dot16.h): A's rows are K pairs (lda in pairs), B is (K, N) pairs (ldb in pairs). row_max: the
// rows' maxima as gemm_detail's RowMax says.
inline void gemm_pairs(int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t lda, const uint32_t* B,
                       int64_t ldb, float* C, int64_t ldc, bool add_c, float alpha,
                       float* row_max = nullptr) {
#if ATTNX_TILE_BF16
  // A tile holds 16 rows: fewer than half of them (grouped heads' decoding rows, say) run on vdpbf16ps,
  // which wastes none (a decoding step of 4 query heads a kv head measured 5% faster so than on tiles
  // padded with zeros).
  if (use_tiles() && M >= tiles::kRows / 2)
    return tiles::gemm_pairs(M, N, K, A, lda, B, ldb, C, ldc, add_c, alpha, row_max);
#endif
  gemm_detail::gemm_steps<gemm_detail::PairProduct>(M, N, K, A, lda, B, ldb, C, ldc, add_c, alpha, row_max);
}
#endif

// The fp64 tiles (reference-grade results, not speed): a vectorised loop over C's rows.
inline void gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb,
                 double* C, int64_t ldc, bool add_c) {
  using V = Vec<double>;
  constexpr int64_t W = V::size();
  for (int64_t i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    if (!add_c) std::fill_n(c, N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const double a = A[i * lda + k];
      const double* b = B + k * ldb;
      const V va(a);
      int64_t j = 0;
      for (; j + W <= N; j += W) fmadd(va, V::loadu(b + j), V::loadu(c + j)).store(c + j);
      for (; j < N; ++j) c[j] += a * b[j];
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace attnx::cpu
