// attnx: the emulated CUDA kernels under ThreadSanitizer (see test_cuda_emulation.py).
//
// The emulation's barriers and warp exchanges are atomics that TSan understands, so a shared-memory access
// that no __syncthreads/__syncwarp orders against another thread's write is reported as a data race, whether
// or not the OS happened to interleave the threads badly. Values do not matter here (the pytest suite checks
// them): each launch covers several key tiles, masks (on the tensor cores after attn_mask's pre-pass), causal
// skipping and partial tiles; some add grouped KV heads, a window with per-batch key lengths (tile loops that
// start past key 0), soft-capping, sinks and dropout. The backwards' launches (three SIMT, two on the tensor
// cores) run after forwards of their own.
#include "race_check.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda/attention_backward_kernel.h"
#include "cuda/attention_kernel.h"

namespace {

using attnx::cuda::DType;
using attnx::cuda::Kernel;

template <typename T>
std::vector<T> randn(size_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist;
  std::vector<T> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const float x = dist(gen);
    if constexpr (std::is_same_v<T, __half>) {
      out.push_back(__float2half_rn(x));
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out.push_back(__float2bfloat16_rn(x));
    } else {
      out.push_back(static_cast<T>(x));
    }
  }
  return out;
}

// The features beyond masks, with key lengths (B of them, or none).
struct Features : attnx::race_check::Features {
  std::vector<int32_t> key_lengths;
};

template <typename T>
int run(DType dtype, Kernel kernel, int64_t B, int64_t H, int64_t L, int64_t S, int64_t D, bool causal,
        const Features& f = {}) {
  std::mt19937 gen(0);
  attnx::AttentionParams p = attnx::race_check::params(B, H, L, S, D, causal, f);
  if (!f.key_lengths.empty()) p.key_lengths_kind = attnx::kKeyLengthsInt32, p.key_lengths_stride = 1;
  std::vector<double> sinks(H, 0.5);  // room for float64's; the float kernels read the first H floats
  const auto q = randn<T>(B * H * L * D, gen), k = randn<T>(B * p.kv_heads * S * D, gen),
             v = randn<T>(B * p.kv_heads * S * D, gen);
  std::vector<T> out(B * H * L * D);
  std::vector<double> lse(B * H * L);  // room for float64's
  // A random (L, S) bool mask and a float key_padding_mask that removes whole tiles of batch 0.
  const auto attn_mask = attnx::race_check::random_attn_mask(L, S, gen);
  const auto padding = attnx::race_check::padding_of_first_keys(B, S, 64);
  attnx::AttentionPointers ptr{};
  ptr.query = q.data();
  ptr.key = k.data();
  ptr.value = v.data();
  ptr.attn_mask = attn_mask.data();
  ptr.key_padding_mask = padding.data();
  ptr.out = out.data();
  ptr.lse = lse.data();
  ptr.key_lengths = f.key_lengths.empty() ? nullptr : f.key_lengths.data();
  ptr.sinks = f.sinks ? sinks.data() : nullptr;
  // The mma kernel's attn_mask tile classes: its pre-pass writes them, its blocks read them.
  std::vector<uint32_t> workspace(attnx::cuda::attention_workspace_bytes(p, dtype, ptr, kernel) / 4);
  const cudaError_t err = attnx::cuda::launch_attention(p, dtype, ptr, nullptr, kernel,
                                                        workspace.empty() ? nullptr : workspace.data());
  if (err != cudaSuccess) std::fprintf(stderr, "launch failed: %d\n", static_cast<int>(err));
  return err == cudaSuccess ? 0 : 1;
}

// The forward (SIMT) then the backward of one problem: the SIMT kernels (attention_backward_kernel.cu), or
// with `mma` the tensor-core ones (attention_backward_kernel_mma.cu); with a float (L, S) attn_mask and its
// gradient (summed over B and H: one block loops over both) when `mask_grad`.
template <typename T>
int run_backward(DType dtype, int64_t B, int64_t H, int64_t L, int64_t S, int64_t D, bool causal,
                 bool mask_grad, const Features& f = {}, bool mma = false) {
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::mt19937 gen(1);
  attnx::AttentionBackwardParams bp{};
  attnx::AttentionParams& p = bp.fwd;
  p = attnx::race_check::params(B, H, L, S, D, causal, f);
  if (!f.key_lengths.empty()) p.key_lengths_kind = attnx::kKeyLengthsInt32, p.key_lengths_stride = 1;
  std::vector<acc_t> sinks(H, acc_t(0.5));
  const auto q = randn<T>(B * H * L * D, gen), k = randn<T>(B * p.kv_heads * S * D, gen),
             v = randn<T>(B * p.kv_heads * S * D, gen), grad_out = randn<T>(B * H * L * D, gen);
  const auto bool_mask = attnx::race_check::random_attn_mask(L, S, gen);
  const auto float_mask = randn<acc_t>(L * S, gen);
  if (mask_grad) p.attn_mask_kind = sizeof(acc_t) == 8 ? attnx::kMaskFloat64 : attnx::kMaskFloat32;
  const auto padding = attnx::race_check::padding_of_first_keys(B, S, 40);
  std::vector<T> out(B * H * L * D), grad_query(B * H * L * D), grad_key(B * p.kv_heads * S * D),
      grad_value(B * p.kv_heads * S * D);
  std::vector<acc_t> lse(B * H * L), grad_mask(mask_grad ? L * S : 0);
  attnx::AttentionBackwardPointers ptr{};
  ptr.fwd.query = q.data();
  ptr.fwd.key = k.data();
  ptr.fwd.value = v.data();
  ptr.fwd.attn_mask = mask_grad ? static_cast<const void*>(float_mask.data()) : bool_mask.data();
  // with f.bool_padding, the same keys removed by a bool key_padding_mask (both masks bool: no float term)
  std::vector<uint8_t> bool_padding(padding.size());
  for (size_t i = 0; i < padding.size(); ++i) bool_padding[i] = padding[i] == -INFINITY;
  if (f.bool_padding) p.key_padding_mask_kind = attnx::kMaskBool;
  ptr.fwd.key_padding_mask = f.bool_padding ? static_cast<const void*>(bool_padding.data())
                                            : static_cast<const void*>(padding.data());
  ptr.fwd.out = out.data();
  ptr.fwd.lse = lse.data();
  ptr.fwd.key_lengths = f.key_lengths.empty() ? nullptr : f.key_lengths.data();
  ptr.fwd.sinks = f.sinks ? sinks.data() : nullptr;
  cudaError_t err = attnx::cuda::launch_attention(p, dtype, ptr.fwd, nullptr, Kernel::kSimt);
  // The gradients as the forward's layouts: contiguous (B, H, N, E).
  attnx::race_check::contiguous(bp.grad_out_stride, H, L, D);
  attnx::race_check::contiguous(bp.grad_query_stride, H, L, D);
  attnx::race_check::contiguous(bp.grad_key_stride, p.kv_heads, S, D);
  attnx::race_check::contiguous(bp.grad_value_stride, p.kv_heads, S, D);
  if (mask_grad) bp.grad_attn_mask_size[0] = 1, bp.grad_attn_mask_size[1] = 1, bp.grad_attn_mask_size[2] = L;
  if (mask_grad) bp.grad_attn_mask_size[3] = S;
  ptr.grad_out = grad_out.data();
  ptr.grad_query = grad_query.data();
  ptr.grad_key = grad_key.data();
  ptr.grad_value = grad_value.data();
  ptr.grad_attn_mask = mask_grad ? grad_mask.data() : nullptr;
  // delta, and the tensor-core kernels' mask tile classes after it
  const attnx::cuda::AttentionBackwardMmaPlan plan = attnx::cuda::plan_attention_backward_mma(bp, dtype, ptr);
  const size_t bytes = mma ? plan.workspace_bytes
                           : attnx::cuda::plan_attention_backward(bp, dtype, mask_grad).workspace_bytes;
  std::vector<double> workspace(bytes / sizeof(double) + 1);
  if (err == cudaSuccess) {
    err = mma ? attnx::cuda::launch_attention_backward_mma(bp, dtype, ptr, plan, workspace.data(), nullptr)
              : attnx::cuda::launch_attention_backward(bp, dtype, ptr, workspace.data(), nullptr);
  }
  if (err != cudaSuccess) std::fprintf(stderr, "backward launch failed: %d\n", static_cast<int>(err));
  return err == cudaSuccess ? 0 : 1;
}

}  // namespace

int main() {
  int failures = 0;
  failures += run<float>(DType::kFloat32, Kernel::kSimt, 2, 1, 20, 100, 24, false);
  failures += run<float>(DType::kFloat32, Kernel::kSimt, 1, 2, 40, 100, 40, true);
  failures += run<double>(DType::kFloat64, Kernel::kSimt, 1, 1, 9, 70, 200, false);
  failures += run<__nv_bfloat16>(DType::kBFloat16, Kernel::kSimt, 1, 1, 17, 70, 64, false);
  failures += run<__half>(DType::kFloat16, Kernel::kMma, 2, 1, 70, 200, 64, false);
  failures += run<__nv_bfloat16>(DType::kBFloat16, Kernel::kMma, 1, 1, 130, 140, 32, true);
  // Grouped heads, a bottom-right window over per-batch key lengths, soft-capping and sinks.
  Features f;
  f.kv_heads = 1, f.window_left = 40, f.window_right = 0, f.key_lengths = {100, 77}, f.softcap = 5.0f;
  f.sinks = true;
  failures += run<float>(DType::kFloat32, Kernel::kSimt, 2, 2, 20, 100, 24, false, f);
  failures += run<double>(DType::kFloat64, Kernel::kSimt, 2, 2, 9, 100, 40, false, f);
  f.window_left = 70;
  failures += run<__half>(DType::kFloat16, Kernel::kMma, 2, 2, 70, 200, 64, false, f);
  // Dropout on the tensor cores: rows whose tiles start on a Philox block (S = 200: draws shared between
  // lanes) and rows whose do not (S = 141).
  Features drop;
  drop.dropout = true;
  failures += run<__half>(DType::kFloat16, Kernel::kMma, 1, 2, 70, 200, 64, false, drop);
  failures += run<__nv_bfloat16>(DType::kBFloat16, Kernel::kMma, 1, 1, 70, 141, 32, true, drop);
  // The backward: several query and key tiles, every tile size (32, 16 and 8), the mask's gradient.
  failures += run_backward<float>(DType::kFloat32, 2, 2, 40, 70, 24, true, false);
  failures += run_backward<float>(DType::kFloat32, 2, 2, 40, 50, 24, false, true);
  failures += run_backward<__half>(DType::kFloat16, 1, 2, 20, 40, 200, false, false);
  failures += run_backward<double>(DType::kFloat64, 1, 1, 20, 30, 200, true, true);
  f.window_left = 30;
  failures += run_backward<__nv_bfloat16>(DType::kBFloat16, 2, 2, 40, 100, 40, false, true, f);
  // The tensor-core backward: several 64-row query and key tiles, both stages of either pass, partial tiles,
  // and attn_mask's gradient (a block looping over B and H, its dS tile in shared memory).
  failures += run_backward<__half>(DType::kFloat16, 1, 2, 150, 200, 64, true, false, {}, /*mma=*/true);
  failures += run_backward<__half>(DType::kFloat16, 2, 2, 70, 100, 32, false, true, {}, /*mma=*/true);
  failures += run_backward<__nv_bfloat16>(DType::kBFloat16, 2, 2, 70, 100, 40, false, false, f, /*mma=*/true);
  // both masks bool (the bits instantiation: the masks' classes and packed bits), dropout with S a multiple
  // of 4 (each Philox block shared by 4 lanes' scores in both passes)
  Features bits;
  bits.bool_padding = bits.dropout = true;
  failures += run_backward<__half>(DType::kFloat16, 2, 2, 70, 100, 32, false, false, bits, /*mma=*/true);
  std::printf("%d failed launches\n", failures);
  return failures;
}
