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
// problem (plan_attention(p, dtype).bucket == 0: D or Dv above kMaxHeadDim; kComposite or kTorchFlash, which
// are not launches of attnx's; for kMma,
// !mma_supports(p, dtype) or a block map it does not take, !mma_block_map_fits(p); for kSimt, any block map)
// or the params are inconsistent (!params_consistent(p, ptr)). The caller checks
// that an sm80+ device runs kMma.
// `workspace`: attention_workspace_bytes(p, dtype, ptr, kernel) bytes on the device, 8-byte aligned, or
// nullptr when that is 0 (the launch is refused without one where it is not). `mma_shape`: kMma's plain
// instantiation's shape (plan_attention_mma's `shape`; mma_plan's for a Target).
cudaError_t launch_attention(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                             cudaStream_t stream, Kernel kernel = Kernel::kSimt, void* workspace = nullptr,
                             int mma_shape = 0);

// The device memory a launch of `kernel` needs besides its operands: the mma kernel's mask tile classes and
// packed bool masks (AttentionMmaPlan::workspace_bytes); 0 for the others.
inline size_t attention_workspace_bytes(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                                        Kernel kernel) {
  return kernel == Kernel::kMma && mma_supports(p, dtype) ? plan_attention_mma(p, dtype, ptr).workspace_bytes
                                                          : 0;
}

// The tensor-core launcher (cuda/attention_kernel_mma.cu), called by launch_attention for Kernel::kMma.
cudaError_t launch_attention_mma(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                                 void* workspace, cudaStream_t stream, int shape = 0);

// The masks' tile classes and packed bool masks (MaskTiles): the pre-pass of the tensor-core kernels' general
// instantiations, forward and backward (cuda/attention_kernel_mma.cu), `blocks` blocks of kWarps warps, a
// warp per word of attn's then padding's share, into `words` (the workspace, indexed from word 0).
cudaError_t launch_mask_tiles(const AttentionParams& p, const AttentionPointers& ptr, const MaskTiles& attn,
                              const MaskTiles& padding, int64_t blocks, uint32_t* words, cudaStream_t stream);
#endif

}  // namespace attnx::cuda
