// attnx: the torch-free entry point of attnx::attention's CUDA kernels (attention.cu), called by the glue
// (attention_cuda.cpp) and by the CPU emulation (tests/emulation/).
#pragma once

#include <cuda_runtime_api.h>

#include "attnx/params.h"
#include "cuda/attention_plan.h"

namespace attnx::cuda {

// Runs attention on `stream` with the launch of plan_attention(p, dtype). Returns the launch's error
// (cudaGetLastError right after it), cudaSuccess when there is nothing to compute, and cudaErrorInvalidValue
// when no kernel covers the problem (plan_attention(p, dtype).bucket == 0: D or Dv above kMaxHeadDim).
cudaError_t launch_attention(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                             cudaStream_t stream);

}  // namespace attnx::cuda
