// attnx: attnx::attention on MPS. The checks and layouts are common/attention.cpp; the kernels are
// metal/attention.metal, checked, chosen and sized by mps/glue.h (metal_plan.h), encoded on torch's current
// MPS stream.
#include <ATen/ATen.h>
#include <torch/csrc/stable/library.h>

#include <optional>

#include "common/attention.h"
#include "common/stable_bridge.h"
#include "mps/glue.h"
#include "mps/metal_library.h"

namespace attnx {

void run_attention_mps(AttentionProblem& pb) {
  // NotImplementedError, as torch says of what a backend lacks (mps/glue.h's stable-ABI checks raise
  // RuntimeErrors); every other check is attention_plan's, before mps::encode (which must not throw).
  TORCH_CHECK_NOT_IMPLEMENTED(pb.options.dropout_p == 0.0,
                              "attnx::attention: dropout is not implemented on MPS yet");
  const AttentionOptions& o = pb.options;
  const mps::AttentionPlan plan = mps::attention_plan(pb);
  const AttentionParams params = pb.params;
  if (mps::launch_empty(plan.launch)) return;

  const id<MTLComputePipelineState> pso = mps::pipeline(plan.launch.name);
  mps::check_launch(pso, plan.launch, "attnx::attention");
  // The tensors are on the stable ABI (common/attention.cpp); Metal buffers come from their at::Tensor form.
  using bridge::to_aten;
  const at::Tensor query = to_aten(pb.query);
  // Absent masks, key_lengths and sinks are bound to query's buffer: never read (their kind is kMaskNone,
  // kKeyLengthsNone, has_sinks 0), but every buffer argument of the kernel is bound.
  const auto bound = [&](const std::optional<Tensor>& t) { return mps::buffer_ref(t ? to_aten(*t) : query); };
  mps::BufferRef buffers[mps::kAttentionBuffers] = {};
  buffers[mps::kAttentionQuery] = mps::buffer_ref(query);
  buffers[mps::kAttentionKey] = mps::buffer_ref(to_aten(pb.key));
  buffers[mps::kAttentionValue] = mps::buffer_ref(to_aten(pb.value));
  buffers[mps::kAttentionMask] = bound(o.attn_mask);
  buffers[mps::kAttentionKeyPaddingMask] = bound(o.key_padding_mask);
  buffers[mps::kAttentionOut] = mps::buffer_ref(to_aten(pb.out));
  buffers[mps::kAttentionLse] = mps::buffer_ref(to_aten(pb.lse));
  buffers[mps::kAttentionKeyLengths] = bound(o.key_lengths);
  buffers[mps::kAttentionSinks] = bound(pb.sinks_acc);
  mps::encode(pso, plan.launch, buffers, mps::kAttentionParams, &params, sizeof(params));
}

void attention_kernel_mps(AttentionKernelProblem& pb) {
  mps::attention_kernel(pb);
}

}  // namespace attnx

// Through the stable adapter like every backend (the kernel itself is on the regular ABI, hence the bridge).
STABLE_TORCH_LIBRARY_IMPL(attnx, MPS, m) {
  m.impl("_attention", &attnx::attention_op<attnx::run_attention_mps>);
  m.impl("_attention_autograd", &attnx::attention_op<attnx::run_attention_mps>);
  m.impl("_attention_kernel", &attnx::attention_op<attnx::attention_kernel_mps>);
}
