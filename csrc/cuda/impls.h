// attnx: the CUDA library's kernels of attnx's ops, as registrations: into a library of attnx's CUDA key
// (`cuda`) and, for the op without a tensor argument, of CompositeExplicitAutograd (`composite`). Each glue
// file defines its op's. The prebuilt library registers them when it loads; the run-time compiled one
// (csrc/rtc/) when its route is chosen (python/attnx/_loader.py), as only one of them may serve CUDA.
#pragma once

#include <torch/csrc/stable/library.h>

namespace attnx {

using StableLibrary = torch::stable::detail::StableLibrary;

void linear_cuda_impls(StableLibrary& cuda);              // cuda/linear.cpp
void attention_cuda_impls(StableLibrary& cuda);           // cuda/attention.cpp
void cuda_composite_impls(StableLibrary& composite);      // cuda/attention.cpp: _cuda_torch_flash
void attention_backward_cuda_impls(StableLibrary& cuda);  // cuda/attention_backward.cpp

}  // namespace attnx
