// attnx: the interface of attnx::attention_backward's CPU kernel, compiled once per x86 ISA level.
//
// The kernel (attention_backward_cpu_kernel_impl.h) is built from the forward kernel's tile helpers (mask
// reading, packing and transposes, tile GEMMs, vectorised exp), so it is compiled in the same translation
// units as the forward, right after it: attention_cpu.cpp (DEFAULT), attention_cpu_avx2.cpp and
// attention_cpu_avx512.cpp. attention_backward_cpu.cpp picks a variant at run time, as attention_cpu.cpp
// does.
#pragma once

#include "cpu/attention_cpu_kernel.h"

namespace attnx::cpu {

// Where each tensor's data starts (storage offsets applied); the layouts are in AttentionBackwardParams.
struct AttentionBackwardData {
  torch::headeronly::ScalarType dtype;  // of grad_out, query, key, value, out and the gradients
  const void* grad_out;
  const void* query;
  const void* key;
  const void* value;
  const void* out;
  const void* lse;               // float32, or float64 when dtype is float64
  const void* attn_mask;         // nullptr when absent
  const void* key_padding_mask;  // nullptr when absent
  const void* key_lengths;       // nullptr when absent
  const void* sinks;             // nullptr when absent
  void* grad_query;
  void* grad_key;
  void* grad_value;
  // attn_mask's gradient, summed over the dims it broadcasts along: a zeroed, contiguous buffer in the
  // accumulator type of grad_attn_mask_size (B or 1, H or 1, L or 1, S or 1), or nullptr when not asked for.
  void* grad_attn_mask;
  int64_t grad_attn_mask_size[4];
};

using AttentionBackwardKernel = void (*)(const AttentionBackwardParams&, const AttentionBackwardData&);

namespace DEFAULT {
void attention_backward_kernel(const AttentionBackwardParams& p, const AttentionBackwardData& d);
}
#if ATTNX_CPU_X86_VARIANTS
namespace AVX2 {
void attention_backward_kernel(const AttentionBackwardParams& p, const AttentionBackwardData& d);
}
namespace AVX512 {
void attention_backward_kernel(const AttentionBackwardParams& p, const AttentionBackwardData& d);
}
#endif

}  // namespace attnx::cpu
