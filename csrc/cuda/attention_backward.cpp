// attnx: attnx::attention_backward on CUDA. The checks and layouts are common/attention.cpp; the kernels are
// cuda/attention_backward_kernel.cu and attention_backward_kernel_mma.cu (torch-free), launched here on the
// current stream of the inputs' device.
//
// The fused kernels run when ATTNX_CUDA_FUSED_BACKWARD=1 (choose_backward, cuda/attention_plan.h): the
// tensor-core ones (cuda/attention_backward_kernel_mma.cu) where they cover the call, the SIMT ones
// (cuda/attention_backward_kernel.cu) elsewhere. They have passed the CPU emulation and ThreadSanitizer, not
// yet a GPU, so until they have, the default stays the whole-tensor math backward
// (common/attention_math.cpp), which has. The math backward also takes what the kernels do not: head dims
// above cuda::kMaxHeadDim.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>

#include "common/aten.h"
#include "common/attention.h"
#include "common/stable.h"
#include "cuda/attention.h"
#include "cuda/attention_backward_kernel.h"
#include "cuda/impls.h"
#include "cuda/device.h"

namespace attnx::cuda {

BackwardKernel backward_kernel(const AttentionParams& p, DType dtype, const Target& target) {
  const BackwardKernel kernel = choose_backward(p, dtype, target);
  ATTNX_CHECK(kernel != BackwardKernel::kMath || !p.has_block_map,
              "attnx::attention_backward: block_map's backward on CUDA is the fused tensor-core kernel "
              "(float16 or bfloat16, head dims up to 128, sm80+, block_q a multiple of 16 and block_k of 64; "
              "opt-in until it has run on a GPU: ATTNX_CUDA_FUSED_BACKWARD=1), got ", dtype_name(dtype),
              ", D=", p.head_dim, ", Dv=", p.v_head_dim, ", block_q=", p.block_q, ", block_k=", p.block_k,
              target.fused_backward ? "" : ", the fused backward off");
  return kernel;
}

void run_attention_backward(AttentionBackwardProblem& pb, const Target& target, cudaStream_t stream) {
  const DType dtype = kernel_dtype(pb.dtype, "attnx::attention_backward");
  const BackwardKernel kernel = backward_kernel(pb.params.fwd, dtype, target);
  if (kernel == BackwardKernel::kMath) {
    run_attention_backward_math(pb);
    return;
  }
  // attn_mask's gradient is summed in the accumulator dtype in a buffer of the gradient's own size, then
  // converted to the mask's dtype (as the CPU kernel).
  std::optional<Tensor> mask_grad;
  if (pb.grad_attn_mask) {
    mask_grad = aten::new_zeros(pb.lse, pb.params.grad_attn_mask_size);
    pb.ptr.grad_attn_mask = mask_grad->mutable_data_ptr();
  }
  // The workspace: the rows' numbers (and the tensor cores' mask classes), from the plan the launch runs.
  const std::optional<AttentionBackwardMmaPlan> mma =
      kernel == BackwardKernel::kMma ? std::optional(plan_attention_backward_mma(pb.params, dtype, pb.ptr))
                                     : std::nullopt;
  const size_t bytes = mma ? mma->workspace_bytes
                           : plan_attention_backward(pb.params, dtype, pb.grad_attn_mask).workspace_bytes;
  const int64_t rows[1] = {static_cast<int64_t>(bytes / acc_bytes(dtype))};
  const Tensor workspace = aten::new_empty(pb.lse, rows);
  void* const ws = workspace.mutable_data_ptr();
  const cudaError_t err = mma ? launch_attention_backward_mma(pb.params, dtype, pb.ptr, *mma, ws, stream)
                              : launch_attention_backward(pb.params, dtype, pb.ptr, ws, stream);
  const AttentionParams& p = pb.params.fwd;
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention_backward: CUDA kernel launch failed (B=", p.batch,
              ", H=", p.heads, ", Hkv=", p.kv_heads, ", L=", p.q_len, ", S=", p.kv_len, ", D=", p.head_dim,
              ", Dv=", p.v_head_dim, ", ", pb.dtype, "): ", cudaGetErrorString(err));
  if (mask_grad) pb.grad_attn_mask_out = mask_grad_from_buffer(*mask_grad, *pb.options.attn_mask);
}

}  // namespace attnx::cuda

#if !defined(ATTNX_CUDA_EMULATION)  // the CUDA library's entry point (see cuda/attention.cpp)
namespace attnx {

void run_attention_backward_cuda(AttentionBackwardProblem& pb) {
  const int32_t device = pb.query.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  cuda::run_attention_backward(pb, cuda::target(device), cuda::current_stream(device));
}

void attention_backward_cuda_impls(StableLibrary& cuda) {
  cuda.impl("attention_backward", &attention_op<run_attention_backward_cuda>);
}

}  // namespace attnx

#if !defined(ATTNX_CUDA_HOST_ONLY)  // the run-time compiled library registers when its route is chosen
STABLE_TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  attnx::attention_backward_cuda_impls(m);
}
#endif
#endif
