// attnx: attnx::linear on CUDA. The layout work is common/linear.cpp; the GEMM is ATen's addmm on cuBLAS, the
// one F.linear uses, so the only difference from F.linear is that no layout forces a detour.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/linear.h"

namespace attnx {

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  // Only a CUDA input sets the device; a mix of devices fails linear_via_gemm's checks with F.linear's
  // message.
  c10::cuda::OptionalCUDAGuard guard;
  if (input.is_cuda()) guard.set_device(input.device());
  return linear_via_gemm(input, weight, bias);
}

}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("_linear", &attnx::linear_cuda);
  m.impl("_linear_autograd", &attnx::linear_cuda);
}
