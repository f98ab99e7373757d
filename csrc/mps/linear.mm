// attnx: attnx::linear on MPS. The kernels (metal/linear.metal) read the input through its strides, so the
// B=1 transposed layout of nn.MultiheadAttention(batch_first=True), (L, B, E) views, slices and stride-0
// rows need no copy and no detour; an input with more than two leading dims that do not merge is copied once.
#include <ATen/ATen.h>
#include <torch/csrc/stable/library.h>

#include <optional>

#include "common/stable_bridge.h"
#include "mps/glue.h"
#include "mps/metal_library.h"

namespace attnx {

Tensor linear_mps(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  // Every check is metal_linear's, before mps::encode (which must not throw). Metal buffers come from the
  // tensors' at::Tensor form (the encoder is on the regular ABI, hence the bridge).
  using bridge::to_aten;
  const mps::MetalLinear call = mps::metal_linear(input, weight, bias);
  if (mps::launch_empty(call.plan.launch)) return call.out;
  const id<MTLComputePipelineState> pso = mps::pipeline(call.plan.launch.name);
  mps::check_launch(pso, call.plan.launch, "attnx::linear");
  mps::BufferRef buffers[mps::kLinearBuffers] = {};
  buffers[mps::kLinearInput] = mps::buffer_ref(to_aten(call.input));
  buffers[mps::kLinearWeight] = mps::buffer_ref(to_aten(weight));
  buffers[mps::kLinearBias] = mps::buffer_ref(to_aten(bias ? *bias : weight));  // never read without a bias
  buffers[mps::kLinearOut] = mps::buffer_ref(to_aten(call.out));
  mps::encode(pso, call.plan.launch, buffers, mps::kLinearParams, &call.params, sizeof(call.params));
  return call.out;
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, MPS, m) {
  m.impl("_linear", TORCH_BOX(&attnx::linear_mps));
  m.impl("_linear_autograd", TORCH_BOX(&attnx::linear_mps));
}
