// attnx: attnx::attention on CPU. The checks and layouts are common/attention.cpp; the kernel is
// attention_cpu_kernel_impl.h, compiled here for the baseline ISA and in attention_cpu_avx2.cpp /
// attention_cpu_avx512.cpp for wider vectors, and picked at run time like torch's own CPU kernels.
#include <ATen/Version.h>
#include <torch/library.h>

#include <string>
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

// The variant for the ISA level torch itself runs at: at::get_cpu_capability() reads the CPU and honours
// ATEN_CPU_CAPABILITY, so one environment variable moves torch and attnx together.
cpu::AttentionKernel select_kernel() {
#if ATTNX_CPU_X86_VARIANTS
  const std::string isa = at::get_cpu_capability();
  if (isa == "AVX512") return &cpu::AVX512::attention_kernel;
  if (isa == "AVX2") return &cpu::AVX2::attention_kernel;
#endif
  return &cpu::DEFAULT::attention_kernel;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& query, const at::Tensor& key,
                                                 const at::Tensor& value,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                 bool is_causal, std::optional<double> scale,
                                                 double dropout_p,
                                                 const std::optional<at::Tensor>& dropout_seed,
                                                 int64_t window_left, int64_t window_right,
                                                 const std::optional<at::Tensor>& key_lengths,
                                                 std::optional<double> softcap,
                                                 const std::optional<at::Tensor>& sinks) {
  AttentionProblem pb = prepare_attention(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                                          dropout_p, dropout_seed, window_left, window_right, key_lengths,
                                          softcap, sinks);
  const cpu::AttentionData data{{pb.query, pb.key, pb.value, pb.attn_mask, pb.key_padding_mask,
                                 pb.out.data_ptr(), pb.lse.data_ptr(), pb.key_lengths, pb.sinks},
                                pb.dtype};
  static const cpu::AttentionKernel kernel = select_kernel();
  kernel(pb.params, data);
  return {pb.out, pb.lse};
}

}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("_attention", &attnx::attention_cpu);
  m.impl("_attention_autograd", &attnx::attention_cpu);
}
