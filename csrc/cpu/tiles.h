// attnx: the CPU kernels' bfloat16 products on AMX tiles: C (M, N) float32 (+)= A (M, K pairs) B (K pairs, N)
// in dot16.h's pair layout, which is the layout AMX-BF16's tdpbf16ps wants (A's rows are pairs along K, B's
// row k holds the (2k, 2k + 1) pairs of its columns), so the operands are loaded in place, not packed.
//
// Included after vec.h and dot16.h (and before gemm.h, whose gemm_pairs runs on it), in the same
// CPU_CAPABILITY namespace. The TU says which implementation it wants with ATTNX_TILE_BF16 before including
// the kernel:
//   0 (or undefined): none;
//   1: AMX-BF16, in a TU whose target has amx-tile and amx-bf16 (cpu/attention_kernel_avx512_bf16.cpp);
//   2: the same instructions defined on plain arrays: the emulation that lets every machine run the code that
//      AMX machines run (cpu/attention_kernel_bf16_emulated.cpp), with tdpbf16ps's rounding, order and
//      denormal rules (tests/cpu/tiles_check.cpp compares the two bit for bit where the CPU has AMX).
// Whether a call runs on the tiles is decided once per process (cpu_capability(): the amx_bf16 and
// emulated_amx variants); the same TUs run the vdpbf16ps products otherwise.
//
// The driver: 16 x 16 float32 C tiles in blocks of 2 x 2 (four tile registers), each step of 16 pairs of the
// depth loading two A tiles and two B tiles (the other four) and issuing four tdpbf16ps, so each loaded tile
// feeds two products. Columns are the outer loop, as in gemm.h, so a 32-column panel of B stays in L1 while
// it meets every row block of A. A tile that would reach past an operand's edge (rows, columns or depth not
// a multiple of 16) is copied into a zero-padded buffer first: padded depth is zero in both A and B, so it
// adds exact zeros, and padded rows and columns of C are never stored.
//
// Numerics (tdpbf16ps, Intel SDM): per element of C and per tile of 16 pairs, the even and the odd elements
// of the pairs are summed separately from zero, each product added by one rounded fused multiply-add
// (exact products: two bfloat16 values), then the two sums are added, rounded, and added to C, rounded;
// denormal inputs and every result flushed to zero, whatever MXCSR says. So a result depends on how the depth
// is cut into tiles, and the emulation runs this same driver.
#pragma once

#ifndef CPU_CAPABILITY
#error "tiles.h is included by a kernel TU that defines CPU_CAPABILITY"
#endif

#ifndef ATTNX_TILE_BF16
#define ATTNX_TILE_BF16 0
#endif

namespace attnx::cpu {
namespace CPU_CAPABILITY {

namespace tiles {

constexpr int kRows = 16;   // rows of every tile
constexpr int kWords = 16;  // 32-bit words a tile row: 16 pairs (A, B) or 16 floats (C)

// ldtilecfg's 64-byte operand: palette 1, every one of the 8 tiles 16 rows of 64 bytes.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = kWords * 4;
      rows[t] = kRows;
    }
  }
};

#if ATTNX_TILE_BF16 == 1

// The tile registers are per thread and other libraries use them too (oneDNN's kernels in torch, which may
// keep their configuration between calls): a product saves the thread's configuration, loads its own and
// puts the saved one back (or releases the tiles if there was none) when it is done.
struct Scope {
  alignas(64) uint8_t saved[64];
  Scope() {
    _tile_storeconfig(saved);
    static const Config config;
    _tile_loadconfig(&config);
  }
  ~Scope() {
    if (saved[0] != 0) {
      _tile_loadconfig(saved);
    } else {
      _tile_release();
    }
  }
};

// The instructions. A tile number is part of the instruction (GCC's intrinsics paste it into the assembly as
// written), so each one used is a specialisation below.
struct Ops {
  template <int T>
  static void load(const void* p, int64_t stride_bytes);
  template <int T>
  static void store(void* p, int64_t stride_bytes);
  template <int T>
  static void zero();
  template <int C, int A, int B>
  static void dot();
};
// clang-format off
#define ATTNX_TILE_OPS(T)                                                                              \
  template <> inline void Ops::load<T>(const void* p, int64_t s) { _tile_loadd(T, p, s); }            \
  template <> inline void Ops::store<T>(void* p, int64_t s) { _tile_stored(T, p, s); }                \
  template <> inline void Ops::zero<T>() { _tile_zero(T); }
ATTNX_TILE_OPS(0) ATTNX_TILE_OPS(1) ATTNX_TILE_OPS(2) ATTNX_TILE_OPS(3)
ATTNX_TILE_OPS(4) ATTNX_TILE_OPS(5) ATTNX_TILE_OPS(6) ATTNX_TILE_OPS(7)
#undef ATTNX_TILE_OPS
template <> inline void Ops::dot<0, 4, 6>() { _tile_dpbf16ps(0, 4, 6); }
template <> inline void Ops::dot<1, 4, 7>() { _tile_dpbf16ps(1, 4, 7); }
template <> inline void Ops::dot<2, 5, 6>() { _tile_dpbf16ps(2, 5, 6); }
template <> inline void Ops::dot<3, 5, 7>() { _tile_dpbf16ps(3, 5, 7); }
// clang-format on

#elif ATTNX_TILE_BF16 == 2

struct Registers {
  uint32_t t[8][kRows][kWords];
};
inline Registers& registers() {
  static thread_local Registers r;
  return r;
}

struct Scope {};

struct Ops {
  template <int T>
  static void load(const void* p, int64_t stride_bytes) {
    for (int r = 0; r < kRows; ++r)
      std::memcpy(registers().t[T][r], static_cast<const char*>(p) + r * stride_bytes, kWords * 4);
  }
  template <int T>
  static void store(void* p, int64_t stride_bytes) {
    for (int r = 0; r < kRows; ++r)
      std::memcpy(static_cast<char*>(p) + r * stride_bytes, registers().t[T][r], kWords * 4);
  }
  template <int T>
  static void zero() {
    std::memset(registers().t[T], 0, sizeof(registers().t[T]));
  }
  // tdpbf16ps (see the header comment); dot16.h's flush and conversions.
  template <int C, int A, int B>
  static void dot() {
    using dot16::high;
    using dot16::low;
    auto& t = registers().t;
    for (int m = 0; m < kRows; ++m) {
      for (int n = 0; n < kWords; ++n) {
        float even = 0.0f, odd = 0.0f;
        for (int k = 0; k < kWords; ++k) {
          const uint32_t a = t[A][m][k], b = t[B][k][n];
          even = dot16::flush_denormal(std::fma(low(a), low(b), even));
          odd = dot16::flush_denormal(std::fma(high(a), high(b), odd));
        }
        const float c = dot16::flush_denormal(dot16::bits_to_float(t[C][m][n]));
        const float sum = dot16::flush_denormal(even + odd);
        t[C][m][n] = dot16::float_to_bits(dot16::flush_denormal(c + sum));
      }
    }
  }
};

#endif

#if ATTNX_TILE_BF16 != 0

// The tile of `rows` x `words` 32-bit words at p (leading dimension ld words), zero-padded to 16 x 16, into
// buf.
inline void stage(const uint32_t* p, int64_t ld, int rows, int words, uint32_t* buf) {
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) std::memcpy(buf + r * kWords, p + r * ld, words * sizeof(uint32_t));
    std::fill(buf + r * kWords + (r < rows ? words : 0), buf + (r + 1) * kWords, 0u);
  }
}

// Loads tile T from the rows x words tile at p: in place when it is whole, else through buf.
template <int T>
inline void load_tile(const uint32_t* p, int64_t ld, int rows, int words, uint32_t* buf) {
  if (rows == kRows && words == kWords) {
    Ops::load<T>(p, ld * 4);
  } else {
    stage(p, ld, rows, words, buf);
    Ops::load<T>(buf, kWords * 4);
  }
}

// C tile T from (add_c) or zero, and back: the rows x cols floats at c (leading dimension ldc), times alpha.
template <int T>
inline void start_c(float* c, int64_t ldc, int rows, int cols, bool add_c, uint32_t* buf) {
  if (!add_c) {
    Ops::zero<T>();
  } else {
    load_tile<T>(reinterpret_cast<const uint32_t*>(c), ldc, rows, cols, buf);
  }
}
// With row_max (the tile's first row's lanes: gemm.h's RowMax), each row's values after alpha are also maxed
// into its lanes, read back while the stored tile is in L1.
template <int T>
inline void finish_c(float* c, int64_t ldc, int rows, int cols, float alpha, float* row_max, uint32_t* buf) {
  using V = Vec<float>;
  constexpr int W = V::size();
  if (rows == kRows && cols == kWords) {
    Ops::store<T>(c, ldc * 4);
  } else {
    Ops::store<T>(buf, kWords * 4);
    for (int r = 0; r < rows; ++r) std::memcpy(c + r * ldc, buf + r * kWords, cols * sizeof(float));
  }
  if (alpha == 1.0f && !row_max) return;
  const V va(alpha);
  for (int r = 0; r < rows; ++r) {
    float* row = c + r * ldc;
    V m = row_max ? V::loadu(row_max + r * W) : V(0.0f);
    for (int j = 0; j < cols; j += W) {
      const int n = std::min(W, cols - j);
      V x = n == W ? V::loadu(row + j) : V::loadu(row + j, n);
      if (alpha != 1.0f) {
        x = x * va;
        if (n == W) {
          x.store(row + j);
        } else {
          x.store(row + j, n);
        }
      }
      if (row_max) m = maximum(m, n == W ? x : lanes_below_or(x, n, -std::numeric_limits<float>::infinity()));
    }
    if (row_max) m.store(row_max + r * W);
  }
}

// One block of C: R x CN tiles (1 or 2 each) at (i0, j0), over the whole depth. C tiles 0..3 (row r, column
// n: 2 r + n), A tiles 4, 5, B tiles 6, 7.
template <int R, int CN>
inline void block(int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t lda, const uint32_t* B,
                  int64_t ldb, float* C, int64_t ldc, bool add_c, float alpha, float* row_max, int64_t i0,
                  int64_t j0) {
  constexpr int W = Vec<float>::size();
  const auto lanes = [&](int r) { return row_max ? row_max + (i0 + r * kRows) * W : nullptr; };
  alignas(64) uint32_t buf[4][kRows * kWords];
  const int rows[2] = {static_cast<int>(std::min<int64_t>(kRows, M - i0)),
                       static_cast<int>(std::min<int64_t>(kRows, M - i0 - kRows))};
  const int cols[2] = {static_cast<int>(std::min<int64_t>(kWords, N - j0)),
                       static_cast<int>(std::min<int64_t>(kWords, N - j0 - kWords))};
  const auto c_at = [&](int r, int n) { return C + (i0 + r * kRows) * ldc + j0 + n * kWords; };
  start_c<0>(c_at(0, 0), ldc, rows[0], cols[0], add_c, buf[0]);
  if constexpr (CN == 2) start_c<1>(c_at(0, 1), ldc, rows[0], cols[1], add_c, buf[0]);
  if constexpr (R == 2) start_c<2>(c_at(1, 0), ldc, rows[1], cols[0], add_c, buf[0]);
  if constexpr (R == 2 && CN == 2) start_c<3>(c_at(1, 1), ldc, rows[1], cols[1], add_c, buf[0]);
  for (int64_t k0 = 0; k0 < K; k0 += kWords) {
    const int depth = static_cast<int>(std::min<int64_t>(kWords, K - k0));
    load_tile<4>(A + i0 * lda + k0, lda, rows[0], depth, buf[0]);
    if constexpr (R == 2) load_tile<5>(A + (i0 + kRows) * lda + k0, lda, rows[1], depth, buf[1]);
    load_tile<6>(B + k0 * ldb + j0, ldb, depth, cols[0], buf[2]);
    if constexpr (CN == 2) load_tile<7>(B + k0 * ldb + j0 + kWords, ldb, depth, cols[1], buf[3]);
    Ops::dot<0, 4, 6>();
    if constexpr (CN == 2) Ops::dot<1, 4, 7>();
    if constexpr (R == 2) Ops::dot<2, 5, 6>();
    if constexpr (R == 2 && CN == 2) Ops::dot<3, 5, 7>();
  }
  finish_c<0>(c_at(0, 0), ldc, rows[0], cols[0], alpha, lanes(0), buf[0]);
  if constexpr (CN == 2) finish_c<1>(c_at(0, 1), ldc, rows[0], cols[1], alpha, lanes(0), buf[0]);
  if constexpr (R == 2) finish_c<2>(c_at(1, 0), ldc, rows[1], cols[0], alpha, lanes(1), buf[0]);
  if constexpr (R == 2 && CN == 2) finish_c<3>(c_at(1, 1), ldc, rows[1], cols[1], alpha, lanes(1), buf[0]);
}

// C (M, N) = alpha A (M, K pairs) @ B (K pairs, N), or C += A @ B when add_c (alpha then 1), and the rows'
// maxima into row_max when given: gemm.h's gemm_pairs on the tiles.
inline void gemm_pairs(int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t lda, const uint32_t* B,
                       int64_t ldb, float* C, int64_t ldc, bool add_c, float alpha, float* row_max) {
  if (M <= 0 || N <= 0) return;
  if (row_max) std::fill_n(row_max, M * Vec<float>::size(), -std::numeric_limits<float>::infinity());
  [[maybe_unused]] const Scope scope;
  for (int64_t j0 = 0; j0 < N; j0 += 2 * kWords) {
    const bool two_cols = N - j0 > kWords;
    for (int64_t i0 = 0; i0 < M; i0 += 2 * kRows) {
      const bool two_rows = M - i0 > kRows;
      if (two_rows && two_cols) {
        block<2, 2>(M, N, K, A, lda, B, ldb, C, ldc, add_c, alpha, row_max, i0, j0);
      } else if (two_rows) {
        block<2, 1>(M, N, K, A, lda, B, ldb, C, ldc, add_c, alpha, row_max, i0, j0);
      } else if (two_cols) {
        block<1, 2>(M, N, K, A, lda, B, ldb, C, ldc, add_c, alpha, row_max, i0, j0);
      } else {
        block<1, 1>(M, N, K, A, lda, B, ldb, C, ldc, add_c, alpha, row_max, i0, j0);
      }
    }
  }
}

#endif

}  // namespace tiles
}  // namespace CPU_CAPABILITY
}  // namespace attnx::cpu
