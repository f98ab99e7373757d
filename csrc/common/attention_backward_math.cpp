// attnx: attention_backward's whole-tensor math (common/attention_math.cpp) as the CompositeExplicitAutograd
// kernel: the backward of backends without a fused backward kernel (MPS). Backends with one (CPU, CUDA)
// register their own, which the dispatcher prefers. A file of its own because attention_math.cpp is compiled
// into every backend's library, and this registration must be made once, by the CPU library.
#include <torch/csrc/stable/library.h>

#include "common/attention.h"

STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("attention_backward", &attnx::attention_op<attnx::run_attention_backward_math>);
}
