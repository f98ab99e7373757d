// attnx: attnx::attention and attnx::attention_backward as every backend sees them. The schema's arguments
// are unboxed once, into AttentionOptions (everything after value); prepare_attention checks them, reads
// every layout into params.h's AttentionParams and AttentionPointers and allocates the outputs; a backend
// only implements run(AttentionProblem&) and registers it through attention_op (the backward likewise).
// Semantics: csrc/schemas.cpp and attnx.reference.attention. On the LibTorch stable ABI: no ATen or c10
// header.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

#include "attnx/params.h"
#include "common/stable.h"

namespace attnx {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// attnx::attention's arguments after value, as csrc/schemas.cpp declares them (names, order, defaults). The
// one C++ declaration of the option list: the op adapters unbox it, internal callers set the fields they need
// by name and call the op with it (call_attention).
struct AttentionOptions {
  std::optional<Tensor> attn_mask;
  std::optional<Tensor> key_padding_mask;
  bool is_causal = false;
  std::optional<double> scale;
  double dropout_p = 0.0;
  std::optional<Tensor> dropout_seed;
  int64_t window_left = -1;
  int64_t window_right = -1;
  std::optional<Tensor> key_lengths;
  std::optional<double> softcap;
  std::optional<Tensor> sinks;

  // The fields in the schema's order (a tuple of references, const for a const struct).
  template <typename Self>
  static auto fields(Self& o) {
    return std::tie(o.attn_mask, o.key_padding_mask, o.is_causal, o.scale, o.dropout_p, o.dropout_seed,
                    o.window_left, o.window_right, o.key_lengths, o.softcap, o.sinks);
  }
};

// One call of attnx::attention, ready for a kernel: the arguments, sizes and strides in `params`, where each
// tensor starts in `ptr` (out and lse included), and the allocated outputs.
struct AttentionProblem {
  Tensor query, key, value;
  AttentionOptions options;
  AttentionParams params;
  AttentionPointers ptr;
  ScalarType dtype;                 // of query, key, value and out
  std::optional<Tensor> sinks_acc;  // what ptr.sinks points into: sinks as (H,) in the accumulator dtype
  Tensor out;                       // (B, H, L, Dv) in query's dtype, memory order (B, L, H, Dv)
  Tensor lse;                       // (B, H, L), float32 (float64 for float64 inputs), contiguous
};

// The argument checks of attnx::attention. Errors read "attnx::attention: expected ..., got ...".
// key_lengths values are checked against [0, S] where they can be read without a device sync (on the CPU).
void check_attention_args(const Tensor& query, const Tensor& key, const Tensor& value,
                          const AttentionOptions& options);

// Checks the arguments, reads every tensor's layout into the params without copying any of them, and
// allocates out and lse (or takes the caller's `outputs`, out and lse of the right sizes and dtypes in any
// strides). Masks are canonicalised as views: (L, S) and 4-D masks broadcast to (B, H, L, S) with stride 0
// on broadcast dims, and a (B*H, L, S) mask is split into (B, H). dropout_seed's values go into the params,
// read on the host (no device sync for a GPU kernel). sinks are converted to the accumulator dtype (H
// values) when they are in another dtype or not contiguous.
AttentionProblem prepare_attention(Tensor query, Tensor key, Tensor value, AttentionOptions options,
                                   std::optional<std::pair<Tensor, Tensor>> outputs = std::nullopt);

// One call of attnx::attention_backward, ready for a kernel. The gradients are allocated in out's layout,
// (B, H, N, E) with memory order (B, N, H, E).
struct AttentionBackwardProblem {
  Tensor grad_out, query, key, value, out, lse;
  AttentionOptions options;
  bool grad_attn_mask;  // attn_mask's gradient is asked for and exists (a float attn_mask)
  AttentionBackwardParams params;
  AttentionBackwardPointers ptr;  // grad_attn_mask: nullptr; a kernel that sums into a buffer sets it
  ScalarType dtype;               // of grad_out, query, key, value, out and the gradients
  std::optional<Tensor> sinks_acc;
  Tensor grad_query;                         // (B, H, L, D)
  Tensor grad_key;                           // (B, Hkv, S, D)
  Tensor grad_value;                         // (B, Hkv, S, Dv)
  std::optional<Tensor> grad_attn_mask_out;  // set by the backend when grad_attn_mask: in attn_mask's shape
};

// attnx::attention's checks on query, key, value and the options (errors name attnx::attention), then
// grad_out and out of shape (B, H, L, Dv) in query's dtype and lse (B, H, L) in the accumulator dtype, any
// strides (errors name attnx::attention_backward). Reads every layout without copying and allocates the
// gradients of query, key and value.
AttentionBackwardProblem prepare_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
                                                    Tensor out, Tensor lse, AttentionOptions options,
                                                    bool grad_attn_mask);

// ---------------------------------------------------------------------------------------------------------------
// The op adapters: each backend registers its run function through them, e.g.
//   m.impl("_attention", &attention_op<run_attention_cpu>);
// and never spells out the argument list.

// Writes pb.out and pb.lse.
using AttentionRun = void (*)(AttentionProblem&);
// Writes pb.grad_query, pb.grad_key, pb.grad_value and, when pb.grad_attn_mask, pb.grad_attn_mask_out.
using AttentionBackwardRun = void (*)(AttentionBackwardProblem&);

namespace detail {
AttentionProblem unbox_attention(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
AttentionBackwardProblem unbox_attention_backward(StableIValue* stack, uint64_t num_args,
                                                  uint64_t num_outputs);
// (grad_query, grad_key, grad_value, grad_attn_mask, grad_sinks) onto the stack, the sinks' gradient
// computed here for every backend, empty tensors for what was not asked for.
void box_attention_backward(StableIValue* stack, AttentionBackwardProblem& pb);
}  // namespace detail

// The boxed kernel of attnx::_attention and attnx::_attention_autograd for a backend.
template <AttentionRun Run>
void attention_op(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  AttentionProblem pb = detail::unbox_attention(stack, num_args, num_outputs);
  Run(pb);
  stack[0] = torch::stable::detail::from(pb.out);
  stack[1] = torch::stable::detail::from(pb.lse);
}

// The boxed kernel of attnx::attention_backward for a backend.
template <AttentionBackwardRun Run>
void attention_backward_op(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  AttentionBackwardProblem pb = detail::unbox_attention_backward(stack, num_args, num_outputs);
  Run(pb);
  detail::box_attention_backward(stack, pb);
}

// attnx::_attention through the dispatcher (the kernel of query's device): out and lse.
std::array<Tensor, 2> call_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                     const AttentionOptions& options);

// attnx::attention_backward through the dispatcher: grad_query, grad_key, grad_value, grad_attn_mask (empty
// unless asked for) and grad_sinks (empty without sinks).
std::array<Tensor, 5> call_attention_backward(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                                              const Tensor& value, const Tensor& out, const Tensor& lse,
                                              const AttentionOptions& options, bool grad_attn_mask);

// ---------------------------------------------------------------------------------------------------------------

// The sizes of attn_mask's gradient as (B, H, L, S), each either the full size or 1 where the mask's shape
// broadcasts along it (an (L, S) mask is (1, 1, L, S), nn.MultiheadAttention's (B*H, L, S) is (B, H, L, S)).
// Taken from the shape, not the strides: an expanded mask (stride 0, full size) gets a gradient per element,
// as autograd's expand backward expects.
std::array<int64_t, 4> mask_grad_shape(const Tensor& attn_mask, int64_t B, int64_t H);

// A contiguous buffer of mask_grad_shape in the accumulator dtype, as the result of a kernel that summed dS
// into it, turned into attn_mask's gradient: viewed in attn_mask's shape, in its dtype.
Tensor mask_grad_from_buffer(const Tensor& buffer, const Tensor& attn_mask);

// mha's attention weights when asked for them: softmax(scale * q k^T + masks), (B, H, L, S) in `acc`,
// normalised by each row's maximum and sum as torch's softmax is (exact where exp(score - lse) is not); NaN
// on a fully masked row, as torch's.
Tensor attention_weights_exact(const Tensor& query, const Tensor& key, ScalarType acc,
                               const AttentionOptions& options, double scale);

// The accumulator dtype of an input dtype, which is also lse's dtype: float64 for float64, float32 otherwise.
ScalarType attention_acc_dtype(ScalarType dtype);

// The softmax scale: the caller's, else 1 / sqrt(D) (1 for D == 0, where every score is an empty sum).
inline double attention_scale(const AttentionOptions& options, int64_t head_dim) {
  if (options.scale) return *options.scale;
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}

}  // namespace attnx
