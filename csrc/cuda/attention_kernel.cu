// attnx: attnx::attention's CUDA SIMT forward kernel, for float32, float64, float16 and bfloat16.
//
// Torch-free (raw pointers, AttentionParams, cudaStream_t): the glue is cuda/attention.cpp. The same source
// is compiled for the CPU by tests/emulation/ and run there against the float64 reference.
//
// One block per (b, h, block of rows_per_block query rows); grid, block and shared-memory layout come from
// plan_attention() (attention_plan.h). Each warp owns R = rows_per_warp consecutive query rows. For each tile
// of 32 keys the block stages K and V in shared memory in the accumulator type; lane j scores key j against
// the warp's R rows (queries read from shared memory as broadcasts), adds the masks read in place through
// their strides, and the warp's max and sum (shuffles) drive the online softmax of softmax.h. Lane i
// accumulates the output columns it owns (bucket / 32 of them, in vectors of up to 16 bytes) for the R rows,
// in float (double for float64), from the probabilities each warp passes through shared memory. out and lse
// are written once per row at the end.
//
// Which keys a row sees at all (attnx/key_range.h: is_causal, the bottom-right window, per-batch key lengths)
// is one interval of keys per row whose ends grow with the row, so the block's rows together see one interval
// [kv_begin, kv_end): the tile loop runs over it only (its cost grows with the window, not with S), and each
// row compares its key against its own interval. Key tiles that key_padding_mask removes entirely are skipped
// too (every warp reads the same 32 mask elements, so the decision is the block's). Masks change nothing
// else: a masked score is -inf and contributes exp(-inf) = 0. A key outside a row's interval is not seen at
// all, whatever its score (NaN included).
//
// Grouped KV heads: query head h reads kv head h / (H / Hkv) in place. Soft-capping (cap * tanh(x / cap) of
// the scaled score x, before the masks) is one more step per score. Sinks join the denominator at the end
// (softmax_finish in common.cuh).
//
// Dropout: after the warp's row sum (the softmax normalises by the undropped mass), lane j drops its key's
// probability by the element's Philox draw (attnx/philox.h, one block per element: the draws are a pure
// function of (seed, offset, b, h, l, s), so they match the CPU kernels and the reference bit for bit).
//
// Head dims up to kMaxHeadDim; the glue falls back to a chunked composition of ATen ops above that.
#include "attnx/philox.h"
#include "cuda/attention_kernel.h"
#include "cuda/common.cuh"

namespace attnx::cuda {
namespace {
#if ATTNX_CUDA_DEVICE_CODE  // the kernels (cuda/common.cuh); the launchers follow

// Blocks per SM the launch bounds ask ptxas for (0: none). Left to itself, ptxas keeps the float64 kernels
// under 128 registers on some arches and spills there (sm_80: 8 and 12 bytes at head dims 32 and 256); 3
// blocks allow 168 registers, and shared memory already holds a float64 block to at most 3 per SM at head
// dims >= 64 (4 on sm_90 at 64), so only head dim 32 on sm_80 loses a block (4 -> 3). The other dtypes fit
// in ptxas's own choice (80-140 registers) without spilling.
template <typename acc_t>
constexpr int simt_min_blocks() {
  return sizeof(acc_t) == 8 ? 3 : 0;
}

template <typename scalar_t, int kBucket, int R>
__global__ void __launch_bounds__(kWarps* kWarpSize, simt_min_blocks<typename AccType<scalar_t>::type>())
    attention_forward_simt(const AttentionParams p, const AttentionPointers ptr, const AttentionPlan plan) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr int kVec = 16 / static_cast<int>(sizeof(acc_t));  // accumulator elements per 16-byte vector
  constexpr int kCols = kBucket / kWarpSize;                  // output columns per lane
  constexpr int kOutVec = kCols < kVec ? kCols : kVec;        // a lane's columns come in groups of kOutVec
  constexpr int kGroups = kCols / kOutVec;                    // ... spaced 32 * kOutVec apart
  using Vec = Pack<acc_t, kVec>;
  using OutVec = Pack<acc_t, kOutVec>;
  constexpr acc_t kNegInf = -acc_t(INFINITY);

  ATTNX_DYNAMIC_SHARED(acc_t, smem);
  // Zero past D, Dv and the last key (the partial last tile), so padded lanes and columns add exact zeros.
  acc_t* const q_s = smem + plan.q_off;  // (rows_per_block, ldq) the block's queries
  acc_t* const k_s = smem + plan.k_off;  // (kTileKeys, ldk) the key tile
  acc_t* const v_s = smem + plan.v_off;  // (kTileKeys, ldv) the value tile
  acc_t* const p_s = smem + plan.p_off;  // (rows_per_block, kTileKeys) probabilities, one row per query row

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.v_head_dim);
  const int64_t L = p.q_len, S = p.kv_len;
  const int ldq = plan.ldq, ldk = plan.ldk, ldv = plan.ldv;

  const BlockProblem<scalar_t> block =
      block_problem<scalar_t>(p, ptr, plan.q_blocks, plan.bh, plan.rows_per_block);
  const int64_t b = block.b, h = block.h, q0 = block.q0, rows_in_block = block.rows, Sb = block.kv_len;
  const scalar_t* const q = block.q;
  const scalar_t* const k = block.k;
  const scalar_t* const v = block.v;
  const int64_t am_base = block.attn_mask_base, kpm_base = block.key_padding_mask_base;
  const acc_t scale = split_value<acc_t>(p.scale, p.scale_lo);
  const acc_t dropout_scale = split_value<acc_t>(p.dropout_scale, p.dropout_scale_lo);
  const SoftCap<acc_t> cap = soft_cap_of<acc_t>(p);
  const uint64_t dropout_row0 =
      static_cast<uint64_t>(b * p.heads + h) * static_cast<uint64_t>(L);  // row of query 0

  // The block's queries, one row per warp at a time, lanes along D (coalesced when the last stride is 1).
  for (int r = warp; r < plan.rows_per_block; r += kWarps) {
    const bool valid = r < rows_in_block;
    const scalar_t* src = q + (q0 + r) * p.q_stride[2];
    for (int d = lane; d < ldq; d += kWarpSize) {
      q_s[r * ldq + d] = valid && d < D ? to_acc(src[d * p.q_stride[3]]) : acc_t(0);
    }
  }

  // This warp's rows: row r is query l0 + r and sees keys [key_lo[r], key_hi[r]); rows past L (in the last
  // block) take part in every collective but read and write nothing (an empty interval). The row index is
  // recomputed from l0 where it is needed rather than kept per row: R more 64-bit values held across the tile
  // loop made ptxas spill at head dims 64 and 128 on sm_90.
  const int64_t l0 = q0 + warp * R;
  int64_t key_lo[R], key_hi[R];
  SoftmaxRow<acc_t> state[R];
  acc_t o[R][kCols];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool active = warp * R + r < rows_in_block;
    key_lo[r] = active ? range_key_begin(l0 + r, L, Sb, p.window_left) : 0;
    key_hi[r] = active ? range_key_end(l0 + r, L, Sb, p.window_right, p.is_causal) : 0;
    state[r] = softmax_row_init<acc_t>();
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[r][c] = acc_t(0);
  }

  // The keys any row of the block sees: from its first row's first key to its last row's end.
  const int64_t kv_begin = range_key_begin(q0, L, Sb, p.window_left);
  const int64_t kv_end = range_key_end(q0 + rows_in_block - 1, L, Sb, p.window_right, p.is_causal);
  for (int64_t k0 = kv_begin; k0 < kv_end; k0 += kTileKeys) {
    const int nk = kv_end - k0 < kTileKeys ? static_cast<int>(kv_end - k0) : kTileKeys;
    const int64_t key = k0 + lane;  // this lane's key

    // key_padding_mask is the same for every row of the block: read once per tile. Every warp reads the same
    // elements, so a tile it removes entirely is skipped by the whole block (before any __syncthreads).
    acc_t padding = acc_t(0);
    if (p.key_padding_mask_kind != kMaskNone) {
      padding = lane < nk ? mask_value<acc_t>(p.key_padding_mask_kind, ptr.key_padding_mask,
                                              kpm_base + key * p.key_padding_mask_stride[1])
                          : kNegInf;
      if (__all_sync(kFullMask, padding == kNegInf)) continue;
    }

    __syncthreads();  // every warp is done with the previous tile's k_s, v_s and p_s (and q_s is written)
    for (int j = warp; j < kTileKeys; j += kWarps) {
      const bool valid = j < nk;
      const scalar_t* ksrc = k + (k0 + j) * p.k_stride[2];
      const scalar_t* vsrc = v + (k0 + j) * p.v_stride[2];
      for (int d = lane; d < ldk; d += kWarpSize) {
        k_s[j * ldk + d] = valid && d < D ? to_acc(ksrc[d * p.k_stride[3]]) : acc_t(0);
      }
      // Zeros past the last key matter: their probabilities are 0, and 0 * (stale NaN) would not be.
      for (int c = lane; c < ldv; c += kWarpSize) {
        v_s[j * ldv + c] = valid && c < Dv ? to_acc(vsrc[c * p.v_stride[3]]) : acc_t(0);
      }
    }
    __syncthreads();

    // Scores of key `key` against the warp's R rows: one pass over D, each key vector serving R rows.
    acc_t dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) dot[r] = acc_t(0);
    {
      const Vec* krow = reinterpret_cast<const Vec*>(k_s + lane * ldk);
      const Vec* qrow = reinterpret_cast<const Vec*>(q_s + warp * R * ldq);
      const int nvec = ldq / kVec;  // k rows are at least as long (ldk >= ldq)
      for (int i = 0; i < nvec; ++i) {
        const Vec kv = krow[i];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const Vec qv = qrow[r * nvec + i];
#pragma unroll
          for (int e = 0; e < kVec; ++e) dot[r] += qv.v[e] * kv.v[e];
        }
      }
    }

    // Online softmax, row by row (each row is one warp-uniform branch).
    bool any = false;  // some row of the warp has a finite probability mass in this tile
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc_t pr = acc_t(0);
      // A row reads this tile when its key interval meets the tile (never for rows past L).
      if (key_lo[r] < k0 + nk && k0 < key_hi[r]) {
        acc_t s = kNegInf;  // keys past the tile's end or outside the row's interval contribute exp(-inf) = 0
        if (lane < nk && key_lo[r] <= key && key < key_hi[r]) {
          // scores + (attn_mask + key_padding_mask), summed in the reference's order.
          acc_t bias = padding;
          if (p.attn_mask_kind != kMaskNone) {
            bias =
                mask_value<acc_t>(p.attn_mask_kind, ptr.attn_mask,
                                  am_base + (l0 + r) * p.attn_mask_stride[2] + key * p.attn_mask_stride[3]) +
                padding;
          }
          s = dot[r] * scale;
          if (cap.cap > acc_t(0)) s = soft_cap(s, cap);
          s += bias;
        }
        const acc_t tile_max = warp_max(s);
        const SoftmaxStep<acc_t> step = softmax_step(state[r], tile_max);
        pr = softmax_exp(s - step.base);
        state[r] = softmax_advance(state[r], step, warp_sum(pr));
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[r][c] *= step.alpha;
        any = any || tile_max != kNegInf;
        if (p.dropout && lane < nk) {
          const uint64_t e = (dropout_row0 + static_cast<uint64_t>(l0 + r)) * static_cast<uint64_t>(S) +
                             static_cast<uint64_t>(key);
          const bool kept = dropout_keep(e, p.dropout_threshold, p.dropout_seed[0], p.dropout_seed[1],
                                         p.dropout_offset[0], p.dropout_offset[1]);
          pr = kept ? pr * dropout_scale : acc_t(0);
        }
      }
      p_s[(warp * R + r) * kTileKeys + lane] = pr;
    }
    __syncwarp();

    // o[r] += p[r] V over the tile's keys, for the warp's R rows; skipped when every row's mass is 0.
    if (any) {
      const acc_t* prow = p_s + warp * R * kTileKeys;
      const int jn = (nk + kVec - 1) / kVec * kVec;  // p and V are zero past nk
      for (int j = 0; j < jn; j += kVec) {
        Vec pv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) pv[r] = *reinterpret_cast<const Vec*>(prow + r * kTileKeys + j);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const acc_t* vrow = v_s + (j + e) * ldv + lane * kOutVec;
#pragma unroll
          for (int g = 0; g < kGroups; ++g) {
            const OutVec vv = *reinterpret_cast<const OutVec*>(vrow + g * kWarpSize * kOutVec);
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
              for (int u = 0; u < kOutVec; ++u) o[r][g * kOutVec + u] += pv[r].v[e] * vv.v[u];
            }
          }
        }
      }
    }
  }

  // out = o / l and lse = m + log(l) (the sink joins l); a row that saw no unmasked key gets out 0 and lse
  // +inf.
  const acc_t sink = p.has_sinks ? static_cast<const acc_t*>(ptr.sinks)[h] : acc_t(0);
  scalar_t* const out = static_cast<scalar_t*>(ptr.out) + b * p.out_stride[0] + h * p.out_stride[1];
  acc_t* const lse = static_cast<acc_t*>(ptr.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (warp * R + r >= rows_in_block) continue;  // past L
    const bool empty = softmax_row_empty(state[r]);
    const RowResult<acc_t> result = softmax_finish(state[r], p.has_sinks != 0, sink);
    const acc_t factor = result.factor;
    scalar_t* dst = out + (l0 + r) * p.out_stride[2];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int u = 0; u < kOutVec; ++u) {
        const int c = g * kWarpSize * kOutVec + lane * kOutVec + u;
        // Written as 0, not as o * 0: o may hold 0 * inf = NaN from masked keys of an infinite value.
        if (c < Dv)
          dst[c * p.out_stride[3]] = from_acc<scalar_t>(empty ? acc_t(0) : o[r][g * kOutVec + u] * factor);
      }
    }
    if (lane == 0) lse[(l0 + r) * p.lse_stride[2]] = result.lse;
  }
}

#endif  // ATTNX_CUDA_DEVICE_CODE

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
template <typename scalar_t>
cudaError_t launch_simt(const AttentionParams& p, const AttentionPointers& ptr, const AttentionPlan& plan,
                        cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  return dispatch_bucket<32, 64, 128, 256>(plan.bucket, [&](auto bucket) {
    constexpr int kBucket = decltype(bucket)::value;
    constexpr int R = rows_per_warp(static_cast<int>(sizeof(acc_t)), kBucket);
    if (plan.rows_per_warp != R) return cudaErrorInvalidValue;  // plan and kernel disagree
    return launch_plan(ATTNX_KERNEL(attention_forward_simt, scalar_t, kBucket, R), plan.blocks, plan.threads,
                       plan.smem_bytes, stream, p, ptr, plan);
  });
}

#endif
}  // namespace

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
cudaError_t launch_attention(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                             cudaStream_t stream, Kernel kernel, void* workspace, int mma_shape) {
  if (kernel == Kernel::kMma) return launch_attention_mma(p, dtype, ptr, workspace, stream, mma_shape);
  if (kernel != Kernel::kSimt || !params_consistent(p, ptr) || p.has_block_map != 0) {
    return cudaErrorInvalidValue;  // the SIMT kernel reads no block map
  }
  const AttentionPlan plan = plan_attention(p, dtype);
  if (plan.bucket == 0) return cudaErrorInvalidValue;
  if (plan.blocks == 0) return cudaSuccess;
  if (plan.blocks > kMaxBlocks) return cudaErrorInvalidConfiguration;
  return dispatch_dtype(dtype, [&](auto tag) { return launch_simt<decltype(tag)>(p, ptr, plan, stream); });
}

#endif

}  // namespace attnx::cuda
