// attnx: attnx::linear on MPS. The kernels (metal/linear.metal) read the input through its strides, so the
// B=1 transposed layout of nn.MultiheadAttention(batch_first=True), (L, B, E) views, slices and stride-0
// rows need no copy and no detour; an input with more than two leading dims that do not merge is copied once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "common/linear.h"
#include "mps/metal_library.h"

namespace attnx {

at::Tensor linear_mps(const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  // Every check happens here, before mps::encode (which must not throw).
  check_linear_args(input, weight, bias);
  const mps::DType dtype = mps::metal_dtype(input.scalar_type(), "attnx::linear");

  const int64_t N = weight.size(0);
  const auto pack = [&](const at::Tensor& x, LinearParams* p) {
    return mps::pack_linear_params(x.dim(), x.sizes().data(), x.strides().data(), N, weight.strides().data(),
                                   bias.has_value(), bias ? bias->size(0) : 0, bias ? bias->stride(0) : 0, p);
  };
  LinearParams params{};
  at::Tensor x = input;
  if (!pack(x, &params)) {
    // No (outer, inner) row indexing exists (e.g. a 4-D input with two gaps): one copy, then one kernel.
    x = input.clone(at::MemoryFormat::Contiguous);
    pack(x, &params);
  }
  std::vector<int64_t> out_sizes(input.sizes().begin(), input.sizes().end());
  out_sizes.back() = N;
  at::Tensor out = at::empty(out_sizes, input.options());  // contiguous (params.out_stride): logical order

  const mps::LinearPlan plan = mps::plan_linear(params, dtype);
  if (mps::launch_empty(plan.launch)) return out;
  const id<MTLComputePipelineState> pso = mps::pipeline(plan.launch.name);
  mps::check_launch(pso, plan.launch, "attnx::linear");
  mps::BufferRef buffers[mps::kLinearBuffers] = {};
  buffers[mps::kLinearInput] = mps::buffer_ref(x);
  buffers[mps::kLinearWeight] = mps::buffer_ref(weight);
  buffers[mps::kLinearBias] = mps::buffer_ref(bias ? *bias : weight);  // never read without a bias
  buffers[mps::kLinearOut] = mps::buffer_ref(out);
  mps::encode(pso, plan.launch, buffers, mps::kLinearParams, &params, sizeof(params));
  return out;
}

}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, MPS, m) {
  m.impl("_linear", &attnx::linear_mps);
  m.impl("_linear_autograd", &attnx::linear_mps);
}
