// attnx: attnx::attention_backward on CUDA. The checks and layouts are common/attention.cpp; the kernels are
// cuda/attention_backward_kernel.cu (torch-free), launched here on the current stream of the inputs' device.
//
// The fused kernels run when ATTNX_CUDA_FUSED_BACKWARD=1 (read once per process): they have passed the CPU
// emulation (tests/test_cuda_emulation_backward.py) and ThreadSanitizer, not yet a GPU, so until they have,
// the default stays the whole-tensor math backward (common/attention_math.cpp), which has. The math backward
// also takes what the kernels do not: head dims above cuda::kMaxHeadDim.
#include <cuda_runtime_api.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "common/aten.h"
#include "common/attention.h"
#include "common/stable.h"
#include "cuda/attention_backward_kernel.h"
#include "cuda/stream.h"

namespace attnx {

namespace {

bool fused_backward_requested() {
  static const bool requested = [] {
    const char* flag = std::getenv("ATTNX_CUDA_FUSED_BACKWARD");
    return flag != nullptr && std::strcmp(flag, "1") == 0;
  }();
  return requested;
}

}  // namespace

void run_attention_backward_cuda(AttentionBackwardProblem& pb) {
  const cuda::DType dtype = cuda::kernel_dtype(pb.dtype, "attnx::attention_backward");
  const cuda::AttentionBackwardPlan plan = cuda::plan_attention_backward(pb.params, dtype, pb.grad_attn_mask);
  if (!fused_backward_requested() || plan.bucket == 0) {
    run_attention_backward_math(pb);
    return;
  }
  const int32_t device = pb.query.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  // delta, one accumulator per query row; the mask's gradient summed in the accumulator dtype in a buffer of
  // the gradient's own size, then converted to the mask's dtype (as the CPU kernel).
  const int64_t rows[1] = {static_cast<int64_t>(plan.workspace_bytes / acc_bytes(dtype))};
  const Tensor workspace = aten::new_empty(pb.lse, rows);
  std::optional<Tensor> mask_grad;
  if (pb.grad_attn_mask) {
    mask_grad = aten::new_zeros(pb.lse, pb.params.grad_attn_mask_size);
    pb.ptr.grad_attn_mask = mask_grad->mutable_data_ptr();
  }
  const cudaError_t err = cuda::launch_attention_backward(
      pb.params, dtype, pb.ptr, workspace.mutable_data_ptr(), cuda::current_stream(device));
  const AttentionParams& p = pb.params.fwd;
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention_backward: CUDA kernel launch failed (B=", p.batch,
              ", H=", p.heads, ", Hkv=", p.kv_heads, ", L=", p.q_len, ", S=", p.kv_len, ", D=", p.head_dim,
              ", Dv=", p.v_head_dim, ", ", pb.dtype, "): ", cudaGetErrorString(err));
  if (mask_grad) pb.grad_attn_mask_out = mask_grad_from_buffer(*mask_grad, *pb.options.attn_mask);
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("attention_backward", &attnx::attention_op<attnx::run_attention_backward_cuda>);
}
