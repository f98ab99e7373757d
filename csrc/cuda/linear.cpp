// attnx: attnx::linear on CUDA. The layout work is common/linear.cpp; the GEMM is torch's addmm / mm on
// cuBLAS, the one F.linear uses, so the only difference from F.linear is that no layout forces a detour. On
// the LibTorch stable ABI: the device guard is the shim's accelerator-generic one, not c10::cuda's.
#include "common/linear.h"
#include "cuda/impls.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>

namespace attnx {

torch::stable::Tensor linear_cuda(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                                  const std::optional<torch::stable::Tensor>& bias) {
  // Only a CUDA input sets the device; a mix of devices fails linear_via_gemm's checks with F.linear's
  // message.
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  if (input.is_cuda()) guard.emplace(input.get_device_index());
  return linear_via_gemm(input, weight, bias);
}

void linear_cuda_impls(StableLibrary& cuda) {
  cuda.impl("_linear", TORCH_BOX(&linear_cuda));
  cuda.impl("_linear_autograd", TORCH_BOX(&linear_cuda));
}

}  // namespace attnx

#if !defined(ATTNX_CUDA_HOST_ONLY)  // the run-time compiled library registers when its route is chosen
STABLE_TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  attnx::linear_cuda_impls(m);
}
#endif
