// attnx: attnx::attention_backward's CUDA kernels (SIMT, every dtype), FlashAttention-2's backward without
// ever storing (B, H, L, S).
//
// Torch-free (raw pointers, AttentionBackwardParams, cudaStream_t): the glue is cuda/attention_backward.cpp.
// The same source is compiled for the CPU by tests/emulation/ and run there against the CPU kernel and the
// float64 reference. Launches and shared memory: cuda/attention_backward_kernel.h.
//
// The math (as cpu/attention_backward_kernel_impl.h): the probabilities are recomputed tile by tile from the
// forward's logsumexp,
//   x = scale q.k,  y = softcap ? cap tanh(x / cap) : x,  P = exp(y + bias - lse),  delta = rowsum(dO * O),
//   dP = dO.v,  dS = P * (Z dP - delta),  dV = (Z P)^T dO,  dQ = scale (dS y') K,  dK = scale (dS y')^T Q,
// with Z the dropout's keep / (1 - p) regenerated from the forward's Philox draws (1 without dropout), y' =
// 1 - (y / cap)^2 the soft cap's derivative (1 without), and bias the masks. attn_mask's gradient is dS.
// A row that sees no key has lse = +inf: its P is 0 and it contributes nothing. A key outside a row's key
// range (attnx/key_range.h) is not seen at all, whatever its score.
//
// Every tile pair computes its (tile x tile) P and dS in shared memory from the staged operands, a thread a
// small block of it (tile_pair: one pass over D and one over Dv for the whole block). Then the key pass
// accumulates dV and dK of its key tile in registers and the query pass dQ of its query tile, a thread owning
// a fixed set of (row, column) elements (Shape::kOwnedRows x kOwnedCols), so that every output element has
// one owner and is written once. Grouped KV heads: a key block loops over the query heads of
// its group, K and V are read in place, never repeated. Tiles are aligned to multiples of `tile` in both
// passes, and a pass visits only the tiles its key ranges reach.
#include "attnx/philox.h"
#include "cuda/attention_backward_kernel.h"
#include "cuda/common.cuh"

namespace attnx::cuda {
namespace {
#if ATTNX_CUDA_DEVICE_CODE  // the kernels (cuda/common.cuh); the launchers follow

// Blocks per SM the launch bounds ask ptxas for. Stated, although 1 is what it means without it: left to
// itself, ptxas holds some query-pass kernels to 128-168 registers on sm_80 and spills 4-32 bytes there
// (fp32/fp16/bf16 at buckets 32 and 128, fp64 at 128); with it none spills on sm_80 or sm_90.
constexpr int kBackwardMinBlocks = 1;

// delta[(b * H + h) * L + l] = sum over c < Dv of dO[b, h, l, c] * O[b, h, l, c], one warp per row.
template <typename scalar_t>
__global__ void __launch_bounds__(kBackwardThreads)
    attention_backward_delta(const AttentionBackwardParams bp, const AttentionBackwardPointers ptr,
                             typename AccType<scalar_t>::type* delta) {
  using acc_t = typename AccType<scalar_t>::type;
  const AttentionParams& p = bp.fwd;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBackwardThreads / kWarpSize) +
                      static_cast<int64_t>(threadIdx.x) / kWarpSize;
  if (row >= p.batch * p.heads * p.q_len) return;  // a whole warp leaves together
  const int64_t l = row % p.q_len, bh = row / p.q_len, h = bh % p.heads, b = bh / p.heads;
  const scalar_t* dout = static_cast<const scalar_t*>(ptr.grad_out) + b * bp.grad_out_stride[0] +
                         h * bp.grad_out_stride[1] + l * bp.grad_out_stride[2];
  const scalar_t* out = static_cast<const scalar_t*>(ptr.fwd.out) + b * p.out_stride[0] +
                        h * p.out_stride[1] + l * p.out_stride[2];
  acc_t sum = acc_t(0);
  for (int64_t c = lane; c < p.v_head_dim; c += kWarpSize) {
    sum += to_acc(dout[c * bp.grad_out_stride[3]]) * to_acc(out[c * p.out_stride[3]]);
  }
  sum = warp_sum(sum);
  if (lane == 0) delta[row] = sum;
}

// What a backward block sees of the problem, in the accumulator type.
template <typename acc_t>
struct Constants {
  acc_t scale, dropout_scale;
  SoftCap<acc_t> cap;
};

template <typename acc_t>
__device__ __forceinline__ Constants<acc_t> constants_of(const AttentionParams& p) {
  return {split_value<acc_t>(p.scale, p.scale_lo), split_value<acc_t>(p.dropout_scale, p.dropout_scale_lo),
          soft_cap_of<acc_t>(p)};
}

// The block's shared memory (cuda/attention_backward_kernel.h): four operand tiles (kTile, kLd), the P and
// dS tiles (kTile, kTile + 1), and the query tile's lse and delta.
template <typename acc_t, int kTile, int kLd>
struct Tiles {
  acc_t *q, *dout, *k, *v, *p, *ds, *lse, *delta;
};

template <typename acc_t, int kTile, int kLd>
__device__ __forceinline__ Tiles<acc_t, kTile, kLd> tiles_of(acc_t* smem) {
  Tiles<acc_t, kTile, kLd> t;
  t.q = smem;
  t.dout = t.q + kTile * kLd;
  t.k = t.dout + kTile * kLd;
  t.v = t.k + kTile * kLd;
  t.p = t.v + kTile * kLd;
  t.ds = t.p + kTile * (kTile + 1);
  t.lse = t.ds + kTile * (kTile + 1);
  t.delta = t.lse + kTile;
  return t;
}

// Rows [row0, row0 + tile) of a (rows, cols) operand of (b, head) into `dst` (tile, ld) in the accumulator
// type, zero past `valid_rows` and past `cols`. One warp per row, lanes along the columns.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void stage_rows(acc_t* dst, int ld, int tile, const scalar_t* base,
                                           const int64_t* stride, int64_t row0, int64_t valid_rows,
                                           int64_t cols) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize,
            lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int r = warp; r < tile; r += kBackwardThreads / kWarpSize) {
    const bool valid = row0 + r < valid_rows;
    const scalar_t* src = base + (row0 + r) * stride[2];
    for (int c = lane; c < ld; c += kWarpSize) {
      dst[r * ld + c] = valid && c < cols ? to_acc(src[c * stride[3]]) : acc_t(0);
    }
  }
}

// The tile sizes of a kernel instantiation (plan_attention_backward computes the same).
template <typename scalar_t, int kBucket>
struct Shape {
  using acc_t = typename AccType<scalar_t>::type;
  static constexpr int kTile = backward_tile(kBucket, static_cast<int>(sizeof(acc_t)));
  static constexpr int kLd = kBucket + 1;
  // The elements of a (kTile, kBucket) gradient tile a thread owns: rows warp + 4 m (m < kOwnedRows) and
  // columns lane + 32 u (u < kOwnedCols). A warp reads one P or dS element (a broadcast) and its lanes 32
  // consecutive operand columns (no bank conflict) per step, each read serving kOwnedCols (kOwnedRows) FMAs.
  static constexpr int kWarpsPerBlock = kBackwardThreads / kWarpSize;
  static constexpr int kOwnedRows = kTile / kWarpsPerBlock, kOwnedCols = kBucket / kWarpSize;
  using Smem = Tiles<acc_t, kTile, kLd>;
};

// One (query tile, key tile) pair of (b, h): P and dS into t.p and t.ds (kTile, kTile + 1), from the staged
// t.q, t.dout, t.k, t.v, t.lse and t.delta. t.p gets Z P (what dV needs) in the key pass and dS (the mask's
// gradient) in the query pass; t.ds gets dS y' (what dQ and dK need). Elements outside the rows' key ranges,
// past L or past S_b are 0.
//
// A thread computes a kRI x kRJ block of the pair (2 x 4 at tile 32, 1 x 2 at 16, 1 x 1 at 8, where half the
// threads idle): rows ti + r * kTile / kRI and keys tj + s * kTile / kRJ, so that each operand element it
// reads from shared memory serves kRJ (kRI) products, and the 8 key rows and 4 query rows a warp reads at
// once fall on distinct banks (odd row stride kLd).
template <typename scalar_t, int kBucket, bool kKeyPass>
__device__ __forceinline__ void tile_pair(const AttentionParams& p, const AttentionPointers& ptr,
                                          const Constants<typename AccType<scalar_t>::type>& k,
                                          const typename Shape<scalar_t, kBucket>::Smem& t, int64_t b,
                                          int64_t h, int64_t q0, int64_t k0, int64_t Sb) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr int kTile = Shape<scalar_t, kBucket>::kTile, kLd = Shape<scalar_t, kBucket>::kLd;
  constexpr int kRI = kTile == 32 ? 2 : 1, kRJ = kTile == 32 ? 4 : kTile == 16 ? 2 : 1;
  constexpr int kThreadsI = kTile / kRI, kThreadsJ = kTile / kRJ;
  static_assert(kThreadsI * kThreadsJ <= kBackwardThreads,
                "a pair's blocks need more threads than a block has");
  const int tid = static_cast<int>(threadIdx.x);
  if (tid >= kThreadsI * kThreadsJ) return;
  const int ti = tid / kThreadsJ, tj = tid % kThreadsJ;
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.v_head_dim);

  // The block's scores and dO.v products: one pass over D and one over Dv.
  acc_t dot[kRI][kRJ], dp[kRI][kRJ];
#pragma unroll
  for (int r = 0; r < kRI; ++r) {
#pragma unroll
    for (int c = 0; c < kRJ; ++c) dot[r][c] = dp[r][c] = acc_t(0);
  }
  for (int c = 0; c < D; ++c) {
    acc_t q[kRI], kk[kRJ];
#pragma unroll
    for (int r = 0; r < kRI; ++r) q[r] = t.q[(ti + r * kThreadsI) * kLd + c];
#pragma unroll
    for (int j = 0; j < kRJ; ++j) kk[j] = t.k[(tj + j * kThreadsJ) * kLd + c];
#pragma unroll
    for (int r = 0; r < kRI; ++r) {
#pragma unroll
      for (int j = 0; j < kRJ; ++j) dot[r][j] += q[r] * kk[j];
    }
  }
  for (int c = 0; c < Dv; ++c) {
    acc_t o[kRI], v[kRJ];
#pragma unroll
    for (int r = 0; r < kRI; ++r) o[r] = t.dout[(ti + r * kThreadsI) * kLd + c];
#pragma unroll
    for (int j = 0; j < kRJ; ++j) v[j] = t.v[(tj + j * kThreadsJ) * kLd + c];
#pragma unroll
    for (int r = 0; r < kRI; ++r) {
#pragma unroll
      for (int j = 0; j < kRJ; ++j) dp[r][j] += o[r] * v[j];
    }
  }

  const int64_t L = p.q_len, S = p.kv_len;
  const int64_t am_base = b * p.attn_mask_stride[0] + h * p.attn_mask_stride[1];
  const int64_t kpm_base = b * p.key_padding_mask_stride[0];
  const uint64_t dropout_row0 = static_cast<uint64_t>(b * p.heads + h) * static_cast<uint64_t>(L);
#pragma unroll
  for (int r = 0; r < kRI; ++r) {
    const int i = ti + r * kThreadsI;
    const int64_t l = q0 + i;
    const int64_t key_lo = l < L ? range_key_begin(l, L, Sb, p.window_left) : 0;
    const int64_t key_hi = l < L ? range_key_end(l, L, Sb, p.window_right, p.is_causal) : 0;
#pragma unroll
    for (int jj = 0; jj < kRJ; ++jj) {
      const int j = tj + jj * kThreadsJ;
      const int64_t s = k0 + j;
      acc_t pz = acc_t(0), ds_bias = acc_t(0), ds = acc_t(0);
      if (key_lo <= s && s < key_hi) {
        acc_t y = dot[r][jj] * k.scale, slope = acc_t(1);
        if (k.cap.cap > acc_t(0)) {
          const acc_t th = tanh_acc(y * k.cap.inv_cap);
          y = k.cap.cap * th;
          slope = acc_t(1) - th * th;
        }
        // scores + (attn_mask + key_padding_mask), summed in the reference's order.
        acc_t bias = acc_t(0);
        if (p.key_padding_mask_kind != kMaskNone) {
          bias = mask_value<acc_t>(p.key_padding_mask_kind, ptr.key_padding_mask,
                                   kpm_base + s * p.key_padding_mask_stride[1]);
        }
        if (p.attn_mask_kind != kMaskNone) {
          bias = mask_value<acc_t>(p.attn_mask_kind, ptr.attn_mask,
                                   am_base + l * p.attn_mask_stride[2] + s * p.attn_mask_stride[3]) +
                 bias;
        }
        const acc_t prob = softmax_exp(y + bias - t.lse[i]);  // the accurate exp: expf in float
        acc_t z = acc_t(1);
        if (p.dropout) {
          const uint64_t el =
              (dropout_row0 + static_cast<uint64_t>(l)) * static_cast<uint64_t>(S) + static_cast<uint64_t>(s);
          z = dropout_keep(el, p.dropout_threshold, p.dropout_seed[0], p.dropout_seed[1], p.dropout_offset[0],
                           p.dropout_offset[1])
                  ? k.dropout_scale
                  : acc_t(0);
        }
        pz = z * prob;
        ds_bias = prob * (z * dp[r][jj] - t.delta[i]);
        ds = ds_bias * slope;
      }
      t.p[i * (kTile + 1) + j] = kKeyPass ? pz : ds_bias;
      t.ds[i * (kTile + 1) + j] = ds;
    }
  }
}

// Query rows [q0, q0 + kTile) of (b, h): Q, dO, lse and delta into t.q, t.dout, t.lse, t.delta.
template <typename scalar_t, int kBucket>
__device__ __forceinline__ void stage_queries(const AttentionBackwardParams& bp,
                                              const AttentionBackwardPointers& ptr,
                                              const typename AccType<scalar_t>::type* delta,
                                              const typename Shape<scalar_t, kBucket>::Smem& t, int64_t b,
                                              int64_t h, int64_t q0) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr int kTile = Shape<scalar_t, kBucket>::kTile, kLd = Shape<scalar_t, kBucket>::kLd;
  const AttentionParams& p = bp.fwd;
  const int64_t L = p.q_len;
  stage_rows(t.q, kLd, kTile,
             static_cast<const scalar_t*>(ptr.fwd.query) + b * p.q_stride[0] + h * p.q_stride[1], p.q_stride,
             q0, L, p.head_dim);
  stage_rows(
      t.dout, kLd, kTile,
      static_cast<const scalar_t*>(ptr.grad_out) + b * bp.grad_out_stride[0] + h * bp.grad_out_stride[1],
      bp.grad_out_stride, q0, L, p.v_head_dim);
  const acc_t* lse = static_cast<const acc_t*>(ptr.fwd.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
  for (int i = static_cast<int>(threadIdx.x); i < kTile; i += kBackwardThreads) {
    const bool valid = q0 + i < L;
    t.lse[i] = valid ? lse[(q0 + i) * p.lse_stride[2]] : acc_t(INFINITY);
    t.delta[i] = valid ? delta[(b * p.heads + h) * L + q0 + i] : acc_t(0);
  }
}

// Keys [k0, k0 + kTile) of (b, kv head hk): K and V into t.k and t.v, zero at and past the batch's key count
// Sb. Those keys are never read: a static cache's unfilled slots may hold NaN, which 0 * NaN would carry into
// dQ (P and dS are 0 there) and dV.
template <typename scalar_t, int kBucket>
__device__ __forceinline__ void stage_keys(const AttentionParams& p, const AttentionPointers& ptr,
                                           const typename Shape<scalar_t, kBucket>::Smem& t, int64_t b,
                                           int64_t hk, int64_t k0, int64_t Sb) {
  constexpr int kTile = Shape<scalar_t, kBucket>::kTile, kLd = Shape<scalar_t, kBucket>::kLd;
  stage_rows(t.k, kLd, kTile, static_cast<const scalar_t*>(ptr.key) + b * p.k_stride[0] + hk * p.k_stride[1],
             p.k_stride, k0, Sb, p.head_dim);
  stage_rows(t.v, kLd, kTile,
             static_cast<const scalar_t*>(ptr.value) + b * p.v_stride[0] + hk * p.v_stride[1], p.v_stride, k0,
             Sb, p.v_head_dim);
}

// The key pass: block = (b, kv head, key tile). dV = sum (Z P)^T dO and dK = scale sum (dS y')^T Q over the
// group's query heads and the query tiles that see the key tile, in registers (Shape's ownership).
template <typename scalar_t, int kBucket>
__global__ void __launch_bounds__(kBackwardThreads, kBackwardMinBlocks)
    attention_backward_keys(const AttentionBackwardParams bp, const AttentionBackwardPointers ptr,
                            const AttentionBackwardPlan plan, const typename AccType<scalar_t>::type* delta) {
  using acc_t = typename AccType<scalar_t>::type;
  using Sh = Shape<scalar_t, kBucket>;
  constexpr int kTile = Sh::kTile, kLd = Sh::kLd, kRows = Sh::kOwnedRows, kCols = Sh::kOwnedCols;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize,
            lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const AttentionParams& p = bp.fwd;
  ATTNX_DYNAMIC_SHARED(acc_t, smem);
  const typename Sh::Smem t = tiles_of<acc_t, kTile, kLd>(smem);

  const int64_t L = p.q_len, S = p.kv_len;
  const uint32_t kt = blockIdx.x % static_cast<uint32_t>(plan.k_tiles);
  const uint32_t bhk = blockIdx.x / static_cast<uint32_t>(plan.k_tiles);
  const int64_t hk = bhk % static_cast<uint32_t>(p.kv_heads), b = bhk / static_cast<uint32_t>(p.kv_heads);
  const int64_t k0 = static_cast<int64_t>(kt) * kTile;
  const int64_t Sb = batch_kv_len(p, ptr.fwd.key_lengths, b);
  const Constants<acc_t> consts = constants_of<acc_t>(p);
  stage_keys<scalar_t, kBucket>(p, ptr.fwd, t, b, hk, k0, Sb);

  acc_t dk[kRows][kCols], dv[kRows][kCols];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
#pragma unroll
    for (int u = 0; u < kCols; ++u) dk[m][u] = dv[m][u] = acc_t(0);
  }

  // The queries that see some key of the tile: from its first key's first query to its last key's end
  // (none when the tile starts past S_b).
  const int64_t last = (k0 + kTile < Sb ? k0 + kTile : Sb) - 1;
  const int64_t q_begin = k0 <= last ? range_query_begin(k0, L, Sb, p.window_right, p.is_causal) : L;
  const int64_t q_end = k0 <= last ? range_query_end(last, L, Sb, p.window_left) : 0;
  const int64_t group = p.heads / p.kv_heads;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    for (int64_t q0 = q_begin / kTile * kTile; q0 < q_end; q0 += kTile) {
      __syncthreads();  // the previous pair is done with t.q, t.dout, t.p and t.ds
      stage_queries<scalar_t, kBucket>(bp, ptr, delta, t, b, h, q0);
      __syncthreads();
      tile_pair<scalar_t, kBucket, /*kKeyPass=*/true>(p, ptr.fwd, consts, t, b, h, q0, k0, Sb);
      __syncthreads();
      for (int i = 0; i < kTile; ++i) {
        acc_t o[kCols], q[kCols];
#pragma unroll
        for (int u = 0; u < kCols; ++u) {
          o[u] = t.dout[i * kLd + lane + u * kWarpSize];
          q[u] = t.q[i * kLd + lane + u * kWarpSize];
        }
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          const int j = warp + m * Sh::kWarpsPerBlock;
          const acc_t pz = t.p[i * (kTile + 1) + j], ds = t.ds[i * (kTile + 1) + j];
#pragma unroll
          for (int u = 0; u < kCols; ++u) {
            dv[m][u] += pz * o[u];
            dk[m][u] += ds * q[u];
          }
        }
      }
    }
  }

  scalar_t* const grad_key =
      static_cast<scalar_t*>(ptr.grad_key) + b * bp.grad_key_stride[0] + hk * bp.grad_key_stride[1];
  scalar_t* const grad_value =
      static_cast<scalar_t*>(ptr.grad_value) + b * bp.grad_value_stride[0] + hk * bp.grad_value_stride[1];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    const int64_t s = k0 + warp + m * Sh::kWarpsPerBlock;
    if (s >= S) continue;
#pragma unroll
    for (int u = 0; u < kCols; ++u) {
      const int c = lane + u * kWarpSize;
      if (c < p.head_dim) {
        grad_key[s * bp.grad_key_stride[2] + c * bp.grad_key_stride[3]] =
            from_acc<scalar_t>(dk[m][u] * consts.scale);
      }
      if (c < p.v_head_dim) {
        grad_value[s * bp.grad_value_stride[2] + c * bp.grad_value_stride[3]] = from_acc<scalar_t>(dv[m][u]);
      }
    }
  }
}

// attn_mask's gradient of one tile pair: t.p (dS) summed over the tile's rows (keys) where the gradient
// broadcasts along L (S), added to elements that only this block writes (see attention_backward_queries).
template <typename scalar_t, int kBucket>
__device__ __forceinline__ void add_mask_grad(const AttentionBackwardParams& bp,
                                              typename AccType<scalar_t>::type* mask_grad,
                                              const typename Shape<scalar_t, kBucket>::Smem& t, int64_t b,
                                              int64_t h, int64_t q0, int64_t k0) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr int kTile = Shape<scalar_t, kBucket>::kTile;
  const int64_t* size = bp.grad_attn_mask_size;
  const bool sum_rows = size[2] == 1, sum_keys = size[3] == 1;
  const int ni = sum_rows ? 1 : kTile, nj = sum_keys ? 1 : kTile;
  acc_t* const base =
      mask_grad + ((size[0] == 1 ? 0 : b) * size[1] + (size[1] == 1 ? 0 : h)) * size[2] * size[3];
  for (int e = static_cast<int>(threadIdx.x); e < ni * nj; e += kBackwardThreads) {
    const int i = e / nj, j = e % nj;
    const int64_t l = sum_rows ? 0 : q0 + i, s = sum_keys ? 0 : k0 + j;
    if (l >= size[2] || s >= size[3]) continue;
    acc_t sum = acc_t(0);
    for (int ii = sum_rows ? 0 : i; ii < (sum_rows ? kTile : i + 1); ++ii) {
      for (int jj = sum_keys ? 0 : j; jj < (sum_keys ? kTile : j + 1); ++jj)
        sum += t.p[ii * (kTile + 1) + jj];
    }
    base[l * size[3] + s] += sum;
  }
}

// The query pass: dQ = scale sum (dS y') K of one (b, h, query tile) per iteration (in registers, Shape's
// ownership), and attn_mask's gradient. A block loops over the batches,
// heads and query tiles whose mask gradients add into the same elements (the dims of
// bp.grad_attn_mask_size that are 1), one after another, so that it alone writes them.
template <typename scalar_t, int kBucket>
__global__ void __launch_bounds__(kBackwardThreads, kBackwardMinBlocks)
    attention_backward_queries(const AttentionBackwardParams bp, const AttentionBackwardPointers ptr,
                               const AttentionBackwardPlan plan,
                               const typename AccType<scalar_t>::type* delta) {
  using acc_t = typename AccType<scalar_t>::type;
  using Sh = Shape<scalar_t, kBucket>;
  constexpr int kTile = Sh::kTile, kLd = Sh::kLd, kRows = Sh::kOwnedRows, kCols = Sh::kOwnedCols;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize,
            lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const AttentionParams& p = bp.fwd;
  ATTNX_DYNAMIC_SHARED(acc_t, smem);
  const typename Sh::Smem t = tiles_of<acc_t, kTile, kLd>(smem);
  const int64_t L = p.q_len;
  const Constants<acc_t> consts = constants_of<acc_t>(p);

  // This block's batches, heads and query tiles: all of them along a dim the mask's gradient broadcasts
  // along, else the one blockIdx.x names.
  acc_t* const mask_grad = static_cast<acc_t*>(ptr.grad_attn_mask);
  const bool all_b = plan.queries.all_batches, all_h = plan.queries.all_heads,
             all_q = plan.queries.all_query_tiles;
  int64_t b_id, h_id, qt_id;
  plan.queries.block_item(blockIdx.x, p.heads, &b_id, &h_id, &qt_id);

  for (int64_t b = all_b ? 0 : b_id; b < (all_b ? p.batch : b_id + 1); ++b) {
    const int64_t Sb = batch_kv_len(p, ptr.fwd.key_lengths, b);
    for (int64_t h = all_h ? 0 : h_id; h < (all_h ? p.heads : h_id + 1); ++h) {
      const int64_t hk = kv_head_of(p, h);
      for (int64_t qt = all_q ? 0 : qt_id; qt < (all_q ? plan.q_tiles : qt_id + 1); ++qt) {
        const int64_t q0 = qt * kTile;
        const int64_t rows = L - q0 < kTile ? L - q0 : kTile;
        __syncthreads();  // the previous query tile is done with every shared region
        stage_queries<scalar_t, kBucket>(bp, ptr, delta, t, b, h, q0);
        acc_t dq[kRows][kCols];
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
#pragma unroll
          for (int u = 0; u < kCols; ++u) dq[m][u] = acc_t(0);
        }
        // The keys any row of the tile sees: from its first row's first key to its last row's end.
        const int64_t k_begin = range_key_begin(q0, L, Sb, p.window_left);
        const int64_t k_end = range_key_end(q0 + rows - 1, L, Sb, p.window_right, p.is_causal);
        for (int64_t k0 = k_begin / kTile * kTile; k0 < k_end; k0 += kTile) {
          __syncthreads();  // the queries are staged; the previous key tile is done with t.k, t.v, t.p, t.ds
          stage_keys<scalar_t, kBucket>(p, ptr.fwd, t, b, hk, k0, Sb);
          __syncthreads();
          tile_pair<scalar_t, kBucket, /*kKeyPass=*/false>(p, ptr.fwd, consts, t, b, h, q0, k0, Sb);
          __syncthreads();
          for (int j = 0; j < kTile; ++j) {
            acc_t kk[kCols];
#pragma unroll
            for (int u = 0; u < kCols; ++u) kk[u] = t.k[j * kLd + lane + u * kWarpSize];
#pragma unroll
            for (int m = 0; m < kRows; ++m) {
              const acc_t ds = t.ds[(warp + m * Sh::kWarpsPerBlock) * (kTile + 1) + j];
#pragma unroll
              for (int u = 0; u < kCols; ++u) dq[m][u] += ds * kk[u];
            }
          }
          if (mask_grad != nullptr) add_mask_grad<scalar_t, kBucket>(bp, mask_grad, t, b, h, q0, k0);
        }
        scalar_t* const grad_query = static_cast<scalar_t*>(ptr.grad_query) + b * bp.grad_query_stride[0] +
                                     h * bp.grad_query_stride[1];
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          const int i = warp + m * Sh::kWarpsPerBlock;
          if (i >= rows) continue;
#pragma unroll
          for (int u = 0; u < kCols; ++u) {
            const int c = lane + u * kWarpSize;
            if (c < p.head_dim) {
              grad_query[(q0 + i) * bp.grad_query_stride[2] + c * bp.grad_query_stride[3]] =
                  from_acc<scalar_t>(dq[m][u] * consts.scale);
            }
          }
        }
      }
    }
  }
}

#endif  // ATTNX_CUDA_DEVICE_CODE

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
template <typename scalar_t>
cudaError_t launch_backward(const AttentionBackwardParams& bp, const AttentionBackwardPointers& ptr,
                            const AttentionBackwardPlan& plan, void* workspace, cudaStream_t stream) {
  using acc_t = typename AccType<scalar_t>::type;
  acc_t* const delta = static_cast<acc_t*>(workspace);
  if (plan.delta_blocks > 0) {
    const cudaError_t err = launch_plan(ATTNX_KERNEL(attention_backward_delta, scalar_t), plan.delta_blocks,
                                        plan.threads, 0, stream, bp, ptr, delta);
    if (err != cudaSuccess) return err;
  }
  return dispatch_bucket<32, 64, 128, 256>(plan.bucket, [&](auto bucket) {
    constexpr int kBucket = decltype(bucket)::value;
    if (plan.tile != backward_tile(kBucket, static_cast<int>(sizeof(acc_t))))
      return cudaErrorInvalidValue;  // plan and kernel disagree
    if (plan.key_blocks > 0) {
      const cudaError_t err =
          launch_plan(ATTNX_KERNEL(attention_backward_keys, scalar_t, kBucket), plan.key_blocks, plan.threads,
                      plan.smem_bytes, stream, bp, ptr, plan, static_cast<const acc_t*>(delta));
      if (err != cudaSuccess) return err;
    }
    if (plan.queries.blocks > 0 && bp.fwd.q_len > 0) {
      return launch_plan(ATTNX_KERNEL(attention_backward_queries, scalar_t, kBucket), plan.queries.blocks,
                         plan.threads, plan.smem_bytes, stream, bp, ptr, plan,
                         static_cast<const acc_t*>(delta));
    }
    return cudaSuccess;
  });
}

#endif
}  // namespace

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only (see attnx/rtc.h)
cudaError_t launch_attention_backward(const AttentionBackwardParams& bp, DType dtype,
                                      const AttentionBackwardPointers& ptr, void* workspace,
                                      cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  if (!params_consistent(p, ptr.fwd) || p.varlen != 0 || p.has_block_map != 0) return cudaErrorInvalidValue;
  const AttentionBackwardPlan plan = plan_attention_backward(bp, dtype, ptr.grad_attn_mask != nullptr);
  if (plan.bucket == 0) return cudaErrorInvalidValue;
  if (plan.delta_blocks > kMaxBlocks || plan.key_blocks > kMaxBlocks || plan.queries.blocks > kMaxBlocks) {
    return cudaErrorInvalidConfiguration;
  }
  return dispatch_dtype(
      dtype, [&](auto tag) { return launch_backward<decltype(tag)>(bp, ptr, plan, workspace, stream); });
}

#endif

}  // namespace attnx::cuda
