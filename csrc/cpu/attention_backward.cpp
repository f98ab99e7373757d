// attnx: attnx::attention_backward on CPU. The checks and layouts are common/attention.cpp; the kernel is
// cpu/attention_backward_kernel_impl.h, compiled with the forward kernel for each ISA level (see
// cpu/attention_backward_kernel.h) and picked at run time like the forward.
#include <torch/csrc/stable/library.h>

#include <optional>

#include "common/aten.h"
#include "common/attention.h"
#include "cpu/attention.h"
#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

namespace attnx {

void run_attention_backward_cpu(AttentionBackwardProblem& pb) {
  // The mask's gradient is summed in the accumulator dtype, in a buffer of the gradient's own size (never
  // (B, H, L, S) unless the mask is), then converted to the mask's dtype.
  std::optional<Tensor> mask_grad;
  if (pb.grad_attn_mask) {
    mask_grad = aten::new_zeros(pb.lse, pb.params.grad_attn_mask_size);
    pb.ptr.grad_attn_mask = mask_grad->mutable_data_ptr();
  }
  static const cpu::AttentionBackwardKernel kernel = ATTNX_CPU_VARIANT(attention_backward_kernel);
  kernel(pb.params, pb.ptr, pb.dtype);
  if (mask_grad) pb.grad_attn_mask_out = mask_grad_from_buffer(*mask_grad, *pb.options.attn_mask);
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("attention_backward", &attnx::attention_op<attnx::run_attention_backward_cpu>);
}
