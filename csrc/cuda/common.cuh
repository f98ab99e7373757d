// attnx: what every attnx .cu file shares: element conversions, warp reductions, and the two constructs that
// differ between nvcc and the CPU emulation (tests/emulation/cuda_shim.h): dynamic shared memory and the
// launch.
//
// Torch-free on purpose: a .cu that includes ATen takes ~30 s and 1.5 GB in nvcc, one that does not ~1 s.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#if !defined(__CUDACC_RTC__)  // NVRTC has none of these; attnx/rtc.h stands in for what the kernels use
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>
#endif

#if defined(ATTNX_CUDA_EMULATION)
// g++ compiles this file for the CPU: threadIdx, __syncthreads, warp shuffles and the launch are emulated.
#include "cuda_shim.h"
#endif
#if defined(ATTNX_CUDA_HOST_ONLY)
// The host compiler compiles the launchers alone, for the run-time compiled library (csrc/rtc/launch.h): the
// kernels and their device functions are left out (ATTNX_CUDA_DEVICE_CODE), NVRTC compiles them when a
// launch first needs them.
#include "rtc/launch.h"
#endif

#include "attnx/key_range.h"
#include "attnx/params.h"
#include "attnx/philox.h"
#include "attnx/softmax.h"
#include "cuda/attention_plan.h"

// Whether this compile holds the kernels (every one but the run-time compiled library's host side).
#if defined(ATTNX_CUDA_HOST_ONLY)
#define ATTNX_CUDA_DEVICE_CODE 0
#else
#define ATTNX_CUDA_DEVICE_CODE 1
#endif

// A launcher's kernel: the instantiation's address (nvcc, NVRTC, the emulation), or in the run-time compiled
// library its name expression, a KernelRef made once per instantiation (the lambda's static: one per
// enclosing template instantiation). ATTNX_KERNEL for a kernel template (`name<args...>`), ATTNX_KERNEL_FN
// for a kernel that is no template.
#if defined(ATTNX_CUDA_HOST_ONLY)
#define ATTNX_RTC_KERNEL_(name, ...)                                                         \
  ([]() -> ::attnx::rtc::KernelRef& {                                                        \
    static ::attnx::rtc::KernelRef kernel_ref(__FILE__, "attnx::cuda::" #name, __VA_ARGS__); \
    return kernel_ref;                                                                       \
  }())
#define ATTNX_KERNEL(name, ...) ATTNX_RTC_KERNEL_(name, ::attnx::rtc::template_arguments<__VA_ARGS__>())
#define ATTNX_KERNEL_FN(name) ATTNX_RTC_KERNEL_(name, std::string())
#else
#define ATTNX_KERNEL(name, ...) (&name<__VA_ARGS__>)
#define ATTNX_KERNEL_FN(name) (&name)
#endif

namespace attnx::cuda {

#if defined(ATTNX_CUDA_EMULATION)
#define ATTNX_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::attnx_emu::dynamic_shared_memory())
using ::attnx_emu::launch_kernel;
#else
#define ATTNX_DYNAMIC_SHARED(T, name)                          \
  extern __shared__ __align__(16) unsigned char attnx_smem_[]; \
  T* name = reinterpret_cast<T*>(attnx_smem_)

#if !defined(__CUDACC_RTC__) && ATTNX_CUDA_DEVICE_CODE  // nvcc's host code
// kernel<<<grid, block, smem, stream>>>(args...), then the launch's error, as C10_CUDA_KERNEL_LAUNCH_CHECK
// reads it.
template <typename... Params, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream, Args&&... args) {
  // clang-format off
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  // clang-format on
  return cudaGetLastError();
}
#endif
#endif

#if !defined(__CUDACC_RTC__)  // host code: NVRTC compiles the kernels only
#if ATTNX_CUDA_DEVICE_CODE
// A kernel's launch over `blocks` 1-D blocks of `threads` threads with `smem` bytes of dynamic shared memory:
// above 48 KiB a kernel must opt in first, and a device with less shared memory per block fails there.
template <typename... Params, typename... Args>
inline cudaError_t launch_plan(void (*kernel)(Params...), int64_t blocks, int threads, size_t smem,
                               cudaStream_t stream, Args&&... args) {
  // The run-time compiled library's launches (below), from the same launchers, pass the arguments' addresses
  // as the kernel's parameters: each must be of its parameter's type, which this build checks.
  static_assert((std::is_same<typename std::decay<Args>::type, Params>::value && ...),
                "a launch passes each kernel parameter's own type");
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), smem, stream,
                       std::forward<Args>(args)...);
}

#else
// The run-time compiled library's launch (rtc/launch.h): the driver takes the arguments' addresses.
template <typename... Args>
inline cudaError_t launch_plan(::attnx::rtc::KernelRef& kernel, int64_t blocks, int threads, size_t smem,
                               cudaStream_t stream, Args&&... args) {
  void* argv[] = {const_cast<void*>(static_cast<const void*>(&args))...};
  ::attnx::rtc::launch(kernel, blocks, threads, smem, stream, argv);
  return cudaSuccess;
}
#endif

// f(std::integral_constant<int, B>{}) for the B among kBuckets that equals `bucket` (a head-dim bucket a
// kernel is instantiated for); cudaErrorInvalidValue when none does.
template <int... kBuckets, typename F>
inline cudaError_t dispatch_bucket(int bucket, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  (void)((bucket == kBuckets ? (err = f(std::integral_constant<int, kBuckets>{}), true) : false) || ...);
  return err;
}

// f(scalar_t{}) for the element type of `dtype` (float, double, __half, __nv_bfloat16): the value is a type
// tag, read as decltype(tag), as the CPU kernels' dispatch_float_types passes it. cudaErrorInvalidValue for a
// value outside DType. A launcher without a kernel for some type refuses it in f with if constexpr, so that
// no kernel is instantiated for it.
template <typename F>
inline cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}
#endif

#if ATTNX_CUDA_DEVICE_CODE
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------------------
// Conversions. torch builds .cu files with __CUDA_NO_HALF_CONVERSIONS__ and friends, so half and bfloat16 go
// through the explicit intrinsics (round to nearest even, as torch's own casts).

__device__ __forceinline__ float to_acc(float x) {
  return x;
}
__device__ __forceinline__ double to_acc(double x) {
  return x;
}
__device__ __forceinline__ float to_acc(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
struct FromAcc;
template <>
struct FromAcc<float> {
  __device__ __forceinline__ static float cast(float x) { return x; }
};
template <>
struct FromAcc<double> {
  __device__ __forceinline__ static double cast(double x) { return x; }
};
template <>
struct FromAcc<__half> {
  __device__ __forceinline__ static __half cast(float x) { return __float2half_rn(x); }
};
template <>
struct FromAcc<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 cast(float x) { return __float2bfloat16_rn(x); }
};

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A x) {
  return FromAcc<T>::cast(x);
}

// A float mask's element type as a tag, for code compiled once per type (the tensor-core kernel's mask tile),
// where mask_value's runtime switch would be taken per element.
template <typename T>
struct MaskElements {};

// Calls f(MaskElements<T>{}) for a float mask's `kind` (float16, bfloat16, float32 or float64): compares,
// not a jump table, taken once where a loop over elements follows.
template <typename F>
__device__ __forceinline__ void with_float_mask(int32_t kind, F&& f) {
  if (kind == kMaskFloat16) {
    f(MaskElements<__half>{});
  } else if (kind == kMaskBFloat16) {
    f(MaskElements<__nv_bfloat16>{});
  } else if (kind == kMaskFloat32) {
    f(MaskElements<float>{});
  } else {
    f(MaskElements<double>{});
  }
}

// Element `offset` of a float mask of element type T as the float term it stands for (mask_value<float>'s).
template <typename T>
__device__ __forceinline__ float mask_term(MaskElements<T> /*type*/, const void* mask, int64_t offset) {
  return static_cast<float>(to_acc(static_cast<const T*>(mask)[offset]));
}

// One element of a mask, as the additive term it stands for: bool true = masked out (-inf), a float is added
// as it is, converted to the accumulator type like the reference's mask.to(acc). `kind` is the same for every
// thread of a launch, so the switch never diverges.
template <typename A>
__device__ __forceinline__ A mask_value(int32_t kind, const void* mask, int64_t offset) {
  switch (kind) {
    case kMaskBool:
      return static_cast<const bool*>(mask)[offset] ? -A(INFINITY) : A(0);
    case kMaskFloat16:
      return A(__half2float(static_cast<const __half*>(mask)[offset]));
    case kMaskBFloat16:
      return A(__bfloat162float(static_cast<const __nv_bfloat16*>(mask)[offset]));
    case kMaskFloat32:
      return A(static_cast<const float*>(mask)[offset]);
    case kMaskFloat64:
      return A(static_cast<const double*>(mask)[offset]);
    default:
      return A(0);
  }
}

// min in 32 bits (range_min's operands are 64-bit, and so would be a division of its result).
__device__ __forceinline__ uint32_t min_u32(uint32_t a, uint32_t b) {
  return a < b ? a : b;
}

// A block-sparse mask (AttentionParams::has_block_map), read by the tensor-core kernels, whose tiles lie in
// its blocks (mma_block_map_fits, cuda/attention_plan.h): the entry of query block qb and key block kb of
// (b, h): kBlockEmpty, kBlockFull or a PARTIAL block's index into block_bits. Broadcast dims have stride 0.
// Offsets in 32 bits (mma_block_map_fits bounds them).
__device__ __forceinline__ int32_t block_map_entry(const AttentionParams& p, const AttentionPointers& ptr,
                                                   int64_t b, int64_t h, uint32_t qb, uint32_t kb) {
  const int64_t* const st = p.block_map_stride;
  const uint32_t at = static_cast<uint32_t>(b) * static_cast<uint32_t>(st[0]) +
                      static_cast<uint32_t>(h) * static_cast<uint32_t>(st[1]) +
                      qb * static_cast<uint32_t>(st[2]) + kb * static_cast<uint32_t>(st[3]);
  return static_cast<const int32_t*>(ptr.block_map)[at];
}

// Query row l's block row of the map and its row in that block's bits (a row past L: the last row's, whose
// scores are not seen), in 32 bits.
__device__ __forceinline__ uint32_t block_of_row(const AttentionParams& p, int64_t l) {
  const uint32_t row = min_u32(static_cast<uint32_t>(l), static_cast<uint32_t>(p.q_len - 1));
  return row / static_cast<uint32_t>(p.block_q);
}
__device__ __forceinline__ uint32_t row_in_block(const AttentionParams& p, int64_t l) {
  const uint32_t row = min_u32(static_cast<uint32_t>(l), static_cast<uint32_t>(p.q_len - 1));
  return row % static_cast<uint32_t>(p.block_q);
}

// Up to 64 keys of row r of a block of class `entry`, from its key `key` (a multiple of 32, below block_k):
// bit i set removes key + i. A PARTIAL block's are its bits (two words of its row; one where the row ends
// after the first), an EMPTY block's all set, a FULL block's all clear; an entry that is none of these (not
// checked on the host: AttentionParams::block_partial) reads as EMPTY, never past block_bits.
__device__ __forceinline__ uint64_t block_row_bits(const AttentionParams& p, const AttentionPointers& ptr,
                                                   int32_t entry, uint32_t r, uint32_t key) {
  if (entry == kBlockFull) return 0;
  if (entry < 0 || entry >= p.block_partial) return ~uint64_t{0};
  const int64_t* const st = p.block_bits_stride;
  const uint32_t word = static_cast<uint32_t>(st[2]);
  const int32_t* const w = static_cast<const int32_t*>(ptr.block_bits) +
                           (static_cast<uint32_t>(entry) * static_cast<uint32_t>(st[0]) +
                            r * static_cast<uint32_t>(st[1]) + key / 32 * word);
  const uint32_t hi = key + 32 < p.block_k ? static_cast<uint32_t>(w[word]) : 0u;
  return uint64_t{hi} << 32 | static_cast<uint32_t>(w[0]);
}

// ---------------------------------------------------------------------------------------------------------------
// The problem's features that are parameters of every kernel: grouped KV heads, key ranges
// (attnx/key_range.h), soft-capping and sinks.

// The kv head query head h reads: query heads come in groups of heads / kv_heads per kv head (the launchers
// check that kv_heads divides heads). Key and value are indexed there in place, never repeated. In 32-bit
// arithmetic: a launch has fewer than 2^31 blocks, hence fewer heads, and a 64-bit division costs the tile
// loop tens of registers (measured: 189 -> 232 in the mma kernel at bucket 64).
__device__ __forceinline__ int64_t kv_head_of(const AttentionParams& p, int64_t h) {
  const uint32_t group = static_cast<uint32_t>(p.heads) / static_cast<uint32_t>(p.kv_heads);
  return static_cast<int64_t>(static_cast<uint32_t>(h) / group);
}

// S_b: the valid keys of batch b, key_lengths[b] clamped into [0, S] (a GPU cannot report a bad value without
// a sync, so it is clamped, as attnx/key_range.h specifies), or S without key lengths.
__device__ __forceinline__ int64_t batch_kv_len(const AttentionParams& p, const void* key_lengths,
                                                int64_t b) {
  switch (p.key_lengths_kind) {
    case kKeyLengthsInt32:
      return range_kv_len(static_cast<const int32_t*>(key_lengths)[b * p.key_lengths_stride], p.kv_len);
    case kKeyLengthsInt64:
      return range_kv_len(static_cast<const int64_t*>(key_lengths)[b * p.key_lengths_stride], p.kv_len);
    default:
      return p.kv_len;
  }
}

// The query rows and the head a block computes, and where its operands start. Under is_causal the last query
// blocks see the most keys: they get the lowest block indices, so they start first and the short blocks fill
// in at the end. Otherwise consecutive blocks share (b, h), hence K and V in L2. (32-bit arithmetic: a launch
// has fewer than 2^31 blocks, kMaxBlocks, and 64-bit divisions cost registers.)
template <typename scalar_t>
struct BlockProblem {
  int64_t b, h, hk;                               // batch, query head, its kv head
  int64_t q0, rows;                               // the block's first query row and its number of rows
  int64_t kv_len;                                 // S_b
  const scalar_t* q;                              // query row 0 of (b, h)
  const scalar_t* k;                              // key 0 of (b, hk)
  const scalar_t* v;                              // value 0 of (b, hk)
  int64_t attn_mask_base, key_padding_mask_base;  // offsets of (b, h) in the masks
};

template <typename scalar_t>
__device__ __forceinline__ BlockProblem<scalar_t> block_problem(const AttentionParams& p,
                                                                const AttentionPointers& ptr,
                                                                int64_t q_blocks, int64_t bh_count,
                                                                int64_t rows_per_block) {
  const uint32_t block = blockIdx.x;
  const uint32_t nq = static_cast<uint32_t>(q_blocks), nbh = static_cast<uint32_t>(bh_count);
  uint32_t qb, bh;
  if (p.is_causal) {
    qb = nq - 1 - block / nbh;
    bh = block % nbh;
  } else {
    qb = block % nq;
    bh = block / nq;
  }
  const uint32_t heads = static_cast<uint32_t>(p.heads);
  BlockProblem<scalar_t> r;
  r.b = bh / heads;
  r.h = bh % heads;
  r.hk = kv_head_of(p, r.h);
  r.q0 = static_cast<int64_t>(qb) * rows_per_block;
  r.rows = p.q_len - r.q0 < rows_per_block ? p.q_len - r.q0 : rows_per_block;
  r.kv_len = batch_kv_len(p, ptr.key_lengths, r.b);
  r.q = static_cast<const scalar_t*>(ptr.query) + r.b * p.q_stride[0] + r.h * p.q_stride[1];
  r.k = static_cast<const scalar_t*>(ptr.key) + r.b * p.k_stride[0] + r.hk * p.k_stride[1];
  r.v = static_cast<const scalar_t*>(ptr.value) + r.b * p.v_stride[0] + r.hk * p.v_stride[1];
  r.attn_mask_base = r.b * p.attn_mask_stride[0] + r.h * p.attn_mask_stride[1];
  r.key_padding_mask_base = r.b * p.key_padding_mask_stride[0];
  return r;
}

// tanh in the accumulator type: the overload of the argument's type, tanhf in float (accurate; soft_cap_fast
// below is the SFU's).
template <typename A>
__device__ __forceinline__ A tanh_acc(A x) {
  return tanh(x);
}

// Soft-capping constants in the accumulator type: cap = softcap (float64: softcap + softcap_lo, the double
// the caller passed) and its reciprocal; cap = 0 when the problem has none.
template <typename A>
struct SoftCap {
  A cap;
  A inv_cap;
};

template <typename A>
__device__ __forceinline__ SoftCap<A> soft_cap_of(const AttentionParams& p) {
  SoftCap<A> c;
  c.cap = split_value<A>(p.softcap, p.softcap_lo);
  c.inv_cap = c.cap > A(0) ? A(1) / c.cap : A(0);
  return c;
}

// cap * tanh(x / cap) for a scaled score x: bounded by cap, ~x for |x| << cap. NaN stays NaN, +-inf gives
// +-cap, as the reference's tanh.
template <typename A>
__device__ __forceinline__ A soft_cap(A x, SoftCap<A> c) {
  return c.cap * tanh_acc(x * c.inv_cap);
}

// What turns a row's running statistics into its results: out = o * factor, lse.
template <typename A>
struct RowResult {
  A factor;
  A lse;
};

// The row's results, with the sink's logit in the denominator when `has_sink` (softmax.h's *_sink functions,
// shared by every backend): a row that saw no key keeps out 0 and lse +inf (the sink does not make it a row).
template <typename A>
__device__ __forceinline__ RowResult<A> softmax_finish(SoftmaxRow<A> row, bool has_sink, A sink) {
  RowResult<A> r;
  r.factor = has_sink ? softmax_out_scale_sink(row, sink) : softmax_out_scale(row);
  r.lse = has_sink ? softmax_lse_sink(row, sink) : softmax_lse(row);
  return r;
}

// ---------------------------------------------------------------------------------------------------------------
// Warp reductions (butterfly: every lane ends with the same value, bit for bit, since a + b == b + a).

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = nan_max(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// N elements of T as one aligned access: a 16-byte struct compiles to one ld.shared.v4.f32 (v2.f64).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// ---------------------------------------------------------------------------------------------------------------
// Tensor cores (sm80+): D += A B for one m16n8k16 tile, A row-major 16x16 and B column-major 16x8 in float16
// or bfloat16 (T), D 16x8 in float. Fragments are laid out as the PTX ISA specifies for mma.m16n8k16 (g =
// lane / 4, t = lane % 4; each 32-bit register holds two elements, the lower index in the low half):
//   a[0] = A[g][2t, 2t+1]  a[1] = A[g+8][2t, 2t+1]  a[2] = A[g][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]  b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1]  d[2], d[3] = D[g+8][2t, 2t+1]
// The CPU emulation replaces the instruction with a warp collective that rebuilds A, B and D from these
// layouts.

// The asm operands of an m16n8 mma `instruction` that accumulates in place into float d[4] from 32-bit A and B
// fragments a[4] and b[2] (the f16, bf16 and tf32 forms alike).
#define ATTNX_MMA_F32(instruction)                                                              \
  instruction " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"              \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::mma_m16n8k16<T>(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<T, __half>::value) {
    asm(ATTNX_MMA_F32("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"));
  } else {
    asm(ATTNX_MMA_F32("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // no tensor-core kernel below sm80; the glue never launches one there
#endif
}

// float32 on the same tensor cores (sm80+), 3xTF32: a float x is split into big = tf32(x) and small =
// tf32(x - big) (cvt.rna: round to nearest, ties away from zero, to 10 mantissa bits), and a b as big_a big_b
// + big_a small_b + small_a big_b, three mma.m16n8k8.tf32 with fp32 accumulators. The one term left out,
// small_a small_b, is below 2^-22 of |a b|: float32 accuracy, as CUTLASS's OpMultiplyAddFastF32 and SDPA's
// memory-efficient kernel in float32. Fragments of mma.m16n8k8.tf32 (one element per 32-bit register):
//   a[0] = A[g][t]  a[1] = A[g+8][t]  a[2] = A[g][t+4]  a[3] = A[g+8][t+4]
//   b[0] = B[t][g]  b[1] = B[t+4][g]
//   d[0], d[1] = D[g][2t, 2t+1]  d[2], d[3] = D[g+8][2t, 2t+1]

// A float's bit pattern, and back: how float32 elements ride in the 32-bit fragment registers.
__device__ __forceinline__ uint32_t float_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return bits;
}
__device__ __forceinline__ float bits_float(uint32_t bits) {
  float x;
  memcpy(&x, &bits, 4);
  return x;
}

// tf32(x) as cvt.rna.tf32.f32 returns it: x rounded to 10 mantissa bits, in a float's bit pattern.
__device__ __forceinline__ uint32_t to_tf32(float x) {
#if defined(ATTNX_CUDA_EMULATION) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) return bits;  // inf and NaN as they are
  return (bits + 0x1000u) & 0xffffe000u;                 // the magnitude rounded half away from zero
#else
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
#endif
}

// x = big + small, both tf32, exactly up to 2^-22 |x|.
struct Tf32Split {
  uint32_t big, small;
};
__device__ __forceinline__ Tf32Split split_tf32(float x) {
  const uint32_t big = to_tf32(x);
  return {big, to_tf32(x - bits_float(big))};
}

__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::mma_m16n8k8_tf32(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm(ATTNX_MMA_F32("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"));
#elif defined(__CUDA_ARCH__)
  __trap();  // no tensor-core kernel below sm80; the glue never launches one there
#endif
}

// d += A B in float32 accuracy, 3xTF32: A already split (it serves many B fragments), B given as the bit
// patterns of two floats and split here. The small terms go first, while the accumulator is still close to
// their size.
__device__ __forceinline__ void mma_m16n8k8_3xtf32(float (&d)[4], const uint32_t (&a_big)[4],
                                                   const uint32_t (&a_small)[4], const uint32_t (&b)[2]) {
  const Tf32Split x = split_tf32(bits_float(b[0])), y = split_tf32(bits_float(b[1]));
  mma_m16n8k8_tf32(d, a_small, {x.big, y.big});
  mma_m16n8k8_tf32(d, a_big, {x.small, y.small});
  mma_m16n8k8_tf32(d, a_big, {x.big, y.big});
}

// Two 16-bit elements as one 32-bit fragment register, `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  static_assert(sizeof(T) == 2, "pack2 packs 16-bit elements");
  uint16_t l, h;
  memcpy(&l, static_cast<const void*>(&lo), 2);
  memcpy(&h, static_cast<const void*>(&hi), 2);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

// Two floats rounded to T (round to nearest even) as one fragment register, `lo` in the low half: one
// cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 on the GPU.
template <typename T>
__device__ __forceinline__ uint32_t pack2_rn(float lo, float hi) {
#if defined(ATTNX_CUDA_EMULATION) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
  return pack2(from_acc<T>(lo), from_acc<T>(hi));
#else
  uint32_t r;
  if constexpr (std::is_same<T, __half>::value) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 matrices of 16-bit elements from shared memory, one per
// register. Lanes 8m .. 8m + 7 give the addresses of matrix m's rows (16 bytes each, 16-byte aligned).
// Without .trans, lane l receives row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of every matrix; with
// .trans (`kTrans`), elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4): the matrix read as column-major.
// Either way the register is the fragment an mma.m16n8k16 B operand wants (see mma_m16n8k16) when the
// matrix's rows are B's columns (no .trans) or B's rows (.trans). Volatile: it reads shared memory that
// barriers order.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::ldmatrix_x4(r, row, kTrans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // tensor-core kernels only; the glue never launches one below sm80
#endif
}

// cp.async.cg.shared.global: 16 bytes from global to shared memory without passing through registers (.cg:
// cached in L2 only). `valid` false zero-fills the 16 bytes and reads nothing (src-size 0). The copy lands
// at the latest when cp_async_wait<N> returns for its group (groups close with cp_async_commit); a barrier
// after the wait makes it visible to the block. The emulation performs each copy as late as that allows, so
// a missing wait reads stale shared memory there too.
__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::cp_async_16(smem, global, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global),
               "r"(valid ? 16 : 0)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// `p`, hidden from the compiler's arithmetic: a pointer advanced by a run-time stride in an unrolled loop
// stays a chain of 64-bit adds (2 instructions a step) where the compiler would otherwise rewrite each as
// base + i stride, a 64-bit multiply a step.
template <typename T>
__device__ __forceinline__ T* opaque(T* p) {
#if defined(__CUDA_ARCH__) && !defined(ATTNX_CUDA_EMULATION)
  asm("" : "+l"(p));
#endif
  return p;
}

// `p`, as a new value at every call (volatile): loads through it stay where the call is, never hoisted out of
// a loop whose iterations read the same addresses (where holding what they read would take the loop's
// registers).
template <typename T>
__device__ __forceinline__ T* fresh(T* p) {
#if defined(__CUDA_ARCH__) && !defined(ATTNX_CUDA_EMULATION)
  asm volatile("" : "+l"(p));
#endif
  return p;
}

// One 16-byte store of shared memory to global memory, both addresses 16-byte aligned.
__device__ __forceinline__ void store_16(void* global, const void* smem) {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::store_16(global, smem);
#else
  *static_cast<uint4*>(global) = *static_cast<const uint4*>(smem);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(ATTNX_CUDA_EMULATION)
  ::attnx_emu::cp_async_wait(kPending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// tanh(x) = 1 - 2 / (exp(2x) + 1) on the SFU (ex2.approx and an approximate division): absolute error ~1e-6,
// which soft-capping multiplies by the cap (a score error of ~cap * 1e-6, far below what float16/bfloat16
// inputs carry), in a few instructions where tanhf takes a branchy polynomial and the registers for it.
// +-inf and large |x| give +-1 (exp overflows to inf, or underflows to 0); NaN stays NaN.
__device__ __forceinline__ float fast_tanh(float x) {
#if defined(ATTNX_CUDA_EMULATION)
  return 1.0f - 2.0f / (expf(2.0f * x) + 1.0f);
#else
  return 1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f);
#endif
}

// 2^x on the SFU: one ex2.approx.ftz (relative error ~2^-22; results and arguments below 2^-126 flush to 0,
// far below the probabilities' own rounding). The tensor-core kernel's exponential: with the scores' scale
// and log2(e) folded into the FFMA that subtracts the row's maximum, a probability is two instructions, as in
// FlashAttention-2. exp2f under the emulation, which therefore cannot see this error. -inf gives 0 and NaN
// stays NaN.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(ATTNX_CUDA_EMULATION) || !defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// nan_max (attnx/softmax.h) in one instruction on sm80+: max.NaN returns NaN when either argument is NaN.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(ATTNX_CUDA_EMULATION) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
  return nan_max(a, b);
#else
  float y;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
#endif
}

// Dropout's keep decisions for a lane's probabilities in an mma C fragment whose rows are queries (the
// forward's tile, the backward's query pass): kRows rows r (row_start(r): the Philox stream's element
// ((b H + h) L + l) S + k0 of the row's first key of the tile, attnx/philox.h) by kTiles n-tiles of 8 keys,
// the lane's pair of adjacent keys 8 j + 2 t, 8 j + 2 t + 1 in each: bit 2 (r kTiles + j) + i is set where
// key 8 j + 2 t + i of row r is kept. A Philox block is the draws of 4 consecutive elements, so where every
// row's tile starts on a block (`aligned`: S and k0 multiples of 4) the quad's 8 pairs in n-tiles 2m and
// 2m + 1 of a row lie in 4 blocks, each half of one n-tile: lane t draws half t / 2 of n-tile 2m + t % 2,
// keeps the pair that is its own and passes the other to lane t ^ 1, whose own it is: a block a lane per 4
// probabilities. Elsewhere each lane draws the block of each of its pairs, and the next one where the pair
// straddles two. The draws are made in loops that are not unrolled (the 10 rounds' code once rather than
// once per block).
template <int kRows, int kTiles, typename RowStart>
__device__ __forceinline__ uint32_t quad_dropout_bits(const AttentionParams& p, RowStart row_start,
                                                      bool aligned, int t) {
  static_assert(kRows * kTiles * 2 <= 32 && kTiles % 2 == 0, "a bit per probability of the lane");
  const uint32_t threshold = p.dropout_threshold;
  const auto draws = [&](uint64_t e) {  // the block of element e
    return dropout_block(e >> 2, p.dropout_seed[0], p.dropout_seed[1], p.dropout_offset[0],
                         p.dropout_offset[1]);
  };
  uint32_t kept = 0;
  if (aligned) {
    const int own = t % 2;  // lane t's block is in n-tile 2m + own; its partner's in the other
#pragma unroll 1
    for (int rm = 0; rm < kRows * kTiles / 2; ++rm) {
      const int r = rm / (kTiles / 2), m = rm % (kTiles / 2);
      const Philox4x32 block = draws(row_start(r) + static_cast<uint64_t>(8 * (2 * m + own) + 4 * (t / 2)));
      const uint32_t mine = static_cast<uint32_t>(philox_word(block, 2 * own) < threshold) |
                            static_cast<uint32_t>(philox_word(block, 2 * own + 1) < threshold) << 1;
      const uint32_t theirs = static_cast<uint32_t>(philox_word(block, 2 - 2 * own) < threshold) |
                              static_cast<uint32_t>(philox_word(block, 3 - 2 * own) < threshold) << 1;
      const uint32_t received = __shfl_xor_sync(kFullMask, theirs, 1);
      kept |= mine << (2 * (r * kTiles + 2 * m + own)) | received << (2 * (r * kTiles + 2 * m + 1 - own));
    }
  } else {
#pragma unroll 1
    for (int pair = 0; pair < kRows * kTiles; ++pair) {
      const int r = pair / kTiles, j = pair % kTiles;
      const uint64_t e = row_start(r) + static_cast<uint64_t>(8 * j + 2 * t);
      const uint32_t w = static_cast<uint32_t>(e & 3);
      const Philox4x32 block = draws(e);
      const uint32_t second = w == 3 ? draws(e + 1).x : philox_word(block, w + 1);
      kept |= static_cast<uint32_t>(philox_word(block, w) < threshold) << (2 * pair);
      kept |= static_cast<uint32_t>(second < threshold) << (2 * pair + 1);
    }
  }
  return kept;
}

// soft_cap with fast_tanh: the tensor-core kernel's, whose probabilities are rounded to 16 bits anyway.
__device__ __forceinline__ float soft_cap_fast(float x, SoftCap<float> c) {
  return c.cap * fast_tanh(x * c.inv_cap);
}

#endif  // ATTNX_CUDA_DEVICE_CODE

}  // namespace attnx::cuda
