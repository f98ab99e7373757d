// attnx: tensors -> AttentionParams for attnx::attention, shared by every backend: argument checks, mask
// canonicalisation and output allocation. Kernels see only params.h and raw pointers. On the LibTorch stable ABI
// (torch/csrc/stable): no ATen or c10 header.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <optional>

#include "attnx/params.h"

namespace attnx {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// One call of attnx::attention, ready for a kernel: sizes and strides in `params`, data pointers (storage
// offsets applied) beside them, and the allocated outputs.
struct AttentionProblem {
  AttentionParams params;
  ScalarType dtype;  // of query, key, value and out
  const void* query;
  const void* key;
  const void* value;
  const void* attn_mask;         // nullptr when absent; indexed through params.attn_mask_stride
  const void* key_padding_mask;  // nullptr when absent; indexed through params.key_padding_mask_stride
  const void* key_lengths;       // nullptr when absent; (B,) int32 or int64
  const void* sinks;             // nullptr when absent; (H,) in the accumulator dtype, contiguous
  std::optional<Tensor> sinks_acc;  // what `sinks` points into (sinks converted, when they had to be)
  Tensor out;                // (B, H, L, Dv) in query's dtype, memory order (B, L, H, Dv)
  Tensor lse;                // (B, H, L), float32 (float64 for float64 inputs), contiguous
};

// The argument checks of attnx::attention. Errors read "attnx::attention: expected ..., got ...".
// key_lengths values are checked against [0, S] where they can be read without a device sync (on the CPU).
void check_attention_args(const Tensor& query, const Tensor& key, const Tensor& value,
                          const std::optional<Tensor>& attn_mask,
                          const std::optional<Tensor>& key_padding_mask, double dropout_p = 0.0,
                          const std::optional<Tensor>& dropout_seed = std::nullopt,
                          int64_t window_left = -1, int64_t window_right = -1,
                          const std::optional<Tensor>& key_lengths = std::nullopt,
                          std::optional<double> softcap = std::nullopt,
                          const std::optional<Tensor>& sinks = std::nullopt);

// Checks the arguments, reads every tensor's layout into AttentionParams without copying any of them, and
// allocates out and lse. Masks are canonicalised as views: (L, S) and 4-D masks broadcast to (B, H, L, S)
// with stride 0 on broadcast dims, and a (B*H, L, S) mask is split into (B, H).
// dropout_p in [0, 1]; when it is > 0, dropout_seed is a CPU int64 tensor (seed, offset) of shape (2,) whose
// values go into the params (read on the host: no device sync for CUDA kernels). sinks are converted to the
// accumulator dtype (H values) when they are in another dtype or not contiguous.
AttentionProblem prepare_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const std::optional<Tensor>& attn_mask,
                                   const std::optional<Tensor>& key_padding_mask, bool is_causal,
                                   std::optional<double> scale, double dropout_p = 0.0,
                                   const std::optional<Tensor>& dropout_seed = std::nullopt,
                                   int64_t window_left = -1, int64_t window_right = -1,
                                   const std::optional<Tensor>& key_lengths = std::nullopt,
                                   std::optional<double> softcap = std::nullopt,
                                   const std::optional<Tensor>& sinks = std::nullopt);

// One call of attnx::attention_backward, ready for a kernel. The gradients are allocated in out's layout,
// (B, H, N, E) with memory order (B, N, H, E).
struct AttentionBackwardProblem {
  AttentionBackwardParams params;
  ScalarType dtype;  // of grad_out, query, key, value, out and the gradients
  const void* grad_out;
  const void* query;
  const void* key;
  const void* value;
  const void* out;
  const void* lse;               // float32 (float64 for float64 inputs)
  const void* attn_mask;         // nullptr when absent
  const void* key_padding_mask;  // nullptr when absent
  const void* key_lengths;       // nullptr when absent
  const void* sinks;             // nullptr when absent; (H,) in the accumulator dtype
  std::optional<Tensor> sinks_acc;
  Tensor grad_query;         // (B, H, L, D)
  Tensor grad_key;           // (B, Hkv, S, D)
  Tensor grad_value;         // (B, Hkv, S, Dv)
};

// attnx::attention's checks on query, key, value and the masks (errors name attnx::attention), then
// grad_out and out of shape (B, H, L, Dv) in query's dtype and lse (B, H, L) in the accumulator dtype, any
// strides (errors name attnx::attention_backward). Reads every layout without copying and allocates the
// gradients.
AttentionBackwardProblem prepare_attention_backward(const Tensor& grad_out, const Tensor& query,
                                                    const Tensor& key, const Tensor& value,
                                                    const Tensor& out, const Tensor& lse,
                                                    const std::optional<Tensor>& attn_mask,
                                                    const std::optional<Tensor>& key_padding_mask,
                                                    bool is_causal, std::optional<double> scale,
                                                    double dropout_p = 0.0,
                                                    const std::optional<Tensor>& dropout_seed =
                                                        std::nullopt,
                                                    int64_t window_left = -1, int64_t window_right = -1,
                                                    const std::optional<Tensor>& key_lengths = std::nullopt,
                                                    std::optional<double> softcap = std::nullopt,
                                                    const std::optional<Tensor>& sinks = std::nullopt);

// The gradient of attn_mask: its dims as (B, H, L, S), each either the full size or 1 when the mask's shape
// broadcasts along it (an (L, S) mask is (1, 1, L, S), nn.MultiheadAttention's (B*H, L, S) is (B, H, L, S)).
// Taken from the shape, not the strides: an expanded mask (stride 0, full size) gets a gradient per element,
// as autograd's expand backward expects.
struct MaskGradShape {
  int64_t size[4];
};
MaskGradShape mask_grad_shape(const Tensor& attn_mask, int64_t B, int64_t H);

// A contiguous (B', H', L', S') buffer (mask_grad_shape) in the accumulator dtype, as the result of a kernel
// that summed dS into it, turned into attn_mask's gradient: viewed in attn_mask's shape, in its dtype.
Tensor mask_grad_from_buffer(const Tensor& buffer, const Tensor& attn_mask);

// The gradient of the sinks, -sum over (B, L) of exp(sink_h - lse) * rowsum(dO * O): a sink's probability
// times the row's delta, in sinks' dtype. O(B * H * L * Dv) work, done in torch's ops for every backend.
Tensor sinks_grad(const Tensor& grad_out, const Tensor& out, const Tensor& lse,
                      const Tensor& sinks);

// mha's attention weights when asked for them: softmax(scale * q k^T + masks), (B, H, L, S) in `acc`,
// normalised by each row's maximum and sum as torch's softmax is (exact where exp(score - lse) is not); NaN
// on a fully masked row, as torch's.
Tensor attention_weights_exact(const Tensor& query, const Tensor& key, ScalarType acc,
                                   const std::optional<Tensor>& attn_mask,
                                   const std::optional<Tensor>& key_padding_mask, bool is_causal,
                                   double scale);

// The accumulator dtype of an input dtype, which is also lse's dtype: float64 for float64, float32 otherwise.
ScalarType attention_acc_dtype(ScalarType dtype);

}  // namespace attnx
