// attnx: the CUDA run functions of attnx::attention, attention_backward and _attention_kernel
// (cuda/attention.cpp, cuda/attention_backward.cpp), for a Target and a stream given by the caller: the CUDA
// library's registrations give them the current device's (cuda/device.h), the emulated backend
// (tests/emulation/cuda_backend.cpp) its own, so both run the same glue and the same kernel choice.
#pragma once

#include <cuda_runtime_api.h>

#include "common/attention.h"
#include "cuda/attention_plan.h"

namespace attnx::cuda {

// Writes pb.out and pb.lse with the kernel choose_kernel picks for `target`, on `stream`.
void run_attention(AttentionProblem& pb, const Target& target, cudaStream_t stream);

// Writes the gradients with the kernel choose_backward picks for `target`, on `stream`.
void run_attention_backward(AttentionBackwardProblem& pb, const Target& target, cudaStream_t stream);

// The backward's kernel for `p` (choose_backward), with the error the call raises where no kernel takes it.
BackwardKernel backward_kernel(const AttentionParams& p, DType dtype, const Target& target);

// attnx::_attention_kernel: what run_attention (run_attention_backward with pb.backward) would run for
// `target`, raising the error it would raise.
void attention_kernel(AttentionKernelProblem& pb, const Target& target);

}  // namespace attnx::cuda
