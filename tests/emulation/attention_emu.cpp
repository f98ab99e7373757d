// attnx: a C entry point to attnx::attention's CUDA kernels compiled for the CPU (see cuda_shim.h), for
// ctypes.
//
// The launch goes through the real launcher, launch_attention() in csrc/cuda/attention_kernel.cu, so grid,
// block and shared memory are the plan the GPU gets (plan_attention() in csrc/cuda/attention_plan.h).
#include "cuda/attention_backward_kernel.h"
#include "cuda/attention_kernel.h"

#include <vector>

extern "C" {

// sizeof(AttentionParams) and sizeof(AttentionPlan): the Python side checks its ctypes mirrors against them.
size_t attnx_emu_sizeof_params() {
  return sizeof(attnx::AttentionParams);
}
size_t attnx_emu_sizeof_plan() {
  return sizeof(attnx::cuda::AttentionPlan);
}

void attnx_emu_plan(const attnx::AttentionParams* p, int dtype, attnx::cuda::AttentionPlan* plan) {
  *plan = attnx::cuda::plan_attention(*p, static_cast<attnx::cuda::DType>(dtype));
}

// Returns the cudaError_t of the launch (0 = cudaSuccess). kernel: 0 = SIMT, 1 = mma. key_lengths and sinks
// may be null (absent).
int attnx_emu_attention(const attnx::AttentionParams* p, int dtype, int kernel, const void* query,
                        const void* key, const void* value, const void* attn_mask,
                        const void* key_padding_mask, void* out, void* lse, const void* key_lengths,
                        const void* sinks) {
  attnx::AttentionPointers ptr{};
  ptr.query = query;
  ptr.key = key;
  ptr.value = value;
  ptr.attn_mask = attn_mask;
  ptr.key_padding_mask = key_padding_mask;
  ptr.out = out;
  ptr.lse = lse;
  ptr.key_lengths = key_lengths;
  ptr.sinks = sinks;
  return static_cast<int>(attnx::cuda::launch_attention(*p, static_cast<attnx::cuda::DType>(dtype), ptr,
                                                        /*stream=*/nullptr,
                                                        static_cast<attnx::cuda::Kernel>(kernel)));
}

size_t attnx_emu_sizeof_backward_params() {
  return sizeof(attnx::AttentionBackwardParams);
}

// attention_backward's launches (launch_attention_backward) with the forward's pointers as attnx_emu_attention
// takes them (out and lse are read here), the gradients, and grad_attn_mask (a zeroed buffer, or null).
// Allocates the workspace itself. Returns the cudaError_t of the launches.
int attnx_emu_attention_backward(const attnx::AttentionBackwardParams* p, int dtype, const void* query,
                                 const void* key, const void* value, const void* attn_mask,
                                 const void* key_padding_mask, const void* out, const void* lse,
                                 const void* key_lengths, const void* sinks, const void* grad_out,
                                 void* grad_query, void* grad_key, void* grad_value, void* grad_attn_mask) {
  attnx::AttentionBackwardPointers ptr{};
  ptr.fwd.query = query;
  ptr.fwd.key = key;
  ptr.fwd.value = value;
  ptr.fwd.attn_mask = attn_mask;
  ptr.fwd.key_padding_mask = key_padding_mask;
  ptr.fwd.out = const_cast<void*>(out);
  ptr.fwd.lse = const_cast<void*>(lse);
  ptr.fwd.key_lengths = key_lengths;
  ptr.fwd.sinks = sinks;
  ptr.grad_out = grad_out;
  ptr.grad_query = grad_query;
  ptr.grad_key = grad_key;
  ptr.grad_value = grad_value;
  ptr.grad_attn_mask = grad_attn_mask;
  const auto d = static_cast<attnx::cuda::DType>(dtype);
  const attnx::cuda::AttentionBackwardPlan plan =
      attnx::cuda::plan_attention_backward(*p, d, grad_attn_mask != nullptr);
  std::vector<unsigned char> workspace(plan.workspace_bytes + 16);
  return static_cast<int>(attnx::cuda::launch_attention_backward(*p, d, ptr, workspace.data(), /*stream=*/nullptr));
}

}  // extern "C"
