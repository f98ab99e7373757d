// attnx: attnx::attention's tensor-core forward kernel for float16 and bfloat16 (sm80+), the default for
// those dtypes where it applies (ATTNX_CUDA_MMA=0 selects the SIMT kernel instead).
//
// Checked on an H100 against the float64 reference (tests/test_cuda.py) and under compute-sanitizer; the CPU
// emulation runs this source in CI with mma.sync replaced by a warp collective over the PTX ISA's fragment
// layouts (tests/emulation/cuda_shim.h).
//
// FlashAttention-2's scheme on mma.sync.m16n8k16 with fp32 accumulators: one block per (b, h, 64 query rows),
// 4 warps of 16 rows. A warp keeps its Q fragments (16 x bucket) in registers, loaded once from global memory
// through q's strides. For each tile of 64 keys, staged in shared memory in the input type (16-byte loads
// when the rows allow it, see mma_vector_loads; K row-major, V transposed so that both B fragments are
// 32-bit words): S = Q K^T (8 n-tiles of 8 keys), scale and both masks read in place, the online softmax of
// softmax.h per row (a row's 64 scores sit in the 4 lanes of a quad: shuffles over xor 1 and 2), then
// O += P V with P rounded to the input type (the C fragments of two adjacent S n-tiles are exactly the A
// fragment of one k-step). Tiles are skipped as in the SIMT kernel (causal, key padding).
#include "cuda/attention.h"
#include "cuda/common.cuh"

namespace attnx::cuda {
namespace {

template <typename scalar_t, int kBucket>
__global__ void __launch_bounds__(kWarps* kWarpSize)
    attention_forward_mma(const AttentionParams p, const AttentionPointers ptr, const AttentionMmaPlan plan,
                          const bool vector_loads) {
  constexpr int kKSteps = kBucket / 16;       // k-steps of Q K^T over the (padded) head dim
  constexpr int kSTiles = kMmaTileKeys / 8;   // n-tiles of 8 keys in a score tile
  constexpr int kPSteps = kMmaTileKeys / 16;  // k-steps of P V over the tile's keys
  constexpr int kOTiles = kBucket / 8;        // n-tiles of 8 output columns
  constexpr float kNegInf = -INFINITY;

  ATTNX_DYNAMIC_SHARED(scalar_t, smem);
  const int ld = plan.ld, ldt = plan.ldt;
  scalar_t* const k_s = smem;                 // (kMmaTileKeys, ld), zero past D and the last key
  scalar_t* const vt_s = smem + plan.vt_off;  // (kBucket, ldt): V transposed, zero past Dv and the last key

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // fragment coordinates: row group, thread in group
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.v_head_dim);
  const int64_t L = p.q_len, S = p.kv_len;
  const bool causal = p.is_causal != 0;

  const int64_t block = blockIdx.x;
  int64_t qb, bh;
  if (causal) {  // heaviest query blocks first, as in the SIMT kernel
    qb = plan.q_blocks - 1 - block / plan.bh;
    bh = block % plan.bh;
  } else {
    qb = block % plan.q_blocks;
    bh = block / plan.q_blocks;
  }
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int64_t q0 = qb * kMmaRowsPerBlock;
  const int64_t rows_in_block = L - q0 < kMmaRowsPerBlock ? L - q0 : kMmaRowsPerBlock;

  const scalar_t* const q = static_cast<const scalar_t*>(ptr.query) + b * p.q_stride[0] + h * p.q_stride[1];
  const scalar_t* const k = static_cast<const scalar_t*>(ptr.key) + b * p.k_stride[0] + h * p.k_stride[1];
  const scalar_t* const v = static_cast<const scalar_t*>(ptr.value) + b * p.v_stride[0] + h * p.v_stride[1];
  const int64_t am_base = b * p.attn_mask_stride[0] + h * p.attn_mask_stride[1];
  const int64_t kpm_base = b * p.key_padding_mask_stride[0];
  const float scale = p.scale;
  const scalar_t zero = from_acc<scalar_t>(0.0f);

  // This lane's two query rows: fragment rows g and g + 8 of the warp's 16.
  int64_t l[2];
  bool active[2];
  for (int r = 0; r < 2; ++r) {
    l[r] = q0 + warp * kMmaRowsPerWarp + g + 8 * r;
    active[r] = l[r] < L;
  }

  // Q fragments, zero past D and past L: register i holds rows g (i even) or g + 8 (i odd), columns
  // 16 ks + 2t (+ 8 for i >= 2), two elements each.
  uint32_t qa[kKSteps][4];
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i % 2;
      const int col = 16 * ks + 2 * t + (i >= 2 ? 8 : 0);
      const scalar_t* src = q + l[r] * p.q_stride[2];
      const scalar_t x0 = active[r] && col < D ? src[col * p.q_stride[3]] : zero;
      const scalar_t x1 = active[r] && col + 1 < D ? src[(col + 1) * p.q_stride[3]] : zero;
      qa[ks][i] = pack2(x0, x1);
    }
  }

  float o[kOTiles][4];
#pragma unroll
  for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
  }
  SoftmaxRow<float> state[2] = {softmax_row_init<float>(), softmax_row_init<float>()};

  const int64_t kv_end = causal ? (S < q0 + rows_in_block ? S : q0 + rows_in_block) : S;
  for (int64_t k0 = 0; k0 < kv_end; k0 += kMmaTileKeys) {
    const int nk = kv_end - k0 < kMmaTileKeys ? static_cast<int>(kv_end - k0) : kMmaTileKeys;

    // A tile that key_padding_mask removes entirely is skipped by the whole block (every warp reads the
    // same elements). Lanes cover keys lane and lane + 32.
    if (p.key_padding_mask_kind != kMaskNone) {
      bool all_masked = true;
      for (int j = lane; j < kMmaTileKeys; j += kWarpSize) {
        if (j < nk) {
          all_masked =
              all_masked && mask_value<float>(p.key_padding_mask_kind, ptr.key_padding_mask,
                                              kpm_base + (k0 + j) * p.key_padding_mask_stride[1]) == kNegInf;
        }
      }
      if (__all_sync(kFullMask, all_masked)) continue;
    }

    __syncthreads();  // every warp is done with the previous tile
    if (vector_loads) {
      // Loads are issued kBatch vectors at a time before their stores, so a tile waits on global memory
      // kIters / kBatch times per tensor rather than once per vector (kBatch = 4 keeps bucket 128 within
      // 255 registers without spills). K: consecutive threads read consecutive 16-byte vectors of a row
      // (coalesced) and store them whole. V: consecutive threads read consecutive keys, so that the transposed
      // element stores of a warp fall on consecutive 16-bit slots of a V^T row.
      constexpr int kVecs = kBucket / 8;
      constexpr int kIters = kMmaTileKeys * kVecs / (kWarps * kWarpSize);
      constexpr int kBatch = kIters < 4 ? kIters : 4;
      Pack<scalar_t, 8> x[kBatch];
      for (int i0 = 0; i0 < kIters; i0 += kBatch) {
#pragma unroll
        for (int it = 0; it < kBatch; ++it) {
          const int idx = tid + (i0 + it) * kWarps * kWarpSize;
          const int j = idx / kVecs, c = 8 * (idx % kVecs);
          if (j < nk && c < D) {
            x[it] = *reinterpret_cast<const Pack<scalar_t, 8>*>(k + (k0 + j) * p.k_stride[2] + c);
          } else {
            for (int e = 0; e < 8; ++e) x[it].v[e] = zero;
          }
        }
#pragma unroll
        for (int it = 0; it < kBatch; ++it) {
          const int idx = tid + (i0 + it) * kWarps * kWarpSize;
          *reinterpret_cast<Pack<scalar_t, 8>*>(k_s + (idx / kVecs) * ld + 8 * (idx % kVecs)) = x[it];
        }
      }
      for (int i0 = 0; i0 < kIters; i0 += kBatch) {
#pragma unroll
        for (int it = 0; it < kBatch; ++it) {
          const int idx = tid + (i0 + it) * kWarps * kWarpSize;
          const int j = idx % kMmaTileKeys, c = 8 * (idx / kMmaTileKeys);
          if (j < nk && c < Dv) {
            x[it] = *reinterpret_cast<const Pack<scalar_t, 8>*>(v + (k0 + j) * p.v_stride[2] + c);
          } else {
            for (int e = 0; e < 8; ++e) x[it].v[e] = zero;
          }
        }
#pragma unroll
        for (int it = 0; it < kBatch; ++it) {
          const int idx = tid + (i0 + it) * kWarps * kWarpSize;
          const int j = idx % kMmaTileKeys, c = 8 * (idx / kMmaTileKeys);
#pragma unroll
          for (int e = 0; e < 8; ++e) vt_s[(c + e) * ldt + j] = x[it].v[e];
        }
      }
    } else {
      for (int j = warp; j < kMmaTileKeys; j += kWarps) {
        const bool valid = j < nk;
        const scalar_t* ksrc = k + (k0 + j) * p.k_stride[2];
        const scalar_t* vsrc = v + (k0 + j) * p.v_stride[2];
        for (int c = lane; c < kBucket; c += kWarpSize) {
          k_s[j * ld + c] = valid && c < D ? ksrc[c * p.k_stride[3]] : zero;
          vt_s[c * ldt + j] = valid && c < Dv ? vsrc[c * p.v_stride[3]] : zero;
        }
      }
    }
    __syncthreads();

    // S = Q K^T: n-tile j is keys k0 + 8j .. + 7; B[kk][n] = K[8j + n][16 ks + kk].
    float s[kSTiles][4];
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
      const scalar_t* krow = k_s + (8 * j + g) * ld + 2 * t;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const uint32_t kb[2] = {load_pair(krow + 16 * ks), load_pair(krow + 16 * ks + 8)};
        mma_m16n8k16<scalar_t>(s[j], qa[ks], kb);
      }
    }

    // Scale and masks: element i of n-tile j is row l[i / 2], key k0 + 8j + 2t + i % 2. A tile with no mask,
    // 64 keys, the warp's 16 rows all in range and (under is_causal) every key at or before the warp's first
    // row only needs the scale: the common case takes that short path (uniform over the warp).
    float row_max[2] = {kNegInf, kNegInf};
    const int64_t warp_row0 = q0 + warp * kMmaRowsPerWarp;
    const bool plain = p.attn_mask_kind == kMaskNone && p.key_padding_mask_kind == kMaskNone &&
                       nk == kMmaTileKeys && warp_row0 + kMmaRowsPerWarp <= L &&
                       !(causal && k0 + kMmaTileKeys - 1 > warp_row0);
    if (plain) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[j][i] *= scale;
          row_max[i / 2] = nan_max(row_max[i / 2], s[j][i]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i / 2;
          const int jj = 8 * j + 2 * t + i % 2;
          const int64_t key = k0 + jj;
          float x = kNegInf;
          // Rows past L, and rows before the tile's first key under is_causal, read no mask.
          if (active[r] && jj < nk && !(causal && k0 > l[r])) {
            float bias = 0.0f;
            if (p.key_padding_mask_kind != kMaskNone) {
              bias = mask_value<float>(p.key_padding_mask_kind, ptr.key_padding_mask,
                                       kpm_base + key * p.key_padding_mask_stride[1]);
            }
            if (p.attn_mask_kind != kMaskNone) {
              bias = mask_value<float>(p.attn_mask_kind, ptr.attn_mask,
                                       am_base + l[r] * p.attn_mask_stride[2] + key * p.attn_mask_stride[3]) +
                     bias;
            }
            x = s[j][i] * scale + bias;
            if (causal && key > l[r]) x += kNegInf;
          }
          s[j][i] = x;
          row_max[r] = nan_max(row_max[r], x);
        }
      }
    }

    // Online softmax per row; a row's scores are spread over the 4 lanes of its quad.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
      m = nan_max(m, __shfl_xor_sync(kFullMask, m, 1));
      m = nan_max(m, __shfl_xor_sync(kFullMask, m, 2));
      const SoftmaxStep<float> step = softmax_step(state[r], m);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 2 * r; i < 2 * r + 2; ++i) {
          s[j][i] = fast_exp(s[j][i] - step.base);
          sum += s[j][i];
        }
      }
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      state[r] = softmax_advance(state[r], step, sum);
      alpha[r] = step.alpha;
    }
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] *= alpha[i / 2];
    }

    // O += P V: k-step kk covers keys 16kk .. 16kk + 15 = S n-tiles 2kk and 2kk + 1;
    // B[kk'][n] = V[16kk + kk'][8n' + n] = V^T[8n' + n][16kk + kk'].
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      const uint32_t pa[4] = {
          pack2(from_acc<scalar_t>(s[2 * kk][0]), from_acc<scalar_t>(s[2 * kk][1])),
          pack2(from_acc<scalar_t>(s[2 * kk][2]), from_acc<scalar_t>(s[2 * kk][3])),
          pack2(from_acc<scalar_t>(s[2 * kk + 1][0]), from_acc<scalar_t>(s[2 * kk + 1][1])),
          pack2(from_acc<scalar_t>(s[2 * kk + 1][2]), from_acc<scalar_t>(s[2 * kk + 1][3])),
      };
      const scalar_t* vcol = vt_s + g * ldt + 16 * kk + 2 * t;
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) {
        const scalar_t* vn = vcol + 8 * n * ldt;
        const uint32_t vb[2] = {load_pair(vn), load_pair(vn + 8)};
        mma_m16n8k16<scalar_t>(o[n], pa, vb);
      }
    }
  }

  // out = O / l, lse = m + log(l); fully masked rows: out 0, lse +inf.
  scalar_t* const out = static_cast<scalar_t*>(ptr.out) + b * p.out_stride[0] + h * p.out_stride[1];
  float* const lse = static_cast<float*>(ptr.lse) + b * p.lse_stride[0] + h * p.lse_stride[1];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!active[r]) continue;
    const bool empty = softmax_row_empty(state[r]);
    const float factor = softmax_out_scale(state[r]);
    scalar_t* dst = out + l[r] * p.out_stride[2];
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
      for (int i = 2 * r; i < 2 * r + 2; ++i) {
        const int c = 8 * n + 2 * t + i % 2;
        if (c < Dv) dst[c * p.out_stride[3]] = from_acc<scalar_t>(empty ? 0.0f : o[n][i] * factor);
      }
    }
    if (t == 0) lse[l[r] * p.lse_stride[2]] = softmax_lse(state[r]);
  }
}

template <typename scalar_t, int kBucket>
cudaError_t launch_mma(const AttentionParams& p, const AttentionPointers& ptr, const AttentionMmaPlan& plan,
                       cudaStream_t stream) {
  void (*kernel)(const AttentionParams, const AttentionPointers, const AttentionMmaPlan, const bool) =
      &attention_forward_mma<scalar_t, kBucket>;
  if (plan.smem_bytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem_bytes));
    if (err != cudaSuccess) return err;
  }
  return launch_kernel(kernel, dim3(static_cast<unsigned>(plan.blocks)), dim3(plan.threads), plan.smem_bytes,
                       stream, p, ptr, plan, mma_vector_loads(p, ptr.key, ptr.value));
}

template <typename scalar_t>
cudaError_t launch_mma_bucket(const AttentionParams& p, const AttentionPointers& ptr,
                              const AttentionMmaPlan& plan, cudaStream_t stream) {
  switch (plan.bucket) {
    case 32:
      return launch_mma<scalar_t, 32>(p, ptr, plan, stream);
    case 64:
      return launch_mma<scalar_t, 64>(p, ptr, plan, stream);
    case 128:
      return launch_mma<scalar_t, 128>(p, ptr, plan, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_attention_mma(const AttentionParams& p, DType dtype, const AttentionPointers& ptr,
                                 cudaStream_t stream) {
  if (!mma_supports(p, dtype)) return cudaErrorInvalidValue;
  const AttentionMmaPlan plan = plan_attention_mma(p, dtype);
  if (plan.blocks == 0) return cudaSuccess;
  if (plan.blocks > kMaxBlocks) return cudaErrorInvalidConfiguration;
  switch (dtype) {
    case DType::kFloat16:
      return launch_mma_bucket<__half>(p, ptr, plan, stream);
    case DType::kBFloat16:
      return launch_mma_bucket<__nv_bfloat16>(p, ptr, plan, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace attnx::cuda
