// attnx: attnx::linear's own CPU GEMM for small fp32 problems, torch-free.
#pragma once

#include <cstdint>

namespace attnx::cpu {

// c (M, N) = a (M, K) @ w (N, K)^T (+ bias), fp32, rows of a and w contiguous (unit column stride) at row
// strides lda and ldw, c's rows contiguous at ldc; bias[j * bias_stride] (stride 0: one element for every
// column), or none when bias is null. Each output is one dot product summed in a fixed order, whatever the
// shape, layout or thread: the same bits for the same row and column.
void small_linear_f32(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* w,
                      int64_t ldw, const float* bias, int64_t bias_stride, float* c, int64_t ldc);

}  // namespace attnx::cpu
