// attnx: attnx::attention on MPS. The checks and layouts are common/attention.cpp; the kernels are
// metal/attention.metal, chosen and sized by metal_plan.h, encoded on torch's current MPS stream.
#include <ATen/ATen.h>
#include <torch/csrc/stable/library.h>

#include <optional>

#include "common/attention.h"
#include "common/stable_bridge.h"
#include "mps/metal_library.h"

namespace attnx {

void run_attention_mps(AttentionProblem& pb) {
  // Every check happens here, before mps::encode (which must not throw).
  const AttentionOptions& o = pb.options;
  TORCH_CHECK_NOT_IMPLEMENTED(o.dropout_p == 0.0, "attnx::attention: dropout is not implemented on MPS yet");
  const mps::DType dtype = mps::metal_dtype(pb.dtype, "attnx::attention");
  for (const auto* mask : {&o.attn_mask, &o.key_padding_mask}) {
    TORCH_CHECK(!*mask || (*mask)->scalar_type() != ScalarType::Double,
                "attnx::attention: float64 masks are not supported on MPS (Metal has no double)");
  }
  TORCH_CHECK(!o.sinks || o.sinks->scalar_type() != ScalarType::Double,
              "attnx::attention: float64 sinks are not supported on MPS (Metal has no double)");
  // Grouped KV heads, key_lengths (int32 or int64, read in place and clamped into [0, S] by the kernels:
  // reading their values here would cost a device sync), windows, softcap and sinks are parameters of both
  // kernels. sinks reach them as float32 (H,) contiguous (pb.sinks_acc).
  const AttentionParams params = pb.params;
  const mps::AttentionPlan plan = mps::plan_attention(params, dtype);
  TORCH_CHECK(plan.kernel != mps::AttentionKernel::kNone,
              "attnx::attention: expected head dims D and Dv up to ", metal_config::kMaxHeadDim,
              " on MPS, got D=", params.head_dim, ", Dv=", params.v_head_dim,
              " (B*H=", params.batch * params.heads, ", L=", params.q_len, ")");
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

}  // namespace attnx

// Through the stable adapter like every backend (the kernel itself is on the regular ABI, hence the bridge).
STABLE_TORCH_LIBRARY_IMPL(attnx, MPS, m) {
  m.impl("_attention", &attnx::attention_op<attnx::run_attention_mps>);
  m.impl("_attention_autograd", &attnx::attention_op<attnx::run_attention_mps>);
}
