// attnx: ATen -> AttentionParams for attnx::attention, shared by every backend: argument checks, mask
// canonicalisation and output allocation. Kernels see only params.h and raw pointers.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "attnx/params.h"

namespace attnx {

// One call of attnx::attention, ready for a kernel: sizes and strides in `params`, data pointers (storage
// offsets applied) beside them, and the allocated outputs.
struct AttentionProblem {
  AttentionParams params;
  at::ScalarType dtype;  // of query, key, value and out
  const void* query;
  const void* key;
  const void* value;
  const void* attn_mask;         // nullptr when absent; indexed through params.attn_mask_stride
  const void* key_padding_mask;  // nullptr when absent; indexed through params.key_padding_mask_stride
  at::Tensor out;                // (B, H, L, Dv) in query's dtype, memory order (B, L, H, Dv)
  at::Tensor lse;                // (B, H, L), float32 (float64 for float64 inputs), contiguous
};

// The argument checks of attnx::attention. Errors read "attnx::attention: expected ..., got ...".
void check_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask,
                          const std::optional<at::Tensor>& key_padding_mask, double dropout_p = 0.0,
                          const std::optional<at::Tensor>& dropout_seed = std::nullopt);

// Checks the arguments, reads every tensor's layout into AttentionParams without copying any of them, and
// allocates out and lse. Masks are canonicalised as views: (L, S) and 4-D masks broadcast to (B, H, L, S)
// with stride 0 on broadcast dims, and a (B*H, L, S) mask is split into (B, H).
// dropout_p in [0, 1]; when it is > 0, dropout_seed is a CPU int64 tensor (seed, offset) of shape (2,) whose
// values go into the params (read on the host: no device sync for CUDA kernels).
AttentionProblem prepare_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   const std::optional<at::Tensor>& attn_mask,
                                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                   std::optional<double> scale, double dropout_p = 0.0,
                                   const std::optional<at::Tensor>& dropout_seed = std::nullopt);

// One call of attnx::attention_backward, ready for a kernel. The gradients are allocated in out's layout,
// (B, H, N, E) with memory order (B, N, H, E).
struct AttentionBackwardProblem {
  AttentionBackwardParams params;
  at::ScalarType dtype;  // of grad_out, query, key, value, out and the gradients
  const void* grad_out;
  const void* query;
  const void* key;
  const void* value;
  const void* out;
  const void* lse;               // float32 (float64 for float64 inputs)
  const void* attn_mask;         // nullptr when absent
  const void* key_padding_mask;  // nullptr when absent
  at::Tensor grad_query;         // (B, H, L, D)
  at::Tensor grad_key;           // (B, H, S, D)
  at::Tensor grad_value;         // (B, H, S, Dv)
};

// attnx::attention's checks on query, key, value and the masks (errors name attnx::attention), then
// grad_out and out of shape (B, H, L, Dv) in query's dtype and lse (B, H, L) in the accumulator dtype, any
// strides (errors name attnx::attention_backward). Reads every layout without copying and allocates the
// gradients.
AttentionBackwardProblem prepare_attention_backward(const at::Tensor& grad_out, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& value,
                                                    const at::Tensor& out, const at::Tensor& lse,
                                                    const std::optional<at::Tensor>& attn_mask,
                                                    const std::optional<at::Tensor>& key_padding_mask,
                                                    bool is_causal, std::optional<double> scale,
                                                    double dropout_p = 0.0,
                                                    const std::optional<at::Tensor>& dropout_seed =
                                                        std::nullopt);

// attention's probabilities exp(scale * q k^T + masks - lse), (B, H, L, S) in lse's dtype, recomputed from the
// lse attnx::attention returned; 0 on a fully masked row (lse = +inf). Materialises (B, H, L, S): for callers
// that asked for the weights, and for the math fallback of attention_backward.
at::Tensor attention_probabilities(const at::Tensor& query, const at::Tensor& key, const at::Tensor& lse,
                                   const std::optional<at::Tensor>& attn_mask,
                                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                   double scale);

// The accumulator dtype of an input dtype, which is also lse's dtype: float64 for float64, float32 otherwise.
at::ScalarType attention_acc_dtype(at::ScalarType dtype);

}  // namespace attnx
