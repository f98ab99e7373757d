// attnx: attnx::linear's Metal kernels, out (M, N) = input (M, K) @ weight.T + bias, for float32, float16 and
// bfloat16 (accumulating in float).
//
// Both read input through LinearParams' strides: rows as (outer, inner) with a stride each, any stride along
// K, and write out the same way, where linear's layout on every backend puts each row (the input's memory
// order of rows). nn.MultiheadAttention's (L, 1, E) B=1 transpose, (L, B, E) views of batch-first data,
// slices and stride-0 rows are read in place; nothing is copied on the host for inputs of up to two leading
// dims.
//   linear_gemv  M <= kGemvMaxRows: one simdgroup per output feature n, lanes along K, simd_sum per row.
//                Decoding-sized inputs are bandwidth-bound on the weight, which each simdgroup reads once.
//   linear_gemm  otherwise: kGemmTile x kGemmTile outputs per threadgroup; input and weight tiles are staged
//                in threadgroup memory as float, then multiplied as 8x8 simdgroup matrices.
#include "common.h"

namespace attnx {

using namespace metal_config;

// Element offset of input row r: (r / rows_inner, r % rows_inner) through their strides.
inline int64_t input_row_offset(const constant LinearParams& p, int64_t r) {
  return (r / p.rows_inner) * p.input_stride[0] + (r % p.rows_inner) * p.input_stride[1];
}

// Element offset of output row r, indexed as the input's: the output keeps the input's memory order of rows.
inline int64_t out_row_offset(const constant LinearParams& p, int64_t r) {
  return (r / p.rows_inner) * p.out_stride[0] + (r % p.rows_inner) * p.out_stride[1];
}

template <typename T>
kernel void linear_gemv(const device T* input [[buffer(0)]], const device T* weight [[buffer(1)]],
                        const device T* bias [[buffer(2)]], device T* out [[buffer(3)]],
                        const constant LinearParams& p [[buffer(4)]], ATTNX_THREAD_POSITIONS) {
  // A simdgroup past N has nothing to do; it returns as a whole (no threadgroup barrier in this kernel).
  const int64_t n = int64_t(tgid.x) * kGemvSimdgroups + sg;
  if (n >= p.out_features) return;
  const int M = int(p.rows);  // <= kGemvMaxRows (the plan's choice)
  const int64_t K = p.in_features;

  int64_t row[kGemvMaxRows];
  float acc[kGemvMaxRows];
  for (int r = 0; r < kGemvMaxRows; ++r) {
    row[r] = r < M ? input_row_offset(p, r) : 0;
    acc[r] = 0.0f;
  }
  const device T* w = weight + n * p.weight_stride[0];
  for (int64_t k = lane; k < K; k += kSimdWidth) {
    const float wk = float(w[k * p.weight_stride[1]]);
    const int64_t xk = k * p.input_stride[2];
    for (int r = 0; r < kGemvMaxRows; ++r) {
      if (r < M) acc[r] += wk * float(input[row[r] + xk]);
    }
  }
  const float b = p.has_bias ? float(bias[n * p.bias_stride]) : 0.0f;
  for (int r = 0; r < kGemvMaxRows; ++r) {
    if (r >= M) break;  // M is uniform: every lane leaves together, so simd_sum sees the whole simdgroup
    const float sum = simd_sum(acc[r]);
    if (lane == 0) out[out_row_offset(p, r) + n * p.out_stride[2]] = T(sum + b);
  }
}

template <typename T>
kernel void linear_gemm(const device T* input [[buffer(0)]], const device T* weight [[buffer(1)]],
                        const device T* bias [[buffer(2)]], device T* out [[buffer(3)]],
                        const constant LinearParams& p [[buffer(4)]], ATTNX_THREAD_POSITIONS) {
  // Row stride of the staged tiles: 4 floats of padding keep the transposed weight loads off one bank.
  constexpr int ld = kGemmTile + 4;
  constexpr int kPerThread = kGemmTile * kGemmTile / kGemmThreads;  // staged elements per thread per tile
  // a_s (m, k): the input tile, and the output tile at the end. w_s (n, k): the weight tile.
  ATTNX_THREADGROUP_ARRAY(float, a_s, (kGemmTile * ld));
  ATTNX_THREADGROUP_ARRAY(float, w_s, (kGemmTile * ld));

  const int64_t M = p.rows, N = p.out_features, K = p.in_features;
  const int64_t m0 = int64_t(tgid.y) * kGemmTile, n0 = int64_t(tgid.x) * kGemmTile;

  // Thread tid stages elements tid + i * kGemmThreads of each tile: always the same rows, so their input
  // offsets (a division each) are computed once.
  int64_t a_row[kPerThread];
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t m = m0 + (int(tid) + i * kGemmThreads) / kGemmTile;
    a_row[i] = m < M ? input_row_offset(p, m) : -1;
  }

  simdgroup_float8x8 c[kGemmTile / 8];
  for (int j = 0; j < kGemmTile / 8; ++j) c[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int64_t k0 = 0; k0 < K; k0 += kGemmTile) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the previous tiles
    for (int i = 0; i < kPerThread; ++i) {
      const int e = int(tid) + i * kGemmThreads;
      const int r = e / kGemmTile, kk = e % kGemmTile;
      const int64_t k = k0 + kk;
      // Zeros past M, N and K: they multiply into outputs that are never written, or add exact zeros.
      a_s[r * ld + kk] = a_row[i] >= 0 && k < K ? float(input[a_row[i] + k * p.input_stride[2]]) : 0.0f;
      const int64_t n = n0 + r;
      w_s[r * ld + kk] =
          n < N && k < K ? float(weight[n * p.weight_stride[0] + k * p.weight_stride[1]]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < kGemmTile; kk += 8) {
      simdgroup_float8x8 a;
      simdgroup_load(a, a_s + sg * 8 * ld + kk, ld);
      for (int j = 0; j < kGemmTile / 8; ++j) {
        simdgroup_float8x8 wt;  // (k, n): the weight tile read transposed
        simdgroup_load(wt, w_s + j * 8 * ld + kk, ld, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(c[j], a, wt, c[j]);
      }
    }
  }

  // The simdgroup's 8 x kGemmTile outputs go through its own rows of a_s, then out through out's strides, a
  // row at a time (one row offset, a division, per row).
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading a_s
  for (int j = 0; j < kGemmTile / 8; ++j) simdgroup_store(c[j], a_s + sg * 8 * ld + j * 8, ld);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = 0; i < 8; ++i) {
    const int r = int(sg) * 8 + i;
    const int64_t m = m0 + r;
    if (m >= M) break;  // uniform across the simdgroup, and no barrier follows
    const int64_t row = out_row_offset(p, m);
    for (int col = int(lane); col < kGemmTile; col += kSimdWidth) {
      const int64_t n = n0 + col;
      if (n < N) {
        const float b = p.has_bias ? float(bias[n * p.bias_stride]) : 0.0f;
        out[row + n * p.out_stride[2]] = T(a_s[r * ld + col] + b);
      }
    }
  }
}

// clang-format off
ATTNX_INSTANTIATE_KERNEL("linear_gemv_float32", linear_gemv, float)
ATTNX_INSTANTIATE_KERNEL("linear_gemv_float16", linear_gemv, half)
ATTNX_INSTANTIATE_KERNEL("linear_gemv_bfloat16", linear_gemv, bfloat)
ATTNX_INSTANTIATE_KERNEL("linear_gemm_float32", linear_gemm, float)
ATTNX_INSTANTIATE_KERNEL("linear_gemm_float16", linear_gemm, half)
ATTNX_INSTANTIATE_KERNEL("linear_gemm_bfloat16", linear_gemm, bfloat)
// clang-format on

}  // namespace attnx
