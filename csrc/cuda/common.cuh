// attnx: what every attnx .cu file shares: element conversions, warp reductions, and the two constructs that
// differ between nvcc and the CPU emulation (tests/emulation/cuda_shim.h): dynamic shared memory and the
// launch.
//
// Torch-free on purpose: a .cu that includes ATen takes ~30 s and 1.5 GB in nvcc, one that does not ~1 s.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <utility>

#if defined(ATTNX_CUDA_EMULATION)
// g++ compiles this file for the CPU: threadIdx, __syncthreads, warp shuffles and the launch are emulated.
#include "cuda_shim.h"
#endif

#include "attnx/params.h"
#include "attnx/softmax.h"

namespace attnx::cuda {

#if defined(ATTNX_CUDA_EMULATION)
#define ATTNX_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::attnx_emu::dynamic_shared_memory())
using ::attnx_emu::launch_kernel;
#else
#define ATTNX_DYNAMIC_SHARED(T, name)                          \
  extern __shared__ __align__(16) unsigned char attnx_smem_[]; \
  T* name = reinterpret_cast<T*>(attnx_smem_)

// kernel<<<grid, block, smem, stream>>>(args...), then the launch's error, as C10_CUDA_KERNEL_LAUNCH_CHECK
// reads it.
template <typename... Params, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream, Args&&... args) {
  // clang-format off
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  // clang-format on
  return cudaGetLastError();
}
#endif

constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------------------
// Conversions. torch builds .cu files with __CUDA_NO_HALF_CONVERSIONS__ and friends, so half and bfloat16 go
// through the explicit intrinsics (round to nearest even, as torch's own casts).

__device__ __forceinline__ float to_acc(float x) {
  return x;
}
__device__ __forceinline__ double to_acc(double x) {
  return x;
}
__device__ __forceinline__ float to_acc(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
struct FromAcc;
template <>
struct FromAcc<float> {
  __device__ __forceinline__ static float cast(float x) { return x; }
};
template <>
struct FromAcc<double> {
  __device__ __forceinline__ static double cast(double x) { return x; }
};
template <>
struct FromAcc<__half> {
  __device__ __forceinline__ static __half cast(float x) { return __float2half_rn(x); }
};
template <>
struct FromAcc<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 cast(float x) { return __float2bfloat16_rn(x); }
};

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A x) {
  return FromAcc<T>::cast(x);
}

// One element of a mask, as the additive term it stands for: bool true = masked out (-inf), a float is added
// as it is, converted to the accumulator type like the reference's mask.to(acc). `kind` is the same for every
// thread of a launch, so the switch never diverges.
template <typename A>
__device__ __forceinline__ A mask_value(int32_t kind, const void* mask, int64_t offset) {
  switch (kind) {
    case kMaskBool:
      return static_cast<const bool*>(mask)[offset] ? -A(INFINITY) : A(0);
    case kMaskFloat16:
      return A(__half2float(static_cast<const __half*>(mask)[offset]));
    case kMaskBFloat16:
      return A(__bfloat162float(static_cast<const __nv_bfloat16*>(mask)[offset]));
    case kMaskFloat32:
      return A(static_cast<const float*>(mask)[offset]);
    case kMaskFloat64:
      return A(static_cast<const double*>(mask)[offset]);
    default:
      return A(0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Warp reductions (butterfly: every lane ends with the same value, bit for bit, since a + b == b + a).

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = nan_max(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// N elements of T as one aligned access: a 16-byte struct compiles to one ld.shared.v4.f32 (v2.f64).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

}  // namespace attnx::cuda
