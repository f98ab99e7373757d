// attnx: attnx::linear on CPU. The layout work is common/linear.cpp; the GEMM is ATen's CPU BLAS, the one
// F.linear uses, so the only difference from F.linear is that no layout forces a detour.
#include <torch/library.h>

#include "common/linear.h"

namespace attnx {

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_via_gemm(input, weight, bias);
}

}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CPU, m) { m.impl("linear", &attnx::linear_cpu); }
