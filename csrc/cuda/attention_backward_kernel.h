// attnx: the torch-free entry point of attnx::attention_backward's CUDA kernels
// (cuda/attention_backward_kernel.cu) and their launch plan, used by the glue (cuda/attention_backward.cpp)
// and by the CPU emulation (tests/emulation/).
//
// Three launches on one stream, each over 128 threads:
//   delta   one warp per query row: delta = rowsum(dO * O) in the accumulator type, into the workspace.
//   keys    one block per (b, kv head, tile of `tile` keys): dK and dV of those keys, summed over the query
//           heads of the kv head's group and over every query tile that sees the key tile (key-major).
//   queries one block per (b, h, tile of `tile` query rows): dQ of those rows (query-major), and the float
//           attn_mask's gradient. When that gradient broadcasts along B, H or L, the blocks that would add
//           into the same elements are one block looping over them, so that no two blocks write the same
//           memory: no atomics, and the results are the same bit for bit from run to run.
// Shared memory, in accumulator elements: q_s (tile, ld) | do_s (tile, ld) | k_s (tile, ld) | v_s (tile, ld)
// | p_s (tile, tile + 1) | ds_s (tile, tile + 1) | lse_s (tile) | delta_s (tile); ld = bucket + 1 (odd: the
// 32 keys or rows a warp reads at once fall on distinct banks).
#pragma once

#if !defined(__CUDACC_RTC__)  // NVRTC compiles the kernels only, not the host function below
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>
#endif

#include "attnx/params.h"
#include "cuda/attention_plan.h"

namespace attnx::cuda {

constexpr int kBackwardThreads = 128;

// Keys and query rows per tile: 32, fewer where the four staged operand tiles would pass 64 KiB of shared
// memory (so that a block fits in the 99 KiB an sm86/sm89 block may have): 16 at bucket 256 in float and
// 128 in double, 8 at 256 in double. tile * bucket <= 4096 (float) or 2048 (double), so that a thread owns at
// most 32 (16) elements of a (tile, bucket) gradient tile.
constexpr int backward_tile(int bucket, int acc_size) {
  return bucket * acc_size <= 512 ? 32 : 16384 / (bucket * acc_size);
}

// The query pass's grid, the same in both backwards: a block per (b, h, query tile), without the dims along
// which attn_mask's gradient broadcasts (all_*): a block loops over those, so that the blocks that would add
// into the same elements are one, and no two blocks write the same memory.
struct QueryPassGrid {
  bool all_batches, all_heads, all_query_tiles;  // where attn_mask's gradient broadcasts along B, H, L
  int64_t q_tiles;
  int64_t blocks;

  // The (b, h, query tile) of block `block` along the dims it does not loop over (0 along the others).
  constexpr void block_item(int64_t block, int64_t heads, int64_t* b, int64_t* h, int64_t* qt) const {
    const int64_t nq = all_query_tiles ? 1 : q_tiles, nh = all_heads ? 1 : heads;
    *qt = block % nq;
    *h = block / nq % nh;
    *b = block / nq / nh;
  }
};

// `mask_grad`: attn_mask's gradient is asked for; `q_tiles`: the pass's query tiles per (b, h).
constexpr QueryPassGrid query_pass_grid(const AttentionBackwardParams& bp, bool mask_grad, int64_t q_tiles) {
  const AttentionParams& p = bp.fwd;
  const int64_t* g = bp.grad_attn_mask_size;
  QueryPassGrid grid{mask_grad && g[0] == 1, mask_grad && g[1] == 1, mask_grad && g[2] == 1, q_tiles, 0};
  grid.blocks = (grid.all_batches ? 1 : p.batch) * (grid.all_heads ? 1 : p.heads) *
                (grid.all_query_tiles ? 1 : q_tiles);
  return grid;
}

struct AttentionBackwardPlan {
  int bucket;  // max(D, Dv) rounded up to 32, 64, 128 or 256; 0 when it exceeds kMaxHeadDim (no kernel)
  int tile;    // keys and query rows per tile: 32, 16 or 8
  int ld;      // row stride of q_s, do_s, k_s and v_s
  int threads;
  int64_t q_tiles, k_tiles;
  int64_t delta_blocks;  // ceil(B * H * L / warps per block)
  int64_t key_blocks;    // B * Hkv * k_tiles
  QueryPassGrid queries;
  size_t smem_bytes;
  size_t workspace_bytes;  // delta: B * H * L accumulators
};

// `mask_grad`: attn_mask's gradient is asked for (AttentionBackwardPointers::grad_attn_mask is not null).
inline AttentionBackwardPlan plan_attention_backward(const AttentionBackwardParams& bp, DType dtype,
                                                     bool mask_grad) {
  const AttentionParams& p = bp.fwd;
  AttentionBackwardPlan plan{};
  plan.bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
  if (plan.bucket == 0) return plan;
  const int acc = acc_bytes(dtype);
  plan.tile = backward_tile(plan.bucket, acc);
  plan.ld = plan.bucket + 1;
  plan.threads = kBackwardThreads;
  plan.q_tiles = (p.q_len + plan.tile - 1) / plan.tile;
  plan.k_tiles = (p.kv_len + plan.tile - 1) / plan.tile;
  const int64_t rows = p.batch * p.heads * p.q_len;
  const int64_t warps = kBackwardThreads / kWarpSize;
  plan.delta_blocks = (rows + warps - 1) / warps;
  plan.key_blocks = p.batch * p.kv_heads * plan.k_tiles;
  plan.queries = query_pass_grid(bp, mask_grad, plan.q_tiles);
  const int64_t operands = 4 * int64_t{plan.tile} * plan.ld;
  const int64_t tiles = 2 * int64_t{plan.tile} * (plan.tile + 1);
  plan.smem_bytes = static_cast<size_t>(operands + tiles + 2 * plan.tile) * acc;
  plan.workspace_bytes = static_cast<size_t>(rows) * acc;
  return plan;
}

// The tensor-core kernels (cuda/attention_backward_kernel_mma.cu), two launches on one stream, 128 threads a
// block, mma_backward_smem_bytes of shared memory:
//   queries one block per (b, h, 64 query rows): delta = rowsum(dO * O) of its rows into the workspace, then
//           dQ of its rows over the key tiles they see, and attn_mask's gradient. Where that gradient
//           broadcasts along B, H or L, a block loops over the batches, heads or query tiles that add into
//           the same elements (as the SIMT query pass), so that no two blocks write the same memory.
//   keys    one block per (b, kv head, 64 keys): dK and dV of its keys, summed over the group's query heads
//           and the query tiles that see them (reading the queries' lse log2(e) and delta).
// The workspace starts with the rows' numbers the query pass writes for the key pass: lse log2(e) of each
// (b, h) row, q_tiles 64-row tiles of them (rows past L: infinity), then delta of the same rows (past L: 0).
// The key pass copies both for a tile by cp.async, in 16-byte chunks of whole tiles: no test of L.
struct AttentionBackwardMmaPlan {
  int bucket;   // head-dim bucket (32, 64 or 128); 0 where mma_backward_supports() is false
  // MmaVariant, as the forward's: plain (mma_plain and vector loads: no mask, soft-cap or dropout), bits (the
  // others where each mask is bool or absent: the masks read as the pre-pass's packed bits alone, so the
  // loops hold no code for a float mask) and general (a float mask, read per score on the tiles it cuts).
  int variant;
  bool vector;  // every row of q, k, v and grad_out moves as 16-byte vectors (cp.async)
  int threads;
  int64_t q_tiles, k_tiles;
  QueryPassGrid queries;
  int64_t key_blocks;  // B * Hkv * k_tiles
  size_t smem_bytes;
  // The general instantiation's mask tile classes (MaskTiles, kind kMaskNone where a mask is absent or the
  // instantiation the plain one): the forward's pre-pass, over tiles of kMmaRowsPerWarp query rows (4 a
  // query block) and kMmaTileKeys keys (a key block), with bool masks packed a bit per element; its blocks
  // (0: no pre-pass). The words follow the rows' numbers in the workspace.
  MaskTiles attn_tiles, padding_tiles;
  int64_t mask_blocks;
  int64_t row_words;       // lse log2(e), then delta: B * H * q_tiles * 64 floats each
  size_t workspace_bytes;  // the rows' numbers (2 row_words floats), then the masks' words
};

inline AttentionBackwardMmaPlan plan_attention_backward_mma(const AttentionBackwardParams& bp, DType dtype,
                                                            const AttentionBackwardPointers& ptr) {
  const AttentionParams& p = bp.fwd;
  AttentionBackwardMmaPlan plan{};
  if (!mma_backward_supports(p, dtype)) return plan;
  const bool mask_grad = ptr.grad_attn_mask != nullptr;
  plan.bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
  const int element = mma_element_bytes(dtype);
  plan.vector = mma_rows_16(ptr.fwd.query, p.q_stride, p.head_dim, element) &&
                mma_vector_loads(p, ptr.fwd.key, ptr.fwd.value, element) &&
                mma_rows_16(ptr.grad_out, bp.grad_out_stride, p.v_head_dim, element);
  const auto bits = [](int32_t kind) { return kind == kMaskNone || kind == kMaskBool; };
  // float32's plain instantiation also stages rows that are not 16-byte vectors (element by element): it has
  // no other (mma_backward_supports).
  plan.variant = mma_plain(p) && (plan.vector || dtype == DType::kFloat32) ? kMmaPlain
                 : bits(p.attn_mask_kind) && bits(p.key_padding_mask_kind) ? kMmaBits
                                                                            : kMmaGeneral;
  plan.threads = kWarps * kWarpSize;
  plan.q_tiles = (p.q_len + kMmaTileKeys - 1) / kMmaTileKeys;
  plan.k_tiles = (p.kv_len + kMmaTileKeys - 1) / kMmaTileKeys;
  plan.queries = query_pass_grid(bp, mask_grad, plan.q_tiles);
  plan.key_blocks = p.batch * p.kv_heads * plan.k_tiles;
  plan.smem_bytes = static_cast<size_t>(mma_backward_smem_bytes(plan.bucket, element, mask_grad));
  // The masks' words start after the rows' numbers, at a multiple of 64 words: plan_mask_tiles lays packed
  // rows out from an even word, for the forward's 8-byte loads of a tile's two words.
  plan.row_words = p.batch * p.heads * plan.q_tiles * kMmaTileKeys;
  const int64_t row_words = 2 * plan.row_words;
  int64_t words = row_words;
  if (plan.variant != kMmaPlain && (p.attn_mask_kind != kMaskNone || p.key_padding_mask_kind != kMaskNone)) {
    const int64_t row_tiles = plan.q_tiles * (kMmaTileKeys / kMmaRowsPerWarp);
    plan.attn_tiles = plan_mask_tiles(p, p.attn_mask_kind, p.attn_mask_stride, row_tiles, row_words, true);
    const int64_t* const kpm = p.key_padding_mask_stride;
    const int64_t padding_stride[4] = {kpm[0], 0, 0, kpm[1]};
    plan.padding_tiles =
        plan_mask_tiles(p, p.key_padding_mask_kind, padding_stride, 1, plan.attn_tiles.end, true);
    plan.mask_blocks = (plan.attn_tiles.warps + plan.padding_tiles.warps + kWarps - 1) / kWarps;
    words = plan.padding_tiles.end;
  }
  plan.workspace_bytes = static_cast<size_t>(words) * sizeof(float);
  return plan;
}

#if !defined(__CUDACC_RTC__)
// Runs attention_backward on `stream` with the tensor-core kernels: grad_query, grad_key and grad_value
// (every element written), and adds attn_mask's gradient into ptr.grad_attn_mask when it is not null (a
// zeroed float buffer of bp.grad_attn_mask_size). `plan`: plan_attention_backward_mma(bp, dtype, ptr), which
// the caller sized the workspace from (computed once a call). `workspace`: plan.workspace_bytes, 16-byte
// aligned, any content. Returns the first launch error, cudaSuccess when there is nothing to compute, and
// cudaErrorInvalidValue when the kernels do not cover the problem (mma_backward_supports, inconsistent
// params).
cudaError_t launch_attention_backward_mma(const AttentionBackwardParams& bp, DType dtype,
                                          const AttentionBackwardPointers& ptr,
                                          const AttentionBackwardMmaPlan& plan, void* workspace,
                                          cudaStream_t stream);

// Runs attention_backward on `stream`: grad_query, grad_key and grad_value (every element written), and adds
// attn_mask's gradient into ptr.grad_attn_mask when it is not null (a zeroed buffer of
// bp.grad_attn_mask_size in the accumulator type). `workspace`: plan.workspace_bytes, 16-byte aligned, any
// content. The sinks' gradient is not computed here (AttentionBackwardProblem::box computes it for every
// backend). Returns the first launch error, cudaSuccess when there is nothing to compute, and
// cudaErrorInvalidValue when the kernels do not cover the problem (head dims above kMaxHeadDim, packed
// sequences, inconsistent params).
cudaError_t launch_attention_backward(const AttentionBackwardParams& bp, DType dtype,
                                      const AttentionBackwardPointers& ptr, void* workspace,
                                      cudaStream_t stream);
#endif

}  // namespace attnx::cuda
