// attnx: the MPS backend on the CPU, for the tests (tests/emulation/backends.py builds and loads it). The glue
// is csrc/mps/glue.h, which mps/attention.mm and mps/linear.mm run too (checks, plans, the one input copy of
// linear); the kernels are metal/*.metal compiled for the CPU with clang against the metal_stdlib shim (a
// library of their own, with metal_runtime.cpp, linked here). attnx_emu_metal::enable makes these attnx's CPU
// kernels of attention, its backward (the whole-tensor math, as on MPS), _attention_kernel and linear; buffers are bound at the plan's indices, as the .mm
// files bind them, and params go by value, as setBytes copies them.
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <optional>

#include "backend.h"
#include "common/attention.h"
#include "common/stable.h"
#include "metal_runtime.h"
#include "mps/glue.h"

namespace {

using attnx::AttentionKernelProblem;
using attnx::AttentionProblem;
using torch::stable::Tensor;
namespace mps = attnx::mps;

attnx_emu::Library* library = nullptr;

void launch(const mps::Launch& launch, void* const* buffers, const char* op) {
  const int err = attnx_emu_metal::launch(launch.name, launch.grid, launch.threads, buffers);
  ATTNX_CHECK(err == 0, op, ": emulated Metal launch of ", launch.name, " failed: ",
              err == 1 ? "no kernel of that name" : "a threadgroup size Metal refuses");
}

void run_attention(AttentionProblem& pb) {
  const mps::AttentionPlan plan = mps::attention_plan(pb);
  if (mps::launch_empty(plan.launch)) return;
  attnx::AttentionParams params = pb.params;
  const attnx::AttentionPointers& ptr = pb.ptr;
  // Absent masks, key_lengths and sinks are bound to query's buffer, as mps/attention.mm binds them.
  const auto bound = [&](const void* p) { return const_cast<void*>(p ? p : ptr.query); };
  void* buffers[mps::kAttentionBuffers] = {};
  buffers[mps::kAttentionQuery] = bound(ptr.query);
  buffers[mps::kAttentionKey] = bound(ptr.key);
  buffers[mps::kAttentionValue] = bound(ptr.value);
  buffers[mps::kAttentionMask] = bound(ptr.attn_mask);
  buffers[mps::kAttentionKeyPaddingMask] = bound(ptr.key_padding_mask);
  buffers[mps::kAttentionOut] = ptr.out;
  buffers[mps::kAttentionLse] = ptr.lse;
  buffers[mps::kAttentionKeyLengths] = bound(ptr.key_lengths);
  buffers[mps::kAttentionSinks] = bound(ptr.sinks);
  buffers[mps::kAttentionParams] = &params;
  launch(plan.launch, buffers, "attnx::attention");
}

void attention_kernel(AttentionKernelProblem& pb) {
  mps::attention_kernel(pb);
}

Tensor linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  const mps::MetalLinear call = mps::metal_linear(input, weight, bias);
  if (mps::launch_empty(call.plan.launch)) return call.out;
  attnx::LinearParams params = call.params;
  void* buffers[mps::kLinearBuffers] = {};
  buffers[mps::kLinearInput] = const_cast<void*>(call.input.const_data_ptr());
  buffers[mps::kLinearWeight] = const_cast<void*>(weight.const_data_ptr());
  buffers[mps::kLinearBias] = const_cast<void*>((bias ? *bias : weight).const_data_ptr());
  buffers[mps::kLinearOut] = call.out.mutable_data_ptr();
  buffers[mps::kLinearParams] = &params;
  launch(call.plan.launch, buffers, "attnx::linear");
  return call.out;
}

// attnx_emu_metal::enable: the emulated MPS backend on or off.
bool enable(bool on) {
  return attnx_emu::override_cpu_kernels(library, on, [](attnx_emu::Library& m) {
    m.impl("_attention", &attnx::attention_op<run_attention>);
    m.impl("_attention_autograd", &attnx::attention_op<run_attention>);
    m.impl("_attention_kernel", &attnx::attention_op<attention_kernel>);
    // MPS registers no backward: attention_backward there is the whole-tensor math composite.
    m.impl("attention_backward", &attnx::attention_op<attnx::run_attention_backward_math>);
    m.impl("_linear", TORCH_BOX(&linear));
    m.impl("_linear_autograd", TORCH_BOX(&linear));
  });
}

}  // namespace

STABLE_TORCH_LIBRARY(attnx_emu_metal, m) {
  m.def("enable(bool on) -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(attnx_emu_metal, CompositeExplicitAutograd, m) {
  m.impl("enable", TORCH_BOX(&enable));
}
