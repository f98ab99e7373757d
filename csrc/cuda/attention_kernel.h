// attnx: the torch-free entry point of attnx::attention's CUDA kernels (cuda/attention_kernel.cu), called by
// the glue (cuda/attention.cpp) and by the CPU emulation (tests/emulation/).
#pragma once

#if !defined(__CUDACC_RTC__)  // NVRTC compiles the kernels only, not these host functions
#include <cuda_runtime_api.h>
#endif

#include "attnx/params.h"
#include "cuda/attention_plan.h"

namespace attnx::cuda {

#if !defined(__CUDACC_RTC__)
// Runs attention on `stream` with `kernel` (kSimt or kMma: choose_kernel) and the launch of its plan
// (plan_attention / plan_attention_mma). Returns the launch's error (cudaGetLastError right after it),
// cudaSuccess when there is nothing to compute, and cudaErrorInvalidValue when the kernel does not cover the
// problem (plan_attention(p, dtype).bucket == 0: D or Dv above kMaxHeadDim; kComposite; for kMma,
// !mma_supports(p, dtype)) or the params are inconsistent (!params_consistent(p, ptr)). The caller checks
// that an sm80+ device runs kMma.
cudaError_t launch_attention(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                             cudaStream_t stream, Kernel kernel = Kernel::kSimt);

// The tensor-core launcher (cuda/attention_kernel_mma.cu), called by launch_attention for Kernel::kMma.
cudaError_t launch_attention_mma(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                                 cudaStream_t stream);
#endif

}  // namespace attnx::cuda
