// attnx: attnx::attention_backward's tensor-core kernels for float16 and bfloat16 (sm80+): FlashAttention-2's
// backward on mma.sync.m16n8k16 with fp32 accumulators, deterministic (no atomics), nothing of size
// (B, H, L, S) stored.
//
// Torch-free (raw pointers, AttentionBackwardParams, cudaStream_t): the glue is cuda/attention_backward.cpp,
// the launches cuda/attention_backward_kernel.h. The CPU emulation runs this source in CI against the float64
// reference (tests/emulation/), with mma.sync, ldmatrix and cp.async replaced by their PTX definitions.
//
// The math is the SIMT kernels' (cuda/attention_backward_kernel.cu): P recomputed from the forward's lse,
// dS = P (Z dP - delta), dV = (Z P)^T dO, dK = scale (dS y')^T Q, dQ = scale (dS y') K. Here each of the five
// products (the scores S = Q K^T and dP = dO V^T in both passes, dV and dK in the key pass, dQ in the query
// pass) is an mma over tiles staged in shared memory in the input type, and P is one FFMA and one ex2 a
// score: P = 2^(x scale log2(e) - lse log2(e)), with lse log2(e) read once a row. Z P and dS y' are rounded
// to the input type for their products, as FlashAttention-2 rounds them (and the forward P).
//
// Two passes, so that every output element is written by one thread of one block, in a fixed order:
//   queries  block = (b, h, 64 query rows), a warp 16 rows. Q and dO are staged once; delta = rowsum(dO * O)
//            of the rows is computed from them and written to the workspace with lse log2(e). Then over the
//            key tiles the rows see (attnx/key_range.h), K and V in two stages of cp.async: S = Q K^T and
//            dP = dO V^T (B fragments by ldmatrix from K's and V's rows), dS, and dQ += dS K (K's B fragments
//            by ldmatrix.trans). The C fragments of two adjacent n-tiles of dS are the A fragment of one
//            k-step.
//   keys     block = (b, kv head, 64 keys), a warp 16 keys; launched after the query pass, whose numbers of
//            the rows it reads. K and V are staged once; then over the group's query heads and the query
//            tiles that see the keys, Q and dO (and the tile's lse and delta) in two stages: the transposed
//            products S^T = K Q^T and dP^T = V dO^T, then dV += (Z P)^T dO and dK += (dS y')^T Q, K's and V's
//            A fragments by ldmatrix from their rows, Q's and dO's B fragments by ldmatrix (.trans for dV and
//            dK).
// Grouped KV heads are summed in the key pass's registers, K and V read in place. A tile where every row of a
// warp sees every key of it (interior) tests no key range; elsewhere each score is tested against its row's
// interval. Three instantiations (MmaVariant, as the forward's): plain (no mask, soft-cap or dropout), bits
// (each mask bool or absent: the loops read the masks only as packed bits and hold no code for a float mask)
// and general (a float mask); "the general instantiation" below is either of the last two unless bits is
// named. The general instantiation reads the masks through the forward's tile classes (its pre-pass writes
// them into the workspace after the rows' numbers): a tile no row sees is stepped over, a tile both masks
// keep for a warp's rows reads no mask, and on the others a bool mask is its packed bits (a word per row and
// 32 keys, routed as removed keys) and a float mask is read per score (mask_value). It soft-caps with
// fast_tanh and applies its derivative, and regenerates dropout's keep decision per score from the forward's
// Philox stream (attnx/philox.h); the plain one (mma_plain, vector loads) holds none of that code. A
// block-sparse mask (the general instantiation; blocks of whole tiles: mma_block_map_fits): both passes step
// over the tiles no query block of theirs sees (the map read per tile, never K, V, Q or dO of an EMPTY one),
// and a score its block's bits remove is unseen, as one outside its row's range.
#include "attnx/philox.h"
#include "cuda/attention_backward_kernel.h"
#include "cuda/attention_kernel.h"
#include "cuda/common.cuh"

namespace attnx::cuda {
namespace {
#if ATTNX_CUDA_DEVICE_CODE  // the kernels (cuda/common.cuh); the launchers follow

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kBwdThreads = kWarps * kWarpSize;
constexpr int kBwdRows = kMmaTileKeys;  // a block's own rows in both passes: 64 queries, 64 keys

template <typename scalar_t, int kBucket>
struct BwdShape {
  static constexpr int kBytes = sizeof(scalar_t);
  static constexpr bool kTf32 = kBytes == 4;                // float32: 3xTF32 on mma.m16n8k8
  static constexpr int kLd = mma_tile_ld(kBucket, kBytes);  // a staged row: bucket + one 16-byte unit
  static constexpr int kOwn = kBwdRows * kLd;               // elements of one of the block's own tiles
  static constexpr int kRows =
      mma_backward_tile(kBucket, kBytes);    // rows of a staged tile of the other operand
  static constexpr int kTile = kRows * kLd;  // its elements
  static constexpr int kKSteps =
      kBucket / 16;  // k-steps of 16 of S and dP over the head dim (float32: pairs of 8)
  static constexpr int kOTiles = kBucket / 8;  // n-tiles of a gradient row
  static_assert(kKSteps % 2 == 0 && kOTiles % 2 == 0, "ldmatrix.x4 serves two steps");
};

// What the element-wise step of either pass reads of the call.
struct BwdConsts {
  float scale;          // the softmax scale
  float c;              // the plain exponent's factor: scale log2(e)
  float dropout_scale;  // 1 / (1 - p)
  SoftCap<float> cap;
};

__device__ __forceinline__ BwdConsts bwd_consts_of(const AttentionParams& p) {
  const float scale = split_value<float>(p.scale, p.scale_lo);
  return {scale, scale * kLog2e, split_value<float>(p.dropout_scale, p.dropout_scale_lo),
          soft_cap_of<float>(p)};
}

// Rows [0, kRows) of a 16-bit operand at `src` (row stride rs, column stride cs, in elements) into `dst`
// (kRows, kLd), zero at and past row `valid` and column `cols`. With 16-byte rows (kVector, or `vector` at
// run time: mma_rows_16 holds for the operand) by cp.async in the caller's open group, a thread the 16-byte
// chunks of one column kRowStep rows apart, from one pointer advanced by a constant (no multiply per copy);
// otherwise element by element (visible after the caller's barrier). A zero-filled row reads nothing, so a
// tile may end past the tensor's last row. The 16-bit plain instantiations always have 16-byte rows
// (kVector): their copies compile without the element-wise path. (Copies at constant offsets from one pointer a row,
// as the forward's, took registers that the bucket-128 loops do not have.) The caller passes the thread's
// first chunk, `at` = first_chunk(src, rs), rather than src: a tile loop carries it from tile to tile by a
// constant, where the compiler would otherwise recompute its 64-bit product every tile rather than hold it.
// A zero-filled copy names `base` (any address of the tensor) and reads nothing.
template <typename scalar_t, int kBucket>
struct StageChunks {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(scalar_t)), kChunks = kBucket / kVec,
                       kRowStep = kBwdThreads / kChunks;
};
template <typename scalar_t, int kBucket>
__device__ __forceinline__ int64_t chunk_offset(int64_t rs) {
  using C = StageChunks<scalar_t, kBucket>;
  const int tid = static_cast<int>(threadIdx.x);
  return tid / C::kChunks * rs + C::kVec * (tid % C::kChunks);
}
template <int kBucket, typename scalar_t>
__device__ __forceinline__ const scalar_t* first_chunk(const scalar_t* src, int64_t rs) {
  return src + chunk_offset<scalar_t, kBucket>(rs);
}
template <typename scalar_t, int kBucket, bool kVector, int kRows = kBwdRows>
__device__ __forceinline__ void stage_rows_mma(scalar_t* dst, const scalar_t* at, const void* base,
                                               int64_t rs, int64_t cs, int64_t valid, int cols, bool vector) {
  using C = StageChunks<scalar_t, kBucket>;
  constexpr int kLd = BwdShape<scalar_t, kBucket>::kLd, kVec = C::kVec, kChunks = C::kChunks,
                kRowStep = C::kRowStep;
  constexpr int kCopies = kRows / kRowStep;
  static_assert(kRows % kRowStep == 0, "whole rounds of copies");
  const int tid = static_cast<int>(threadIdx.x);
  if (kVector || vector) {
    const int r0 = tid / kChunks, c = kVec * (tid % kChunks);
    const int64_t step = kRowStep * rs;
    at = opaque(at);  // not folded into the caller's advance of it either
#pragma unroll
    for (int i = 0; i < kCopies; ++i, at = opaque(at + step)) {
      const int r = r0 + kRowStep * i;
      const bool ok = r < valid && c < cols;
      cp_async_16(dst + r * kLd + c, ok ? static_cast<const void*>(at) : base, ok);
    }
  } else if constexpr (!kVector) {
    const scalar_t* const src = at - chunk_offset<scalar_t, kBucket>(rs);
    const scalar_t zero = from_acc<scalar_t>(0.0f);
    for (int e = tid; e < kRows * kBucket; e += kBwdThreads) {
      const int r = e / kBucket, c = e % kBucket;
      dst[r * kLd + c] = r < valid && c < cols ? src[r * rs + c * cs] : zero;
    }
  }
}

// A key range relative to a tile's first row or key: [lo, hi) clamped into [0, 64], so that the element-wise
// test is two 32-bit compares.
struct TileRange {
  int lo, hi;
};
__device__ __forceinline__ int clamp_rows(int x) {
  return x < 0 ? 0 : x > kBwdRows ? kBwdRows : x;
}
__device__ __forceinline__ TileRange tile_range(int lo, int hi, int at) {
  return {clamp_rows(lo - at), clamp_rows(hi - at)};
}

// Z P, dS y' (before the scale) and dS (attn_mask's gradient) of one score of the general instantiation, from
// x = q.k, dp = dO.v, the row's lse2 = lse log2(e) and delta, the masks' term `bias`, the dropout factor z (1
// without) and whether the row sees the key at all. Where it does not, all are 0 whatever x is (a NaN of an
// unseen key included). kTanhf: the soft-cap's tanh by tanhf (float32, as the forward's float32 takes it)
// rather than fast_tanh.
struct ScoreGrads {
  float pz, ds, ds_bias;
};
template <bool kTanhf>
__device__ __forceinline__ ScoreGrads general_grads(float x, float dp, float lse2, float delta, float bias,
                                                    float z, bool seen, const BwdConsts& k) {
  float y = x * k.scale, slope = 1.0f;
  if (k.cap.cap > 0.0f) {
    const float th = kTanhf ? tanhf(y * k.cap.inv_cap) : fast_tanh(y * k.cap.inv_cap);
    y = k.cap.cap * th;
    slope = 1.0f - th * th;
  }
  const float prob = seen ? fast_exp2(fmaf(y + bias, kLog2e, -lse2)) : 0.0f;
  const float ds = seen ? prob * (z * dp - delta) : 0.0f;
  return {prob * z, ds * slope, ds};
}

// key_padding_mask's term of key s of batch b (0 without one); and the masks' term of score (l, s) of (b, h),
// in the reference's order (attn_mask + key_padding_mask).
__device__ __forceinline__ float padding_term(const AttentionParams& p, const AttentionPointers& ptr,
                                              int64_t b, int64_t s) {
  return p.key_padding_mask_kind == kMaskNone
             ? 0.0f
             : mask_value<float>(p.key_padding_mask_kind, ptr.key_padding_mask,
                                 b * p.key_padding_mask_stride[0] + s * p.key_padding_mask_stride[1]);
}
// `padding`: key_padding_mask's term of key s, where the caller has it already.
__device__ __forceinline__ float mask_bias(const AttentionParams& p, const AttentionPointers& ptr, int64_t b,
                                           int64_t h, int64_t l, int64_t s, const float* padding = nullptr) {
  float bias = padding != nullptr ? *padding : padding_term(p, ptr, b, s);
  if (p.attn_mask_kind != kMaskNone) {
    const int64_t* const st = p.attn_mask_stride;
    bias = mask_value<float>(p.attn_mask_kind, ptr.attn_mask, b * st[0] + h * st[1] + l * st[2] + s * st[3]) +
           bias;
  }
  return bias;
}
// Dropout's keep decisions for a lane's scores of a key-pass chunk (the transposed fragment: its rows are
// keys): keys w0 + g + 8 r (r < 2), queries l0 + 8 j + 2 t + i (j < kN, i < 2); bit q = 2 (r kN + j) + i
// set where score (query, key) is kept, by the Philox stream's element ((b H + h) L + l) S + key. The 4
// lanes of a column (g = 4c .. 4c + 3, lanes 4 apart) hold 4 consecutive keys of each query, one Philox
// block when S is a multiple of 4 (w0 is one of 16): lane g % 4 = u draws the blocks of kN of the 4 kN
// (r, j, i), and the 4 lanes swap their 4-bit results (3 shuffles), a block a lane per 4 probabilities;
// otherwise each lane draws a block per score.
template <int kN>
__device__ __forceinline__ uint32_t key_dropout_bits(const AttentionParams& p, int64_t bh, int64_t w0,
                                                     int64_t l0, int lane) {
  static_assert(4 * kN <= 32 && kN <= 8, "a bit per score of the lane, a nibble per draw");
  const int g = lane / 4, t = lane % 4, u = g % 4;
  const uint64_t S = static_cast<uint64_t>(p.kv_len);
  const uint64_t row0 =
      static_cast<uint64_t>(bh) * static_cast<uint64_t>(p.q_len) + static_cast<uint64_t>(l0);
  const auto element = [&](int q, int key) {  // score q's element at key w0 + key
    const int r = q / (2 * kN), j = q / 2 % kN, i = q % 2;
    return (row0 + static_cast<uint64_t>(8 * j + 2 * t + i)) * S + static_cast<uint64_t>(w0 + key + 8 * r);
  };
  const auto draws = [&](uint64_t e) {
    return dropout_block(e >> 2, p.dropout_seed[0], p.dropout_seed[1], p.dropout_offset[0],
                         p.dropout_offset[1]);
  };
  const uint32_t threshold = p.dropout_threshold;
  uint32_t kept = 0;
  if ((S & 3) == 0) {
    uint32_t mine = 0;  // nibble m: keys 4 (g / 4) .. + 3 of score u kN + m
#pragma unroll 1
    for (int m = 0; m < kN; ++m) {
      const Philox4x32 block = draws(element(u * kN + m, g - u));
#pragma unroll
      for (int w = 0; w < 4; ++w)
        mine |= static_cast<uint32_t>(philox_word(block, w) < threshold) << (4 * m + w);
    }
#pragma unroll
    for (int d = 0; d < 4; ++d) {  // the nibbles of lane u ^ d: its scores' bits at this lane's key (bit u)
      const uint32_t theirs = d == 0 ? mine : __shfl_xor_sync(kFullMask, mine, 4 * d);
#pragma unroll
      for (int m = 0; m < kN; ++m) kept |= ((theirs >> (4 * m + u)) & 1u) << ((u ^ d) * kN + m);
    }
  } else {
#pragma unroll 1
    for (int q = 0; q < 4 * kN; ++q) {
      const uint64_t e = element(q, g);
      kept |= static_cast<uint32_t>(philox_word(draws(e), static_cast<uint32_t>(e & 3)) < threshold) << q;
    }
  }
  return kept;
}

// The masks' tile classes (MaskTiles, the forward's pre-pass: cuda/attention_plan.h) of key tile n (keys
// kMmaTileKeys n .. + 63) for query row tile lt (kMmaRowsPerWarp rows) of (b, h): bit 0 set where some term
// is not -inf (clear: EMPTY), bit 1 where every term is 0 (FULL); 3 without the mask. A dim the mask
// broadcasts along has one slice (index 0).
__device__ __forceinline__ uint32_t tile_class(const MaskTiles& mt, const uint32_t* words, int64_t b,
                                               int64_t h, int64_t lt, int64_t n) {
  if (mt.kind == kMaskNone) return 3u;
  const int64_t row =
      mask_tile_row(mt, mt.stride[0] == 0 ? 0 : b, mt.stride[1] == 0 ? 0 : h, mt.stride[2] == 0 ? 0 : lt);
  const int bit = static_cast<int>(n % 32);
  return ((words[row + n / 32] >> bit) & 1u) | ((words[row + mt.words + n / 32] >> bit) & 1u) << 1;
}
// Word w of a packed bool mask's row l of (b, h) (MaskTiles::key_words != 0): bit i set where the mask
// removes key 32 w + i.
__device__ __forceinline__ const uint32_t* packed_words(const MaskTiles& mt, const uint32_t* words, int64_t b,
                                                        int64_t h, int64_t l, int64_t w) {
  return words +
         mask_packed_row(mt, mt.stride[0] == 0 ? 0 : b, mt.stride[1] == 0 ? 0 : h,
                         mt.stride[2] == 0 ? 0 : l) +
         w;
}

// ldmatrix row addresses of this lane in a staged tile (cuda/attention_kernel_mma.cu uses the same): `a`
// reads a 16 x 16 A fragment (matrices rows 0-7 / 8-15 x columns 0-7 / 8-15), or with .trans the B fragments
// of two n-tiles from a [k][n] tile; `b` reads, without .trans, the B fragments of two k-steps from an [n][k]
// tile.
__device__ __forceinline__ int a_lane(int lane, int ld) {
  return (lane % 8 + 8 * ((lane / 8) % 2)) * ld + 8 * (lane / 16);
}
__device__ __forceinline__ int b_lane(int lane, int ld) {
  return (lane % 8) * ld + 8 * (lane / 8);
}

// This lane's offsets in a staged tile (row stride ld) for rows_by_rows (`a`: its A fragments, the warp's 16
// rows included; `b`: its B fragments) and accumulate (`t`: its B fragments). 16-bit types: the ldmatrix
// addresses above. float32: element by element, A's and B's at row g, column t of an 8-column k-step,
// accumulate's B at rows 2 t, 2 t + 1 (the permuted k order, below) and column g: each on 32 distinct banks
// (ld = bucket + 4).
struct LaneAt {
  int a, b, t;
};
template <typename scalar_t>
__device__ __forceinline__ LaneAt lane_at(int lane, int warp, int ld) {
  const int g = lane / 4, t = lane % 4;
  if constexpr (sizeof(scalar_t) == 4) {
    return {(16 * warp + g) * ld + t, g * ld + t, 2 * t * ld + g};
  } else {
    return {a_lane(lane, ld) + 16 * warp * ld, b_lane(lane, ld), a_lane(lane, ld)};
  }
}

// acc[j] += A B over the head dim for n-tiles j < kN: A the warp's 16 rows of `a_s` (an [m][k] tile), B the
// rows n0 + 8 j .. + 7 of `b_s` (an [n][k] tile): S or dP of a chunk.
// kHeld: A's fragments are held in registers (`held`, a k-step's a row), not read from `a_s` (16-bit types).
// float32: a pair of 8-column k-steps at a time, A's 8 elements split once into their big and small parts
// for all of the chunk's n-tiles, B's split in mma_m16n8k8_3xtf32.
template <typename scalar_t, int kBucket, int kN, bool kHeld = false>
__device__ __forceinline__ void rows_by_rows(float (&acc)[kN][4], const scalar_t* a_s, const scalar_t* b_s,
                                             int a_at, int b_at, const uint32_t (*held)[4] = nullptr) {
  using Sh = BwdShape<scalar_t, kBucket>;
  if constexpr (Sh::kTf32) {
    static_assert(!kHeld, "float32's fragments are not held");
    // A k-step at a time, A's and B's elements read one by one (both on 32 distinct banks), so that few
    // registers hold them: the loop around holds dQ or dK and dV. `fresh`: the rows are the same for every
    // chunk of a tile, and the compiler would otherwise read and split them once (2 bucket registers) for
    // the chunks' loop.
    const scalar_t* const a = fresh(a_s + a_at);
#pragma unroll
    for (int ks = 0; ks < 2 * Sh::kKSteps; ++ks) {
      uint32_t big[4], small[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Tf32Split x = split_tf32(a[(i % 2) * 8 * Sh::kLd + 8 * ks + (i / 2) * 4]);
        big[i] = x.big;
        small[i] = x.small;
      }
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const scalar_t* const row = b_s + b_at + 8 * j * Sh::kLd + 8 * ks;
        mma_m16n8k8_3xtf32(acc[j], big, small, {float_bits(row[0]), float_bits(row[4])});
      }
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < Sh::kKSteps; ks += 2) {
      uint32_t a[2][4];
      if constexpr (kHeld) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a[0][i] = held[ks][i];
          a[1][i] = held[ks + 1][i];
        }
      } else {
        ldmatrix_x4<false>(a[0], a_s + a_at + 16 * ks);
        ldmatrix_x4<false>(a[1], a_s + a_at + 16 * (ks + 1));
      }
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        uint32_t bf[4];
        ldmatrix_x4<false>(bf, b_s + b_at + 8 * j * Sh::kLd + 16 * ks);
        mma_m16n8k16<scalar_t>(acc[j], a[0], {bf[0], bf[1]});
        mma_m16n8k16<scalar_t>(acc[j], a[1], {bf[2], bf[3]});
      }
    }
  }
}

// grad[n] += F B for the gradient's n-tiles: F the chunk's element-wise results (C fragments of S's n-tiles,
// rounded to the input type: two adjacent n-tiles are one k-step's A fragment), B rows k0 + 16 kk .. + 15 of
// `b_s` (a [k][n] tile, by ldmatrix.trans). float32: F as it is (3xTF32), each n-tile one 8-row k-step in a
// permuted k order, as the forward's P V: A's columns t, t + 4 are the n-tile's columns 2 t, 2 t + 1 (its C
// fragment's elements 0, 2 and 1, 3), so B's rows t, t + 4 are b_s's rows 2 t, 2 t + 1 (lane_at's `t`),
// read element by element (ldmatrix.trans moves 16-bit elements only).
template <typename scalar_t, int kBucket, int kN>
__device__ __forceinline__ void accumulate(float (&grad)[BwdShape<scalar_t, kBucket>::kOTiles][4],
                                           const float (&f)[kN][4], const scalar_t* b_s, int b_at) {
  using Sh = BwdShape<scalar_t, kBucket>;
  if constexpr (Sh::kTf32) {
#pragma unroll
    for (int kk = 0; kk < kN; ++kk) {
      uint32_t big[4], small[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Tf32Split x = split_tf32(f[kk][i == 1 ? 2 : i == 2 ? 1 : i]);
        big[i] = x.big;
        small[i] = x.small;
      }
      const scalar_t* const row = b_s + b_at + 8 * kk * Sh::kLd;
#pragma unroll
      for (int n = 0; n < Sh::kOTiles; ++n) {
        mma_m16n8k8_3xtf32(grad[n], big, small, {float_bits(row[8 * n]), float_bits(row[Sh::kLd + 8 * n])});
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kN / 2; ++kk) {
      const uint32_t a[4] = {pack2_rn<scalar_t>(f[2 * kk][0], f[2 * kk][1]),
                             pack2_rn<scalar_t>(f[2 * kk][2], f[2 * kk][3]),
                             pack2_rn<scalar_t>(f[2 * kk + 1][0], f[2 * kk + 1][1]),
                             pack2_rn<scalar_t>(f[2 * kk + 1][2], f[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < Sh::kOTiles; n += 2) {
        uint32_t bf[4];
        ldmatrix_x4<true>(bf, b_s + b_at + 16 * kk * Sh::kLd + 8 * n);
        mma_m16n8k16<scalar_t>(grad[n], a, {bf[0], bf[1]});
        mma_m16n8k16<scalar_t>(grad[n + 1], a, {bf[2], bf[3]});
      }
    }
  }
}

// blockIdx.x and threadIdx.x, read so that the compiler computes what derives from them again rather than
// keep it in registers through a loop (volatile reads of %ctaid.x and %tid.x).
__device__ __forceinline__ uint64_t block_index() {
#if defined(__CUDA_ARCH__) && !defined(ATTNX_CUDA_EMULATION)
  uint32_t x;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  return x;
#else
  return blockIdx.x;
#endif
}
__device__ __forceinline__ uint32_t thread_index() {
#if defined(__CUDA_ARCH__) && !defined(ATTNX_CUDA_EMULATION)
  uint32_t x;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(x));
  return x;
#else
  return threadIdx.x;
#endif
}

template <typename scalar_t>
__device__ __forceinline__ const scalar_t* rows_of(const void* base, const int64_t* stride, int64_t b,
                                                   int64_t h, int64_t row0) {
  return static_cast<const scalar_t*>(base) + b * stride[0] + h * stride[1] + row0 * stride[2];
}

// Writes a warp's (16, bucket) gradient tile times `factor`: element i of n-tile n is row r0 + 16 warp + g
// (+ 8 for i >= 2), column 8 n + 2 t + i % 2; rows at and past `rows` and columns past `cols` are not
// written. The thread's coordinates are read anew from threadIdx: values derived from them before the tile
// loop and kept through it took registers the loop needs (ptxas spilled them at bucket 128).
template <typename scalar_t, int kBucket>
__device__ __forceinline__ void write_rows(const float (&grad)[BwdShape<scalar_t, kBucket>::kOTiles][4],
                                           void* base, const int64_t* stride, int64_t b, int64_t h,
                                           int64_t r0, int64_t rows, int cols, float factor) {
  const int tid = static_cast<int>(thread_index());
  const int lane = tid % kWarpSize, g = lane / 4, t = lane % 4;
  r0 += 16 * (tid / kWarpSize);
  scalar_t* const dst = static_cast<scalar_t*>(base) + b * stride[0] + h * stride[1];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t r = r0 + g + 8 * half;
    if (r >= rows) continue;
#pragma unroll
    for (int n = 0; n < BwdShape<scalar_t, kBucket>::kOTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * n + 2 * t + e;
        if (c < cols) dst[r * stride[2] + c * stride[3]] = from_acc<scalar_t>(grad[n][2 * half + e] * factor);
      }
    }
  }
}

// attn_mask's gradient of one tile: dS of the tile's 64 rows x kKeys keys, staged in `ds_s` (64, kKeys + 1),
// summed over the rows (keys) where the gradient broadcasts along L (S) and added to
// elements of `mask_grad` (a float buffer of bp.grad_attn_mask_size) that only this block writes; a thread
// an element, rows past L and keys past S not read.
template <int kKeys>
__device__ __forceinline__ void add_mask_grad_tile(const AttentionBackwardParams& bp, float* mask_grad,
                                                   const float* ds_s, int64_t b, int64_t h, int64_t q0,
                                                   int64_t k0) {
  const int64_t* size = bp.grad_attn_mask_size;
  const int64_t L = bp.fwd.q_len, S = bp.fwd.kv_len;
  const bool sum_rows = size[2] == 1, sum_keys = size[3] == 1;
  const int rows = static_cast<int>(range_min(kBwdRows, L - q0));
  const int keys = static_cast<int>(range_min(kKeys, S - k0));
  const int ni = sum_rows ? 1 : rows, nj = sum_keys ? 1 : keys;
  float* const base =
      mask_grad + ((size[0] == 1 ? 0 : b) * size[1] + (size[1] == 1 ? 0 : h)) * size[2] * size[3];
  for (int e = static_cast<int>(threadIdx.x); e < ni * nj; e += kBwdThreads) {
    const int i = e / nj, j = e % nj;
    float sum = 0.0f;
    for (int ii = sum_rows ? 0 : i; ii < (sum_rows ? rows : i + 1); ++ii) {
      for (int jj = sum_keys ? 0 : j; jj < (sum_keys ? keys : j + 1); ++jj) {
        sum += ds_s[ii * (kKeys + 1) + jj];
      }
    }
    base[(sum_rows ? 0 : q0 + i) * size[3] + (sum_keys ? 0 : k0 + j)] += sum;
  }
}

// The query pass: dQ of (b, h, 64 query rows), delta of those rows into the workspace, and attn_mask's
// gradient; a block loops over the batches, heads and query tiles whose mask gradients add into the same
// elements (the dims of bp.grad_attn_mask_size that are 1), one after another. The general instantiation
// states 2 blocks an SM for ptxas's register budget: left to itself it aims at 3 (168 registers) and spills
// there on sm_80 and sm_90. kVariant: MmaVariant (cuda/attention_plan.h), as the forward's.
template <typename scalar_t, int kBucket, int kVariant>
__global__ void __launch_bounds__(kBwdThreads, kVariant == kMmaPlain && sizeof(scalar_t) == 2 ? 0 : 2)
    attention_backward_mma_queries(const AttentionBackwardParams bp, const AttentionBackwardPointers ptr,
                                   const AttentionBackwardMmaPlan plan, float* const lse_delta,
                                   const uint32_t* const mask_tiles) {
  constexpr bool kPlain = kVariant == kMmaPlain, kBits = kVariant == kMmaBits;
  using Sh = BwdShape<scalar_t, kBucket>;
  // kKeys: a key tile's rows (mma_backward_tile); kChunk of them at a time.
  constexpr int kLd = Sh::kLd, kOwn = Sh::kOwn, kKeys = Sh::kRows, kTile = Sh::kTile;
  constexpr int kChunk = kMmaBackwardChunk, kN = kChunk / 8;
  // The chunks of a tile unrolled in the plain instantiation; one at a time in the general one, whose
  // per-score code would otherwise be copied per chunk and spill.
  [[maybe_unused]] constexpr int kChunkUnroll = kPlain ? kKeys / kChunk : 1;
  // Q's and dO's fragments held in registers through the key loop (rows_by_rows's kHeld), bucket / 2
  // registers a thread: the plain instantiation (the general one has no registers for them).
  constexpr bool kHoldRows = kPlain && !Sh::kTf32;
  // Rows staged by cp.async alone: the 16-bit plain instantiation (float32's also takes rows that are not
  // 16-byte vectors: plan_attention_backward_mma).
  constexpr bool kVectorRows = kPlain && !Sh::kTf32;
  const AttentionParams& p = bp.fwd;
  ATTNX_DYNAMIC_SHARED(scalar_t, smem);
  scalar_t* const q_s = smem;
  scalar_t* const do_s = smem + kOwn;  // then stage s: K at smem + 2 kOwn + 2 s kTile, V right after
  // attn_mask's gradient (the general instantiation): the tile's dS, after the stages and the lse rows.
  float* const mask_grad = static_cast<float*>(ptr.grad_attn_mask);
  // (after the key pass's lse and delta rows and its votes)
  [[maybe_unused]] float* const ds_s = reinterpret_cast<float*>(smem + 2 * kOwn + 4 * kTile) + 8 * kKeys + 8;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize, g = lane / 4, t = lane % 4;
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.v_head_dim);
  const int64_t L = p.q_len;
  const BwdConsts consts = bwd_consts_of(p);
  const LaneAt at_lane = lane_at<scalar_t>(lane, warp, kLd);
  const int a_at = at_lane.a, b_at = at_lane.b, t_at = at_lane.t;

  // One (b, h, query tile).
  const auto item = [&](int64_t b, int64_t h, int64_t qt) {
    const int64_t Sb = batch_kv_len(p, ptr.fwd.key_lengths, b);
    const int64_t hk = kv_head_of(p, h), bh = b * p.heads + h;
    const int64_t q0 = qt * kBwdRows;
    const int64_t* const qs = p.q_stride;
    const int64_t* const ds = bp.grad_out_stride;
    stage_rows_mma<scalar_t, kBucket, kVectorRows>(
        q_s, first_chunk<kBucket>(rows_of<scalar_t>(ptr.fwd.query, qs, b, h, q0), qs[2]), ptr.fwd.query,
        qs[2], qs[3], L - q0, D, plan.vector);
    stage_rows_mma<scalar_t, kBucket, kVectorRows>(
        do_s, first_chunk<kBucket>(rows_of<scalar_t>(ptr.grad_out, ds, b, h, q0), ds[2]), ptr.grad_out, ds[2],
        ds[3], L - q0, Dv, plan.vector);
    cp_async_commit();

    // The keys the block's rows see, in tiles from k_first, a multiple of kKeys. Key indices from here
    // on are offsets from k_first (32-bit: mma_backward_supports bounds S), as the key pass's queries.
    const int64_t rows = range_min(kBwdRows, L - q0);
    const int64_t k_begin = range_key_begin(q0, L, Sb, p.window_left);
    const int64_t k_end = range_key_end(q0 + rows - 1, L, Sb, p.window_right, p.is_causal);
    const int64_t k_first = k_begin / kKeys * kKeys;
    const int span = k_begin < k_end ? static_cast<int>(k_end - k_first) : 0;
    const auto offset = [&](int64_t k) { return static_cast<int>(k - k_first); };
    // This lane's rows l[r] = q0 + 16 warp + g + 8 r and their intervals: held in the plain
    // instantiation, recomputed a tile in the general one (which has no registers to hold them); the
    // warp's interior keys (seen by all 16 of its rows, all below L).
    const int64_t w0 = q0 + 16 * warp;
    const auto row_keys = [&](int r) {
      const int64_t l = w0 + g + 8 * r;
      return l < L ? TileRange{offset(range_key_begin(l, L, Sb, p.window_left)),
                               offset(range_key_end(l, L, Sb, p.window_right, p.is_causal))}
                   : TileRange{0, 0};
    };
    const TileRange held[2] = {kPlain ? row_keys(0) : TileRange{}, kPlain ? row_keys(1) : TileRange{}};
    const bool warp_in = w0 + 15 < L;
    const int in_lo = warp_in ? offset(range_key_begin(w0 + 15, L, Sb, p.window_left)) : 0;
    const int in_hi = warp_in ? offset(range_key_end(w0, L, Sb, p.window_right, p.is_causal)) : 0;

    // The general instantiation: the first key tile at or after `off` that some row of the block sees
    // (span: none). A key block that the masks' classes leave EMPTY for all the block's row tiles, or
    // that a block map leaves EMPTY for its query blocks, is stepped over whole.
    // The block's first row tile of the classes (warp w's is lt0() + w), computed where used.
    const auto lt0 = [&] { return q0 / kMmaRowsPerWarp; };
    const auto next_tile = [&](int off) {
      if constexpr (!kPlain) {
        while (off < span && (plan.mask_blocks > 0 || p.has_block_map)) {
          const int64_t k = k_first + off;
          if (plan.mask_blocks > 0) {
            const int64_t n = k / kMmaTileKeys;
            uint32_t seen = 0;
            for (int w = 0; w < kWarps; ++w)
              seen |= tile_class(plan.attn_tiles, mask_tiles, b, h, lt0() + w, n);
            seen &= tile_class(plan.padding_tiles, mask_tiles, b, 0, 0, n);
            if ((seen & 1u) == 0) {
              off = static_cast<int>((n + 1) * kMmaTileKeys - k_first);
              continue;
            }
          }
          if (p.has_block_map) {
            const uint32_t bq = static_cast<uint32_t>(p.block_q);
            const uint32_t kb = static_cast<uint32_t>(k) / static_cast<uint32_t>(p.block_k);
            bool seen = false;
            for (uint32_t qb = static_cast<uint32_t>(q0) / bq;
                 qb <= static_cast<uint32_t>(q0 + rows - 1) / bq; ++qb) {
              seen = seen || block_map_entry(p, ptr.fwd, b, h, qb, kb) != kBlockEmpty;
            }
            if (!seen) {
              off = static_cast<int>((int64_t{kb} + 1) * p.block_k - k_first);
              continue;
            }
          }
          break;
        }
      }
      return off;
    };

    // The thread's first chunks of the key tile at k_first + off (stage_rows_mma): the plain instantiation
    // carries them from tile to tile, a constant apart (no multiply in the loop); the general one, whose
    // tiles are not evenly spaced and whose loop has no registers for them, computes them a tile.
    const scalar_t* key =
        first_chunk<kBucket>(rows_of<scalar_t>(ptr.fwd.key, p.k_stride, b, hk, k_first), p.k_stride[2]);
    const scalar_t* value =
        first_chunk<kBucket>(rows_of<scalar_t>(ptr.fwd.value, p.v_stride, b, hk, k_first), p.v_stride[2]);
    const int valid_keys = static_cast<int>(Sb - k_first);
    const auto stage_keys = [&](int stage, int off) {
      scalar_t* const k_s = smem + 2 * kOwn + 2 * stage * kTile;
      const scalar_t* const k_at = kPlain ? key : key + off * p.k_stride[2];
      const scalar_t* const v_at = kPlain ? value : value + off * p.v_stride[2];
      stage_rows_mma<scalar_t, kBucket, kVectorRows, kKeys>(k_s, k_at, ptr.fwd.key, p.k_stride[2], p.k_stride[3],
                                                       valid_keys - off, D, plan.vector);
      stage_rows_mma<scalar_t, kBucket, kVectorRows, kKeys>(k_s + kTile, v_at, ptr.fwd.value, p.v_stride[2],
                                                       p.v_stride[3], valid_keys - off, Dv, plan.vector);
      cp_async_commit();
    };
    int off = next_tile(0);  // the tile at k_first + off (plain: 0)
    if (off < span) stage_keys(0, off);
    if (off < span) {
      cp_async_wait<1>();  // Q and dO, not the first key tile
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // delta of this lane's rows: its quad's columns 2 t + 8 n (+ 1) of dO (staged) times O's, summed over
    // the quad. It and lse2 go to the workspace for the key pass, every row of the tile (past L: a row that
    // sees nothing, P = 0 and delta = 0).
    float lse2[2], row_delta[2];
    const scalar_t* const out = rows_of<scalar_t>(ptr.fwd.out, p.out_stride, b, h, 0);
    const float* const lse =
        static_cast<const float*>(ptr.fwd.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rr = 16 * warp + g + 8 * r;
      const int64_t l = q0 + rr;
      float sum = 0.0f;
      if (l < L) {
        const scalar_t* const o_row = out + l * p.out_stride[2];
        for (int c = 2 * t; c < Dv; c += 8) {
          sum += to_acc(do_s[rr * kLd + c]) * to_acc(o_row[c * p.out_stride[3]]);
          if (c + 1 < Dv) {
            sum += to_acc(do_s[rr * kLd + c + 1]) * to_acc(o_row[(c + 1) * p.out_stride[3]]);
          }
        }
      }
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      row_delta[r] = sum;
      lse2[r] = l < L ? lse[l * p.lse_stride[2]] * kLog2e : INFINITY;
      if (t == 0) {
        float* const at = lse_delta + bh * plan.q_tiles * kBwdRows + l;
        at[0] = lse2[r];
        at[plan.row_words] = sum;
      }
    }

    // The plain instantiation holds the warp's Q and dO fragments in registers for the whole key loop
    // (read once from the staged rows), where its tiles read them from shared memory for every key tile.
    uint32_t q_held[kHoldRows ? Sh::kKSteps : 1][4], do_held[kHoldRows ? Sh::kKSteps : 1][4];
    if constexpr (kHoldRows) {
#pragma unroll
      for (int ks = 0; ks < Sh::kKSteps; ++ks) {
        ldmatrix_x4<false>(q_held[ks], q_s + a_at + 16 * ks);
        ldmatrix_x4<false>(do_held[ks], do_s + a_at + 16 * ks);
      }
    }
    float dq[Sh::kOTiles][4];
#pragma unroll
    for (int n = 0; n < Sh::kOTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dq[n][i] = 0.0f;
    }

    for (int stage = 0; off < span; stage ^= 1) {
      const int off_next = next_tile(off + kKeys);
      if constexpr (kPlain) {  // off_next = off + kKeys
        key += kKeys * p.k_stride[2];
        value += kKeys * p.v_stride[2];
      }
      if (off_next < span) {
        stage_keys(stage ^ 1, off_next);  // the other stage was last read before the previous barrier
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const scalar_t* const k_s = smem + 2 * kOwn + 2 * stage * kTile;
      const scalar_t* const v_s = k_s + kTile;
      const int64_t k0 = k_first + off;
      const bool interior = off >= in_lo && off + kKeys <= in_hi;
      // The masks on the warp's rows of this tile (the general instantiation): none where the classes
      // say FULL (both masks' terms 0); otherwise a packed bool mask's bits a chunk (below), and a float
      // mask's terms per score (`terms`).
      [[maybe_unused]] bool full = true, terms = false;
      if constexpr (!kPlain) {
        if (plan.mask_blocks > 0) {
          const int64_t n = k0 / kMmaTileKeys;
          full = (tile_class(plan.attn_tiles, mask_tiles, b, h, lt0() + warp, n) &
                  tile_class(plan.padding_tiles, mask_tiles, b, 0, 0, n) & 2u) != 0;
          terms = !kBits && !full &&
                  ((p.attn_mask_kind != kMaskNone && plan.attn_tiles.key_words == 0) ||
                   (p.key_padding_mask_kind != kMaskNone && plan.padding_tiles.key_words == 0));
        }
      }
      TileRange range[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const TileRange keys = kPlain ? held[r] : row_keys(r);
        range[r] = tile_range(keys.lo, keys.hi, off);
      }
#pragma unroll kChunkUnroll
      for (int c0 = 0; c0 < kKeys; c0 += kChunk) {
        float s[kN][4], dp[kN][4];
#pragma unroll
        for (int j = 0; j < kN; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[j][i] = dp[j][i] = 0.0f;
        }
        rows_by_rows<scalar_t, kBucket, kN, kHoldRows>(s, q_s, k_s, a_at, b_at + c0 * kLd, q_held);
        rows_by_rows<scalar_t, kBucket, kN, kHoldRows>(dp, do_s, v_s, a_at, b_at + c0 * kLd, do_held);
        // The keys of the chunk the block map removes from this lane's rows: bit c is key k0 + c0 + c,
        // from the class of the warp's rows of the tile (one query block: block_q is a multiple of 16;
        // one key block: block_k is a multiple of the tile; rows past L take the last row's). A chunk
        // with a removed key takes the ranged path, whose scores are tested one by one anyway.
        [[maybe_unused]] uint32_t removed[2] = {0u, 0u};
        bool blocked = false;
        if constexpr (!kPlain) {
          if (p.has_block_map) {
            const uint32_t bk = static_cast<uint32_t>(p.block_k);
            const int32_t block_class =
                block_map_entry(p, ptr.fwd, b, h, block_of_row(p, w0), static_cast<uint32_t>(k0) / bk);
            blocked = block_class != kBlockFull;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              removed[r] = static_cast<uint32_t>(block_row_bits(p, ptr.fwd, block_class,
                                                                row_in_block(p, w0 + g + 8 * r),
                                                                static_cast<uint32_t>(k0) % bk + c0));
            }
          }
          // A packed bool mask's word of the chunk's 32 keys (k0 + c0 is a multiple of 32), on a tile that
          // is not FULL: key_padding_mask's shared by the rows, attn_mask's a row (none past L).
          const bool attn_bits = plan.attn_tiles.key_words != 0,
                     padding_bits = plan.padding_tiles.key_words != 0;
          if (!full && (attn_bits || padding_bits)) {
            const int64_t word = (k0 + c0) / 32;
            const uint32_t pad =
                padding_bits ? *packed_words(plan.padding_tiles, mask_tiles, b, 0, 0, word) : 0u;
            uint32_t any = 0;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int64_t l = w0 + g + 8 * r;
              removed[r] |=
                  pad | (attn_bits && l < L ? *packed_words(plan.attn_tiles, mask_tiles, b, h, l, word) : 0u);
              any |= removed[r];
            }
            blocked = blocked || __any_sync(kFullMask, any != 0);
          }
        }
        // Dropout (the general instantiation): the lane's scores' keep decisions, as the forward's tile draws
        // them (the same fragment layout: bit 2 (r kN + j) + i % 2 of element i of n-tile j; the quad shares
        // each Philox block where S is a multiple of 4, k0 + c0 being one of 32), applied to dP here: dS =
        // P (Z dP - delta) is all this pass takes of Z, and the bits need no register through the scores.
        if constexpr (!kPlain) {
          if (p.dropout) {
            const uint64_t S = static_cast<uint64_t>(p.kv_len);
            const auto row_start = [&](int r) {
              const uint64_t l = static_cast<uint64_t>(w0 + g + 8 * r);
              return (static_cast<uint64_t>(b * p.heads + h) * static_cast<uint64_t>(L) + l) * S +
                     static_cast<uint64_t>(k0 + c0);
            };
            const uint32_t kept = quad_dropout_bits<2, kN>(p, row_start, (S & 3) == 0, t);
#pragma unroll
            for (int j = 0; j < kN; ++j) {
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                dp[j][i] *= (kept >> (2 * ((i / 2) * kN + j) + i % 2)) & 1u ? consts.dropout_scale : 0.0f;
              }
            }
          }
        }
        // s becomes dS y' (element i of n-tile j: row l[i / 2], key k0 + c0 + 8 j + 2 t + i % 2), and dS
        // goes to ds_s where attn_mask's gradient is asked for; `ranged`: each score tested against its
        // row's key range and the removed bits, and the masks' terms read where `terms` (not on interior
        // tiles, which a tile with `terms` never is).
        const auto grads = [&](auto ranged) {
#pragma unroll
          for (int j = 0; j < kN; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int r = i / 2, col = c0 + 8 * j + 2 * t + i % 2;
              bool seen = true;
              if constexpr (decltype(ranged)::value) {
                seen = col >= range[r].lo && col < range[r].hi;
                if constexpr (!kPlain) seen = seen && ((removed[r] >> (col - c0)) & 1u) == 0;
              }
              if constexpr (kPlain) {
                const float prob = fast_exp2(fmaf(s[j][i], consts.c, -lse2[r]));
                s[j][i] = seen ? prob * (dp[j][i] - row_delta[r]) : 0.0f;
              } else {
                const int64_t l = w0 + g + 8 * r, kk = k0 + col;
                float bias = 0.0f;
                if constexpr (decltype(ranged)::value && !kBits) {
                  bias = seen && terms ? mask_bias(p, ptr.fwd, b, h, l, kk) : 0.0f;
                }
                const ScoreGrads sg =  // dp is Z dP already: z = 1
                    general_grads<Sh::kTf32>(s[j][i], dp[j][i], lse2[r], row_delta[r], bias, 1.0f, seen,
                                             consts);
                s[j][i] = sg.ds;
                if (!kBits && mask_grad != nullptr) {  // a float attn_mask's: not the bits instantiation's
                  ds_s[(16 * warp + g + 8 * r) * (kKeys + 1) + col] = sg.ds_bias;
                }
              }
            }
          }
        };
        if (interior && !blocked && !terms) {
          grads(std::false_type{});
        } else {
          grads(std::true_type{});
        }
        accumulate<scalar_t, kBucket, kN>(dq, s, k_s, t_at + c0 * kLd);
      }
      if constexpr (!kPlain && !kBits) {
        if (mask_grad != nullptr) {
          __syncthreads();  // the tile's dS is in ds_s
          add_mask_grad_tile<kKeys>(bp, mask_grad, ds_s, b, h, q0, k0);
        }
      }
      __syncthreads();  // every warp is done with this stage (and ds_s) before it is refilled
      off = off_next;
    }
    write_rows<scalar_t, kBucket>(dq, ptr.grad_query, bp.grad_query_stride, b, h, q0, L, D, consts.scale);
  };
  // This block's batches, heads and query tiles: all of them along a dim the mask's gradient broadcasts
  // along, else the one blockIdx.x names (the plain instantiation: no mask, one item).
  const bool all_b = plan.queries.all_batches, all_h = plan.queries.all_heads,
             all_q = plan.queries.all_query_tiles;
  int64_t b_id, h_id, qt_id;
  plan.queries.block_item(blockIdx.x, p.heads, &b_id, &h_id, &qt_id);
  if constexpr (kPlain) {
    item(b_id, h_id, qt_id);
  } else {
    // One index over the items (b fastest varying last), so that the loop holds two numbers.
    const int64_t items = (all_b ? p.batch : 1) * (all_h ? p.heads : 1) * (all_q ? plan.q_tiles : 1);
    for (int64_t i = 0; i < items; ++i) {
      int64_t rest = i;
      const int64_t qt = all_q ? rest % plan.q_tiles : qt_id;
      rest = all_q ? rest / plan.q_tiles : rest;
      const int64_t h = all_h ? rest % p.heads : h_id;
      const int64_t b = all_b ? (all_h ? rest / p.heads : rest) : b_id;
      __syncthreads();  // the previous item is done with every shared region
      item(b, h, qt);
    }
  }
}

// The key pass: dK and dV of one (b, kv head, 64 keys), over the group's query heads. The general
// instantiation states 2 blocks an SM for ptxas's register budget, as the query pass.
template <typename scalar_t, int kBucket, int kVariant>
__global__ void __launch_bounds__(kBwdThreads, kVariant == kMmaPlain && sizeof(scalar_t) == 2 ? 0 : 2)
    attention_backward_mma_keys(const AttentionBackwardParams bp, const AttentionBackwardPointers ptr,
                                const AttentionBackwardMmaPlan plan, const float* const lse_delta,
                                const uint32_t* const mask_tiles) {
  constexpr bool kPlain = kVariant == kMmaPlain, kBits = kVariant == kMmaBits;
  using Sh = BwdShape<scalar_t, kBucket>;
  constexpr bool kVectorRows = kPlain && !Sh::kTf32;  // as the query pass's
  // kQueries: a query tile's rows (mma_backward_tile).
  constexpr int kLd = Sh::kLd, kOwn = Sh::kOwn, kQueries = Sh::kRows, kTile = Sh::kTile;
  // Queries a chunk: kMmaBackwardChunk, and 16 in the general instantiation and at bucket 128, where dK and
  // dV (16 x bucket floats each) with the per-score mask and dropout code, or at 128 alone, leave no room
  // for 32 queries' S and dP.
  constexpr int kChunk = kPlain ? kMmaBackwardChunk : 16, kN = kChunk / 8;
  // The chunks of a tile unrolled in the plain instantiation up to bucket 64; one at a time in the general
  // one, whose per-score code would otherwise be copied per chunk and spill, and at bucket 128, where dK and
  // dV take 128 registers and unrolled chunks spill a register (sm_80 or sm_90, as the loop's control
  // changes).
  [[maybe_unused]] constexpr int kChunkUnroll = kPlain ? kQueries / kChunk : 1;
  const AttentionParams& p = bp.fwd;
  ATTNX_DYNAMIC_SHARED(scalar_t, smem);
  scalar_t* const k_s = smem;
  scalar_t* const v_s = smem + kOwn;  // then stage s: Q at smem + 2 kOwn + 2 s kTile, dO right after
  // stage s: lse2 and delta of the tile's queries, kQueries each
  float* const rows_s = reinterpret_cast<float*>(smem + 2 * kOwn + 4 * kTile);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize, g = lane / 4, t = lane % 4;
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.v_head_dim);
  const int64_t L = p.q_len;
  const int64_t kt = static_cast<int64_t>(blockIdx.x) % plan.k_tiles;
  const int64_t bhk = static_cast<int64_t>(blockIdx.x) / plan.k_tiles;
  const int hk = static_cast<int>(bhk % p.kv_heads), b = static_cast<int>(bhk / p.kv_heads);
  const int64_t k0 = kt * kBwdRows;
  const int64_t Sb = batch_kv_len(p, ptr.fwd.key_lengths, b);
  const BwdConsts consts = bwd_consts_of(p);

  // K and V rows at and past S_b are zero: never read (a static cache's unfilled slots may hold NaN).
  stage_rows_mma<scalar_t, kBucket, kVectorRows>(
      k_s, first_chunk<kBucket>(rows_of<scalar_t>(ptr.fwd.key, p.k_stride, b, hk, k0), p.k_stride[2]),
      ptr.fwd.key, p.k_stride[2], p.k_stride[3], Sb - k0, D, plan.vector);
  stage_rows_mma<scalar_t, kBucket, kVectorRows>(
      v_s, first_chunk<kBucket>(rows_of<scalar_t>(ptr.fwd.value, p.v_stride, b, hk, k0), p.v_stride[2]),
      ptr.fwd.value, p.v_stride[2], p.v_stride[3], Sb - k0, Dv, plan.vector);

  // The block's queries, in tiles from q_first, a multiple of kQueries. Query indices from here on are
  // offsets from q_first (32-bit, as mma_backward_supports bounds L: the loop holds fewer registers, and its
  // per-tile tests are 32-bit compares).
  const int64_t last = range_min(k0 + kBwdRows, Sb) - 1;
  const int64_t q_begin = k0 <= last ? range_query_begin(k0, L, Sb, p.window_right, p.is_causal) : L;
  const int64_t q_end = k0 <= last ? range_query_end(last, L, Sb, p.window_left) : 0;
  const int64_t q_first = q_begin / kQueries * kQueries;
  const int nq = q_begin < q_end ? static_cast<int>((q_end - 1 - q_first) / kQueries) + 1 : 0;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const auto offset = [&](int64_t l) { return static_cast<int>(l - q_first); };
  // This lane's keys s[r] = k0 + 16 warp + g + 8 r and the queries that see them; the warp's interior
  // queries (that see all 16 of its keys).
  const int64_t w0 = k0 + 16 * warp;
  int query_lo[2], query_hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t s = w0 + g + 8 * r;
    query_lo[r] = offset(range_query_begin(s, L, Sb, p.window_right, p.is_causal));
    query_hi[r] = offset(range_query_end(s, L, Sb, p.window_left));
  }
  const int in_lo = offset(range_query_begin(w0 + 15, L, Sb, p.window_right, p.is_causal));
  int in_hi = offset(range_query_end(w0, L, Sb, p.window_left));

  // The steps: the group's query heads h (hk group <= h < h_end), for each the query tiles at offsets 0,
  // kQueries, .. < `span` from q_first (a step's head and offset are carried from the previous step's: no
  // division). Q, dO, lse2 and delta of (head h, offset off) into stage s. Heads, b and hk are below 2^31
  // (as the grid's blocks): 32-bit, a register each through the loop.
  const int span = kQueries * nq;
  // A block map (the general instantiation): the block's keys lie in one key block (block_kb); a step none
  // of whose query blocks sees it is stepped over (advance, below), and a staged tile's rows carry the bits
  // of the block's 64 keys (bits_s, two words a row and stage, after the votes), so that a score's test is
  // one shared-memory word. Its numbers are computed where used: the loop holds no register for them. A
  // packed bool attn_mask's bits of the rows at the block's keys (key tile kt of the masks' classes) are
  // OR-ed into the same words. The loop finds kt from w0 (key_tile), which it holds anyway.
  [[maybe_unused]] const auto key_tile = [&] {
    return static_cast<int64_t>(static_cast<uint64_t>(w0) / kMmaTileKeys);
  };
  const auto block_kb = [&] { return static_cast<uint32_t>(w0) / static_cast<uint32_t>(p.block_k); };
  [[maybe_unused]] uint32_t* const bits_s = reinterpret_cast<uint32_t*>(rows_s + 4 * kQueries) + 4;
  // A float attn_mask's classes of a staged tile's row tiles at the block's keys (key tile kt), a word a
  // stage after bits_s: bit i set where row tile i is FULL. Staged rather than read a chunk from the
  // classes, whose address took registers that bucket 128 does not have.
  [[maybe_unused]] uint32_t* const classes_s = bits_s + 4 * kQueries;
  // A step: head h, the query tile at q_first + off, and the thread's first chunks of its rows in global
  // memory (of Q and dO, as stage_rows_mma copies them; `nums`: of the tile's lse2 and delta, below). The
  // plain instantiation carries them from step to step by constant increments (no multiply in the loop),
  // with Q's and dO's of the head's first tile for the step to the next head; the general one, whose steps
  // are not evenly spaced and whose loop has no registers for them, computes them a step.
  struct Step {
    int h, off;
    const scalar_t *q, *dout, *q_head, *dout_head;
    const float* nums;
  };
  const int64_t* const qs = p.q_stride;
  const int64_t* const ds = bp.grad_out_stride;
  const int64_t row_tiles = plan.q_tiles * kBwdRows;  // the workspace's rows of one (b, h)
  // lse2 and delta of a tile's rows (the query pass wrote them for whole tiles): a 16-byte chunk a thread of
  // the first kQueries / 2, lse2's for the first half of them, delta's (plan.row_words further) for the rest.
  constexpr int kNumChunks = kQueries / 4;
  const int h0 = hk * group;
  const scalar_t* const q_at =
      first_chunk<kBucket>(rows_of<scalar_t>(ptr.fwd.query, qs, b, h0, q_first), qs[2]);
  const scalar_t* const do_at =
      first_chunk<kBucket>(rows_of<scalar_t>(ptr.grad_out, ds, b, h0, q_first), ds[2]);
  const float* const nums_at = lse_delta + (int64_t{b} * p.heads + h0) * row_tiles + q_first +
                               (tid / kNumChunks != 0 ? plan.row_words : 0) + 4 * (tid % kNumChunks);
  const int back = span - kQueries;  // from a head's last tile to its first
  const auto next_step = [&](Step& st) {
    if (st.off + kQueries >= span) {
      ++st.h;
      st.off = 0;
      st.q = st.q_head += qs[1];
      st.dout = st.dout_head += ds[1];
      st.nums += row_tiles - back;
    } else {
      st.off += kQueries;
      st.q += kQueries * qs[2];
      st.dout += kQueries * ds[2];
      st.nums += kQueries;
    }
  };
  const int valid_rows = static_cast<int>(L - q_first);
  const auto stage_queries = [&](int stage, const Step& st) {
    const int h = st.h, off = st.off;
    const int64_t q0 = q_first + off;
    scalar_t* const q_s = smem + 2 * kOwn + 2 * stage * kTile;
    const int64_t dh = h - h0;
    stage_rows_mma<scalar_t, kBucket, kVectorRows, kQueries>(q_s, kPlain ? st.q : q_at + dh * qs[1] + off * qs[2],
                                                        ptr.fwd.query, qs[2], qs[3], valid_rows - off, D,
                                                        plan.vector);
    stage_rows_mma<scalar_t, kBucket, kVectorRows, kQueries>(
        q_s + kTile, kPlain ? st.dout : do_at + dh * ds[1] + off * ds[2], ptr.grad_out, ds[2], ds[3],
        valid_rows - off, Dv, plan.vector);
    if (tid < 2 * kNumChunks) {
      cp_async_16(rows_s + 2 * kQueries * stage + (tid / kNumChunks) * kQueries + 4 * (tid % kNumChunks),
                  kPlain ? st.nums : nums_at + dh * row_tiles + off, true);
    }
    cp_async_commit();
    if constexpr (!kPlain) {
      if (tid < kQueries) {
        const int64_t l = q0 + tid;
        const bool attn_bits = plan.attn_tiles.key_words != 0;
        if (p.has_block_map || attn_bits) {  // the 64 keys' bits of the row (set: removed)
          uint64_t bits = 0;
          if (p.has_block_map) {  // block_kb's block; past L: the last row's
            const int32_t block_class = block_map_entry(p, ptr.fwd, b, h, block_of_row(p, l), block_kb());
            const uint32_t key =  // the block's first key in its key block
                static_cast<uint32_t>(w0) % static_cast<uint32_t>(p.block_k) / kBwdRows * kBwdRows;
            bits = block_row_bits(p, ptr.fwd, block_class, row_in_block(p, l), key);
          }
          if (attn_bits && l < L) {  // words 2 kt, 2 kt + 1 of the row (past L: no query, none)
            const uint32_t* const at = packed_words(plan.attn_tiles, mask_tiles, b, h, l, 2 * key_tile());
            bits |= uint64_t{at[1]} << 32 | at[0];
          }
          bits_s[2 * (kQueries * stage + tid)] = static_cast<uint32_t>(bits);
          bits_s[2 * (kQueries * stage + tid) + 1] = static_cast<uint32_t>(bits >> 32);
        }
      }
    }
    if constexpr (!kPlain && !kBits) {
      if (p.attn_mask_kind != kMaskNone && plan.attn_tiles.key_words == 0 && warp == 0) {
        const bool kept =
            lane < kQueries / kMmaRowsPerWarp &&
            (tile_class(plan.attn_tiles, mask_tiles, b, h, q0 / kMmaRowsPerWarp + lane, key_tile()) & 2u) !=
                0;
        const unsigned word = __ballot_sync(kFullMask, kept);
        if (lane == 0) classes_s[stage] = word;
      }
    }
  };
  // The general instantiation: key_padding_mask's terms of this lane's two keys, the same for every query
  // and head, read once; where it removes all 64 keys of the block (a padded tile, EMPTY), no query sees
  // them and the loop is skipped: dK and dV are 0. The warps' votes meet in shared memory (a slot each).
  // Where attn_mask is absent or bool (its terms 0 or -inf), a key the padding removes (-inf) sees no query:
  // its range is made empty, and the warp's tiles are then not interior. Bit 1 of the warp's vote: some key
  // of the warp has a term to add (not 0, nor removed so), read from `padding` on a chunk that reads the
  // masks (kept in shared memory rather than a register through the loop: bucket 128 has none to spare).
  [[maybe_unused]] float padding[2] = {0.0f, 0.0f};
  int* const votes = reinterpret_cast<int*>(rows_s + 4 * kQueries);
  bool skip = nq == 0;
  if constexpr (!kPlain) {
    if (p.key_padding_mask_kind != kMaskNone) {
      const bool fold = p.attn_mask_kind == kMaskNone || p.attn_mask_kind == kMaskBool;
      bool removed = true, folded = false, terms = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t s = w0 + g + 8 * r;
        padding[r] = s < p.kv_len ? padding_term(p, ptr.fwd, b, s) : -INFINITY;
        removed = removed && padding[r] == -INFINITY;
        if (fold && padding[r] == -INFINITY) {
          query_lo[r] = query_hi[r] = 0;
          folded = true;
        } else {
          terms = terms || padding[r] != 0.0f;
        }
      }
      if (__any_sync(kFullMask, folded)) in_hi = 0;  // no tile is interior (off + kQueries > 0)
      const int all = __all_sync(kFullMask, removed), adds = __any_sync(kFullMask, terms);
      if (lane == 0) votes[warp] = all | adds << 1;
      __syncthreads();
      skip = skip || (votes[0] & votes[1] & votes[2] & votes[3] & 1) != 0;
    }
  }
  const int h_end = hk * group + group;
  // A step none of whose rows sees the block's keys (the general instantiation) is stepped over: attn_mask's
  // classes EMPTY for each of its row tiles at key tile kt, or a block map's EMPTY for its query blocks.
  const auto advance = [&](Step& st) {
    if constexpr (!kPlain) {
      const bool classed = plan.attn_tiles.kind != kMaskNone;
      while (st.h < h_end && (classed || p.has_block_map)) {
        const int h = st.h;
        const int64_t l0 = q_first + st.off;
        bool seen = true;
        if (classed) {
          uint32_t any = 0;
          for (int i = 0; i < kQueries / kMmaRowsPerWarp; ++i) {
            any |= tile_class(plan.attn_tiles, mask_tiles, b, h, l0 / kMmaRowsPerWarp + i, key_tile());
          }
          seen = (any & 1u) != 0;
        }
        if (seen && p.has_block_map) {
          const uint32_t kb = block_kb(), qb_hi = block_of_row(p, l0 + kQueries - 1);
          seen = false;
          for (uint32_t qb = block_of_row(p, l0); qb <= qb_hi; ++qb) {
            seen = seen || block_map_entry(p, ptr.fwd, b, h, qb, kb) != kBlockEmpty;
          }
        }
        if (seen) break;
        next_step(st);
      }
    }
  };
  // The step being computed (h = h_end: none left).
  Step step = {skip ? h_end : h0, 0, q_at, do_at, q_at, do_at, nums_at};
  advance(step);
  if (step.h < h_end) {
    stage_queries(0, step);  // K and V's copies are in this group
  } else {
    cp_async_commit();
  }

  float dk[Sh::kOTiles][4], dv[Sh::kOTiles][4];
#pragma unroll
  for (int n = 0; n < Sh::kOTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.0f;
  }
  const LaneAt at_lane = lane_at<scalar_t>(lane, warp, kLd);
  const int a_at = at_lane.a, b_at = at_lane.b, t_at = at_lane.t;

  for (int stage = 0; step.h < h_end; stage ^= 1) {
    const int h = step.h, off = step.off;
    Step next = step;
    next_step(next);
    advance(next);
    if (next.h < h_end) {
      stage_queries(stage ^ 1, next);  // the other stage was last read before the last barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int64_t q0 = q_first + off;
    const scalar_t* const q_s = smem + 2 * kOwn + 2 * stage * kTile;
    const scalar_t* const do_s = q_s + kTile;
    const float* const lse2_s = rows_s + 2 * kQueries * stage;
    const float* const delta_s = lse2_s + kQueries;
    const bool interior = off >= in_lo && off + kQueries <= in_hi;
    const TileRange range[2] = {tile_range(query_lo[0], query_hi[0], off),
                                tile_range(query_lo[1], query_hi[1], off)};
#pragma unroll kChunkUnroll
    for (int c0 = 0; c0 < kQueries; c0 += kChunk) {
      float s[kN][4], dp[kN][4];
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
      }
      rows_by_rows<scalar_t, kBucket, kN>(s, k_s, q_s, a_at, b_at + c0 * kLd);
      rows_by_rows<scalar_t, kBucket, kN>(dp, v_s, do_s, a_at, b_at + c0 * kLd);
      // The block map's bits of this lane's queries (n-tile j, query q0 + c0 + 8 j + 2 t + i), from the
      // staged word that holds the warp's 16 keys, shifted so that bit 8 r removes the lane's key r.
      // A chunk with a removed key takes the ranged path, whose scores are tested one by one anyway.
      [[maybe_unused]] uint32_t removed[kN][2] = {};
      bool blocked = false;
      // `terms`: the chunk reads the masks' terms per score: a float attn_mask on a row tile its classes do
      // not keep whole at the block's keys, or key_padding_mask's terms to add (its vote's bit 1).
      [[maybe_unused]] bool terms = false;
      if constexpr (!kPlain) {
        terms = !kBits && p.key_padding_mask_kind != kMaskNone && (votes[warp] & 2) != 0;
        if (!kBits && p.attn_mask_kind != kMaskNone && plan.attn_tiles.key_words == 0) {
          terms = terms || ((classes_s[stage] >> (c0 / kMmaRowsPerWarp)) & 1u) == 0;
        }
        if (p.has_block_map || plan.attn_tiles.key_words != 0) {
          const int shift = 16 * (warp % 2) + g;
          uint32_t any = 0;
#pragma unroll
          for (int j = 0; j < kN; ++j) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              removed[j][i] = bits_s[2 * (kQueries * stage + c0 + 8 * j + 2 * t + i) + warp / 2] >> shift;
              any |= removed[j][i] & 0x101u;
            }
          }
          blocked = __any_sync(kFullMask, any != 0);
        }
      }
      // Dropout's keep decisions of the lane's scores of the chunk (the general instantiation): bit
      // 2 (r kN + j) + e % 2 of element e of n-tile j.
      [[maybe_unused]] uint32_t kept = 0;
      if constexpr (!kPlain) {
        if (p.dropout) kept = key_dropout_bits<kN>(p, b * p.heads + h, w0, q0 + c0, lane);
      }
      // s becomes Z P and dp dS y' (element e of n-tile j: key s[e / 2], query q0 + c0 + 8 j + 2 t + e % 2);
      // `ranged`: each score tested against its key's query range and the removed bits, and the masks' terms
      // read where `terms` (not on interior tiles, which a chunk with `terms` never is).
      const auto grads = [&](auto ranged) {
#pragma unroll
        for (int j = 0; j < kN; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, col = c0 + 8 * j + 2 * t + e % 2;
            const float lse2 = lse2_s[col], row_delta = delta_s[col];
            bool seen = true;
            if constexpr (decltype(ranged)::value) {
              seen = col >= range[r].lo && col < range[r].hi;
              if constexpr (!kPlain) seen = seen && ((removed[j][e % 2] >> (8 * r)) & 1u) == 0;
            }
            if constexpr (kPlain) {
              const float prob = fast_exp2(fmaf(s[j][e], consts.c, -lse2));
              s[j][e] = seen ? prob : 0.0f;
              dp[j][e] = seen ? prob * (dp[j][e] - row_delta) : 0.0f;
            } else {
              const int64_t l = q0 + col, key = w0 + g + 8 * r;
              float bias = 0.0f;
              if constexpr (decltype(ranged)::value && !kBits) {
                bias = seen && terms ? mask_bias(p, ptr.fwd, b, h, l, key, &padding[r]) : 0.0f;
              }
              const float z = !p.dropout || !seen                         ? 1.0f
                              : (kept >> (2 * (r * kN + j) + e % 2)) & 1u ? consts.dropout_scale
                                                                          : 0.0f;
              const ScoreGrads sg =
                  general_grads<Sh::kTf32>(s[j][e], dp[j][e], lse2, row_delta, bias, z, seen, consts);
              s[j][e] = sg.pz;
              dp[j][e] = sg.ds;
            }
          }
        }
      };
      if (interior && !blocked && !terms) {
        grads(std::false_type{});
      } else {
        grads(std::true_type{});
      }
      accumulate<scalar_t, kBucket, kN>(dv, s, do_s, t_at + c0 * kLd);
      accumulate<scalar_t, kBucket, kN>(dk, dp, q_s, t_at + c0 * kLd);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    step = next;
  }
  cp_async_wait<0>();  // no copy in flight at exit (K and V's, when no query sees the keys)
  // The block's first key and its kv head again, from its index read anew: kept from before the loop, they
  // took registers the loop needs (ptxas spilled them at bucket 128).
  const uint64_t index = block_index(), k_tiles = static_cast<uint64_t>(plan.k_tiles);
  const int64_t k_out = static_cast<int64_t>(index % k_tiles) * kBwdRows;
  const int64_t hk_out = static_cast<int64_t>(index / k_tiles % static_cast<uint64_t>(p.kv_heads));
  write_rows<scalar_t, kBucket>(dk, ptr.grad_key, bp.grad_key_stride, b, hk_out, k_out, p.kv_len, D,
                                consts.scale);
  write_rows<scalar_t, kBucket>(dv, ptr.grad_value, bp.grad_value_stride, b, hk_out, k_out, p.kv_len, Dv,
                                1.0f);
}

#endif  // ATTNX_CUDA_DEVICE_CODE

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
template <typename scalar_t, int kBucket, int kVariant>
cudaError_t launch_passes(const AttentionBackwardParams& bp, const AttentionBackwardPointers& ptr,
                          const AttentionBackwardMmaPlan& plan, float* lse_delta, const uint32_t* mask_tiles,
                          cudaStream_t stream) {
  // The query pass first: the key pass reads the rows' numbers it writes.
  if (plan.queries.blocks > 0) {
    const cudaError_t err = launch_plan(
        ATTNX_KERNEL(attention_backward_mma_queries, scalar_t, kBucket, kVariant), plan.queries.blocks,
        plan.threads, plan.smem_bytes, stream, bp, ptr, plan, lse_delta, mask_tiles);
    if (err != cudaSuccess) return err;
  }
  if (plan.key_blocks > 0) {
    return launch_plan(ATTNX_KERNEL(attention_backward_mma_keys, scalar_t, kBucket, kVariant),
                       plan.key_blocks, plan.threads, plan.smem_bytes, stream, bp, ptr, plan,
                       static_cast<const float*>(lse_delta), mask_tiles);
  }
  return cudaSuccess;
}
#endif

}  // namespace

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
cudaError_t launch_attention_backward_mma(const AttentionBackwardParams& bp, DType dtype,
                                          const AttentionBackwardPointers& ptr,
                                          const AttentionBackwardMmaPlan& plan, void* workspace,
                                          cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  if (!params_consistent(p, ptr.fwd) || !mma_block_map_fits(p)) return cudaErrorInvalidValue;
  if (plan.bucket == 0) return cudaErrorInvalidValue;
  if (plan.queries.blocks > kMaxBlocks || plan.key_blocks > kMaxBlocks || plan.mask_blocks > kMaxBlocks) {
    return cudaErrorInvalidConfiguration;
  }
  if (plan.workspace_bytes > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  float* const lse_delta = static_cast<float*>(workspace);
  uint32_t* const mask_tiles = static_cast<uint32_t*>(workspace);  // the classes' words follow the rows'
  if (plan.mask_blocks > 0) {
    const cudaError_t err = launch_mask_tiles(p, ptr.fwd, plan.attn_tiles, plan.padding_tiles,
                                              plan.mask_blocks, mask_tiles, stream);
    if (err != cudaSuccess) return err;
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    if constexpr (sizeof(scalar_t) == 8) {
      return cudaErrorInvalidValue;  // no float64 (mma_backward_supports refuses it)
    } else {
      return dispatch_bucket<32, 64, 128>(plan.bucket, [&](auto bucket) {
        constexpr int kBucket = decltype(bucket)::value;
        if constexpr (sizeof(scalar_t) == 4) {  // the plain instantiation up to kMmaBackwardMaxHeadDimTf32
          if constexpr (kBucket <= kMmaBackwardMaxHeadDimTf32) {
            if (plan.variant == kMmaPlain) {
              return launch_passes<scalar_t, kBucket, kMmaPlain>(bp, ptr, plan, lse_delta, mask_tiles, stream);
            }
          }
          return cudaErrorInvalidValue;  // mma_backward_supports refuses the others
        } else {
          return plan.variant == kMmaPlain
                     ? launch_passes<scalar_t, kBucket, kMmaPlain>(bp, ptr, plan, lse_delta, mask_tiles, stream)
                 : plan.variant == kMmaBits
                     ? launch_passes<scalar_t, kBucket, kMmaBits>(bp, ptr, plan, lse_delta, mask_tiles, stream)
                     : launch_passes<scalar_t, kBucket, kMmaGeneral>(bp, ptr, plan, lse_delta, mask_tiles,
                                                                     stream);
        }
      });
    }
  });
}
#endif

}  // namespace attnx::cuda
