// attnx: at::Tensor <-> torch::stable::Tensor, for the files still on the regular ABI that call code already on
// the stable one. Regular build only: it goes when the last at::Tensor file does.
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

#include "common/linear.h"

namespace attnx::bridge {

inline torch::stable::Tensor to_stable(const at::Tensor& t) {
  return torch::stable::Tensor(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
}

inline std::optional<torch::stable::Tensor> to_stable(const std::optional<at::Tensor>& t) {
  return t ? std::optional<torch::stable::Tensor>(to_stable(*t)) : std::nullopt;
}

inline at::Tensor to_aten(const torch::stable::Tensor& t) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(t.get());
}

}  // namespace attnx::bridge

namespace attnx {

// For mps/linear.mm.
inline void check_linear_args(const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  check_linear_args(bridge::to_stable(input), bridge::to_stable(weight), bridge::to_stable(bias));
}

}  // namespace attnx
