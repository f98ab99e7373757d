// attnx: kernels that break Metal's rules on purpose, to check that the emulation reports each break (see
// test_metal_emulation.py::test_shim_reports). Not part of the library: only the shim's tests compile this.
#include "../../../metal/common.h"

namespace attnx {

// A simd collective that half of the simdgroup skips.
template <typename T>
kernel void divergent_simd_sum(device T* out [[buffer(0)]], ATTNX_THREAD_POSITIONS) {
  float x = 1.0f;
  if (lane < 16) x = simd_sum(x);
  out[tid] = x;
}

// A threadgroup barrier that one simdgroup skips.
template <typename T>
kernel void divergent_barrier(device T* out [[buffer(0)]], ATTNX_THREAD_POSITIONS) {
  if (sg == 0) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
}

// Reads a neighbour's threadgroup memory without the barrier that orders it after the neighbour's write.
template <typename T>
kernel void missing_barrier(device T* out [[buffer(0)]], ATTNX_THREAD_POSITIONS) {
  ATTNX_THREADGROUP_ARRAY(float, shared, metal_config::kSimdWidth * 4);
  shared[tid] = float(tid);
  out[tid] = shared[(tid + 1) % (metal_config::kSimdWidth * 4)];
}

// The same with the barrier: every thread reads its neighbour's index.
template <typename T>
kernel void with_barrier(device T* out [[buffer(0)]], ATTNX_THREAD_POSITIONS) {
  ATTNX_THREADGROUP_ARRAY(float, shared, metal_config::kSimdWidth * 4);
  shared[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared[(tid + 1) % (metal_config::kSimdWidth * 4)];
}

// More threadgroup memory than any Apple GPU has.
template <typename T>
kernel void too_much_threadgroup_memory(device T* out [[buffer(0)]], ATTNX_THREAD_POSITIONS) {
  ATTNX_THREADGROUP_ARRAY(float, big, 9000);
  big[tid] = 0.0f;
  out[tid] = big[tid];
}

ATTNX_INSTANTIATE_KERNEL("divergent_simd_sum", divergent_simd_sum, float)
ATTNX_INSTANTIATE_KERNEL("divergent_barrier", divergent_barrier, float)
ATTNX_INSTANTIATE_KERNEL("missing_barrier", missing_barrier, float)
ATTNX_INSTANTIATE_KERNEL("with_barrier", with_barrier, float)
ATTNX_INSTANTIATE_KERNEL("too_much_threadgroup_memory", too_much_threadgroup_memory, float)

}  // namespace attnx
