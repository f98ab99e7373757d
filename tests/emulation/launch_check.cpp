// attnx: the CUDA launch plans and the launchers' refusals, on the kernels compiled for the CPU (see
// test_cuda_emulation.py).
//
// What the glue never sends to a launcher, but a launcher must still hold to: the plans stay within a GPU's
// limits for every dtype and head-dim bucket (shared memory, a 1-D grid past grid.y's 65535), and
// launch_attention refuses parameters that would make a kernel divide by zero or read a null pointer, and
// head dims it has no kernel for, with cudaErrorInvalidValue, as the CUDA runtime refuses a bad launch.
// AttentionParams are built here as common/attention.cpp builds them, so nothing mirrors them outside C++.
//
// Prints one line per failed check and "ok" when there is none; the exit status is the number of failures.
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "cuda/attention_kernel.h"
#include "race_check.h"

namespace {

using attnx::AttentionParams;
using attnx::AttentionPointers;
using attnx::race_check::unmasked;
using attnx::cuda::DType;
using attnx::cuda::Kernel;

int failures = 0;

void check(bool ok, const char* what, long long a = 0, long long b = 0) {
  if (ok) return;
  std::printf("FAILED: %s (%lld, %lld)\n", what, a, b);
  ++failures;
}

const char* name(DType dtype) {
  return attnx::cuda::dtype_name(dtype);
}

// Shared memory within the 163 KiB an sm80 block may opt into, for every dtype and head-dim bucket of the
// SIMT kernel, and within sm90's 227 KiB for the tensor-core kernel, whose float32 bucket 128 takes 165 KiB
// (choose_kernel leaves it to the SIMT kernel on a device with less). The launchers opt in above 48 KiB; the
// emulated runtime refuses a launch that did not, as the real one does. B * H past grid.y's 65535: the grid
// is 1-D, one block per (query block, b, h).
void plan_limits() {
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (int d : {32, 64, 128, 256}) {
      const AttentionParams p = unmasked(1, 1, 1, 1, 1, d, d);
      const attnx::cuda::AttentionPlan plan = attnx::cuda::plan_attention(p, dtype);
      std::printf("simt %s d=%d: %zu bytes of shared memory\n", name(dtype), d, plan.smem_bytes);
      check(plan.bucket == d, "simt bucket", plan.bucket, d);
      check(plan.threads == 128, "simt threads", plan.threads);
      check(plan.smem_bytes <= 163 * 1024, "simt shared memory within 163 KiB", d,
            static_cast<long long>(plan.smem_bytes));
      const attnx::cuda::AttentionMmaPlan mma =
          attnx::cuda::plan_attention_mma(p, dtype, AttentionPointers{});
      if (mma.bucket == 0) continue;  // no tensor-core kernel for this dtype and bucket
      std::printf("mma %s d=%d: %zu bytes of shared memory\n", name(dtype), d, mma.smem_bytes);
      check(mma.bucket == d && mma.threads == 128, "mma bucket and threads", mma.bucket, mma.threads);
      check(mma.smem_bytes <= 227 * 1024, "mma shared memory within 227 KiB", d,
            static_cast<long long>(mma.smem_bytes));
      check(mma.smem_bytes <= 163 * 1024 || (dtype == DType::kFloat32 && d == 128),
            "mma shared memory within 163 KiB but float32 at bucket 128", d,
            static_cast<long long>(mma.smem_bytes));
    }
  }
  // The tensor-core backward's blocks (both passes, attn_mask's gradient asked for): within the 99 KiB of
  // sm_86/89/120 at every bucket it has, float32's (up to kMmaBackwardMaxHeadDimTf32) included.
  for (int element : {2, 4}) {
    for (int d : {32, 64, 128}) {
      if (element == 4 && d > attnx::cuda::kMmaBackwardMaxHeadDimTf32) continue;
      const int64_t bytes = attnx::cuda::mma_backward_smem_bytes(d, element, /*mask_grad=*/true);
      std::printf("mma backward %d-byte d=%d: %lld bytes of shared memory\n", element, d,
                  static_cast<long long>(bytes));
      check(bytes <= 99 * 1024, "mma backward shared memory within 99 KiB", d, bytes);
    }
  }
  AttentionParams p = unmasked(300, 300, 300, 40, 1, 8, 8);
  const attnx::cuda::AttentionPlan plan = attnx::cuda::plan_attention(p, DType::kFloat32);
  check(plan.bh == 90000, "simt grid: B * H", plan.bh);
  check(plan.q_blocks == (40 + plan.rows_per_block - 1) / plan.rows_per_block, "simt grid: query blocks",
        plan.q_blocks, plan.rows_per_block);
  check(plan.blocks == plan.q_blocks * 90000 && plan.blocks <= attnx::cuda::kMaxBlocks, "simt grid: 1-D",
        plan.blocks);
  const attnx::cuda::AttentionMmaPlan mma = attnx::cuda::plan_attention_mma(p, DType::kFloat16, {});
  check(mma.bh == 90000 && mma.blocks == mma.q_blocks * 90000 && mma.blocks <= attnx::cuda::kMaxBlocks,
        "mma grid: 1-D", mma.blocks);
}

// Buffers for unmasked(1, 4, Hkv, 3, 5, D, Dv) in float16 (zeros: only the launch's status matters here).
struct Buffers {
  std::vector<uint16_t> q, k, v, out;
  std::vector<float> lse, sinks;
  std::vector<int32_t> key_lengths;
  Buffers(int64_t Hkv, int64_t D, int64_t Dv)
      : q(4 * 3 * D),
        k(Hkv * 5 * D),
        v(Hkv * 5 * Dv),
        out(4 * 3 * Dv),
        lse(4 * 3),
        sinks(4),
        key_lengths{5} {}
  AttentionPointers pointers(bool key_lengths_ptr = false, bool sinks_ptr = false) {
    AttentionPointers ptr{};
    ptr.query = q.data(), ptr.key = k.data(), ptr.value = v.data();
    ptr.out = out.data(), ptr.lse = lse.data();
    ptr.key_lengths = key_lengths_ptr ? key_lengths.data() : nullptr;
    ptr.sinks = sinks_ptr ? sinks.data() : nullptr;
    return ptr;
  }
};

int launch(const AttentionParams& p, const AttentionPointers& ptr, Kernel kernel) {
  return static_cast<int>(attnx::cuda::launch_attention(p, DType::kFloat16, ptr, nullptr, kernel));
}

// The launchers check what the kernels would otherwise divide by or dereference.
void inconsistent_params_are_refused(Kernel kernel) {
  const char* k = kernel == Kernel::kMma ? "mma" : "simt";
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  Buffers buf(2, 16, 16);
  const AttentionParams base = unmasked(1, 4, 2, 3, 5, 16, 16);
  std::printf("%s: consistent params launch\n", k);
  check(launch(base, buf.pointers(), kernel) == 0, "plain launch");
  AttentionParams p = base;
  p.key_lengths_kind = attnx::kKeyLengthsInt32, p.key_lengths_stride = 1;
  check(launch(p, buf.pointers(true, false), kernel) == 0, "launch with key_lengths");
  check(launch(p, buf.pointers(false, false), kernel) == invalid, "key_lengths without a pointer");
  p = base;
  p.has_sinks = 1;
  check(launch(p, buf.pointers(false, true), kernel) == 0, "launch with sinks");
  check(launch(p, buf.pointers(false, false), kernel) == invalid, "sinks without a pointer");
  for (int64_t kv_heads : {0, 3, 8}) {
    p = base;
    p.kv_heads = kv_heads;
    check(launch(p, buf.pointers(), kernel) == invalid, "kv_heads that do not divide heads", kv_heads);
  }
  if (kernel == Kernel::kMma) {
    // attn_mask's tile classes live in a workspace the caller gives: refused without it.
    std::vector<uint8_t> mask(3 * 5);
    p = base;
    p.attn_mask_kind = attnx::kMaskBool;
    p.attn_mask_stride[2] = 5, p.attn_mask_stride[3] = 1;
    AttentionPointers ptr = buf.pointers();
    ptr.attn_mask = mask.data();
    const size_t bytes = attnx::cuda::attention_workspace_bytes(p, DType::kFloat16, ptr, kernel);
    // One key tile: the classes' two words for each of the block's 4 query tiles, and (bool) the mask packed,
    // two words a row.
    check(bytes == (4 * 2 + 3 * 2) * 4, "an (L, S) bool mask's classes and packed rows", bytes);
    check(launch(p, ptr, kernel) == invalid, "attn_mask without the workspace");
    std::vector<uint32_t> workspace(bytes / 4);
    check(attnx::cuda::launch_attention(p, DType::kFloat16, ptr, nullptr, kernel, workspace.data()) == 0,
          "attn_mask with the workspace");
    // key_padding_mask alone: its batch's two rows of classes and (bool) its packed row.
    p = base;
    p.key_padding_mask_kind = attnx::kMaskBool;
    p.key_padding_mask_stride[0] = 5, p.key_padding_mask_stride[1] = 1;
    ptr = buf.pointers();
    ptr.key_padding_mask = mask.data();
    const size_t padding_bytes = attnx::cuda::attention_workspace_bytes(p, DType::kFloat16, ptr, kernel);
    check(padding_bytes == (2 + 2) * 4, "a bool key_padding_mask's classes and packed row for its one batch",
          padding_bytes);
    check(launch(p, ptr, kernel) == invalid, "key_padding_mask without the workspace");
    check(attnx::cuda::launch_attention(p, DType::kFloat16, ptr, nullptr, kernel, workspace.data()) == 0,
          "key_padding_mask with the workspace");
  }
  p = base;
  p.window_left = -2;
  check(launch(p, buf.pointers(), kernel) == invalid, "window_left below -1");
  p = base;
  p.window_right = -2;
  check(launch(p, buf.pointers(), kernel) == invalid, "window_right below -1");
}

// No kernel above head dim 256 (the glue runs the composite there): no bucket, and the launcher refuses.
void head_dim_above_256_has_no_kernel() {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  for (auto [D, Dv] : {std::pair<int64_t, int64_t>{264, 8}, {8, 300}}) {
    const AttentionParams p = unmasked(1, 4, 4, 3, 5, D, Dv);
    check(attnx::cuda::plan_attention(p, DType::kFloat32).bucket == 0, "no bucket above 256", D, Dv);
    Buffers buf(4, D, Dv);
    check(launch(p, buf.pointers(), Kernel::kSimt) == invalid, "launch above head dim 256", D, Dv);
  }
}

}  // namespace

int main() {
  plan_limits();
  inconsistent_params_are_refused(Kernel::kSimt);
  inconsistent_params_are_refused(Kernel::kMma);
  head_dim_above_256_has_no_kernel();
  if (failures == 0) std::printf("ok\n");
  return failures;
}
