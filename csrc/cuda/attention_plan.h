// attnx: the launch plan of attnx::attention's CUDA SIMT kernel.
//
// Torch-free and host-only. The kernel's launcher (cuda/attention_kernel.cu), the glue (cuda/attention.cpp)
// and the CPU emulation (tests/emulation/) all take grid, block and shared-memory layout from
// plan_attention(), so the emulated launches are the launches a GPU gets.
//
// The kernel (see cuda/attention_kernel.cu):
//   grid   1-D, one block per (b, h, block of kRowsPerBlock query rows): blockIdx.x < 2^31 - 1, so B*H and L
//          never meet the 65535 limit of grid.y / grid.z.
//   block  kWarps warps; warp w owns rows_per_warp consecutive query rows of the block.
//   tiles  kTileKeys = 32 keys at a time (lane j scores key j), K and V staged in shared memory in the
//          accumulator type (float, or double for float64).
//   shared q_s (rows_per_block, ldq) | k_s (kTileKeys, ldk) | v_s (kTileKeys, ldv) | p_s (rows_per_block,
//          kTileKeys), every region 16-byte aligned.
#pragma once

#if !defined(__CUDACC_RTC__)  // NVRTC: attnx/rtc.h
#include <stddef.h>
#include <stdint.h>
#endif

#include "attnx/params.h"

namespace attnx::cuda {

// The element type of query, key, value and out.
enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

constexpr int kWarpSize = 32;
constexpr int kWarps = 4;      // warps per block: 128 threads
constexpr int kTileKeys = 32;  // keys per K/V tile, one per lane
constexpr int kMaxHeadDim = 256;

// Bytes of the accumulator type: 8 for float64 inputs, 4 for the others (fp16/bf16 accumulate in float).
constexpr int acc_bytes(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : 4;
}

// Query rows per warp. Every K or V element a lane reads from shared memory serves this many rows, which is
// what the SIMT kernel's speed hangs on; 4 rows keep 4 * bucket / 32 fp32 output accumulators per lane in
// registers (32 at bucket 256). float64 at bucket 256 takes 2, which keeps its shared memory (148 KiB) under
// the 163 KiB an sm80 block may have.
constexpr int rows_per_warp(int acc_size, int bucket) {
  return acc_size == 8 && bucket == 256 ? 2 : 4;
}

// The head-dim bucket the kernel is instantiated for: max(D, Dv) rounded up to 32, 64, 128 or 256; 0 past
// 256.
constexpr int head_dim_bucket(int64_t head_dim, int64_t v_head_dim) {
  const int64_t d = head_dim > v_head_dim ? head_dim : v_head_dim;
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : d <= kMaxHeadDim ? 256 : 0;
}

struct AttentionPlan {
  int bucket;  // head-dim bucket; 0 when D or Dv exceeds kMaxHeadDim (no kernel: see cuda/attention.cpp)
  int rows_per_warp;
  int rows_per_block;  // kWarps * rows_per_warp
  int threads;         // kWarps * kWarpSize
  int64_t q_blocks;    // ceil(L / rows_per_block)
  int64_t bh;          // B * H
  int64_t blocks;      // q_blocks * bh: grid.x
  // Shared memory, in accumulator elements: row strides and region offsets.
  int ldq;  // >= D, a multiple of the 16-byte vector width; query rows are read whole by every lane
  int ldk;  // >= D, a multiple of the vector width, and an odd number of vectors: lane j reads row j, and an
            // odd vector stride puts the 8 lanes of each 128-bit shared-memory phase on 8 distinct bank
            // groups
  int ldv;  // = bucket: lane i reads columns i * w + 32 * w * g (w = its vector width), never a bank conflict
  int64_t q_off, k_off, v_off, p_off;
  size_t smem_bytes;
};

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// The largest grid.x a launch may have.
constexpr int64_t kMaxBlocks = 2147483647;

// True when the feature fields of `p` agree with each other and with `ptr`: kv_heads divides heads (and is
// positive when heads is), key_lengths and sinks are there when the params say so. The launchers refuse the
// launch (cudaErrorInvalidValue) otherwise, rather than divide by zero or read a null pointer on the device.
inline bool params_consistent(const AttentionParams& p, const AttentionPointers& ptr) {
  if (p.heads > 0 && (p.kv_heads <= 0 || p.heads % p.kv_heads != 0)) return false;
  if (p.key_lengths_kind != kKeyLengthsNone) {
    if (ptr.key_lengths == nullptr) return false;
    if (p.key_lengths_kind != kKeyLengthsInt32 && p.key_lengths_kind != kKeyLengthsInt64) return false;
  }
  if (p.has_sinks != 0 && ptr.sinks == nullptr) return false;
  if (p.has_block_map != 0 && (ptr.block_map == nullptr || p.block_q <= 0 || p.block_k <= 0)) return false;
  return p.window_left >= -1 && p.window_right >= -1;
}

inline AttentionPlan plan_attention(const AttentionParams& p, DType dtype) {
  AttentionPlan plan{};
  const int acc = acc_bytes(dtype);
  const int vec = 16 / acc;  // accumulator elements per 16-byte vector
  plan.bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
  plan.rows_per_warp = rows_per_warp(acc, plan.bucket);
  plan.rows_per_block = kWarps * plan.rows_per_warp;
  plan.threads = kWarps * kWarpSize;
  plan.q_blocks = (p.q_len + plan.rows_per_block - 1) / plan.rows_per_block;
  plan.bh = p.batch * p.heads;
  plan.blocks = plan.q_blocks * plan.bh;
  if (plan.bucket == 0) return plan;
  const int64_t d_vecs = round_up(p.head_dim, vec) / vec;
  plan.ldq = static_cast<int>(d_vecs * vec);
  plan.ldk = static_cast<int>((d_vecs | 1) * vec);
  plan.ldv = plan.bucket;
  plan.q_off = 0;
  plan.k_off = plan.q_off + round_up(int64_t{plan.rows_per_block} * plan.ldq, vec);
  plan.v_off = plan.k_off + round_up(int64_t{kTileKeys} * plan.ldk, vec);
  plan.p_off = plan.v_off + round_up(int64_t{kTileKeys} * plan.ldv, vec);
  plan.smem_bytes = static_cast<size_t>(plan.p_off + int64_t{plan.rows_per_block} * kTileKeys) * acc;
  return plan;
}

// The tensor-core kernel (cuda/attention_kernel_mma.cu): float16/bfloat16 on sm80+, with mma.sync.m16n8k16
// (fp32 accumulators), and float32 as 3xTF32 on mma.sync.m16n8k8. 4 warps of one or two groups of 16 query
// rows (mma_row_groups), one block per (b, h, 64 or 128 query rows). Tiles of 64 keys are staged in shared
// memory in two stages (the next tile is copied while the current one is computed): K and V in the input
// type, row-major with row stride bucket + one 16-byte unit (an odd number of 16-byte units, so the 8 rows an
// ldmatrix phase reads fall on 8 distinct bank groups).
constexpr int kMmaRowsPerWarp = 16;  // one m16 row group
constexpr int kMmaRowsPerBlock = kWarps * kMmaRowsPerWarp;
constexpr int kMmaTileKeys = 64;
constexpr int kMmaStages = 2;
constexpr int kMmaMaxHeadDim = 128;      // its Q, S and O fragments stay in registers up to here
constexpr int kMmaMaxHeadDimTf32 = 128;  // float32: Q's two parts (big and small) from shared memory above
constexpr int kMmaTf32QRegs = 64;        // this bucket (mma_q_shared), in registers up to it
// The general instantiation's mask tile: both masks' terms of a tile as floats, a row per query row of the
// block, rows of kMmaTileKeys + 8 floats (a half-warp's 8-byte reads then fall on distinct banks).
constexpr int kMmaBiasLd = kMmaTileKeys + 8;

// Bytes of one element of the mma kernel's inputs: 4 for float32, 2 for float16/bfloat16.
constexpr int mma_element_bytes(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

// Row stride of a staged K or V tile, in elements: the bucket and one 16-byte unit.
constexpr int mma_tile_ld(int bucket, int element_bytes) {
  return bucket + 16 / element_bytes;
}

// True when the mma kernel covers the problem: float16/bfloat16 with max(D, Dv) <= kMmaMaxHeadDim, float32
// with max(D, Dv) <= kMmaMaxHeadDimTf32 (dropout included: its masked instantiations apply it). Whether a
// device has the shared memory its block takes is the kernel choice's question (choose_kernel).
constexpr bool mma_supports(const AttentionParams& p, DType dtype) {
  const int bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
  const int max_head_dim = dtype == DType::kFloat16 || dtype == DType::kBFloat16 ? kMmaMaxHeadDim
                           : dtype == DType::kFloat32                            ? kMmaMaxHeadDimTf32
                                                                                 : 0;
  return bucket != 0 && bucket <= max_head_dim;
}

// True when the tensor-core kernels (forward and backward) take the call's block-sparse mask, or it has none:
// blocks of whole tiles, block_q a multiple of a warp's 16 query rows and block_k of the 64-key tiles, so
// that a warp's rows of a tile lie in one block (its class is one entry of the map, a PARTIAL block's row of
// the tile two words of block_bits), as FlexAttention's default 128 x 128 blocks do; L and S below 2^31
// (block and row indices in 32 bits), every entry of block_map and word of block_bits at an offset below 2^31
// (they are indexed in 32 bits: 64-bit offsets cost the tile loop registers it does not have). The SIMT
// kernels and the composite read no block map.
constexpr bool mma_block_map_fits(const AttentionParams& p) {
  if (p.has_block_map == 0) return true;
  if (p.block_q <= 0 || p.block_k <= 0) return false;
  const int64_t* const m = p.block_map_stride;
  const int64_t* const w = p.block_bits_stride;
  const int64_t map_end = (p.batch - 1) * m[0] + (p.heads - 1) * m[1] + (p.q_len - 1) / p.block_q * m[2] +
                          (p.kv_len - 1) / p.block_k * m[3];
  const int64_t bits_end = p.block_partial == 0 ? 0
                                                : (p.block_partial - 1) * w[0] + (p.block_q - 1) * w[1] +
                                                      (p.block_k - 1) / 32 * w[2];
  return p.block_q % kMmaRowsPerWarp == 0 && p.block_k % kMmaTileKeys == 0 && p.q_len < (int64_t{1} << 31) &&
         p.kv_len < (int64_t{1} << 31) && map_end < (int64_t{1} << 31) && bits_end < (int64_t{1} << 31);
}

// True when every row of a (B, H, rows, dim) operand at `ptr` moves as 16-byte vectors: unit column stride,
// dim and every other stride a multiple of 16 bytes, a 16-byte aligned base pointer.
inline bool mma_rows_16(const void* ptr, const int64_t* stride, int64_t dim, int element_bytes) {
  const int64_t vec = 16 / element_bytes;
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && stride[3] == 1 && dim % vec == 0 &&
         stride[0] % vec == 0 && stride[1] % vec == 0 && stride[2] % vec == 0;
}

// True when every K and V row of the launch can be read as 16-byte vectors (mma_rows_16). The mma kernel then
// stages its tiles with cp.async, 16 bytes per copy; otherwise element by element through the strides.
inline bool mma_vector_loads(const AttentionParams& p, const void* key, const void* value,
                             int element_bytes) {
  return mma_rows_16(key, p.k_stride, p.head_dim, element_bytes) &&
         mma_rows_16(value, p.v_stride, p.v_head_dim, element_bytes);
}

// Whether a call's features let the mma kernel's plain instantiation run it: no mask (nor block map), no
// soft-cap, no dropout and a scale in [2^-100, 2^100] (positive, so that the row maxima can be taken on Q K^T
// before the scale, and far enough from 0 and inf that scale log2(e) is a normal float). The plan also asks
// for vector loads.
constexpr bool mma_plain(const AttentionParams& p) {
  return p.attn_mask_kind == kMaskNone && p.key_padding_mask_kind == kMaskNone && p.has_block_map == 0 &&
         !(p.softcap > 0.0f) && p.dropout == 0 && p.scale >= 0x1p-100f && p.scale <= 0x1p100f;
}

// The m16 row groups a warp of the mma kernel computes: 2 (32 query rows, as FlashAttention-2's warps) for
// the plain instantiation of the 16-bit kernels up to bucket 64, where S and O of both groups fit in
// registers (Q goes to shared memory); each K and V fragment read from shared memory then feeds twice the
// mma, and the per-tile work around them is shared by twice the scores. 1 elsewhere (at bucket 128 the
// second group's S and O would not fit; the general instantiation's mask reads are per row).
constexpr int mma_row_groups(int element_bytes, int bucket, bool plain) {
  return plain && element_bytes == 2 && bucket <= 64 ? 2 : 1;
}

// The tile shape of the mma kernel's plain instantiation, a family of template parameters (FlashAttention-2's
// kernel traits): m16 row groups a warp (1 or 2: 16 or 32 query rows), warps a block (4 or 8), keys a tile
// (64 or 128) and cp.async pipeline stages (2 or 3). The masked instantiations take the default shape alone:
// their tile classes, packed bits and mask tile are those of 16-row x 64-key tiles, 4 warps a block.
struct MmaShape {
  int groups, warps, keys, stages;
};

// A shape as one integer (the kernel's template argument, as its SASS names it): groups, warps, keys / 64
// and stages as decimal digits, e.g. 2412 for 32 rows a warp, 4 warps, 64 keys, 2 stages.
constexpr int mma_shape_code(MmaShape s) {
  return s.groups * 1000 + s.warps * 100 + s.keys / 64 * 10 + s.stages;
}
constexpr MmaShape mma_shape_of(int code) {
  return MmaShape{code / 1000, code / 100 % 10, code / 10 % 10 * 64, code % 10};
}

// The default shape: 4 warps, 64 keys, 2 stages, and mma_row_groups' rows a warp.
constexpr int mma_default_shape(int element_bytes, int bucket, bool plain) {
  return mma_shape_code(
      MmaShape{mma_row_groups(element_bytes, bucket, plain), kWarps, kMmaTileKeys, kMmaStages});
}

// The shapes of the family (mma_shape_code), each dimension's values crossed; mma_shape_valid says which an
// (element size, bucket) has.
constexpr int kMmaShapes[] = {1412, 1413, 1422, 1423, 1812, 1813, 1822, 1823,
                              2412, 2413, 2422, 2423, 2812, 2813, 2822, 2823};

// Whether the plain instantiation has shape `code` for an element size and bucket: the shapes ptxas compiles
// within 255 registers without spilling (tools/sass.py --family; tests/test_sass.py). Two row groups a warp
// for the 16-bit types up to bucket 64 only (float32's split Q and bucket 128's O leave no registers for a
// second group's S), and 128-key tiles for one row group of a 16-bit type up to bucket 64 only (their S takes
// 64 registers a row group: 32 x 128 spills 52-84 local accesses, as FlashAttention-2's kernel with that warp
// tile does at head dim 64).
constexpr bool mma_shape_valid(int element_bytes, int bucket, int code) {
  const MmaShape s = mma_shape_of(code);
  if (s.groups != 1 && s.groups != 2) return false;
  if (s.warps != 4 && s.warps != 8) return false;
  if (s.keys != 64 && s.keys != 128) return false;
  if (s.stages != 2 && s.stages != 3) return false;
  if (s.groups == 2 && (element_bytes != 2 || bucket > 64)) return false;
  return s.keys == 64 || (s.groups == 1 && element_bytes == 2 && bucket <= 64);
}

// Whether this build's launcher has the family's other shapes: the run-time compiled library, which compiles
// the shapes it launches, and the CPU emulation (every shape tested); the prebuilt library carries each
// element size and bucket's default alone (its build time is every user's), and takes no other.
#if defined(ATTNX_CUDA_HOST_ONLY) || defined(ATTNX_CUDA_EMULATION)
constexpr bool kMmaFamily = true;
#else
constexpr bool kMmaFamily = false;
#endif

// Whether the plain instantiation of this build has shape `code` for an element size and bucket.
constexpr bool mma_shape_built(int element_bytes, int bucket, int code) {
  return mma_shape_valid(element_bytes, bucket, code) &&
         (kMmaFamily || code == mma_default_shape(element_bytes, bucket, true));
}

// Whether the mma kernel stages Q in shared memory (after the K and V stages) and reads its fragments from
// there a k-step at a time, as FlashAttention-2 does where registers are short: with two row groups a warp
// (the 16-bit plain kernels up to bucket 64), and for float32 above kMmaTf32QRegs (Q's big and small parts
// would take 2 bucket registers a thread: at 128, Q, O and S alone would take 224 of the 255).
constexpr bool mma_q_shared(int element_bytes, int bucket, int row_groups) {
  return row_groups > 1 || (element_bytes == 4 && bucket > kMmaTf32QRegs);
}

// The masks' tile classes, for the general instantiations (forward and backward): a pre-pass on the device
// (attention_mask_tiles in cuda/attention_kernel_mma.cu) reads each mask once and writes, per slice of the
// mask that the call's heads share and per tile of kMmaRowsPerWarp query rows (a warp's rows), two bit rows
// over the key tiles of kMmaTileKeys keys from key 0: `seen` (bit n: some term of tile n is not -inf) and
// `kept` (every term of tile n is 0). The tile loop skips a tile that no row of its block sees (EMPTY), runs
// the unmasked loop on a tile both masks keep for the warp's rows (FULL) and reads the masks on the others
// (PARTIAL). A dimension a mask broadcasts over (stride 0) is classified once: an (L, S) attn_mask once for
// every batch and head, a key_padding_mask once per batch (a slice per batch, one query tile). A bool mask is
// also packed, a bit per element (set: removed), so that a PARTIAL tile reads a row's 64 terms as one 8-byte
// load instead of 64 bytes through the strides: bit rows of `key_words` words (a multiple of 2, so that a
// tile's two words are one aligned load) per slice and query row (one row where the mask broadcasts over L),
// after the classes.
struct MaskTiles {
  int32_t kind;                // the mask's MaskKind; kMaskNone: no mask, nothing to classify
  int64_t stride[4];           // the mask's strides as (B, H, L, S), 0 on broadcast dims
  int64_t base;                // where its words start in the workspace
  int64_t slices_b, slices_h;  // 1 where the mask broadcasts over B (H); B (H) otherwise
  int64_t q_tiles;             // tiles of kMmaRowsPerWarp rows up to the last query block's end: 1 where the
                               // mask broadcasts over L
  int64_t words;               // 32-bit words of a bit row: one bit per key tile
  int64_t q_rows;              // the packed mask's rows per slice: L, or 1 where it broadcasts over L
  int64_t key_words;           // words of a packed row, 2 per key tile; 0 where the mask is not packed
  int64_t packed;              // where the packed mask starts: after the classes' words
  // The pre-pass's warps: one per word of the classes' bit rows (the 32 tiles of that word), then one per
  // 32 words of a packed row.
  int64_t class_warps, warps;
  int64_t end;  // the word after this mask's
};

// The word index of slice (bm, hm)'s bit rows for query tile lt: `seen` there, `kept` `words` after it.
constexpr int64_t mask_tile_row(const MaskTiles& mt, int64_t bm, int64_t hm, int64_t lt) {
  return mt.base + ((bm * mt.slices_h + hm) * mt.q_tiles + lt) * 2 * mt.words;
}

// The word index of slice (bm, hm)'s packed row for query row l (0 where the mask broadcasts over L).
constexpr int64_t mask_packed_row(const MaskTiles& mt, int64_t bm, int64_t hm, int64_t l) {
  return mt.packed + ((bm * mt.slices_h + hm) * mt.q_rows + l) * mt.key_words;
}

// The classes (and with `pack`, for a bool mask, the packed bits) of a mask of `kind` with (B, H, L, S)
// strides `stride`, from word `base` of the workspace; q_tiles: the query tiles of the launch.
inline MaskTiles plan_mask_tiles(const AttentionParams& p, int32_t kind, const int64_t* stride,
                                 int64_t q_tiles, int64_t base, bool pack) {
  MaskTiles mt{};
  mt.kind = kind;
  for (int d = 0; d < 4; ++d) mt.stride[d] = stride[d];
  mt.base = base;
  mt.end = base;
  if (kind == kMaskNone) return mt;
  mt.slices_b = stride[0] == 0 ? 1 : p.batch;
  mt.slices_h = stride[1] == 0 ? 1 : p.heads;
  mt.q_tiles = stride[2] == 0 ? 1 : q_tiles;
  const int64_t key_tiles = (p.kv_len + kMmaTileKeys - 1) / kMmaTileKeys;
  mt.words = (key_tiles + 31) / 32;
  mt.q_rows = stride[2] == 0 ? 1 : p.q_len;
  mt.packed = mask_tile_row(mt, mt.slices_b, 0, 0);
  const int64_t rows = mt.slices_b * mt.slices_h * mt.q_rows;
  mt.key_words = pack && kind == kMaskBool ? 2 * key_tiles : 0;
  mt.class_warps = mt.slices_b * mt.slices_h * mt.q_tiles * mt.words;
  mt.warps = mt.class_warps + rows * ((mt.key_words + 31) / 32);
  mt.end = mt.packed + rows * mt.key_words;
  return mt;
}

// The mma kernel's instantiations: plain (mma_plain and vector loads: no mask, no soft-cap, no dropout), bits
// (the others without soft-cap where each mask is bool or absent: the masks are read from the pre-pass's
// packed bits alone, never element by element, so this loop holds no code for a float mask), general (a
// float mask without soft-cap: each lane stages both masks' terms of its scores of a tile that reads them as
// floats in shared memory) and capped (the general one with the soft-cap compiled in: every soft-capped
// call, whatever its masks, so that no loop tests the cap). The backward has the first three.
enum MmaVariant : int { kMmaPlain = 0, kMmaBits = 1, kMmaGeneral = 2, kMmaCapped = 3 };

struct AttentionMmaPlan {
  int bucket;  // head-dim bucket (32, 64 or 128); 0 when mma_supports() is false
  bool plain;  // mma_plain() and vector_loads: the kernel's instantiation without masks and soft-cap
  int variant;  // MmaVariant: kMmaPlain where `plain`
  int shape;    // mma_shape_code of the kernel's MmaShape: the default's but where a plain call asked another
  int threads;
  int rows_per_block;  // warps * kMmaRowsPerWarp * row groups
  int64_t q_blocks;    // ceil(L / rows_per_block)
  int64_t bh;
  int64_t blocks;     // grid.x
  bool vector_loads;  // mma_vector_loads(): K and V by cp.async
  bool q_vector;      // Q's rows by cp.async (with two row groups, where Q is staged in shared memory)
  bool out_vector;    // the output's rows by 16-byte stores, through shared memory
  size_t smem_bytes;
  // The general instantiation's mask classes (kind kMaskNone where the mask is absent or the instantiation
  // the plain one), then the pre-pass's launch: a block per kWarps warps of both masks' (0: no pre-pass).
  MaskTiles attn_tiles, padding_tiles;
  int64_t mask_blocks;
  size_t workspace_bytes;  // the masks' bit rows, which the caller allocates (0: no workspace)
};

// `shape`: the plain instantiation's MmaShape (mma_shape_code) where the build has it (mma_shape_built), 0 or
// any other for the default.
inline AttentionMmaPlan plan_attention_mma(const AttentionParams& p, DType dtype,
                                           const AttentionPointers& ptr, int shape = 0) {
  AttentionMmaPlan plan{};
  plan.bh = p.batch * p.heads;
  const int element_bytes = mma_element_bytes(dtype);
  const bool supported = mma_supports(p, dtype);
  if (supported) {
    plan.bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
    plan.vector_loads = mma_vector_loads(p, ptr.key, ptr.value, element_bytes);
    plan.q_vector = mma_rows_16(ptr.query, p.q_stride, p.head_dim, element_bytes);
    plan.out_vector = mma_rows_16(ptr.out, p.out_stride, p.v_head_dim, element_bytes);
    plan.plain = mma_plain(p) && plan.vector_loads;
    const auto bits = [](int32_t kind) { return kind == kMaskNone || kind == kMaskBool; };
    plan.variant = plan.plain                                                       ? kMmaPlain
                   : p.softcap > 0.0f                                                ? kMmaCapped
                   : bits(p.attn_mask_kind) && bits(p.key_padding_mask_kind) ? kMmaBits
                                                                                 : kMmaGeneral;
  }
  plan.shape = plan.plain && mma_shape_built(element_bytes, plan.bucket, shape)
                   ? shape
                   : mma_default_shape(element_bytes, plan.bucket, plan.plain);
  const MmaShape sh = mma_shape_of(plan.shape);
  plan.threads = sh.warps * kWarpSize;
  plan.rows_per_block = sh.warps * kMmaRowsPerWarp * sh.groups;
  plan.q_blocks = (p.q_len + plan.rows_per_block - 1) / plan.rows_per_block;
  plan.blocks = plan.q_blocks * plan.bh;
  if (!supported) return plan;
  // stages * (K tile + V tile), and Q's rows where the kernel stages them (mma_q_shared: its kQShared)
  const int ld = mma_tile_ld(plan.bucket, element_bytes);
  const int q_rows = mma_q_shared(element_bytes, plan.bucket, sh.groups) ? plan.rows_per_block : 0;
  plan.smem_bytes = static_cast<size_t>(sh.stages * 2 * sh.keys * ld + q_rows * ld) * element_bytes;
  if (plan.variant == kMmaGeneral || plan.variant == kMmaCapped) {  // the mask tile, after stages and Q
    plan.smem_bytes += static_cast<size_t>(plan.rows_per_block) * kMmaBiasLd * sizeof(float);
  }
  if (!plan.plain && plan.blocks > 0) {
    const int64_t q_tiles = plan.q_blocks * (plan.rows_per_block / kMmaRowsPerWarp);
    const bool pack = plan.variant == kMmaBits;  // the general instantiation reads its mask tile instead
    plan.attn_tiles = plan_mask_tiles(p, p.attn_mask_kind, p.attn_mask_stride, q_tiles, 0, pack);
    const int64_t* const kpm = p.key_padding_mask_stride;
    const int64_t padding_stride[4] = {kpm[0], 0, 0, kpm[1]};
    plan.padding_tiles =
        plan_mask_tiles(p, p.key_padding_mask_kind, padding_stride, 1, plan.attn_tiles.end, pack);
    plan.mask_blocks = (plan.attn_tiles.warps + plan.padding_tiles.warps + kWarps - 1) / kWarps;
    plan.workspace_bytes = static_cast<size_t>(plan.padding_tiles.end) * sizeof(uint32_t);
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------------------
// The kernel choice: the one place that decides which CUDA kernel runs a call. The glue (cuda/attention.cpp,
// cuda/attention_backward.cpp) runs what it says, attnx::_attention_kernel names it, and the emulated
// backend (tests/emulation/) takes the same decisions for its own Target.

// What the choice depends on beyond the call: the device's compute capability and what the process asked for
// (ATTNX_CUDA_MMA=0 turns the tensor cores off, ATTNX_CUDA_FUSED_BACKWARD=1 turns the fused backward on,
// ATTNX_CUDA_TORCH_FLASH=0 keeps every call on attnx's kernels; cuda/device.h reads them once per process).
struct Target {
  int capability;  // major * 10 + minor: 80 for sm_80
  bool mma;
  bool fused_backward;
  bool torch_flash;  // torch's flash kernel may take the calls it computes as attnx does (see below)
  int64_t max_smem;  // the shared memory a block may opt into, bytes (227 KiB on sm_90, 99 KiB on sm_89)
  int mma_shape = 0;  // the plain mma instantiation's MmaShape asked for (attnx::_cuda_mma_shape); 0: default
};

// The mma kernel's plan for a call on `target`: the plain instantiation in the shape the process asked for
// where the build has it and the device has the shared memory its block takes, the default otherwise.
inline AttentionMmaPlan mma_plan(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                                 const Target& target) {
  const AttentionMmaPlan plan = plan_attention_mma(p, dtype, ptr, target.mma_shape);
  return target.mma_shape == 0 || static_cast<int64_t>(plan.smem_bytes) <= target.max_smem
             ? plan
             : plan_attention_mma(p, dtype, ptr);
}

enum class Kernel {
  kSimt,        // cuda/attention_kernel.cu: every dtype, head dims up to kMaxHeadDim
  kMma,         // cuda/attention_kernel_mma.cu: tensor cores on sm80+ (mma_supports)
  kComposite,   // above kMaxHeadDim: torch's ops (cuda/attention_composite.h), no dropout
  kTorchFlash,  // torch's own FlashAttention-2 (aten::_flash_attention_forward), torch_flash_supports
};

// The window FlashAttention-2 is given for a call it runs: its local attention keeps for query row l the keys
// [l + S - L - left, l + S - L + right] (bottom-right aligned, -1: unbounded), which is attnx's window
// (attnx/key_range.h); SDPA's top-left is_causal is the right edge L - S, so it maps where L >= S.
struct TorchFlashWindow {
  int64_t left, right;
};
constexpr TorchFlashWindow torch_flash_window(const AttentionParams& p) {
  const int64_t causal = p.q_len - p.kv_len;
  int64_t right = p.window_right;
  if (p.is_causal != 0) right = right < 0 || right > causal ? causal : right;
  return {p.window_left, right};
}

// True when torch's flash kernel computes exactly what attnx's would, bit layout of the results included:
// float16/bfloat16 with D = Dv, a multiple of 8 up to 256; no mask, key lengths, soft-cap, sinks or dropout
// (its dropout draws other numbers); is_causal only where L >= S (torch_flash_window); a scale in [2^-100,
// 2^100] (as mma_plain: its row maxima are taken before the scale); not variable-length or paged
// (attention's own layout only); rows it reads as 16-byte vectors (mma_rows_16: it assumes them and does not
// check); B and H from 1 to its grid's 65535. Rows that see no key are out 0, lse +inf in both. Where any
// input is NaN the outputs are NaN in both, but such a row's lse is +inf there and NaN here.
inline bool torch_flash_supports(const AttentionParams& p, DType dtype, const AttentionPointers& ptr) {
  const bool half = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  return half && p.head_dim == p.v_head_dim && p.head_dim % 8 == 0 && p.head_dim <= 256 &&
         p.attn_mask_kind == kMaskNone && p.key_padding_mask_kind == kMaskNone &&
         p.key_lengths_kind == kKeyLengthsNone && p.has_block_map == 0 && !(p.softcap > 0.0f) &&
         p.has_sinks == 0 && p.dropout == 0 &&
         (p.is_causal == 0 || p.q_len >= p.kv_len) && p.scale >= 0x1p-100f && p.scale <= 0x1p100f &&
         p.varlen == 0 && p.page_size == 0 && p.q_len > 0 && p.kv_len > 0 && p.batch > 0 && p.heads > 0 &&
         p.batch <= 65535 && p.heads <= 65535 && mma_rows_16(ptr.query, p.q_stride, p.head_dim, 2) &&
         mma_rows_16(ptr.key, p.k_stride, p.head_dim, 2) &&
         mma_rows_16(ptr.value, p.v_stride, p.v_head_dim, 2);
}

// attention's kernel: torch's flash kernel where it computes the call exactly as attnx would and the process
// has not turned it off (on the H100 it ran every unmasked 16-bit shape 2-3x faster than attnx's tensor-core
// kernel: benchmarks/results/gpu-check-2026-11-26-h100-07450b2.md; attnx's takes such calls back once
// `make gpu-check` measures it at least as fast); then tensor cores where they cover the problem on sm80+ and
// the process has not turned them off and the device has the shared memory their block takes (float32 at
// bucket 128 takes 165 KiB: sm_90 and sm_100, not sm_80's 163 KiB or sm_86/89/120's 99 KiB), the SIMT kernel
// for the rest up to kMaxHeadDim, the composite above.
inline Kernel choose_kernel(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                            const Target& target) {
  if (target.torch_flash && target.capability >= 80 && torch_flash_supports(p, dtype, ptr)) {
    return Kernel::kTorchFlash;
  }
  if (head_dim_bucket(p.head_dim, p.v_head_dim) == 0) return Kernel::kComposite;
  if (target.mma && target.capability >= 80 && mma_supports(p, dtype) &&
      static_cast<int64_t>(mma_plan(p, dtype, ptr, target).smem_bytes) <= target.max_smem) {
    return Kernel::kMma;
  }
  return Kernel::kSimt;
}

// The tensor-core backward (cuda/attention_backward_kernel_mma.cu): float16 and bfloat16 up to bucket 128,
// float32 (3xTF32) up to kMmaBackwardMaxHeadDimTf32, on sm80+, in two passes over tiles of 64 query rows x 64
// keys, a warp 16 rows of its pass's own (queries, or keys), and the other operand's rows in chunks of
// kMmaBackwardChunk.
constexpr int kMmaBackwardMaxHeadDim = 128;
// float32 takes the plain instantiation (no mask, soft-cap or dropout: mma_plain) up to bucket 64 alone:
// there its passes hold every value in registers; its masked instantiations, and its plain ones at bucket
// 128, spilled 8-280 bytes a thread (the split operands' registers on top of the 16-bit kernels' loops).
constexpr int kMmaBackwardMaxHeadDimTf32 = 64;

// Rows of the other operand (keys in the query pass, queries in the key pass) a block stages at a time: 64,
// and 32 at bucket 128, where the key pass's dK and dV (16 x 128 floats each) take 128 registers of a thread:
// its S and dP then take 32 queries (kMmaBackwardChunk) a tile, with no inner loop, and both passes' blocks
// fit the 99 KiB of an sm_86/89/120 device. float32 (4-byte elements) stages 32 from bucket 64, where its
// blocks then fit those 99 KiB too.
constexpr int mma_backward_tile(int bucket, int element_bytes) {
  return bucket > 64 || (element_bytes == 4 && bucket > 32) ? 32 : 64;
}

// Rows of the other operand a warp's S and dP take at a time (of a staged tile): 32. With 64, S and dP take
// 64 registers of a thread, and the key pass (which also holds dK and dV) spills from bucket 64 on.
constexpr int kMmaBackwardChunk = 32;

// Shared memory of a block of either pass: the block's own two 64-row tiles and two stages of the other
// operand's two tiles (mma_backward_tile rows), in the input type (rows of mma_tile_ld); the key pass's lse
// and delta rows (two stages of a tile's rows each), its warps' 4 votes (16 bytes), a block map's or bool
// attn_mask's bits of the tile's rows (two stages of two words a row) and a float attn_mask's classes (a
// word a stage, 16 bytes with padding); and with `mask_grad` the query pass's tile of attn_mask's gradient
// (64 rows of tile + 1 floats).
constexpr int64_t mma_backward_smem_bytes(int bucket, int element_bytes, bool mask_grad) {
  const int64_t tile = mma_backward_tile(bucket, element_bytes);
  return (2 * kMmaTileKeys + 4 * tile) * mma_tile_ld(bucket, element_bytes) * element_bytes + 8 * tile * 4 + 32 +
         (mask_grad ? kMmaTileKeys * (tile + 1) * 4 : 0);
}

// True when the tensor-core backward covers the call: float16 or bfloat16 with max(D, Dv) <=
// kMmaBackwardMaxHeadDim, or float32 without a mask, soft-cap or dropout (mma_plain) and max(D, Dv) <=
// kMmaBackwardMaxHeadDimTf32; not packed sequences, L and S below 2^30 (the kernels' tile loops count rows
// and keys in 32 bits; a key or query range that long is beyond any tensor a GPU holds).
constexpr bool mma_backward_supports(const AttentionParams& p, DType dtype) {
  const int bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
  const bool half = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  const bool tf32 = dtype == DType::kFloat32 && mma_plain(p) && bucket <= kMmaBackwardMaxHeadDimTf32;
  return (half || tf32) && bucket != 0 && bucket <= kMmaBackwardMaxHeadDim && p.varlen == 0 &&
         p.q_len < (int64_t{1} << 30) && p.kv_len < (int64_t{1} << 30);
}

enum class BackwardKernel {
  kMath,  // the whole-tensor math (common/attention_math.cpp): above kMaxHeadDim, or the fused kernels off
  kSimt,  // cuda/attention_backward_kernel.cu: every dtype up to kMaxHeadDim
  kMma,   // cuda/attention_backward_kernel_mma.cu: tensor cores on sm80+ (mma_backward_supports)
};

// attention_backward's kernel: the fused kernels when the process asked for them (they are opt-in until they
// have run on a GPU) and the head dims are within kMaxHeadDim: the tensor-core ones where they cover the
// call, the tensor cores are on and the device has the shared memory of their largest block (with attn_mask's
// gradient, so that the choice does not depend on whether it is asked for: 77 KiB at bucket 128, which every
// sm80+ device has), the SIMT ones otherwise (float32 with a mask, soft-cap or dropout among them); the
// whole-tensor math for the rest. A block map is read by the tensor-core kernels alone
// (mma_block_map_fits): elsewhere the choice is the math, which refuses it.
constexpr BackwardKernel choose_backward(const AttentionParams& p, DType dtype, const Target& target) {
  const int bucket = head_dim_bucket(p.head_dim, p.v_head_dim);
  if (!target.fused_backward || bucket == 0) return BackwardKernel::kMath;
  if (target.mma && target.capability >= 80 && mma_backward_supports(p, dtype) && mma_block_map_fits(p) &&
      mma_backward_smem_bytes(bucket, mma_element_bytes(dtype), /*mask_grad=*/true) <= target.max_smem) {
    return BackwardKernel::kMma;
  }
  return p.has_block_map ? BackwardKernel::kMath : BackwardKernel::kSimt;
}

// The dtype as the kernel names spell it: "fp16", "bf16", "fp32", "fp64".
constexpr const char* dtype_name(DType dtype) {
  return dtype == DType::kFloat16    ? "fp16"
         : dtype == DType::kBFloat16 ? "bf16"
         : dtype == DType::kFloat32  ? "fp32"
                                     : "fp64";
}

}  // namespace attnx::cuda
