// attnx: the CPU kernels' tile GEMMs: row-major C (M, N) (+)= A (M, K) @ B (K, N) with leading dimensions,
// on register-blocked micro-kernels over vec.h's Vec<float>. Header-only and torch-free; included after
// vec.h, in the same CPU_CAPABILITY namespace.
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

// C (MR, NV vectors, the last holding `tail` lanes when TAIL) (+)= A (MR, K) @ B (K, same columns).
template <int MR, int NV, bool TAIL>
inline void micro(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                  bool add_c, int tail) {
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
    const float* b = B + k * ldb;
    V bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      bv[v] = (TAIL && v == NV - 1) ? V::loadu(b + v * W, tail) : V::loadu(b + v * W);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V a(A[i * lda + k]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(a, bv[v], acc[i][v]);
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
}

template <int MR, int NV>
inline void micro_tail(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                       int64_t ldc, bool add_c, int tail) {
  if (tail == Vec<float>::size()) {
    micro<MR, NV, false>(K, A, lda, B, ldb, C, ldc, add_c, tail);
  } else {
    micro<MR, NV, true>(K, A, lda, B, ldb, C, ldc, add_c, tail);
  }
}

// The last `rows` (< MR) rows of a column block: a micro-kernel of exactly that many rows.
template <int R, int NV>
inline void row_edge(int64_t rows, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                     float* C, int64_t ldc, bool add_c, int tail) {
  if constexpr (R > 0) {
    if (rows == R) {
      micro_tail<R, NV>(K, A, lda, B, ldb, C, ldc, add_c, tail);
    } else {
      row_edge<R - 1, NV>(rows, K, A, lda, B, ldb, C, ldc, add_c, tail);
    }
  }
}

// A column block of nv vectors over every row block of A.
template <int NV>
inline void column_block(int64_t M, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                         float* C, int64_t ldc, bool add_c, int tail) {
  constexpr int MR = mr_for(NV);
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    micro_tail<MR, NV>(K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, add_c, tail);
  }
  if (M > i) row_edge<MR - 1, NV>(M - i, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, add_c, tail);
}

}  // namespace gemm_detail

// C (M, N) = A (M, K) @ B (K, N) (+ C when add_c), row-major with leading dimensions, fp32.
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool add_c) {
  using namespace gemm_detail;
  constexpr int W = Vec<float>::size();
  constexpr int64_t kNr = kNv * W;
  if (M <= 0 || N <= 0) return;
  // Deep products in kKc slices (the last one taking up to 2 kKc - 1), each after the first adding to C.
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kKc) {
    const int64_t kc = K - k0 < 2 * kKc ? K - k0 : kKc;
    const bool add = add_c || k0 > 0;
    for (int64_t j = 0; j < N; j += kNr) {
      const int64_t nc = std::min<int64_t>(kNr, N - j);
      const int nv = static_cast<int>((nc + W - 1) / W);
      const int tail = static_cast<int>(nc - (nv - 1) * W);
      const float* a = A + k0;
      const float* b = B + k0 * ldb + j;
      float* c = C + j;
      switch (nv) {
        case 1:
          column_block<1>(M, kc, a, lda, b, ldb, c, ldc, add, tail);
          break;
        case 2:
          if constexpr (kNv >= 2) column_block<2>(M, kc, a, lda, b, ldb, c, ldc, add, tail);
          break;
        case 3:
          if constexpr (kNv >= 3) column_block<3>(M, kc, a, lda, b, ldb, c, ldc, add, tail);
          break;
        case 4:
          if constexpr (kNv >= 4) column_block<4>(M, kc, a, lda, b, ldb, c, ldc, add, tail);
          break;
        default:
          break;
      }
    }
    if (kc == K - k0) break;
  }
}

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
