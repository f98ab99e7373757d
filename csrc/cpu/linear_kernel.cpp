// attnx: attnx::linear's own CPU GEMM for small fp32 problems (see cpu/linear_kernel.h).
//
// At decoding shapes ((1, 64) x (64, 64): 4096 multiply-adds) the arithmetic takes a fraction of a
// microsecond, while reaching torch's BLAS from the stable ABI is a boxed dispatcher call of a few. The loops
// are written for the vectoriser: kLanes partial sums per dot product (one AVX-512 register, two AVX2, four
// SSE), reduced pairwise; kRows rows of w share each load of a's row. GCC's function multi-versioning
// (target_clones) compiles the function for x86-64-v4 (AVX-512) and v3 (AVX2 + FMA) beside the baseline and
// picks one by the CPU when the library loads: no torch call, so nothing beyond the stable ABI (and, unlike
// the attention kernels, ATEN_CPU_CAPABILITY does not move it). Which version runs can change the rounding
// (FMA contracts a * b + s), never the order of the sums. Other compilers and targets build the baseline
// loops.
#include "cpu/linear_kernel.h"

namespace attnx::cpu {

namespace {

constexpr int kLanes = 16;
constexpr int kRows = 4;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define ATTNX_LINEAR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTNX_LINEAR_CLONES
#endif

// ROWS consecutive outputs of one row of c: a's row against ROWS consecutive rows of w.
template <int ROWS>
inline void dot_rows(int64_t K, const float* a, const float* w, int64_t ldw, const float* bias,
                     int64_t bias_stride, float* c) {
  float acc[ROWS][kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    for (int r = 0; r < ROWS; ++r) {
      const float* wr = w + r * ldw + k;
      for (int l = 0; l < kLanes; ++l) acc[r][l] += a[k + l] * wr[l];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    // The tail of the row in lanes of its own, then the lanes pairwise: a fixed order for every K.
    const float* wr = w + r * ldw;
    for (int64_t t = k; t < K; ++t) acc[r][t - k] += a[t] * wr[t];
    for (int half = kLanes / 2; half > 0; half /= 2) {
      for (int l = 0; l < half; ++l) acc[r][l] += acc[r][l + half];
    }
    c[r] = bias ? acc[r][0] + bias[r * bias_stride] : acc[r][0];
  }
}

}  // namespace

ATTNX_LINEAR_CLONES
void small_linear_f32(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* w,
                      int64_t ldw, const float* bias, int64_t bias_stride, float* c, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    const float* ai = a + i * lda;
    float* ci = c + i * ldc;
    int64_t j = 0;
    for (; j + kRows <= N; j += kRows) {
      dot_rows<kRows>(K, ai, w + j * ldw, ldw, bias ? bias + j * bias_stride : nullptr, bias_stride, ci + j);
    }
    for (; j < N; ++j) {
      dot_rows<1>(K, ai, w + j * ldw, ldw, bias ? bias + j * bias_stride : nullptr, bias_stride, ci + j);
    }
  }
}

}  // namespace attnx::cpu
