// attnx: what the checks of the emulated CUDA and Metal kernels (race_check.cpp, metal/race_check.cpp,
// launch_check.cpp, metal/plan_check.cpp) share: the features a launch may add beyond masks, and the
// AttentionParams of their problems.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "attnx/params.h"

namespace attnx::race_check {

// Contiguous (B, H, N, E) strides.
inline void contiguous(int64_t* st, int64_t H, int64_t N, int64_t E) {
  st[3] = 1;
  st[2] = E;
  st[1] = N * E;
  st[0] = H * N * E;
}

// Grouped KV heads, the window, soft-capping and sinks; the defaults are plain attention. (Each check adds
// its own key lengths.)
struct Features {
  int64_t kv_heads = 0;  // 0: as many as query heads
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool sinks = false;
  bool dropout = false;       // p = 0.3
  bool bool_padding = false;  // key_padding_mask as bool (run_backward): the tensor-core bits instantiation
};

// The parameters of attention over contiguous (B, H, L, D) queries and out, (B, Hkv, S, D) keys and values,
// a contiguous lse, an (L, S) bool attn_mask and a (B, S) float key_padding_mask, both contiguous (see
// random_attn_mask and padding_of_first_keys), causal or not, scale 0.25, with f's features.
inline AttentionParams params(int64_t B, int64_t H, int64_t L, int64_t S, int64_t D, bool causal,
                              const Features& f) {
  const int64_t Hkv = f.kv_heads > 0 ? f.kv_heads : H;
  AttentionParams p{};
  p.batch = B, p.heads = H, p.q_len = L, p.kv_len = S, p.head_dim = D, p.v_head_dim = D;
  p.kv_heads = Hkv;
  contiguous(p.q_stride, H, L, D);
  contiguous(p.k_stride, Hkv, S, D);
  contiguous(p.v_stride, Hkv, S, D);
  contiguous(p.out_stride, H, L, D);
  p.lse_stride[0] = H * L, p.lse_stride[1] = L, p.lse_stride[2] = 1;
  p.window_left = f.window_left, p.window_right = f.window_right;
  p.softcap = f.softcap;
  p.has_sinks = f.sinks;
  if (f.dropout) {
    p.dropout = 1, p.dropout_p = 0.3f, p.dropout_threshold = 3006477107u;  // floor(0.7 * 2^32)
    p.dropout_scale = 1.0f / 0.7f, p.dropout_seed[0] = 17, p.dropout_seed[1] = 3;
  }
  p.attn_mask_kind = kMaskBool, p.attn_mask_stride[2] = S, p.attn_mask_stride[3] = 1;
  p.key_padding_mask_kind = kMaskFloat32, p.key_padding_mask_stride[0] = S;
  p.key_padding_mask_stride[1] = 1;
  p.is_causal = causal;
  p.scale = 0.25f;
  return p;
}

// Attention over contiguous (B, H, L, D) queries and out, (B, Hkv, S, Dv) keys and values, without masks:
// the problems the launch and plan checks size.
inline AttentionParams unmasked(int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t S, int64_t D, int64_t Dv) {
  AttentionParams p = params(B, H, L, S, D, /*causal=*/false, Features{.kv_heads = Hkv});
  p.v_head_dim = Dv;
  contiguous(p.v_stride, Hkv, S, Dv);
  contiguous(p.out_stride, H, L, Dv);
  p.attn_mask_kind = kMaskNone, p.key_padding_mask_kind = kMaskNone;
  for (auto& st : p.attn_mask_stride) st = 0;
  for (auto& st : p.key_padding_mask_stride) st = 0;
  return p;
}

// A random (L, S) bool mask: about one key in ten masked.
inline std::vector<unsigned char> random_attn_mask(int64_t L, int64_t S, std::mt19937& gen) {
  std::vector<unsigned char> attn_mask(L * S);
  for (auto& m : attn_mask) m = gen() % 10 == 0;
  return attn_mask;
}

// A (B, S) float key_padding_mask that removes the first `keys` keys of batch 0 (whole tiles, for the kernels
// to skip).
inline std::vector<float> padding_of_first_keys(int64_t B, int64_t S, int64_t keys) {
  std::vector<float> padding(B * S, 0.0f);
  for (int64_t s = 0; s < S && s < keys; ++s) padding[s] = -INFINITY;
  return padding;
}

}  // namespace attnx::race_check
