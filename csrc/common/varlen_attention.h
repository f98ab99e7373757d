// attnx: attnx::varlen_attention and attnx::varlen_attention_backward as a backend sees them: packed
// sequences of different lengths (cu_seqlens), optionally with a paged key/value cache (block_table). Not a
// kernel of their own: prepare_varlen_attention reads the arguments into the same AttentionParams as
// attention's, one batch per sequence (AttentionParams::varlen), so attention's kernels run them with the key
// range of attnx/key_range.h applied per sequence. Semantics: csrc/schemas.cpp and
// attnx.reference.varlen_attention. On the LibTorch stable ABI: no ATen or c10 header.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "attnx/params.h"
#include "common/attention.h"

namespace attnx {

// attnx::varlen_attention's arguments after cu_seqlens_k, as csrc/schemas.cpp declares them (names, order,
// defaults); also those of attnx::varlen_attention_backward after its cu_seqlens_k.
struct VarlenAttentionOptions {
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  bool is_causal = false;
  std::optional<double> scale;
  int64_t window_left = -1;
  int64_t window_right = -1;
  std::optional<Tensor> seqused_k;
  std::optional<Tensor> block_table;
  std::optional<double> softcap;
  std::optional<Tensor> sinks;

  template <typename Self>
  static auto fields(Self& o) {
    return std::tie(o.max_seqlen_q, o.max_seqlen_k, o.is_causal, o.scale, o.window_left, o.window_right,
                    o.seqused_k, o.block_table, o.softcap, o.sinks);
  }
};

// One call of attnx::varlen_attention, ready for attention's kernel: N sequences as N batches.
struct VarlenAttentionProblem {
  Tensor query, key, value, cu_seqlens_q, cu_seqlens_k;
  VarlenAttentionOptions options;
  AttentionParams params;
  AttentionPointers ptr;
  ScalarType dtype;
  std::optional<Tensor> sinks_acc;
  Tensor out;  // (total_q, H, Dv), contiguous
  Tensor lse;  // (H, total_q), float32 (float64 for float64 inputs), contiguous

  // attention_op's two ends, as AttentionProblem's.
  static VarlenAttentionProblem unbox(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
  void box(StableIValue* stack) const {
    stack[0] = torch::stable::detail::from(out);
    stack[1] = torch::stable::detail::from(lse);
  }
};

// The backward's problem (no block table: paged caches are inference only).
struct VarlenAttentionBackwardProblem {
  Tensor grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k;
  VarlenAttentionOptions options;
  AttentionBackwardParams params;
  AttentionBackwardPointers ptr;
  ScalarType dtype;
  std::optional<Tensor> sinks_acc;
  Tensor grad_query;  // (total_q, H, D)
  Tensor grad_key;    // (total_k, Hkv, D)
  Tensor grad_value;  // (total_k, Hkv, Dv)

  static VarlenAttentionBackwardProblem unbox(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
  // (grad_query, grad_key, grad_value, grad_sinks) onto the stack; grad_sinks computed here, empty without
  // sinks.
  void box(StableIValue* stack) const;
};

// Checks the arguments (errors "attnx::varlen_attention: expected ..., got ..."; cu_seqlens, seqused_k and
// the block table's entries are read and checked where that needs no device sync, on the CPU), reads every
// layout without copying and allocates out and lse.
VarlenAttentionProblem prepare_varlen_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q,
                                                Tensor cu_seqlens_k, VarlenAttentionOptions options);

VarlenAttentionBackwardProblem prepare_varlen_attention_backward(Tensor grad_out, Tensor query, Tensor key,
                                                                 Tensor value, Tensor out, Tensor lse,
                                                                 Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                                                                 VarlenAttentionOptions options);

}  // namespace attnx
