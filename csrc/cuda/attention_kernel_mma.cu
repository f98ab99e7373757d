// attnx: attnx::attention's tensor-core forward kernel for float16, bfloat16 and float32 (sm80+), the default
// for those dtypes where it applies (ATTNX_CUDA_MMA=0 selects the SIMT kernel instead).
//
// Checked on an H100 against the float64 reference, every feature and dtype, and under compute-sanitizer
// (make gpu-check, 2026-11-26); the CPU emulation runs this source in CI with mma.sync, ldmatrix and cp.async
// replaced by their definitions in the PTX ISA (tests/emulation/cuda_shim.h).
//
// FlashAttention-2's scheme on mma.sync.m16n8k16 with fp32 accumulators: 4 warps of one or two groups of 16
// query rows (mma_row_groups: two for the plain 16-bit kernels up to bucket 64, as FlashAttention-2's 32-row
// warps), one block per (b, h, 64 or 128 rows). With one group a warp keeps its Q fragments (16 x bucket) in
// registers, loaded once from global memory through q's strides; with two, Q is staged in shared memory.
// Tiles of 64 keys are staged in shared memory in the input type, K and V row-major, in two stages: cp.async
// copies tile i + 1 while tile i is computed (16-byte copies when the rows allow it, see mma_vector_loads;
// element by element through the strides otherwise). Per tile: S = Q K^T (8 n-tiles of 8 keys, K's B
// fragments by ldmatrix), scale and both masks read in place, the online softmax of softmax.h per row in base
// 2 (one FFMA and one ex2 per score, the scale folded into the FFMA; a row's 64 scores sit in the 4 lanes of
// a quad: the max by shuffles over xor 1 and 2, the sum per lane until the end), then O += P V with P rounded
// to the input type (the C fragments of two adjacent S n-tiles are exactly the A fragment of one k-step; V's
// B fragments by ldmatrix.trans). Tiles are skipped as in the SIMT kernel: the loop runs over the keys the
// block's rows see at all (attnx/key_range.h: is_causal, the bottom-right window, per-batch key lengths),
// past tiles the masks remove entirely for every row of the block (EMPTY), and a tile on which both masks'
// terms are 0 for a warp's rows (FULL) takes the loop that reads no mask: the classes are found before the
// loop, one bit per tile in registers, from a pre-pass (attention_mask_tiles) that classifies each 16 query
// rows x 64 keys of attn_mask, and each batch's 64-key tiles of key_padding_mask, once for every head (and
// batch) that shares them, and packs bool masks a bit per element (read on PARTIAL tiles a row's 64 terms at
// a time). A run of FULL tiles is found once, where it starts: its tiles follow one another with no class
// read and no search for the next tile. Only tiles at the ends of a row's key interval test each score against it. A block-sparse mask
// (block_map, whose blocks are whole tiles: mma_block_map_fits) adds its classes to the masks' from the map
// itself, a window of tiles at a time (EMPTY for the block's rows: skipped; FULL for the warp's: kept), and a
// PARTIAL tile's rows read two words of their block's bits, OR-ed with a bool attn_mask's packed ones (the
// general instantiation stages them as -inf terms, so that there, as under a float mask's -inf, a removed
// key whose score is NaN stays NaN).
// That is the default tile shape; the plain instantiation also runs in the others of a family (MmaShape,
// cuda/attention_plan.h: 16 or 32 rows a warp, 4 or 8 warps, 64 or 128 keys a tile, 2 or 3 stages), which
// `make gpu-check` measures.
// Grouped KV heads index the kv head in place; soft-capping is one fast_tanh per score; sinks join the
// denominator at the end (softmax_finish); dropout keeps each probability by its Philox draw, as every
// backend, before P V (apply_dropout).
//
// float32 takes the same scheme on mma.sync.m16n8k8.tf32 as 3xTF32 (common.cuh: float32 accuracy, as SDPA's
// memory-efficient kernel): K and V are staged as floats; Q's fragments are split into big and small parts
// once, K's after each ldmatrix (a 16-byte row of an 8x8 b16 matrix is 4 floats, which is the tf32 B
// fragment's layout), V's element by element from shared memory (ldmatrix.trans moves 16-bit elements only).
// P stays in float: the C fragment of an S n-tile is the A fragment of one k-step once the k index is
// permuted (logical k = t, t + 4 read keys 2t, 2t + 1, and V's B fragment is read in the same order).
// Soft-capping is tanhf and the probabilities are not rounded. Q's two parts take bucket registers a thread
// (16-bit types: bucket / 4): up to bucket 64 they stay in registers, at 128 (where Q, O and S alone would
// take 224 of the 255) Q is staged in shared memory and each k-step's fragments read and split there, once
// for all of the tile's n-tiles (mma_q_shared).
#include "attnx/philox.h"
#include "cuda/attention_kernel.h"
#include "cuda/common.cuh"

namespace attnx::cuda {
namespace {
#if ATTNX_CUDA_DEVICE_CODE  // the kernels (cuda/common.cuh); the launchers follow

// Four instantiations (MmaVariant, chosen by plan_attention_mma). kPlain (no mask, no soft-cap, no dropout,
// a scale in range, vector loads) keeps the scores unscaled through the tile loop: the row maxima are taken
// on Q K^T itself and the scale, with log2(e), is folded into the one FFMA that subtracts the maximum before
// ex2, and the loop holds no code for masks or the cap. The others scale each score and add the masks;
// their exponent's factor is log2(e) alone. kMmaBits (each mask bool or absent) reads the masks from the
// pre-pass's packed bits alone, on every tile, with each tile's path compiled per boundary or interior tile
// and mask: its loop holds no switch over a mask's dtype. kMmaGeneral (a float mask) stages the masks' terms
// of each lane's scores in shared memory, each mask's element type chosen once a tile. kMmaCapped is
// kMmaGeneral with the soft-cap applied to every score: a compile-time property, never a test in a loop.

// How the general instantiation's mask tile reads a mask (beside MaskElements<T>, common.cuh).
struct NoMask {};
struct BoolMask {};

// A mask's term as the float the tile loop adds: -inf for a removed key of a bool mask, a float mask's
// element as mask_value<float> converts it.
template <typename Kind>
__device__ __forceinline__ float staged_term(Kind kind, const void* mask, int64_t offset) {
  if constexpr (std::is_same<Kind, BoolMask>::value) {
    return static_cast<const bool*>(mask)[offset] ? -INFINITY : 0.0f;
  } else {
    return mask_term(kind, mask, offset);
  }
}

// The general instantiation's mask tile, a lane's own part: the terms of its scores (its rows r = 0, 1; keys
// 8 j + 2 t + e of the tile) at tile[8 r kMmaBiasLd + 8 j + e], in two passes whose element types' code the
// caller chose once a tile. The lane reads back only what it wrote: no synchronisation, and loops that are
// not unrolled, so that the elements' addresses and values never hold many registers. Keys from `nk` on are
// 0 (their scores are not seen).
// First key_padding_mask's terms, from kpm_at, kst apart, into row 0's slots (what both rows add).
template <typename Kpm>
__device__ __forceinline__ void stage_kpm_terms(Kpm kpm, const void* mask, int64_t kpm_at, int64_t kst,
                                                int nk, int t, float* tile) {
#pragma unroll 1
  for (int j = 0; j < kMmaTileKeys / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = 8 * j + 2 * t + e;
      tile[8 * j + e] = key < nk ? staged_term(kpm, mask, kpm_at + key * kst) : 0.0f;
    }
  }
}

// Then each row's terms, from attn_mask's elements at[r], st3 apart: attn_mask's plus key_padding_mask's (as
// staged, where `kpm`), in mask_value's order; a key a bool attn_mask removes is -inf whatever
// key_padding_mask adds, and so is one a block map removes (bit 8 j + e of removed[r]); rows past L
// (!row_in) are 0.
template <typename Attn>
__device__ __forceinline__ void stage_mask_terms(Attn attn, const void* mask, const int64_t (&at)[2],
                                                 int64_t st3, const bool (&row_in)[2], bool kpm, int nk,
                                                 const uint64_t (&removed)[2], int t, float* tile) {
#pragma unroll 1
  for (int j = 0; j < kMmaTileKeys / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = 8 * j + 2 * t + e;
      const float k = kpm ? tile[8 * j + e] : 0.0f;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float term = 0.0f;
        if (row_in[r] && key < nk) {
          if constexpr (std::is_same<Attn, NoMask>::value) {
            term = k;
          } else if constexpr (std::is_same<Attn, BoolMask>::value) {
            term = static_cast<const bool*>(mask)[at[r] + key * st3] ? -INFINITY : k;
          } else {
            term = mask_term(attn, mask, at[r] + key * st3) + k;
          }
          term = (removed[r] >> (8 * j + e)) & 1u ? -INFINITY : term;
        }
        tile[8 * r * kMmaBiasLd + 8 * j + e] = term;
      }
    }
  }
}

// The blocks an SM must hold, for ptxas's register budget where its own aim would spill or cost more than it
// gives: 1 for float32 at bucket 128, whose 165 KiB of shared memory leave room for one; 2 for the masked
// instantiations at bucket 32 (aiming at 3, ptxas spills them at 168 registers: the 16-bit ones on sm_80,
// float32's general one on sm_90 with the block map's code); 1 for the general one at bucket 64, where
// ptxas, unbounded, squeezed the 16-bit kernels to 168 registers on sm_90 for a third block at 12% more
// instructions a FULL tile (481 against 426 at 235 registers); 0, no bound, elsewhere.
constexpr int mma_min_blocks(int element_bytes, int bucket, int variant) {
  return element_bytes == 4 && bucket > kMmaTf32QRegs ? 1
         : bucket == 32 && variant != kMmaPlain       ? 2
         : bucket == 64 && variant == kMmaGeneral     ? 1
                                                      : 0;
}

template <typename scalar_t, int kBucket, int kVariant,
          int kShape = mma_default_shape(static_cast<int>(sizeof(scalar_t)), kBucket, kVariant == kMmaPlain)>
__global__ void __launch_bounds__(mma_shape_of(kShape).warps* kWarpSize,
                                  mma_min_blocks(static_cast<int>(sizeof(scalar_t)), kBucket, kVariant))
    attention_forward_mma(const AttentionParams p, const AttentionPointers ptr, const AttentionMmaPlan plan,
                          const uint32_t* const mask_tiles) {
  constexpr bool kTf32 = std::is_same<scalar_t, float>::value;  // 3xTF32, m16n8k8
  constexpr bool kPlain = kVariant == kMmaPlain;
  // kMmaBits: both masks bool or absent, read from the pre-pass's bits only (no mask_value in this loop).
  constexpr bool kBits = kVariant == kMmaBits;
  // kMmaGeneral: a float mask; both masks' terms of a tile that reads them staged by each lane for its own
  // scores (stage_kpm_terms, stage_mask_terms). kMmaCapped: the same with the soft-cap, which no other
  // instantiation applies.
  constexpr bool kGeneral = kVariant == kMmaGeneral || kVariant == kMmaCapped;
  constexpr bool kCapped = kVariant == kMmaCapped;
  // The tile shape (MmaShape): the plain instantiation's is any of the family's, the others' the default.
  constexpr MmaShape kSh = mma_shape_of(kShape);
  static_assert(mma_shape_valid(static_cast<int>(sizeof(scalar_t)), kBucket, kShape),
                "a shape of the family");
  static_assert(kPlain || kShape == mma_default_shape(static_cast<int>(sizeof(scalar_t)), kBucket, false),
                "the masks' tile classes are those of the default shape");
  constexpr int kBlockWarps = kSh.warps;
  constexpr int kKeys = kSh.keys;      // keys a tile
  constexpr int kStages = kSh.stages;  // tiles staged at once: the copies run kStages - 1 tiles ahead
  constexpr int kThreads = kBlockWarps * kWarpSize;
  // The warp's m16 row groups (mma_row_groups by default): each K and V fragment feeds the mma of every
  // group.
  constexpr int kGroups = kSh.groups;
  constexpr int kRows = 2 * kGroups;  // query rows of this lane: row R is group R / 2's g (+ 8 for R odd)
  constexpr int kRowsPerWarp = kMmaRowsPerWarp * kGroups;
  constexpr int kRowsPerBlock = kBlockWarps * kRowsPerWarp;
  constexpr int kVec = 16 / static_cast<int>(sizeof(scalar_t));  // elements per 16-byte chunk
  constexpr int kK = kTf32 ? 8 : 16;                             // the mma's k
  constexpr int kKSteps = kBucket / kK;       // k-steps of Q K^T over the (padded) head dim
  constexpr int kSTiles = kKeys / 8;          // n-tiles of 8 keys in a score tile
  constexpr int kPSteps = kKeys / kK;         // k-steps of P V over the tile's keys
  constexpr int kOTiles = kBucket / 8;        // n-tiles of 8 output columns
  constexpr int kLd = mma_tile_ld(kBucket, static_cast<int>(sizeof(scalar_t)));
  constexpr int kTile = kKeys * kLd;  // elements of one staged K or V tile
  constexpr float kNegInf = -INFINITY;
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(kKSteps % 2 == 0 && kOTiles % 2 == 0, "ldmatrix.x4 serves two k-steps / two n-tiles");
  static_assert(!kTf32 || kGroups == 1, "the float32 kernel computes one row group a warp");
  // With two row groups Q's fragments would take 32 more registers than the loop has, and float32's at bucket
  // 128 128 more: Q is staged in shared memory once (after the K and V stages) and its fragments read a
  // k-step pair at a time (16-bit: by ldmatrix; float32: a word each, then split), as FlashAttention-2 does
  // where registers are short.
  constexpr bool kQShared = mma_q_shared(static_cast<int>(sizeof(scalar_t)), kBucket, kGroups);

  // Stage s: K at smem + 2 s kTile, V right after; zero past D (Dv) and past the tile's last key. Q's rows
  // (kQShared) and the general instantiation's mask tile follow the kStages stages.
  ATTNX_DYNAMIC_SHARED(scalar_t, smem);

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // fragment coordinates: row group, thread in group
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.v_head_dim);
  const int64_t L = p.q_len;
  const BlockProblem<scalar_t> block = block_problem<scalar_t>(p, ptr, plan.q_blocks, plan.bh, kRowsPerBlock);
  const int64_t b = block.b, h = block.h, q0 = block.q0, rows_in_block = block.rows, Sb = block.kv_len;
  const scalar_t* const q = block.q;
  const scalar_t* const k = block.k;
  const scalar_t* const v = block.v;
  const int64_t am_base = block.attn_mask_base, kpm_base = block.key_padding_mask_base;
  const float scale = split_value<float>(p.scale, p.scale_lo);
  const SoftCap<float> cap = soft_cap_of<float>(p);
  const scalar_t zero = from_acc<scalar_t>(0.0f);
  // The loop's scores x are `unit` times the logits (kPlain: Q K^T, unit = scale; otherwise the logits), and
  // exp(logit - max) = 2^(x c - max c) with c = unit log2(e).
  const float unit = kPlain ? scale : 1.0f;
  const float c = unit * kLog2e;

  // This lane's query rows: row(r) is fragment row g (r even) or g + 8 (r odd) of the warp's row group r / 2.
  // Held in registers for one row group; with two, recomputed where needed (the loop has no registers left).
  const int64_t warp_row0 = q0 + warp * kRowsPerWarp;
  int64_t held[2];
  for (int r = 0; r < 2; ++r) held[r] = warp_row0 + g + 8 * r;
  const auto row = [&](int r) {
    return kGroups == 1 ? held[r % 2] : warp_row0 + kMmaRowsPerWarp * (r / 2) + g + 8 * (r % 2);
  };

  // Dropout (the general instantiation; the rows' sums stay those of the undropped probabilities, as in
  // every backend): probability (l, key) of the tile at k0 is kept when its Philox draw is (attnx/philox.h:
  // element e = ((b H + h) L + l) S + key of the stream every backend draws) and scaled by 1 / (1 - p), before
  // P V. A lane's probabilities are its two rows' pairs of adjacent keys 8j + 2t, 8j + 2t + 1, decided into a
  // bit each by quad_dropout_bits (the quad's lanes share each Philox block where the rows' tiles start on
  // one), then applied in place. (Generic, so that the plain instantiation never compiles it.)
  const auto apply_dropout = [&](auto& sg, int64_t k0) {
    static_assert(kPlain || (kGroups == 1 && kRows * kSTiles * 2 <= 32), "a bit per probability of the lane");
    const uint64_t S = static_cast<uint64_t>(p.kv_len);
    const uint64_t bh_row0 = static_cast<uint64_t>(b * p.heads + h) * static_cast<uint64_t>(L);
    const auto row_start = [&](int r) {  // element of (row r, key k0)
      return (bh_row0 + static_cast<uint64_t>(r == 0 ? row(0) : row(1))) * S + static_cast<uint64_t>(k0);
    };
    const uint32_t kept =
        quad_dropout_bits<kRows, kSTiles>(p, row_start, ((S | static_cast<uint64_t>(k0)) & 3) == 0, t);
    const float dropout_scale = split_value<float>(p.dropout_scale, p.dropout_scale_lo);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sg[j][2 * r + e];
          x = (kept >> (2 * (r * kSTiles + j) + e)) & 1u ? x * dropout_scale : 0.0f;
        }
      }
    }
  };

  // The keys any row of the block sees: from its first row's first key to its last row's end.
  const int64_t kv_begin = range_key_begin(q0, L, Sb, p.window_left);
  const int64_t kv_end = range_key_end(q0 + rows_in_block - 1, L, Sb, p.window_right, p.is_causal);
  const auto tile_keys = [&](int64_t k0) {
    return kv_end - k0 < kKeys ? static_cast<int>(kv_end - k0) : kKeys;
  };
  // Where the masks are classified per tile (below), some tile may be skipped, and the loop reads the masks
  // only on tiles whose terms are not all 0.
  const bool masked = !kPlain && (p.key_padding_mask_kind != kMaskNone || p.attn_mask_kind != kMaskNone ||
                                  p.has_block_map != 0);
  // The tiles start at tile0: kv_begin, or with the masks' tile classes the multiple of kKeys at or
  // below it, where the classes' tiles start (keys before kv_begin are then tested out like any key outside
  // a row's interval).
  const int64_t tile0 = masked ? kv_begin / kKeys * kKeys : kv_begin;

  // Every tile starts at tile0 + kKeys n. The interior tiles of this warp, n_lo <= n < n_hi, hold
  // kKeys keys that every one of its rows (all below L) sees: they need no per-element key-range test. Found
  // once here, so that a tile's test is one unsigned compare of its 32-bit index (a key range of 2^37 keys
  // is beyond any tensor a GPU holds).
  int n_lo = 0, n_hi = 0;
  if (warp_row0 + kRowsPerWarp <= L) {
    const int64_t in_lo = range_key_begin(warp_row0 + kRowsPerWarp - 1, L, Sb, p.window_left);
    const int64_t in_hi = range_key_end(warp_row0, L, Sb, p.window_right, p.is_causal);
    n_lo = static_cast<int>((range_max(in_lo - tile0, 0) + kKeys - 1) / kKeys);
    n_hi = static_cast<int>(range_max(in_hi - tile0, 0) / kKeys);
    n_hi = n_hi > n_lo ? n_hi : n_lo;
  }

  // The masks' tiles are classified before the tile loop rather than by reads at the top of every tile, a
  // window of kWindowTiles tiles from window_k0 at a time: lane i keeps bit w for tile 32 i + w of it in
  // tiles_seen (set: some row of the block sees some key of the tile; clear: EMPTY, skipped) and in
  // tiles_kept (set: every term of both masks is 0 on the warp's rows, FULL: an interior one takes the loop
  // that reads no mask). The first window's come from the pre-pass (attention_mask_tiles), a word per lane
  // and mask: tiles_seen takes the OR of the block's warps' attn_mask `seen` rows, so that every warp keeps
  // the same tiles_seen and the whole block skips the same tiles. With the usual padding (a suffix of each
  // batch's keys), every tile is FULL or EMPTY but the one the padding starts in. A window covers 64 Ki keys;
  // a longer key range is classified a window at a time as the loop reaches it, by a scan of
  // key_padding_mask alone: past the first window every tile reads attn_mask (the classes' reads in the
  // loop cost the loop registers it does not have, and an (L, S) mask over more than 64 Ki keys is rare).
  constexpr int kWindowTiles = kWarpSize * 32;
  constexpr int64_t kWindowKeys = int64_t{kWindowTiles} * kKeys;
  int64_t window_k0 = tile0;
  uint32_t tiles_seen = 0, tiles_kept = 0;
  // A block map's classes of the tiles of a window from w0 (a tile start: block_k is a multiple of the
  // tiles), lane i those of tiles 32 i .. + 31, into tiles_seen (some warp's query block sees the tile's key
  // block) and tiles_kept (the warp's query block sees every key of it: FULL). Read from the map itself, a
  // few entries a tile once a window: its classes are what the pre-pass computes for the other masks.
  const auto block_classes = [&](int64_t w0) {
    const uint32_t tiles_per_block = static_cast<uint32_t>(p.block_k / kKeys);
    const uint32_t first = static_cast<uint32_t>(w0 / kKeys) + 32 * static_cast<uint32_t>(lane);
    uint32_t seen = 0, kept = 0;
#pragma unroll 1
    for (int w = 0; w < 32 && int64_t{first + w} * kKeys < kv_end; ++w) {
      const uint32_t kb = (first + w) / tiles_per_block;
#pragma unroll
      for (int i = 0; i < kBlockWarps; ++i) {  // warp i's rows' query block (some may repeat)
        const int32_t entry = block_map_entry(p, ptr, b, h, block_of_row(p, q0 + i * kMmaRowsPerWarp), kb);
        seen |= static_cast<uint32_t>(entry != kBlockEmpty) << w;
        if (i == warp) kept |= static_cast<uint32_t>(entry == kBlockFull) << w;
      }
    }
    tiles_seen &= seen;
    tiles_kept &= kept;
  };
  // `first`: the first window (std::true_type), or one the loop reaches.
  const auto scan_window = [&](int64_t w0, auto first) {
    window_k0 = w0;
    tiles_seen = ~0u;
    tiles_kept = ~0u;
    if constexpr (decltype(first)::value) {
      // The pre-pass's bits of tiles g0 + 32 lane .. + 31 (tile n: keys 64 n .. + 63) of a bit row: w0 =
      // tile0 is a multiple of kKeys, not always of 32 tiles.
      const int64_t g0 = w0 / kKeys;
      const int shift = static_cast<int>(g0 % 32);
      const auto bits = [&](const MaskTiles& mt, int64_t row) {
        const int64_t word = g0 / 32 + lane;
        const uint32_t lo = word < mt.words ? mask_tiles[row + word] : 0u;
        const uint32_t hi = word + 1 < mt.words ? mask_tiles[row + word + 1] : 0u;
        return shift == 0 ? lo : lo >> shift | hi << (32 - shift);
      };
      if (p.attn_mask_kind != kMaskNone) {
        // Query tile w of the block is warp w's rows (tiles past L have no bit set), or the one tile of a
        // mask that broadcasts over L.
        const MaskTiles& mt = plan.attn_tiles;
        const bool per_row = mt.q_tiles > 1;
        const int64_t step = per_row ? 2 * mt.words : 0;
        const int64_t bm = mt.stride[0] == 0 ? 0 : b, hm = mt.stride[1] == 0 ? 0 : h;
        const int64_t rows = mask_tile_row(mt, bm, hm, per_row ? q0 / kMmaRowsPerWarp : 0);
        uint32_t seen = 0;
#pragma unroll
        for (int w = 0; w < kBlockWarps; ++w) seen |= bits(mt, rows + w * step);
        tiles_seen = seen;
        tiles_kept = bits(mt, rows + warp * step + mt.words);
      }
      if (p.key_padding_mask_kind != kMaskNone) {  // the batch's row
        const MaskTiles& mt = plan.padding_tiles;
        const int64_t row = mask_tile_row(mt, mt.stride[0] == 0 ? 0 : b, 0, 0);
        tiles_seen &= bits(mt, row);
        tiles_kept &= bits(mt, row + mt.words);
      }
    } else {
      // Further windows: key_padding_mask scanned here, 32 keys per warp-wide load and ballot (every warp
      // reads the same elements, so every warp keeps the same tiles_seen); attn_mask read on every tile.
      if (p.key_padding_mask_kind != kMaskNone) {
        tiles_seen = 0;
        const int64_t w_end = range_min(kv_end, w0 + kWindowKeys);
        for (int64_t c = w0; c < w_end; c += kWarpSize) {  // half a tile per step
          const int64_t key = c + lane;
          float term = 0.0f;
          if (key < w_end) {
            if constexpr (kBits) {  // the packed row's bit (set: removed)
              const MaskTiles& mt = plan.padding_tiles;
              const int64_t row = mask_packed_row(mt, mt.stride[0] == 0 ? 0 : b, 0, 0);
              const uint32_t word = mask_tiles[row + key / 32];
              term = (word >> (key % 32)) & 1u ? kNegInf : 0.0f;
            } else {  // mask_value's terms, its switch over the mask's kind as with_float_mask's tests
              const int64_t at = kpm_base + key * p.key_padding_mask_stride[1];
              if (p.key_padding_mask_kind == kMaskBool) {
                term = static_cast<const bool*>(ptr.key_padding_mask)[at] ? kNegInf : 0.0f;
              } else {
                with_float_mask(p.key_padding_mask_kind,
                                [&](auto type) { term = mask_term(type, ptr.key_padding_mask, at); });
              }
            }
          }
          const int tile = static_cast<int>(c - w0) / kKeys;
          const unsigned seen = __ballot_sync(kFullMask, key < w_end && term != kNegInf);
          const unsigned zero = __ballot_sync(kFullMask, term == 0.0f);
          if (lane == tile / 32) {
            if (seen != 0) tiles_seen |= 1u << (tile % 32);
            if (zero != kFullMask) tiles_kept &= ~(1u << (tile % 32));
          }
        }
      }
      if (p.attn_mask_kind != kMaskNone) tiles_kept = 0;
    }
    if (p.has_block_map) block_classes(w0);  // a block map's classes, in every window
  };
  // Whether both masks' terms are all 0 on the warp's rows of the tile at k0, of the window classified last.
  const auto tile_kept = [&](int64_t k0) {
    const int tile = static_cast<int>(k0 - window_k0) / kKeys;
    return ((__shfl_sync(kFullMask, tiles_kept, tile / 32) >> (tile % 32)) & 1u) != 0;
  };
  // The end of the run of FULL tiles (some row of the block sees the tile and both masks' terms are all 0 on
  // the warp's rows) from tile n, a FULL one (k0 = tile0 + kKeys n, in the window classified last): the
  // first tile after it that is not FULL, or the window's end. Found once a run, in the window's words: the
  // run's other tiles take neither a class read nor a search for the next tile.
  const auto full_run = [&](int n) {
    const int window_n0 = static_cast<int>((window_k0 - tile0) / kKeys);
    const int first = n - window_n0;
    const uint32_t gaps = ~(tiles_seen & tiles_kept);
    const uint32_t mine = lane < first / 32    ? 0u
                          : lane == first / 32 ? gaps & (~0u << (first % 32))
                                               : gaps;
    const unsigned lanes = __ballot_sync(kFullMask, mine != 0);
    if (lanes == 0) return window_n0 + kWindowTiles;
    const int owner = __ffs(static_cast<int>(lanes)) - 1;
    const uint32_t word = __shfl_sync(kFullMask, mine, owner);
    return window_n0 + 32 * owner + __ffs(static_cast<int>(word)) - 1;
  };
  // The first tile at or after k0 (a tile start) that the masks do not remove entirely; kv_end when none.
  // Register work only, but for the classification of a new window.
  const auto next_tile = [&](int64_t k0) {
    if constexpr (!kPlain) {
      if (masked) {
        for (; k0 < kv_end; k0 = window_k0 + kWindowKeys) {
          if (k0 >= window_k0 + kWindowKeys) scan_window(k0, std::false_type{});
          const int first = static_cast<int>(k0 - window_k0) / kKeys;
          const uint32_t mine = lane < first / 32    ? 0u
                                : lane == first / 32 ? tiles_seen & (~0u << (first % 32))
                                                     : tiles_seen;
          const unsigned lanes = __ballot_sync(kFullMask, mine != 0);
          if (lanes != 0) {
            const int owner = __ffs(static_cast<int>(lanes)) - 1;
            const uint32_t word = __shfl_sync(kFullMask, mine, owner);
            return window_k0 + int64_t{32 * owner + __ffs(static_cast<int>(word)) - 1} * kKeys;
          }
        }
        return kv_end;
      }
    }
    return k0;
  };
  if (masked && kv_begin < kv_end) scan_window(tile0, std::true_type{});

  // Staging with cp.async (plan.vector_loads): the kRowThreads threads of a row (1, 2 or 4: the block's
  // threads over the tile's keys) copy its 16-byte chunks in turn, this one chunks c_first / kVec +
  // kRowThreads i of row j_copy of both K and V, so that its copies of a tile are at constant offsets from
  // one source pointer for K and one for V (no address arithmetic per copy), and a tile's pointers are the
  // last one's plus a constant. A quarter-warp's 8 lanes store one chunk of 8 consecutive rows (no bank
  // conflict: a staged row is an odd number of chunks long) and a row's lanes read adjacent chunks (whole
  // 32-byte sectors). A chunk past D (Dv) is zero-filled and reads nothing.
  constexpr int kChunks = kBucket / kVec;  // 16-byte chunks per row
  constexpr int kRowThreads = kThreads / kKeys;
  constexpr int kCopies = kChunks / kRowThreads;  // chunks of a K (V) row this thread copies
  static_assert(kThreads % kKeys == 0 && kWarpSize % (8 * kRowThreads) == 0 && kChunks % kRowThreads == 0,
                "the block's threads stage one tile, whole quarter-warps a chunk");
  const int j_copy = (kWarpSize / kRowThreads) * warp + lane % 8 + 8 * (lane / (8 * kRowThreads));
  const int c_first = kVec * ((lane / 8) % kRowThreads);  // the first column this thread copies
  // Columns past D read nothing: copy i is valid where c_first + kRowThreads kVec i < D, i.e.
  // kRowThreads kVec i < k_cols.
  const int k_cols = D - c_first, v_cols = Dv - c_first;
  const int64_t k_key = p.k_stride[2], v_key = p.v_stride[2];
  const scalar_t* const k_chunk0 = k + j_copy * k_key + c_first;  // key 0's first chunk
  const scalar_t* const v_chunk0 = v + j_copy * v_key + c_first;
  const scalar_t* k_src = k_chunk0;
  const scalar_t* v_src = v_chunk0;

  // Stages the tile of keys k0 .. k0 + nk - 1 into `stage` and commits its copies as one cp.async group;
  // k_src and v_src are that tile's (vector loads). A row past the tile's last key is zero-filled and reads
  // nothing (src-size 0, as CUTLASS's zfill copies): its address, past the keys, is never read, so it needs
  // no select. The plain kernel is only launched with vector loads (plan_attention_mma), which keeps the
  // element-wise path, its global loads and its 64-bit index arithmetic, out of its tile loop.
  const auto stage_tile = [&](int stage, int64_t k0, int nk) {
    scalar_t* const k_s = smem + 2 * stage * kTile;
    scalar_t* const v_s = k_s + kTile;
    if (kPlain || plan.vector_loads) {
      const bool row_valid = j_copy < nk;
      const int dst = j_copy * kLd + c_first;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int col = kRowThreads * kVec * i;
        cp_async_16(k_s + dst + col, k_src + col, row_valid && col < k_cols);
        cp_async_16(v_s + dst + col, v_src + col, row_valid && col < v_cols);
      }
    } else if constexpr (!kPlain) {
      for (int j = warp; j < kKeys; j += kBlockWarps) {
        const bool valid = j < nk;
        const scalar_t* ksrc = k + (k0 + j) * p.k_stride[2];
        const scalar_t* vsrc = v + (k0 + j) * p.v_stride[2];
        for (int c = lane; c < kBucket; c += kWarpSize) {
          k_s[j * kLd + c] = valid && c < D ? ksrc[c * p.k_stride[3]] : zero;
          v_s[j * kLd + c] = valid && c < Dv ? vsrc[c * p.v_stride[3]] : zero;
        }
      }
    }
    cp_async_commit();
  };
  // k_src and v_src for the tile at k1: a constant step where it follows the last one (`follows`: always,
  // but where the masks skip tiles).
  const auto advance_src = [&](bool follows, int64_t k1) {
    if (kPlain || follows) {
      k_src += kKeys * k_key;
      v_src += kKeys * v_key;
    } else {
      k_src = k_chunk0 + k1 * k_key;
      v_src = v_chunk0 + k1 * v_key;
    }
  };

  int64_t k0 = kv_begin < kv_end ? next_tile(tile0) : kv_end;
  int n_tile = static_cast<int>((k0 - tile0) / kKeys);  // k0 = tile0 + kKeys n_tile
  // Tiles n_tile <= n < run_end are FULL (full_run) and follow one another: every tile without masks.
  int run_end = masked ? 0 : 0x7fffffff;
  if (k0 < kv_end) {
    k_src = k_chunk0 + k0 * k_key;
    v_src = v_chunk0 + k0 * v_key;
    stage_tile(0, k0, tile_keys(k0));
  }

  // Q fragments, zero past D and past L: register i holds rows g (i even) or g + 8 (i odd), columns
  // 16 ks + 2t (+ 8 for i >= 2), two elements each; float32: column 8 ks + t (+ 4 for i >= 2), its big part
  // in qa and its small part in qs. Loaded while the first tile's copies are in flight.
  uint32_t qa[kQShared ? 1 : kGroups][kQShared ? 1 : kKSteps][4];
  uint32_t qs[kTf32 && !kQShared ? kKSteps : 1][4];
  scalar_t* const q_s =
      smem + 2 * kStages * kTile + warp * kRowsPerWarp * kLd;  // this warp's rows (kQShared)
  // kGeneral: this warp's rows of the mask tile, after the stages and Q's rows.
  [[maybe_unused]] float* const mask_s =
      reinterpret_cast<float*>(smem + 2 * kStages * kTile + (kQShared ? kRowsPerBlock * kLd : 0)) +
      warp * kRowsPerWarp * kMmaBiasLd;
  if constexpr (kQShared) {
    if (plan.q_vector) {
      // 16-byte copies in a cp.async group of their own, after the first tile's: the loop's first wait
      // (for that tile) waits for them too, and its barrier makes them visible to the warp's ldmatrix.
      for (int e = lane; e < kRowsPerWarp * kChunks; e += kWarpSize) {
        const int rr = e / kChunks, col = kVec * (e % kChunks);
        const int64_t qrow = warp_row0 + rr;
        const bool valid = qrow < L && col < D;
        cp_async_16(q_s + rr * kLd + col, valid ? q + qrow * p.q_stride[2] + col : q, valid);
      }
      cp_async_commit();
    } else {
      for (int e = lane; e < kRowsPerWarp * kBucket; e += kWarpSize) {
        const int rr = e / kBucket, col = e % kBucket;
        const int64_t qrow = warp_row0 + rr;
        q_s[rr * kLd + col] = qrow < L && col < D ? q[qrow * p.q_stride[2] + col * p.q_stride[3]] : zero;
      }
      __syncwarp();  // ldmatrix reads rows other lanes wrote
    }
  }
  // With more stages, the tiles after the first up to kStages - 2 are in flight before the loop too, a group
  // each (empty past the last tile: the loop's waits count groups). The plain instantiation alone has more
  // than 2: its tiles follow one another.
  static_assert(kStages == 2 || kPlain, "tiles a constant step apart");
#pragma unroll
  for (int i = 1; i + 1 < kStages; ++i) {
    const int64_t k1 = k0 + i * kKeys;
    if (k1 < kv_end) {
      k_src += kKeys * k_key;
      v_src += kKeys * v_key;
      stage_tile(i, k1, tile_keys(k1));
    } else {
      cp_async_commit();
    }
  }
  if constexpr (!kQShared) {
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 2 * gi + i % 2;
          const scalar_t* src = q + row(r) * p.q_stride[2];
          if constexpr (kTf32) {
            const int col = 8 * ks + t + (i >= 2 ? 4 : 0);
            const Tf32Split x = split_tf32(row(r) < L && col < D ? src[col * p.q_stride[3]] : 0.0f);
            qa[gi][ks][i] = x.big;
            qs[ks][i] = x.small;
          } else {
            const int col = 16 * ks + 2 * t + (i >= 2 ? 8 : 0);
            const scalar_t x0 = row(r) < L && col < D ? src[col * p.q_stride[3]] : zero;
            const scalar_t x1 = row(r) < L && col + 1 < D ? src[(col + 1) * p.q_stride[3]] : zero;
            qa[gi][ks][i] = pack2(x0, x1);
          }
        }
      }
    }
  }

  float o[kGroups][kOTiles][4];
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[gi][n][i] = 0.0f;
    }
  }
  // The rows' running statistics, the maximum in the loop's units (x).
  SoftmaxRow<float> state[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) state[r] = softmax_row_init<float>();

  // ldmatrix row addresses of this lane. K (no .trans): matrix m = (keys 8j .. 8j + 7, columns 16 ks + 8m
  // .. + 7), i.e. the b[0], b[1] of k-steps ks and ks + 1 (float32: columns 8 ks + 4m .. + 3, the same
  // bytes). V (.trans, 16-bit types): matrix m = (keys 16 kk + 8 (m % 2) .. + 7, columns 8 (n + m / 2) ..
  // + 7), i.e. the b[0], b[1] of output n-tiles n and n + 1.
  const int k_lane = (lane % 8) * kLd + kVec * (lane / 8);
  const int v_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 8 * (lane / 16);

  for (int stage = 0; k0 < kv_end; stage = kStages == 2 ? stage ^ 1 : stage + 1 == kStages ? 0 : stage + 1) {
    const int nk = tile_keys(k0);
    // The next tile: the one after this where both are in a run of FULL tiles; otherwise found in the
    // classes (next_tile, which may classify the next window: after this tile's run is found).
    bool masks_read = false;
    int n_next = n_tile + 1;
    int64_t k_next = k0 + kKeys;
    if constexpr (!kPlain) {
      if (n_tile >= run_end && tile_kept(k0)) run_end = full_run(n_tile);
      masks_read = n_tile >= run_end;
      if (n_next >= run_end) {
        k_next = next_tile(k_next);
        n_next = static_cast<int>((k_next - tile0) / kKeys);
      }
    }
    // The block map's class of the warp's rows of this tile where it reads the masks (a tile it keeps is in
    // a FULL block): loaded here, where the scores' mma hides the load.
    [[maybe_unused]] int32_t block_class = kBlockFull;
    if constexpr (!kPlain) {
      if (p.has_block_map && masks_read) {
        // (a warp's rows lie in one query block: block_q is a multiple of 16; computed here, where used,
        // so that the tile loop holds no register for it)
        block_class = block_map_entry(p, ptr, b, h, block_of_row(p, warp_row0),
                                      static_cast<uint32_t>(k0) / static_cast<uint32_t>(p.block_k));
      }
    }
    if constexpr (kStages == 2) {
      if (k_next < kv_end) {
        // The other stage was last read in the previous iteration, which ended with a barrier.
        advance_src(n_next == n_tile + 1, k_next);
        stage_tile(stage ^ 1, k_next, tile_keys(k_next));
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    } else {
      // The tile kStages - 1 ahead, into the stage the previous iteration read (it ended with a barrier);
      // then this tile's group is complete when at most kStages - 1 are pending.
      const int64_t k_fetch = k0 + (kStages - 1) * kKeys;
      if (k_fetch < kv_end) {
        k_src += kKeys * k_key;
        v_src += kKeys * v_key;
        stage_tile(stage == 0 ? kStages - 1 : stage - 1, k_fetch, tile_keys(k_fetch));
      } else {
        cp_async_commit();
      }
      cp_async_wait<kStages - 1>();
    }
    __syncthreads();  // this tile is in shared memory for the whole block
    const scalar_t* const k_s = smem + 2 * stage * kTile;
    const scalar_t* const v_s = k_s + kTile;

    // S = Q K^T: n-tile j is keys k0 + 8j .. + 7; B[kk][n] = K[8j + n][16 ks + kk].
    float s[kGroups][kSTiles][4];
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[gi][j][i] = 0.0f;
      }
    }
    if constexpr (kQShared && kTf32) {
      // k-step pairs outermost: Q's fragments of a pair (register i: row g (i even) or g + 8, column 8 ks + t
      // (+ 4 for i >= 2), as the register-held fragments below; conflict-free: the quad's 8 rows are 4 banks
      // apart) split once and serve every n-tile.
#pragma unroll
      for (int ks = 0; ks < kKSteps; ks += 2) {
        uint32_t qb[2][4], ql[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int at = (g + 8 * (i % 2)) * kLd + 8 * (ks + h) + t + (i >= 2 ? 4 : 0);
            const Tf32Split x = split_tf32(q_s[at]);
            qb[h][i] = x.big;
            ql[h][i] = x.small;
          }
        }
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          uint32_t kb[4];
          ldmatrix_x4<false>(kb, k_s + k_lane + 8 * j * kLd + kK * ks);
          mma_m16n8k8_3xtf32(s[0][j], qb[0], ql[0], {kb[0], kb[1]});
          mma_m16n8k8_3xtf32(s[0][j], qb[1], ql[1], {kb[2], kb[3]});
        }
      }
    } else if constexpr (kQShared) {
      // k-step pairs outermost: Q's fragments of a pair (ldmatrix, A's layout: matrices rows 0-7 / 8-15 x
      // columns 0-7 / 8-15, the lane addresses V's .trans reads use) serve every n-tile.
#pragma unroll
      for (int ks = 0; ks < kKSteps; ks += 2) {
        uint32_t qf[kGroups][2][4];
#pragma unroll
        for (int gi = 0; gi < kGroups; ++gi) {
          ldmatrix_x4<false>(qf[gi][0], q_s + v_lane + kMmaRowsPerWarp * gi * kLd + kK * ks);
          ldmatrix_x4<false>(qf[gi][1], q_s + v_lane + kMmaRowsPerWarp * gi * kLd + kK * (ks + 1));
        }
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          uint32_t kb[4];
          ldmatrix_x4<false>(kb, k_s + k_lane + 8 * j * kLd + kK * ks);
#pragma unroll
          for (int gi = 0; gi < kGroups; ++gi) {
            mma_m16n8k16<scalar_t>(s[gi][j], qf[gi][0], {kb[0], kb[1]});
            mma_m16n8k16<scalar_t>(s[gi][j], qf[gi][1], {kb[2], kb[3]});
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ks += 2) {
          uint32_t kb[4];
          ldmatrix_x4<false>(kb, k_s + k_lane + 8 * j * kLd + kK * ks);
#pragma unroll
          for (int gi = 0; gi < kGroups; ++gi) {
            if constexpr (kTf32) {
              mma_m16n8k8_3xtf32(s[gi][j], qa[gi][ks], qs[ks], {kb[0], kb[1]});
              mma_m16n8k8_3xtf32(s[gi][j], qa[gi][ks + 1], qs[ks + 1], {kb[2], kb[3]});
            } else {
              mma_m16n8k16<scalar_t>(s[gi][j], qa[gi][ks], {kb[0], kb[1]});
              mma_m16n8k16<scalar_t>(s[gi][j], qa[gi][ks + 1], {kb[2], kb[3]});
            }
          }
        }
      }

    }

    // The scores x (element i of group gi's n-tile j is row l[2 gi + i / 2], key k0 + 8j + 2t + i % 2) and
    // their row maxima.
    // kPlain: x = Q K^T. Otherwise the scaled score, capped, plus the masks. An interior tile with no mask
    // needs nothing more (uniform over the warp); other tiles test each score against its row's interval
    // and read the masks.
    float row_max[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) row_max[r] = kNegInf;
    const bool interior = static_cast<unsigned>(n_tile - n_lo) < static_cast<unsigned>(n_hi - n_lo);
    // The soft-cap is the capped instantiation's, compiled in: no loop tests it.
    const auto score = [&](float x) {
      if constexpr (!kPlain) {
        x *= scale;
        if constexpr (kCapped) x = kTf32 ? soft_cap(x, cap) : soft_cap_fast(x, cap);
      }
      return x;
    };
    if (interior && (kPlain || !masks_read)) {
#pragma unroll
      for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s[gi][j][i] = score(s[gi][j][i]);
            row_max[2 * gi + i / 2] = max_nan(row_max[2 * gi + i / 2], s[gi][j][i]);
          }
        }
      }
    } else {
      // kMmaBits: the key_padding_mask terms of this lane's 16 keys, shared by its two rows, read once per
      // tile (on a tile whose terms are not all 0) from the packed mask, the tile's 64 terms in one 8-byte
      // load, bit i key k0 + 2t + i (keys past the tile's end are outside every row's interval, whatever
      // their bit). The general instantiation stages its terms with attn_mask's (stage_kpm_terms).
      float kpm[kSTiles][2];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) kpm[j][e] = 0.0f;
      }
      if constexpr (kBits) {
        if (p.key_padding_mask_kind != kMaskNone && masks_read) {
          const MaskTiles& mt = plan.padding_tiles;
          const int64_t row = mask_packed_row(mt, mt.stride[0] == 0 ? 0 : b, 0, 0);
          const uint2 w = *reinterpret_cast<const uint2*>(mask_tiles + row + k0 / 32);
          const uint64_t removed = (uint64_t{w.y} << 32 | w.x) >> (2 * t);
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) kpm[j][e] = (removed >> (8 * j + e)) & 1u ? kNegInf : 0.0f;
          }
        }
      }
      // The scores with the masks. `ranged`: a boundary tile, each element tested against its row's interval
      // (so that interior tiles carry no test); `packed` (kPacked), the keys a bit removes, a row's 64 at a
      // time: 1, a bool attn_mask's packed bits (kMmaBits) in one load; 2 (kMmaBits), the block map's bits
      // of a block that is not FULL for the warp's rows, two words of its row, OR-ed with a bool attn_mask's
      // packed bits; 0, none; the other terms from kpm or the mask tile; `tiled`: both masks' terms as
      // the lane staged them (mask_s); neither: key_padding_mask's from kpm alone. Each its own path, so that
      // a PARTIAL tile of a bool mask alone carries no code for the block map's.
      const auto masked_scores = [&](auto ranged, auto packed, auto tiled) {
        constexpr int kPacked = decltype(packed)::value;
        static_assert(!kPlain || kPacked == 0, "the plain instantiation reads no mask");
        static_assert(kBits || kPacked == 0, "packed bits are the bits instantiation's");
        static_assert(kGeneral || !decltype(tiled)::value, "the mask tile is the general instantiation's");
        // packed: the words of the lane's first row's terms in this tile (row(1) = row(0) + 8, one row
        // group); on a boundary tile (kBits), each row's own, the last row's for a row past L (whose scores
        // are not seen).
        [[maybe_unused]] const uint32_t* packed_words = nullptr;
        [[maybe_unused]] int64_t packed_step = 0;
        [[maybe_unused]] const MaskTiles& amt = plan.attn_tiles;
        [[maybe_unused]] const int64_t bm = p.attn_mask_stride[0] == 0 ? 0 : b;
        [[maybe_unused]] const int64_t hm = p.attn_mask_stride[1] == 0 ? 0 : h;
        if constexpr (kBits && kPacked != 0 && !decltype(ranged)::value) {
          if (kPacked == 1 || p.attn_mask_kind == kMaskBool) {
            packed_words = mask_tiles + mask_packed_row(amt, bm, hm, amt.q_rows > 1 ? row(0) : 0) + k0 / 32;
            packed_step = amt.q_rows > 1 ? 8 * amt.key_words : 0;
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float (&sg)[kSTiles][4] = s[r / 2];
          // The row's keys in this tile, [lo, hi) in tile coordinates (32-bit: the per-element tests are
          // against the unrolled constants jj). Rows past L, and rows whose key interval misses the tile,
          // read no mask.
          int lo = 0, hi = kKeys;
          bool row_reads = true;
          if constexpr (decltype(ranged)::value) {
            const int64_t key_lo = range_key_begin(row(r), L, Sb, p.window_left);
            const int64_t key_hi = range_key_end(row(r), L, Sb, p.window_right, p.is_causal);
            lo = static_cast<int>(range_min(range_max(key_lo - k0, 0), nk));
            hi = static_cast<int>(range_min(range_max(key_hi - k0, 0), nk));
            row_reads = row(r) < L && lo < hi;
          }
          // packed: bit i is key k0 + 2t + i of the row (set: removed), one 8-byte load of attn_mask's
          // packed row (an interior tile's rows are all below L) and two words of the block's.
          [[maybe_unused]] uint64_t removed = 0;
          if constexpr (kPacked != 0) {
            if constexpr (kBits) {
              if (kPacked == 1 || p.attn_mask_kind == kMaskBool) {
                if constexpr (decltype(ranged)::value) {  // packed_step is 0 here
                  const int64_t l = amt.q_rows > 1 ? range_min(row(r), L - 1) : 0;
                  packed_words = mask_tiles + mask_packed_row(amt, bm, hm, l) + k0 / 32;
                }
                const uint2 w = *reinterpret_cast<const uint2*>(packed_words + (r % 2) * packed_step);
                removed = uint64_t{w.y} << 32 | w.x;
              }
            }
            if constexpr (kPacked == 2) {  // the row in its block (rows past L: the last row's)
              removed |= block_row_bits(p, ptr, block_class, row_in_block(p, row(r)),
                                        static_cast<uint32_t>(k0) % static_cast<uint32_t>(p.block_k));
            }
            removed >>= 2 * t;
          }
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 2 * (r % 2) + e;
              const int jj = 8 * j + 2 * t + e;
              float x = kNegInf;  // past the tile's end or outside the row's interval: not seen at all
              if (!decltype(ranged)::value || (row_reads && lo <= jj && jj < hi)) {
                x = score(sg[j][i]);
                if constexpr (decltype(tiled)::value) {
                  x += mask_s[(g + 8 * (r % 2)) * kMmaBiasLd + 2 * t + 8 * j + e];
                } else if constexpr (!kPlain) {
                  x += kpm[j][e];
                }
                // A removed key is -inf whatever the other terms add there (NaN or +inf included: an unseen
                // position, the spec's unread answer) and whatever the score is (a key of a block the warp's
                // rows do not see may be NaN: only other rows of the block see it).
                if constexpr (kPacked != 0) x = (removed >> (8 * j + e)) & 1u ? kNegInf : x;
              }
              sg[j][i] = x;
              row_max[r] = max_nan(row_max[r], x);
            }
          }
        }
      };
      // Every tile's path compiled per boundary or interior tile and how the masks are read, and chosen here
      // once a tile: no test of either per score. kMmaBits: a bool attn_mask's packed bits or none;
      // kMmaGeneral and kMmaCapped: the terms each lane stages first where the tile reads the masks (a
      // boundary tile both masks keep for the warp's rows reads none); plain: the range test alone.
      const std::false_type no;
      const std::integral_constant<int, 0> unpacked;
      const std::integral_constant<int, 1> attn_bits;
      const std::integral_constant<int, 2> block_bits;
      const auto by_masks = [&](auto ranged) {
        if constexpr (kBits) {
          if (p.has_block_map && block_class != kBlockFull) {
            masked_scores(ranged, block_bits, no);
          } else if (p.attn_mask_kind == kMaskBool) {
            masked_scores(ranged, attn_bits, no);
          } else {
            masked_scores(ranged, unpacked, no);
          }
        } else if constexpr (kGeneral) {
          if (masks_read) {
            // The terms of the lane's scores, each mask's element type's code chosen here.
            const int64_t at[2] = {am_base + row(0) * p.attn_mask_stride[2] + k0 * p.attn_mask_stride[3],
                                   am_base + row(1) * p.attn_mask_stride[2] + k0 * p.attn_mask_stride[3]};
            const bool row_in[2] = {row(0) < L, row(1) < L};
            const int64_t kpm_at = kpm_base + k0 * p.key_padding_mask_stride[1];
            float* const tile = mask_s + g * kMmaBiasLd + 2 * t;
            const bool kpm = p.key_padding_mask_kind != kMaskNone;
            if (p.key_padding_mask_kind == kMaskBool) {
              stage_kpm_terms(BoolMask{}, ptr.key_padding_mask, kpm_at, p.key_padding_mask_stride[1], nk, t,
                              tile);
            } else if (kpm) {
              with_float_mask(p.key_padding_mask_kind, [&](auto type) {
                stage_kpm_terms(type, ptr.key_padding_mask, kpm_at, p.key_padding_mask_stride[1], nk, t,
                                tile);
              });
            }
            // The block map's removed keys of the lane's rows (a block that is not FULL for the warp's).
            uint64_t removed[2] = {0, 0};
            if (p.has_block_map && block_class != kBlockFull) {
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                removed[r] = block_row_bits(p, ptr, block_class, row_in_block(p, row(r)),
                                            static_cast<uint32_t>(k0) % static_cast<uint32_t>(p.block_k)) >>
                             (2 * t);
              }
            }
            const auto fill = [&](auto attn) {
              stage_mask_terms(attn, ptr.attn_mask, at, p.attn_mask_stride[3], row_in, kpm, nk, removed, t,
                               tile);
            };
            if (p.attn_mask_kind == kMaskNone) {
              fill(NoMask{});
            } else if (p.attn_mask_kind == kMaskBool) {
              fill(BoolMask{});
            } else {
              with_float_mask(p.attn_mask_kind, fill);
            }
            masked_scores(ranged, unpacked, std::true_type{});
          } else {
            masked_scores(ranged, unpacked, no);
          }
        } else {
          masked_scores(ranged, unpacked, no);
        }
      };
      if (kPlain || !interior) {  // the plain instantiation's interior tiles took the unmasked path
        by_masks(std::true_type{});
      } else {
        by_masks(no);
      }
    }

    // Online softmax per row (softmax.h's recurrence, in base 2: p = 2^(x c - base c)); a row's scores are
    // spread over the 4 lanes of its quad.
    float alpha[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float (&sg)[kSTiles][4] = s[r / 2];
      float m = row_max[r];
      m = max_nan(m, __shfl_xor_sync(kFullMask, m, 1));
      m = max_nan(m, __shfl_xor_sync(kFullMask, m, 2));
      m = max_nan(state[r].max, m);
      const float base_c = safe_max(m) * c;
      alpha[r] = fast_exp2(state[r].max * c - base_c);  // 0 while the row has seen only -inf
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 2 * (r % 2); i < 2 * (r % 2) + 2; ++i) {
          sg[j][i] = fast_exp2(sg[j][i] * c - base_c);
          sum += sg[j][i];
        }
      }
      state[r].sum = state[r].sum * alpha[r] + sum;  // this lane's share: the quad adds them up at the end
      state[r].max = m;
    }
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[gi][n][i] *= alpha[2 * gi + i / 2];
      }
    }
    if constexpr (!kPlain) {
      if (p.dropout) apply_dropout(s[0], k0);
    }

    // O += P V: k-step kk covers keys 16kk .. 16kk + 15 = S n-tiles 2kk and 2kk + 1;
    // B[kk'][n] = V[16kk + kk'][8n' + n]. float32: k-step kk is S n-tile kk, in the permuted k order (A's
    // columns t, t + 4 = keys 8kk + 2t, 8kk + 2t + 1: its C fragment's elements 0, 2 and 1, 3), so
    // B[t][n] = V[8kk + 2t][8n' + n] and B[t + 4][n] = V[8kk + 2t + 1][8n' + n]: 32-bit loads, on 32
    // distinct banks (kLd = bucket + 4 floats).
    if constexpr (kTf32) {
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        uint32_t pb[4], ps[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const Tf32Split x = split_tf32(s[0][kk][i == 1 ? 2 : i == 2 ? 1 : i]);
          pb[i] = x.big;
          ps[i] = x.small;
        }
        const scalar_t* const v_row = v_s + (8 * kk + 2 * t) * kLd + g;
#pragma unroll
        for (int n = 0; n < kOTiles; ++n) {
          mma_m16n8k8_3xtf32(o[0][n], pb, ps, {float_bits(v_row[8 * n]), float_bits(v_row[kLd + 8 * n])});
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        uint32_t pa[kGroups][4];
#pragma unroll
        for (int gi = 0; gi < kGroups; ++gi) {
          pa[gi][0] = pack2_rn<scalar_t>(s[gi][2 * kk][0], s[gi][2 * kk][1]);
          pa[gi][1] = pack2_rn<scalar_t>(s[gi][2 * kk][2], s[gi][2 * kk][3]);
          pa[gi][2] = pack2_rn<scalar_t>(s[gi][2 * kk + 1][0], s[gi][2 * kk + 1][1]);
          pa[gi][3] = pack2_rn<scalar_t>(s[gi][2 * kk + 1][2], s[gi][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < kOTiles; n += 2) {
          uint32_t vb[4];
          ldmatrix_x4<true>(vb, v_s + v_lane + 16 * kk * kLd + 8 * n);
#pragma unroll
          for (int gi = 0; gi < kGroups; ++gi) {
            mma_m16n8k16<scalar_t>(o[gi][n], pa[gi], {vb[0], vb[1]});
            mma_m16n8k16<scalar_t>(o[gi][n + 1], pa[gi], {vb[2], vb[3]});
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    n_tile = n_next;
    k0 = k_next;
  }

  // out = O / l, lse = m + log(l) (the sink joins l); fully masked rows: out 0, lse +inf. The maxima go back
  // to logits first.
  const float sink = p.has_sinks ? static_cast<const float*>(ptr.sinks)[h] : 0.0f;
  scalar_t* const out = static_cast<scalar_t*>(ptr.out) + b * p.out_stride[0] + h * p.out_stride[1];
  float* const lse = static_cast<float*>(ptr.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
  // Each lane summed its own keys of the row (the max, taken across the quad each tile, is the same in all
  // four): the row's sum is the quad's, added once here rather than once a tile.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    state[r].sum += __shfl_xor_sync(kFullMask, state[r].sum, 1);
    state[r].sum += __shfl_xor_sync(kFullMask, state[r].sum, 2);
  }
  // t again: recomputed rather than kept live through the loop (which spilled it on sm_80)
  const int t_out = static_cast<int>(threadIdx.x) % 4;
  // The plain kernel with plan.out_vector stages the warp's output rows in shared memory (the stages, free
  // since the loop's last barrier; no copy is left in flight there, nor Q's when the loop ran no tile) and
  // writes them out in 16-byte stores; otherwise (and in the general kernel, whose bucket-128 instantiation
  // has no register left for it) element by element through the strides.
  const bool out_vector = kPlain && plan.out_vector;
  cp_async_wait<0>();
  scalar_t* const o_s = smem + warp * kRowsPerWarp * kLd;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!out_vector && row(r) >= L) continue;
    state[r].max *= unit;
    const bool empty = softmax_row_empty(state[r]);
    const RowResult<float> result = softmax_finish(state[r], p.has_sinks != 0, sink);
    const float factor = result.factor;
    const int rr = kMmaRowsPerWarp * (r / 2) + g + 8 * (r % 2);  // the row in the warp's rows
    scalar_t* dst = out + row(r) * p.out_stride[2];
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
      for (int i = 2 * (r % 2); i < 2 * (r % 2) + 2; ++i) {
        const int c = 8 * n + 2 * t_out + i % 2;
        const scalar_t x = from_acc<scalar_t>(empty ? 0.0f : o[r / 2][n][i] * factor);
        if (out_vector) {
          o_s[rr * kLd + c] = x;
        } else if (c < Dv) {
          dst[c * p.out_stride[3]] = x;
        }
      }
    }
    if (t_out == 0 && row(r) < L) lse[row(r) * p.lse_stride[2]] = result.lse;
  }
  if (out_vector) {
    __syncwarp();  // the rows other lanes wrote
    for (int e = lane; e < kRowsPerWarp * kChunks; e += kWarpSize) {
      const int rr = e / kChunks, col = kVec * (e % kChunks);
      const int64_t orow = warp_row0 + rr;
      if (orow < L && col < Dv) store_16(out + orow * p.out_stride[2] + col, o_s + rr * kLd + col);
    }
  }
}

// The masks' tile classes and a bool attn_mask's packed bits (MaskTiles, cuda/attention_plan.h): warp
// `index` of one mask's share of the pre-pass. Classes: one warp per word of the bit rows, that is per (mask
// slice, tile of kMmaRowsPerWarp query rows, 32 key tiles). A warp reads a tile's terms a row at a time, a
// key per lane and two per row (64 keys), and takes `seen` and `kept` by a vote over the warp. The terms are
// mask_value's, those the tile loop adds, so a kept tile's unmasked scores are the masked path's bit for bit.
// Rows past L and keys past S are not read; the bits of a query tile past L (up to the last query block's
// end, so that a block reads its 4 tiles without a bound) are clear.
__device__ __forceinline__ void classify_mask(const AttentionParams& p, const MaskTiles& mt, const void* mask,
                                              int64_t index, int lane, uint32_t* out) {
  const int64_t* const st = mt.stride;
  if (index >= mt.class_warps) {
    // The packed mask: this warp's 32 words (1024 keys) of one row, a ballot a word, a word a lane.
    const int64_t groups = (mt.key_words + 31) / 32;  // (bm, hm, l, group), group fastest
    const int64_t rest = index - mt.class_warps;
    const int64_t group = rest % groups, l = rest / groups % mt.q_rows;
    const int64_t hm = rest / (groups * mt.q_rows) % mt.slices_h;
    const int64_t bm = rest / (groups * mt.q_rows * mt.slices_h);
    const bool* const row = static_cast<const bool*>(mask) + bm * st[0] + hm * st[1] + l * st[2];
    uint32_t mine = 0;
    for (int w = 0; w < 32; ++w) {
      const int64_t key = (32 * group + w) * 32 + lane;
      const uint32_t word = __ballot_sync(kFullMask, key < p.kv_len && row[key * st[3]]);
      if (lane == w) mine = word;
    }
    const int64_t word = 32 * group + lane;
    if (word < mt.key_words) out[mask_packed_row(mt, bm, hm, l) + word] = mine;
    return;
  }
  const int64_t word = index % mt.words, lt = index / mt.words % mt.q_tiles;  // (bm, hm, lt, word)
  const int64_t hm = index / (mt.words * mt.q_tiles) % mt.slices_h;
  const int64_t bm = index / (mt.words * mt.q_tiles * mt.slices_h);
  const int64_t l0 = lt * kMmaRowsPerWarp;
  // A mask that broadcasts over L is read on one row.
  const int64_t rows = st[2] == 0 ? 1 : range_min(int64_t{kMmaRowsPerWarp}, p.q_len - l0);
  uint32_t seen = 0, kept = 0;
  for (int w = 0; w < 32; ++w) {
    const int64_t k0 = (32 * word + w) * kMmaTileKeys;
    if (k0 >= p.kv_len) break;  // uniform over the warp
    bool any_seen = false, all_kept = rows > 0;  // a tile past L: neither
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = bm * st[0] + hm * st[1] + (l0 + r) * st[2];
      for (int64_t key = k0 + lane; key < range_min(k0 + kMmaTileKeys, p.kv_len); key += kWarpSize) {
        const float term = mask_value<float>(mt.kind, mask, row + key * st[3]);
        any_seen = any_seen || term != -INFINITY;
        all_kept = all_kept && term == 0.0f;
      }
    }
    if (__any_sync(kFullMask, any_seen)) seen |= 1u << w;
    if (__all_sync(kFullMask, all_kept)) kept |= 1u << w;
  }
  if (lane == 0) {
    uint32_t* const row = out + mask_tile_row(mt, bm, hm, lt);
    row[word] = seen;
    row[mt.words + word] = kept;
  }
}

// The pre-pass of the general instantiations, forward and backward (launch_mask_tiles): attn_mask's warps,
// then key_padding_mask's (one launch).
__global__ void __launch_bounds__(kWarps* kWarpSize)
    attention_mask_tiles(const AttentionParams p, const AttentionPointers ptr, const MaskTiles attn,
                         const MaskTiles padding, uint32_t* const out) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t index = int64_t{blockIdx.x} * kWarps + warp;
  if (index < attn.warps) {
    classify_mask(p, attn, ptr.attn_mask, index, lane, out);
  } else if (index - attn.warps < padding.warps) {
    classify_mask(p, padding, ptr.key_padding_mask, index - attn.warps, lane, out);
  }
}

#endif  // ATTNX_CUDA_DEVICE_CODE

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
// f(std::integral_constant<int, S>{}) for the shape S of the plain instantiation (kMmaShapes) that equals
// `shape`, among those this build has for the element size and bucket (mma_shape_built);
// cudaErrorInvalidValue for another.
template <int kBytes, int kBucket, typename F, size_t... I>
cudaError_t dispatch_shape(int shape, F&& f, std::index_sequence<I...>) {
  cudaError_t err = cudaErrorInvalidValue;
  const auto one = [&](auto s) {
    if constexpr (mma_shape_built(kBytes, kBucket, decltype(s)::value)) {
      if (shape == decltype(s)::value) {
        err = f(s);
        return true;
      }
    }
    return false;
  };
  (void)(one(std::integral_constant<int, kMmaShapes[I]>{}) || ...);
  return err;
}

template <typename scalar_t>
cudaError_t launch_mma(const AttentionParams& p, const AttentionPointers& ptr, const AttentionMmaPlan& plan,
                       uint32_t* mask_tiles, cudaStream_t stream) {
  const auto launch = [&](auto bucket) {
    constexpr int kBucket = decltype(bucket)::value;
    const auto run = [&](auto&& kernel) {
      return launch_plan(kernel, plan.blocks, plan.threads, plan.smem_bytes, stream, p, ptr, plan,
                         static_cast<const uint32_t*>(mask_tiles));
    };
    if (plan.variant == kMmaBits)
      return run(ATTNX_KERNEL(attention_forward_mma, scalar_t, kBucket, kMmaBits));
    if (plan.variant == kMmaGeneral)
      return run(ATTNX_KERNEL(attention_forward_mma, scalar_t, kBucket, kMmaGeneral));
    if (plan.variant == kMmaCapped)
      return run(ATTNX_KERNEL(attention_forward_mma, scalar_t, kBucket, kMmaCapped));
    constexpr int kBytes = static_cast<int>(sizeof(scalar_t));
    return dispatch_shape<kBytes, kBucket>(
        plan.shape,
        [&](auto shape) {
          constexpr int kShape = decltype(shape)::value;
          return run(ATTNX_KERNEL(attention_forward_mma, scalar_t, kBucket, kMmaPlain, kShape));
        },
        std::make_index_sequence<sizeof(kMmaShapes) / sizeof(kMmaShapes[0])>{});
  };
  return dispatch_bucket<32, 64, 128>(plan.bucket, launch);  // kMmaMaxHeadDim and kMmaMaxHeadDimTf32
}

#endif
}  // namespace

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
cudaError_t launch_mask_tiles(const AttentionParams& p, const AttentionPointers& ptr, const MaskTiles& attn,
                              const MaskTiles& padding, int64_t blocks, uint32_t* words,
                              cudaStream_t stream) {
  return launch_plan(ATTNX_KERNEL_FN(attention_mask_tiles), blocks, kWarps * kWarpSize, 0, stream, p, ptr,
                     attn, padding, words);
}

cudaError_t launch_attention_mma(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                                 void* workspace, cudaStream_t stream, int shape) {
  if (!mma_supports(p, dtype) || !params_consistent(p, ptr) || !mma_block_map_fits(p)) {
    return cudaErrorInvalidValue;
  }
  const AttentionMmaPlan plan = plan_attention_mma(p, dtype, ptr, shape);
  if (plan.blocks == 0) return cudaSuccess;
  if (plan.blocks > kMaxBlocks || plan.mask_blocks > kMaxBlocks) return cudaErrorInvalidConfiguration;
  if (plan.workspace_bytes > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  uint32_t* const mask_tiles = static_cast<uint32_t*>(workspace);
  if (plan.mask_blocks > 0) {
    const cudaError_t err =
        launch_mask_tiles(p, ptr, plan.attn_tiles, plan.padding_tiles, plan.mask_blocks, mask_tiles, stream);
    if (err != cudaSuccess) return err;
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (std::is_same<scalar_t, double>::value) {
      return cudaErrorInvalidValue;  // no float64 tensor-core kernel (mma_supports refuses it too)
    } else {
      return launch_mma<scalar_t>(p, ptr, plan, mask_tiles, stream);
    }
  });
}

#endif

}  // namespace attnx::cuda
