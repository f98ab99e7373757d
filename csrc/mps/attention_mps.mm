// attnx: attnx::attention on MPS. The checks and layouts are common/attention.cpp; the kernels are
// metal/attention.metal, chosen and sized by metal_plan.h, encoded on torch's current MPS stream.
#include <ATen/ATen.h>
#include <ATen/mps/MPSStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/attention.h"
#include "common/stable_bridge.h"
#include "mps/metal_library.h"

namespace attnx {

std::tuple<at::Tensor, at::Tensor> attention_mps(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                 bool is_causal, std::optional<double> scale, double dropout_p,
                                                 const std::optional<at::Tensor>& dropout_seed,
                                                 int64_t window_left, int64_t window_right,
                                                 const std::optional<at::Tensor>& key_lengths,
                                                 std::optional<double> softcap,
                                                 const std::optional<at::Tensor>& sinks) {
  // Every check happens here, before dispatch_sync: an exception inside the block would end the process.
  TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0, "attnx::attention: dropout is not implemented on MPS yet");
  const mps::DType dtype = mps::metal_dtype(query.scalar_type(), "attnx::attention");
  for (const auto* mask : {&attn_mask, &key_padding_mask}) {
    TORCH_CHECK(!*mask || (*mask)->scalar_type() != at::kDouble,
                "attnx::attention: float64 masks are not supported on MPS (Metal has no double)");
  }
  TORCH_CHECK(!sinks || sinks->scalar_type() != at::kDouble,
              "attnx::attention: float64 sinks are not supported on MPS (Metal has no double)");
  // Grouped KV heads, key_lengths (int32 or int64, read in place and clamped into [0, S] by the kernels:
  // reading their values here would cost a device sync), windows, softcap and sinks are parameters of both
  // kernels. sinks reach them as float32 (H,) contiguous (pb.sinks_acc).
  // The checks and layouts are on the stable ABI (common/attention.cpp); this file is not, hence the bridge.
  using bridge::to_aten, bridge::to_stable;
  AttentionProblem pb = prepare_attention(to_stable(query), to_stable(key), to_stable(value), to_stable(attn_mask),
                                          to_stable(key_padding_mask), is_causal, scale, dropout_p,
                                          to_stable(dropout_seed), window_left, window_right, to_stable(key_lengths),
                                          softcap, to_stable(sinks));
  const at::Tensor out = to_aten(pb.out), lse = to_aten(pb.lse);
  const AttentionParams params = pb.params;
  const mps::AttentionPlan plan = mps::plan_attention(params, dtype);
  TORCH_CHECK(plan.kernel != mps::AttentionKernel::kNone,
              "attnx::attention: expected head dims D and Dv up to ", metal_config::kMaxHeadDim,
              " on MPS, got D=", params.head_dim, ", Dv=", params.v_head_dim,
              " (B*H=", params.batch * params.heads, ", L=", params.q_len, ")");
  if (mps::launch_empty(plan.launch)) return {out, lse};

  const id<MTLComputePipelineState> pso = mps::pipeline(plan.launch.name);
  mps::check_launch(pso, plan.launch, "attnx::attention");
  // Absent masks, key_lengths and sinks are bound to query's buffer: never read (their kind is kMaskNone,
  // kKeyLengthsNone, has_sinks 0), but every buffer argument of the kernel is bound.
  struct Buffers {
    mps::BufferRef ref[mps::kAttentionBuffers];
  } buffers{};
  buffers.ref[mps::kAttentionQuery] = mps::buffer_ref(query);
  buffers.ref[mps::kAttentionKey] = mps::buffer_ref(key);
  buffers.ref[mps::kAttentionValue] = mps::buffer_ref(value);
  buffers.ref[mps::kAttentionMask] = mps::buffer_ref(attn_mask ? *attn_mask : query);
  buffers.ref[mps::kAttentionKeyPaddingMask] = mps::buffer_ref(key_padding_mask ? *key_padding_mask : query);
  buffers.ref[mps::kAttentionOut] = mps::buffer_ref(out);
  buffers.ref[mps::kAttentionLse] = mps::buffer_ref(lse);
  buffers.ref[mps::kAttentionKeyLengths] = mps::buffer_ref(key_lengths ? *key_lengths : query);
  buffers.ref[mps::kAttentionSinks] = mps::buffer_ref(pb.sinks_acc ? to_aten(*pb.sinks_acc) : query);
  const mps::Launch launch = plan.launch;

  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      // torch's live encoder, coalesced with its own kernels; never created or ended here.
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      [encoder setComputePipelineState:pso];
      for (int i = 0; i < mps::kAttentionParams; ++i) {
        [encoder setBuffer:buffers.ref[i].buffer offset:buffers.ref[i].offset atIndex:i];
      }
      [encoder setBytes:&params length:sizeof(params) atIndex:mps::kAttentionParams];
      [encoder dispatchThreadgroups:MTLSizeMake(launch.grid[0], launch.grid[1], launch.grid[2])
              threadsPerThreadgroup:MTLSizeMake(launch.threads, 1, 1)];
    }
  });
  return {out, lse};
}

}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, MPS, m) {
  m.impl("_attention", &attnx::attention_mps);
  m.impl("_attention_autograd", &attnx::attention_mps);
}
