// attnx: autograd for attnx::linear, registered on the op's Autograd key for every backend.
//
// Written in C++ rather than with torch.library.register_autograd: a Python autograd kernel runs on every call,
// grad mode or not (~10 us here), which is the size of the whole GEMM at the B=1 decode shapes this op exists for.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace attnx {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor linear_op(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("attnx::linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(input, weight, bias);
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({input, weight});
    ctx->saved_data["bias_size"] = bias && bias->defined() ? bias->size(0) : int64_t{-1};
    return linear_op(input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad = grads[0];
    const int64_t N = weight.size(0), K = weight.size(1);
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      // (*, N) @ (N, K): the op itself, so the backward is as layout-robust as the forward (and differentiable).
      grad_input = linear_op(grad, weight.t(), std::nullopt);
    }
    if (ctx->needs_input_grad(1)) {
      grad_weight = grad.reshape({-1, N}).t().mm(input.reshape({-1, K}));
    }
    const int64_t bias_size = ctx->saved_data["bias_size"].toInt();
    if (bias_size >= 0 && ctx->needs_input_grad(2)) {
      grad_bias = grad.reshape({-1, N}).sum(0);
      if (bias_size != N) grad_bias = grad_bias.sum().reshape({bias_size});  // a size-1 bias broadcast over N
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(input, weight, bias);
}

}  // namespace
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, Autograd, m) { m.impl("linear", &attnx::linear_autograd); }
