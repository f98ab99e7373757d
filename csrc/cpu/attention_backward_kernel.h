// attnx: the interface of attnx::attention_backward's CPU kernel, compiled once per x86 ISA level.
//
// The kernel (cpu/attention_backward_kernel_impl.h) is built from the forward kernel's tile helpers (mask
// reading, packing and transposes, tile GEMMs, vectorised exp), so it is compiled in the same translation
// units as the forward, right after it: cpu/attention.cpp (DEFAULT), cpu/attention_kernel_avx2.cpp and
// cpu/attention_kernel_avx512.cpp. cpu/attention_backward.cpp picks a variant at run time, as
// cpu/attention.cpp does.
#pragma once

#include "cpu/attention_kernel.h"

namespace attnx::cpu {

// dtype: of grad_out, query, key, value, out and the gradients.
using AttentionBackwardKernel = void (*)(const AttentionBackwardParams&, const AttentionBackwardPointers&,
                                         torch::headeronly::ScalarType);

ATTNX_CPU_DECLARE_VARIANTS(void attention_backward_kernel(const AttentionBackwardParams& p,
                                                          const AttentionBackwardPointers& ptr,
                                                          torch::headeronly::ScalarType dtype))

}  // namespace attnx::cpu
