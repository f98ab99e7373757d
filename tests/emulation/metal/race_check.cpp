// attnx: the emulated Metal kernels under ThreadSanitizer (see test_metal_emulation.py).
//
// The emulation's barriers and simd exchanges are atomics that TSan understands, so a threadgroup-memory
// access that no threadgroup_barrier / simdgroup_barrier orders against another thread's write is reported as
// a data race, whether or not the OS happened to interleave the threads badly. Values do not matter here (the
// pytest suite checks them): each launch covers several key tiles, both masks, causal, partial tiles, and
// every kernel (vector and tiled attention, gemv and gemm linear); two attention launches per kernel add
// grouped KV heads, key lengths, a window, soft-capping and sinks.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../race_check.h"
#include "attnx/params.h"
#include "launches.h"

namespace {

using attnx::mps::DType;
constexpr DType kFloat32 = DType::kFloat32, kBFloat16 = DType::kBFloat16;

// Random data in float32 (4 bytes per element) or bfloat16 (the top half of a float32).
std::vector<unsigned char> randn(size_t n, DType dtype, std::mt19937& gen) {
  std::normal_distribution<float> dist;
  std::vector<unsigned char> out(n * (dtype == kFloat32 ? 4 : 2));
  for (size_t i = 0; i < n; ++i) {
    const float x = dist(gen);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (dtype == kFloat32) {
      std::memcpy(&out[4 * i], &bits, 4);
    } else {
      const uint16_t top = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&out[2 * i], &top, 2);
    }
  }
  return out;
}

// Grouped KV heads, key ranges, soft-capping and sinks; the defaults are plain attention.
struct Features : attnx::race_check::Features {
  bool key_lengths = false;  // batch b has S - 7 b keys (int64)
};

int attention(DType dtype, int64_t B, int64_t H, int64_t L, int64_t S, int64_t D, bool causal,
              Features f = Features{}) {
  std::mt19937 gen(0);
  attnx::AttentionParams p = attnx::race_check::params(B, H, L, S, D, causal, f);
  std::vector<int64_t> lengths(B);
  for (int64_t b = 0; b < B; ++b) lengths[b] = S - 7 * b;
  if (f.key_lengths) p.key_lengths_kind = attnx::kKeyLengthsInt64, p.key_lengths_stride = 1;
  std::vector<float> sinks(H, 0.5f);
  auto q = randn(B * H * L * D, dtype, gen), k = randn(B * p.kv_heads * S * D, dtype, gen),
       v = randn(B * p.kv_heads * S * D, dtype, gen);
  auto out = randn(B * H * L * D, dtype, gen);
  std::vector<float> lse(B * H * L);
  // A random (L, S) bool mask and a float key_padding_mask that removes the first tile of batch 0.
  auto attn_mask = attnx::race_check::random_attn_mask(L, S, gen);
  auto padding = attnx::race_check::padding_of_first_keys(B, S, 32);
  const int err = attnx_emu_metal::launch_attention(
      p, dtype, q.data(), k.data(), v.data(), attn_mask.data(), padding.data(), out.data(), lse.data(),
      f.key_lengths ? lengths.data() : nullptr, f.sinks ? sinks.data() : nullptr);
  if (err != 0) std::fprintf(stderr, "attention launch failed: %d\n", err);
  return err != 0;
}

int linear(DType dtype, int64_t M, int64_t K, int64_t N) {
  std::mt19937 gen(1);
  attnx::LinearParams p{};
  p.rows = M, p.rows_inner = 1, p.in_features = K, p.out_features = N;
  p.input_stride[0] = K, p.input_stride[2] = 1;
  p.weight_stride[0] = K, p.weight_stride[1] = 1;
  p.bias_stride = 1, p.has_bias = 1;
  p.out_stride[0] = N, p.out_stride[2] = 1;
  auto x = randn(M * K, dtype, gen), w = randn(N * K, dtype, gen), b = randn(N, dtype, gen);
  auto out = randn(M * N, dtype, gen);
  const int err = attnx_emu_metal::launch_linear(p, dtype, x.data(), w.data(), b.data(), out.data());
  if (err != 0) std::fprintf(stderr, "linear launch failed: %d\n", err);
  return err != 0;
}

}  // namespace

int main() {
  int failures = 0;
  failures += attention(kFloat32, 2, 1, 3, 70, 24, false);   // vector
  failures += attention(kBFloat16, 1, 1, 2, 40, 200, true);  // vector, bucket 256
  failures += attention(kFloat32, 2, 1, 40, 70, 24, false);  // tiled: 2 threadgroups, 3 key tiles
  failures += attention(kBFloat16, 1, 1, 33, 50, 64, true);  // tiled, causal
  Features gqa_window;  // 4 query heads on 2 kv heads, a window that skips tiles, key lengths, sinks
  gqa_window.kv_heads = 2, gqa_window.window_left = 20, gqa_window.window_right = 3;
  gqa_window.key_lengths = true, gqa_window.sinks = true;
  Features mqa_softcap;  // 2 query heads on 1 kv head, bottom-right causal, soft-capping
  mqa_softcap.kv_heads = 1, mqa_softcap.window_right = 0, mqa_softcap.softcap = 2.0f;
  failures += attention(kFloat32, 2, 4, 3, 70, 24, false, gqa_window);   // vector
  failures += attention(kFloat32, 2, 4, 40, 90, 24, false, gqa_window);  // tiled
  failures += attention(kBFloat16, 1, 2, 2, 40, 32, true, mqa_softcap);  // vector
  failures += attention(kBFloat16, 1, 2, 40, 50, 32, false, mqa_softcap);  // tiled
  failures += linear(kFloat32, 5, 70, 9);                    // gemv
  failures += linear(kBFloat16, 40, 45, 33);                 // gemm: partial tiles in M, N and K
  std::printf("%d failed launches\n", failures);
  return failures;
}
