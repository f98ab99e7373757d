// attnx: attnx::varlen_attention and its backward on CPU: attention's kernels (cpu/attention_kernel_impl.h,
// cpu/attention_backward_kernel_impl.h), which take packed sequences and paged keys as parameters
// (AttentionParams::varlen, page_size), picked per ISA level as attention's are. The checks and layouts are
// common/varlen_attention.cpp.
#include "common/varlen_attention.h"

#include <torch/csrc/stable/library.h>

#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

namespace attnx {

void run_varlen_attention_cpu(VarlenAttentionProblem& pb) {
  static const cpu::AttentionKernel kernel = ATTNX_CPU_VARIANT(attention_kernel);
  kernel(pb.params, pb.ptr, pb.dtype);
}

void run_varlen_attention_backward_cpu(VarlenAttentionBackwardProblem& pb) {
  static const cpu::AttentionBackwardKernel kernel = ATTNX_CPU_VARIANT(attention_backward_kernel);
  kernel(pb.params, pb.ptr, pb.dtype);
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("_varlen_attention", &attnx::attention_op<attnx::run_varlen_attention_cpu>);
  m.impl("_varlen_attention_autograd", &attnx::attention_op<attnx::run_varlen_attention_cpu>);
  m.impl("varlen_attention_backward", &attnx::attention_op<attnx::run_varlen_attention_backward_cpu>);
}
