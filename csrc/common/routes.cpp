// attnx: the public differentiable ops choose their kernel op by grad mode (see csrc/schemas.cpp).
//
// With grad mode off, linear / attention / mha (and varlen_attention, likewise) run _linear / _attention /
// _mha, which have no autograd kernel: the call costs one more dispatch than the kernel and runs no Python.
// With grad mode on they run _linear_autograd / _attention_autograd / mha_forward, whose Autograd kernels are
// registered from Python (python/attnx/_autograd.py) and decide from requires_grad whether to record a
// backward. The routers are CompositeImplicitAutograd kernels: they hold for every backend, and fake tensors,
// torch.compile and export see through them to the op they chose.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>

#include "common/stable.h"

namespace attnx {
namespace {

// Forwards the whole stack (the two ops have the router's arguments) and its ownership: the dispatcher call takes
// the arguments and leaves the chosen op's outputs on the stack, of which the router returns the first
// num_outputs; an op with more outputs (mha_forward's saved tensors) has the rest released here.
template <const char* kNoGrad, const char* kGrad, uint64_t kGradOutputs>
void route(StableIValue* stack, uint64_t /*num_args*/, uint64_t num_outputs) {
  const bool grad = aoti_torch_grad_mode_is_enabled();
  const char* op = grad ? kGrad : kNoGrad;
  stable::dispatch(op, "", stack, op);
  if (grad) {
    for (uint64_t i = num_outputs; i < kGradOutputs; ++i) {
      aoti_torch_delete_tensor_object(torch::stable::detail::to<AtenTensorHandle>(stack[i]));
    }
  }
}

constexpr char kLinear[] = "attnx::_linear";
constexpr char kLinearAutograd[] = "attnx::_linear_autograd";
constexpr char kAttention[] = "attnx::_attention";
constexpr char kAttentionAutograd[] = "attnx::_attention_autograd";
constexpr char kVarlen[] = "attnx::_varlen_attention";
constexpr char kVarlenAutograd[] = "attnx::_varlen_attention_autograd";
constexpr char kMha[] = "attnx::_mha";
constexpr char kMhaForward[] = "attnx::mha_forward";

}  // namespace
}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeImplicitAutograd, m) {
  m.impl("linear", &attnx::route<attnx::kLinear, attnx::kLinearAutograd, 1>);
  m.impl("attention", &attnx::route<attnx::kAttention, attnx::kAttentionAutograd, 2>);
  m.impl("mha", &attnx::route<attnx::kMha, attnx::kMhaForward, 7>);
  m.impl("varlen_attention", &attnx::route<attnx::kVarlen, attnx::kVarlenAutograd, 2>);
}
