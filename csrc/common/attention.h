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
#include <string>
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
  std::optional<Tensor> block_map;
  std::optional<Tensor> block_bits;
  int64_t block_q = 128;
  int64_t block_k = 128;

  // The fields in the schema's order (a tuple of references, const for a const struct).
  template <typename Self>
  static auto fields(Self& o) {
    return std::tie(o.attn_mask, o.key_padding_mask, o.is_causal, o.scale, o.dropout_p, o.dropout_seed,
                    o.window_left, o.window_right, o.key_lengths, o.softcap, o.sinks, o.block_map,
                    o.block_bits, o.block_q, o.block_k);
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
  bool outputs_given = false;       // out and lse are the caller's (prepare_attention's `outputs`): a
                                    // backend writes into them and never replaces them

  // attention_op's two ends: attnx::attention's stack unboxed and prepared (prepare_attention), and (out,
  // lse) onto it.
  static AttentionProblem unbox(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
  void box(StableIValue* stack) const {
    stack[0] = torch::stable::detail::from(out);
    stack[1] = torch::stable::detail::from(lse);
  }
};

// One call of attnx::_attention_kernel: attention's call as the op would prepare it (checks, params, outputs)
// and the pass asked about; a backend's namer writes the kernel it would run into `kernel`.
struct AttentionKernelProblem {
  AttentionProblem call;
  bool backward;
  std::string kernel;

  static AttentionKernelProblem unbox(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
  void box(StableIValue* stack) const {
    stack[0] = torch::stable::detail::from(kernel);
  }
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

  static AttentionBackwardProblem unbox(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
  // (grad_query, grad_key, grad_value, grad_attn_mask, grad_sinks) onto the stack, the sinks' gradient
  // computed here for every backend, empty tensors for what was not asked for.
  void box(StableIValue* stack) const;
};

// attnx::attention's checks on query, key, value and the options (errors name attnx::attention), then
// grad_out and out of shape (B, H, L, Dv) in query's dtype and lse (B, H, L) in the accumulator dtype, any
// strides (errors name attnx::attention_backward). Reads every layout without copying and allocates the
// gradients of query, key and value.
AttentionBackwardProblem prepare_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
                                                    Tensor out, Tensor lse, AttentionOptions options,
                                                    bool grad_attn_mask);

// attention_backward in whole-tensor math (common/attention_math.cpp): the backward of backends without a
// fused kernel, and of what a backend's kernels do not take. Stores (B, H, L, S); no dropout.
void run_attention_backward_math(AttentionBackwardProblem& pb);

// ---------------------------------------------------------------------------------------------------------------
// The op adapter: each backend registers its run functions through it, e.g.
//   m.impl("_attention", &attention_op<run_attention_cpu>);
//   m.impl("attention_backward", &attention_op<run_attention_backward_cpu>);
//   m.impl("_attention_kernel", &attention_op<attention_kernel_cpu>);
// and never spells out an argument list. A run function is `void run(Problem&)`; its Problem
// (AttentionProblem, AttentionBackwardProblem or varlen_attention.h's) unboxes and prepares its op's stack
// (Problem::unbox) and boxes the outputs the run wrote (Problem::box). A forward run writes pb.out and
// pb.lse; a backward run pb.grad_query, pb.grad_key, pb.grad_value and, when pb.grad_attn_mask,
// pb.grad_attn_mask_out.

namespace detail {
// The Problem of a run function `void run(Problem&)`.
template <typename Run>
struct ProblemOf;
template <typename Problem>
struct ProblemOf<void (*)(Problem&)> {
  using type = Problem;
};

// The stack's argument and output counts checked against an op's C++ side, then its options: the fields of
// Options, after the op's `tensors` leading tensors (`trailing`: the arguments after the options).
template <typename Options>
Options unbox_options(const char* op, const StableIValue* stack, uint64_t num_args, uint64_t num_outputs,
                      uint64_t tensors, uint64_t trailing, uint64_t outputs) {
  Options options;
  const auto fields = Options::fields(options);
  stable::check_stack(op, num_args, tensors + std::tuple_size_v<decltype(fields)> + trailing, num_outputs,
                      outputs);
  stable::unbox(stack + tensors, fields);
  return options;
}
}  // namespace detail

// The boxed kernel of one of the attention ops (attnx::_attention, _attention_autograd, attention_backward,
// _attention_kernel and varlen_attention's) for a backend's run function.
template <auto Run>
void attention_op(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  using Problem = typename detail::ProblemOf<decltype(Run)>::type;
  Problem pb = Problem::unbox(stack, num_args, num_outputs);
  Run(pb);
  pb.box(stack);
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
inline double attention_scale(std::optional<double> scale, int64_t head_dim) {
  if (scale) return *scale;
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}
inline double attention_scale(const AttentionOptions& options, int64_t head_dim) {
  return attention_scale(options.scale, head_dim);
}

// ---------------------------------------------------------------------------------------------------------------
// What common/varlen_attention.cpp shares with attention's glue: its ops take the same options where they
// have them and fill the same params. `op` is the op's name that errors start with ("attnx::attention").

namespace detail {

// float32, float64, bfloat16 or float16.
bool is_attention_dtype(ScalarType t);

// The unevaluated float sum hi + lo closest to `value` (see AttentionParams::scale).
void split_scale(double value, float* hi, float* lo);

// query of an attention dtype; key and value of its dtype, on its device.
void check_query_key_value_dtypes_and_devices(const char* op, const Tensor& query, const Tensor& key,
                                              const Tensor& value);
// Hkv divides H (H == 0 without key/value heads).
void check_kv_heads(const char* op, int64_t H, int64_t Hkv);
void check_window(const char* op, int64_t window_left, int64_t window_right);
// softcap finite and > 0; sinks of shape (H,), a floating dtype, on query's device.
void check_softcap_and_sinks(const char* op, const std::optional<double>& softcap,
                             const std::optional<Tensor>& sinks, int64_t H, const Tensor& query);

// sinks as the kernels read them: (H,) in the accumulator dtype of `dtype`, contiguous. A copy of H values
// only when they are stored otherwise.
std::optional<Tensor> sinks_for_kernels(const std::optional<Tensor>& sinks, ScalarType dtype);

// The backward's tensors into the params and pointers: the strides of out, grad_out and the gradients as
// (B, H, N, E), which `read_strides(tensor, int64_t* strides4)` reads (varlen's rows as one batch per
// sequence), and where each tensor starts; no mask gradient buffer (a kernel that sums into one sets it).
// lse's strides are the caller's: its layout differs between the ops.
template <typename ReadStrides>
void describe_backward_tensors(AttentionBackwardParams& bp, AttentionBackwardPointers& ptr,
                               ReadStrides read_strides, const Tensor& grad_out, const Tensor& out,
                               const Tensor& lse, const Tensor& grad_query, const Tensor& grad_key,
                               const Tensor& grad_value) {
  read_strides(out, bp.fwd.out_stride);
  read_strides(grad_out, bp.grad_out_stride);
  read_strides(grad_query, bp.grad_query_stride);
  read_strides(grad_key, bp.grad_key_stride);
  read_strides(grad_value, bp.grad_value_stride);
  // The saved out and lse are read here: const, though AttentionPointers names them as the forward writes
  // them.
  ptr.fwd.out = const_cast<void*>(out.const_data_ptr());
  ptr.fwd.lse = const_cast<void*>(lse.const_data_ptr());
  ptr.grad_out = grad_out.const_data_ptr();
  ptr.grad_query = grad_query.mutable_data_ptr();
  ptr.grad_key = grad_key.mutable_data_ptr();
  ptr.grad_value = grad_value.mutable_data_ptr();
  ptr.grad_attn_mask = nullptr;
}

// The gradient of the sinks, -sum over every row of exp(sink_h - lse) * rowsum(dO * O): a sink's probability
// times the row's delta, in sinks' dtype. `lse_rows` is lse viewed in the shape of rowsum(dO * O) (out's
// without its last dim), heads along dim 1. O(rows * Dv) work, done in torch's ops for every backend.
Tensor sinks_grad(const Tensor& grad_out, const Tensor& out, const Tensor& lse_rows, const Tensor& sinks);

}  // namespace detail

}  // namespace attnx
