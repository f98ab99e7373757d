// attnx: Metal kernel launches as the MPS glue makes them (csrc/mps/attention.mm, linear.mm): the plan of
// csrc/mps/metal_plan.h, the buffers bound at its indices (an absent one bound to query's or weight's buffer,
// never read then), params by value as setBytes copies them. For the C++ check programs of the emulation
// (race_check.cpp, plan_check.cpp), which build AttentionParams and LinearParams themselves.
#pragma once

#include "metal_runtime.h"
#include "mps/metal_plan.h"

namespace attnx_emu_metal {

// 0 on success; 1 unknown kernel name, 2 bad threadgroup size (from the launch), 3 no kernel in the plan.
inline int launch_attention(const attnx::AttentionParams& p, attnx::mps::DType dtype, void* query, void* key,
                            void* value, void* attn_mask, void* key_padding_mask, void* out, void* lse,
                            void* key_lengths, void* sinks) {
  namespace mps = attnx::mps;
  const mps::AttentionPlan plan = mps::plan_attention(p, dtype);
  if (plan.kernel == mps::AttentionKernel::kNone) return 3;
  if (mps::launch_empty(plan.launch)) return 0;
  attnx::AttentionParams params = p;
  const auto bound = [query](void* ptr) { return ptr ? ptr : query; };
  void* buffers[mps::kAttentionBuffers] = {};
  buffers[mps::kAttentionQuery] = query;
  buffers[mps::kAttentionKey] = key;
  buffers[mps::kAttentionValue] = value;
  buffers[mps::kAttentionMask] = bound(attn_mask);
  buffers[mps::kAttentionKeyPaddingMask] = bound(key_padding_mask);
  buffers[mps::kAttentionOut] = out;
  buffers[mps::kAttentionLse] = lse;
  buffers[mps::kAttentionKeyLengths] = bound(key_lengths);
  buffers[mps::kAttentionSinks] = bound(sinks);
  buffers[mps::kAttentionParams] = &params;
  return launch(plan.launch.name, plan.launch.grid, plan.launch.threads, buffers);
}

inline int launch_linear(const attnx::LinearParams& p, attnx::mps::DType dtype, void* input, void* weight,
                         void* bias, void* out) {
  namespace mps = attnx::mps;
  const mps::LinearPlan plan = mps::plan_linear(p, dtype);
  if (mps::launch_empty(plan.launch)) return 0;
  attnx::LinearParams params = p;
  void* buffers[mps::kLinearBuffers] = {};
  buffers[mps::kLinearInput] = input;
  buffers[mps::kLinearWeight] = weight;
  buffers[mps::kLinearBias] = bias ? bias : weight;
  buffers[mps::kLinearOut] = out;
  buffers[mps::kLinearParams] = &params;
  return launch(plan.launch.name, plan.launch.grid, plan.launch.threads, buffers);
}

}  // namespace attnx_emu_metal
