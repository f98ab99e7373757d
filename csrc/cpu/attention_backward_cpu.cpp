// attnx: attnx::attention_backward on CPU. The checks and layouts are common/attention.cpp; the kernel is
// attention_backward_cpu_kernel_impl.h, compiled with the forward kernel for each ISA level (see
// attention_backward_cpu_kernel.h) and picked at run time like the forward.
#include <torch/csrc/stable/library.h>

#include <tuple>

#include "common/attention.h"
#include "common/stable.h"
#include "cpu/attention_backward_cpu_kernel.h"
#include "cpu/attention_cpu_kernel.h"

namespace attnx {

namespace {

// The variant for the ISA level torch itself runs at (see attention_cpu.cpp).
cpu::AttentionBackwardKernel select_backward_kernel() {
#if ATTNX_CPU_X86_VARIANTS
  switch (cpu::cpu_capability()) {
    case cpu::CpuCapability::kAvx512: return &cpu::AVX512::attention_backward_kernel;
    case cpu::CpuCapability::kAvx2: return &cpu::AVX2::attention_backward_kernel;
    default: break;
  }
#endif
  return &cpu::DEFAULT::attention_backward_kernel;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> attention_backward_cpu(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& lse, const std::optional<Tensor>& attn_mask,
    const std::optional<Tensor>& key_padding_mask, bool is_causal, std::optional<double> scale,
    double dropout_p, const std::optional<Tensor>& dropout_seed, int64_t window_left, int64_t window_right,
    const std::optional<Tensor>& key_lengths, std::optional<double> softcap,
    const std::optional<Tensor>& sinks, bool grad_attn_mask) {
  AttentionBackwardProblem pb = prepare_attention_backward(grad_out, query, key, value, out, lse, attn_mask,
                                                           key_padding_mask, is_causal, scale, dropout_p,
                                                           dropout_seed, window_left, window_right,
                                                           key_lengths, softcap, sinks);
  cpu::AttentionBackwardData data{pb.dtype,
                                  pb.grad_out,
                                  pb.query,
                                  pb.key,
                                  pb.value,
                                  pb.out,
                                  pb.lse,
                                  pb.attn_mask,
                                  pb.key_padding_mask,
                                  pb.key_lengths,
                                  pb.sinks,
                                  pb.grad_query.mutable_data_ptr(),
                                  pb.grad_key.mutable_data_ptr(),
                                  pb.grad_value.mutable_data_ptr(),
                                  nullptr,
                                  {0, 0, 0, 0}};
  // The mask's gradient is summed in the accumulator dtype, in a buffer of the gradient's own size (never
  // (B, H, L, S) unless the mask is), then converted to the mask's dtype.
  std::optional<Tensor> mask_grad;
  const bool want_mask_grad = grad_attn_mask && attn_mask && attn_mask->scalar_type() != ScalarType::Bool;
  if (want_mask_grad) {
    const MaskGradShape g = mask_grad_shape(*attn_mask, query.size(0), query.size(1));
    mask_grad = stable::empty(g.size, lse.scalar_type(), lse.device());
    torch::stable::zero_(*mask_grad);
    data.grad_attn_mask = mask_grad->mutable_data_ptr();
    for (int d = 0; d < 4; ++d) data.grad_attn_mask_size[d] = g.size[d];
  }
  static const cpu::AttentionBackwardKernel kernel = select_backward_kernel();
  kernel(pb.params, data);
  // Distinct empty tensors where a gradient was not asked for: outputs never alias each other.
  const auto nothing = [&]() { return stable::empty({0}, query.scalar_type(), query.device()); };
  return {pb.grad_query, pb.grad_key, pb.grad_value,
          want_mask_grad ? mask_grad_from_buffer(*mask_grad, *attn_mask) : nothing(),
          sinks ? sinks_grad(grad_out, out, lse, *sinks) : nothing()};
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("attention_backward", TORCH_BOX(&attnx::attention_backward_cpu));
}
