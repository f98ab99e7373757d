// attnx: torch::stable::Tensor -> at::Tensor, for the MPS encoders, which bind the Metal buffers of tensors that
// the stable-ABI glue made. Regular build only: it goes when the last at::Tensor file does.
//
// A torch::stable::Tensor owns an AtenTensorHandle, which in libtorch is a heap-allocated at::Tensor: a new
// handle is one more reference to the same TensorImpl (no copy of data or metadata), and the at::Tensor behind a
// handle is read back as it is.
#pragma once

#ifdef TORCH_TARGET_VERSION
#error "common/stable_bridge.h joins the regular and the stable ABI; no file of a stable-ABI build includes it"
#endif

#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>

namespace attnx::bridge {

inline at::Tensor to_aten(const torch::stable::Tensor& t) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(t.get());
}

}  // namespace attnx::bridge
