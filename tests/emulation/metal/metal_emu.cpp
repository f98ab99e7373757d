// attnx: C entry points to the Metal kernels compiled for the CPU (see metal_runtime.h), for ctypes.
//
// Each call takes its launch from csrc/mps/metal_plan.h and binds the buffers at the plan's indices, as the
// MPS glue (csrc/mps/*_mps.mm) does; params go by value, as setBytes copies them.
#include "metal_runtime.h"
#include "mps/metal_plan.h"

using attnx::AttentionParams;
using attnx::LinearParams;
namespace mps = attnx::mps;

extern "C" {

size_t attnx_metal_emu_sizeof_attention_params() {
  return sizeof(AttentionParams);
}
size_t attnx_metal_emu_sizeof_linear_params() {
  return sizeof(LinearParams);
}
size_t attnx_metal_emu_sizeof_attention_plan() {
  return sizeof(mps::AttentionPlan);
}
size_t attnx_metal_emu_sizeof_linear_plan() {
  return sizeof(mps::LinearPlan);
}

int attnx_metal_emu_kernel_count() {
  return attnx_emu_metal::kernel_count();
}
const char* attnx_metal_emu_kernel_name(int index) {
  return attnx_emu_metal::kernel_name(index);
}
size_t attnx_metal_emu_last_threadgroup_bytes() {
  return attnx_emu_metal::last_threadgroup_bytes();
}

void attnx_metal_emu_plan_attention(const AttentionParams* p, int dtype, mps::AttentionPlan* plan) {
  *plan = mps::plan_attention(*p, static_cast<mps::DType>(dtype));
}

void attnx_metal_emu_plan_linear(const LinearParams* p, int dtype, mps::LinearPlan* plan) {
  *plan = mps::plan_linear(*p, static_cast<mps::DType>(dtype));
}

int attnx_metal_emu_linear_input_layout(int ndim, const int64_t* sizes, const int64_t* strides,
                                        LinearParams* p) {
  return mps::linear_input_layout(ndim, sizes, strides, p) ? 1 : 0;
}

int attnx_metal_emu_pack_linear_params(int ndim, const int64_t* sizes, const int64_t* strides,
                                       int64_t out_features, const int64_t* weight_strides, int has_bias,
                                       int64_t bias_size, int64_t bias_stride, LinearParams* p) {
  return mps::pack_linear_params(ndim, sizes, strides, out_features, weight_strides, has_bias != 0, bias_size,
                                 bias_stride, p)
             ? 1
             : 0;
}

// Any kernel by host name, with its buffers in [[buffer(i)]] order (the shim's own tests use this).
int attnx_metal_emu_launch(const char* name, const int64_t* grid, int threads, void* const* buffers) {
  return attnx_emu_metal::launch(name, grid, threads, buffers);
}

// 0 on success; 1 unknown kernel name, 2 bad threadgroup size (from the launch), 3 no kernel in the plan.
int attnx_metal_emu_attention(const AttentionParams* p, int dtype, void* query, void* key, void* value,
                              void* attn_mask, void* key_padding_mask, void* out, void* lse,
                              void* key_lengths, void* sinks) {
  const mps::AttentionPlan plan = mps::plan_attention(*p, static_cast<mps::DType>(dtype));
  if (plan.kernel == mps::AttentionKernel::kNone) return 3;
  if (mps::launch_empty(plan.launch)) return 0;
  AttentionParams params = *p;
  void* buffers[mps::kAttentionBuffers] = {};
  buffers[mps::kAttentionQuery] = query;
  buffers[mps::kAttentionKey] = key;
  buffers[mps::kAttentionValue] = value;
  buffers[mps::kAttentionMask] = attn_mask;  // nullptr when absent: a kernel that read it would crash
  buffers[mps::kAttentionKeyPaddingMask] = key_padding_mask;
  buffers[mps::kAttentionOut] = out;
  buffers[mps::kAttentionLse] = lse;
  buffers[mps::kAttentionKeyLengths] = key_lengths;  // likewise nullptr when absent
  buffers[mps::kAttentionSinks] = sinks;
  buffers[mps::kAttentionParams] = &params;
  return attnx_emu_metal::launch(plan.launch.name, plan.launch.grid, plan.launch.threads, buffers);
}

int attnx_metal_emu_linear(const LinearParams* p, int dtype, void* input, void* weight, void* bias,
                           void* out) {
  const mps::LinearPlan plan = mps::plan_linear(*p, static_cast<mps::DType>(dtype));
  if (mps::launch_empty(plan.launch)) return 0;
  LinearParams params = *p;
  void* buffers[mps::kLinearBuffers] = {};
  buffers[mps::kLinearInput] = input;
  buffers[mps::kLinearWeight] = weight;
  buffers[mps::kLinearBias] = bias;
  buffers[mps::kLinearOut] = out;
  buffers[mps::kLinearParams] = &params;
  return attnx_emu_metal::launch(plan.launch.name, plan.launch.grid, plan.launch.threads, buffers);
}

}  // extern "C"
