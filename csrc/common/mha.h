// attnx: attnx::mha's arguments, unboxed once (common/mha.cpp). Semantics: csrc/schemas.cpp and
// attnx.reference.mha.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace attnx {

// attnx::mha's arguments, as csrc/schemas.cpp declares them (ATTNX_MHA_ARGUMENTS: names, order, defaults):
// the one C++ declaration of the list, which mha, mha_forward and mha_backward unbox.
struct MhaArgs {
  using Tensor = torch::stable::Tensor;
  using OptTensor = std::optional<Tensor>;

  Tensor query, key, value;
  int64_t num_heads = 0;
  OptTensor in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight, bias_k, bias_v;
  bool add_zero_attn = false;
  Tensor out_proj_weight;
  OptTensor out_proj_bias, key_padding_mask, attn_mask;
  bool is_causal = false;
  OptTensor static_k, static_v;
  bool need_weights = false;
  bool average_attn_weights = false;
  double dropout_p = 0.0;
  OptTensor dropout_seed;
  bool batch_first = false;

  // The fields in the schema's order (a tuple of references).
  template <typename Self>
  static auto fields(Self& a) {
    return std::tie(a.query, a.key, a.value, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.q_proj_weight,
                    a.k_proj_weight, a.v_proj_weight, a.bias_k, a.bias_v, a.add_zero_attn, a.out_proj_weight,
                    a.out_proj_bias, a.key_padding_mask, a.attn_mask, a.is_causal, a.static_k, a.static_v,
                    a.need_weights, a.average_attn_weights, a.dropout_p, a.dropout_seed, a.batch_first);
  }
};

}  // namespace attnx
