// attnx: attnx::attention on CPU. The checks and layouts are common/attention.cpp; the kernel is
// attention_cpu_kernel_impl.h, compiled here for the baseline ISA and in attention_cpu_avx2.cpp /
// attention_cpu_avx512.cpp for wider vectors, and picked at run time like torch's own CPU kernels.
#include <torch/csrc/stable/library.h>

#include <cstdlib>
#include <cstring>
#include <tuple>

#include "common/attention.h"
#include "cpu/attention_backward_cpu_kernel.h"
#include "cpu/attention_cpu_kernel.h"

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "cpu/attention_cpu_kernel_impl.h"
// The backward kernel is built from the forward kernel's helpers, so it is compiled here, after them.
#include "cpu/attention_backward_cpu_kernel_impl.h"

namespace attnx {

namespace {

cpu::CpuCapability detect_cpu_capability() {
#if ATTNX_CPU_X86_VARIANTS
  using cpu::CpuCapability;
  __builtin_cpu_init();
  CpuCapability level = CpuCapability::kDefault;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = CpuCapability::kAvx2;
  if (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    level = CpuCapability::kAvx512;
  }
  // torch lowers its level to the one asked for, never raises it; an unknown value leaves it as it is.
  if (const char* asked = std::getenv("ATEN_CPU_CAPABILITY")) {
    if (std::strcmp(asked, "default") == 0) level = CpuCapability::kDefault;
    if (std::strcmp(asked, "avx2") == 0 && level == CpuCapability::kAvx512) level = CpuCapability::kAvx2;
  }
  return level;
#else
  return cpu::CpuCapability::kDefault;
#endif
}

// The variant for the ISA level torch itself runs at.
cpu::AttentionKernel select_kernel() {
#if ATTNX_CPU_X86_VARIANTS
  switch (cpu::cpu_capability()) {
    case cpu::CpuCapability::kAvx512: return &cpu::AVX512::attention_kernel;
    case cpu::CpuCapability::kAvx2: return &cpu::AVX2::attention_kernel;
    default: break;
  }
#endif
  return &cpu::DEFAULT::attention_kernel;
}

}  // namespace

cpu::CpuCapability cpu::cpu_capability() {
  static const CpuCapability level = detect_cpu_capability();
  return level;
}

std::tuple<Tensor, Tensor> attention_cpu(const Tensor& query, const Tensor& key, const Tensor& value,
                                         const std::optional<Tensor>& attn_mask,
                                         const std::optional<Tensor>& key_padding_mask, bool is_causal,
                                         std::optional<double> scale, double dropout_p,
                                         const std::optional<Tensor>& dropout_seed, int64_t window_left,
                                         int64_t window_right, const std::optional<Tensor>& key_lengths,
                                         std::optional<double> softcap, const std::optional<Tensor>& sinks) {
  AttentionProblem pb = prepare_attention(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                                          dropout_p, dropout_seed, window_left, window_right, key_lengths,
                                          softcap, sinks);
  const cpu::AttentionData data{{pb.query, pb.key, pb.value, pb.attn_mask, pb.key_padding_mask,
                                 pb.out.mutable_data_ptr(), pb.lse.mutable_data_ptr(), pb.key_lengths, pb.sinks},
                                pb.dtype};
  static const cpu::AttentionKernel kernel = select_kernel();
  kernel(pb.params, data);
  return {pb.out, pb.lse};
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("_attention", TORCH_BOX(&attnx::attention_cpu));
  m.impl("_attention_autograd", TORCH_BOX(&attnx::attention_cpu));
}
