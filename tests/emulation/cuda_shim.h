// attnx: the CUDA execution model on the CPU, enough to run attnx's kernels (csrc/cuda/*.cu) unmodified.
//
// g++ compiles a .cu file as C++ with -DATTNX_CUDA_EMULATION; csrc/cuda/common.cuh then includes this header.
// The toolkit's own headers (host-capable) supply dim3, cudaError_t, __half, __nv_bfloat16 and turn
// __device__/__global__/__shared__ into nothing; this file supplies the rest:
//   - one fiber (fibers.h) per CUDA thread of a block, all on the calling thread, switched at barriers in a
//   fixed round-robin order; or, under ThreadSanitizer or with -DATTNX_CUDA_EMU_THREADS, one std::thread
//   each. The blocks of a grid run one after another on the same fibers or threads;
//   - threadIdx / blockIdx / blockDim / gridDim as thread-locals;
//   - __syncthreads: a barrier of the block's threads; __syncwarp: a barrier of the warp's 32;
//   - __shfl_xor_sync / __shfl_sync / __all_sync / __any_sync / __ballot_sync: every lane of the warp writes
//   its
//     value into an exchange slot, a warp barrier, every lane reads the slot it asked for. Only full-warp
//     masks are supported (the kernels use nothing else), and every lane must arrive, as on sm70+;
//   - dynamic shared memory, filled with 0xff bytes (NaN as float or double) before each block, so a kernel
//     that reads shared memory it never wrote produces NaN rather than a lucky zero;
//   - launch_kernel(): grid/block/shared-memory checks like the runtime's (1024 threads, 48 KiB without
//     cudaFuncAttributeMaxDynamicSharedMemorySize, 227 KiB at most, as on sm90), then the run.
// A launch in which a barrier can never complete (a divergent __syncthreads or shuffle) aborts the process with a
// message instead of hanging: at once with fibers (no fiber can run), after kBarrierTimeout with threads.
//
//   - mma.sync.m16n8k16 (attnx::cuda::mma_m16n8k16) and ldmatrix: warp collectives over the PTX ISA's
//     fragment layouts; cp.async: queued per thread and performed when cp.async.wait_group lets no more be
//     pending (as late as the hardware may); a block that ends with copies it never waited for aborts.
// What this cannot show: races that the hardware's scheduling would expose but the OS's does not (run the
// TSan build for those), warp-synchronous code without __syncwarp, tensor-core instructions, performance.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "barrier.h"

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

// One OS thread per CUDA thread where ThreadSanitizer must see the threads (it follows their barriers);
// fibers otherwise (fibers.h), which switch in nanoseconds where 128 OS threads meeting at a futex take
// microseconds each.
#if !defined(ATTNX_CUDA_EMU_THREADS) && defined(__SANITIZE_THREAD__)
#define ATTNX_CUDA_EMU_THREADS 1
#endif
#if !defined(ATTNX_CUDA_EMU_THREADS) && defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ATTNX_CUDA_EMU_THREADS 1
#endif
#endif

namespace attnx_emu {

constexpr int kWarpSize = 32;
constexpr int kSlotBytes = 64;  // the largest value a lane exchanges (an mma's fragments: 40 bytes)
constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kMaxSharedBytes = 227 * 1024;  // sm90's opt-in maximum per block
constexpr auto kBarrierTimeout = std::chrono::seconds(120);

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "attnx CUDA emulation: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

// Barriers (barrier.h): with threads a waiter sleeps on the generation word, with fibers it yields to the
// scheduler until the word moves (cuda_shim.cpp).
void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen);
using Barrier = attnx_emu_barrier::Barrier<wait_for_change>;

[[noreturn]] inline void stalled(long long seconds) {
  char message[200];
  std::snprintf(message, sizeof message,
                "emulated kernel launch: no barrier completed for %lld s: a __syncthreads, __syncwarp or warp "
                "shuffle that not every thread reaches?",
                seconds);
  fail(message);
}

// The exchange slots of one warp, double-buffered: the slots of barrier phase k are rewritten at phase k + 2,
// after every lane has passed phase k + 1 and so finished reading them.
struct Warp {
  Warp() : barrier(kWarpSize) {}
  Barrier barrier;
  alignas(16) unsigned char slots[2][kWarpSize][kSlotBytes];
};

struct Block {
  Block(int threads, size_t smem_bytes)
      : barrier(threads), warps(new Warp[threads / kWarpSize]), smem(smem_bytes ? smem_bytes : 16) {}
  Barrier barrier;
  std::unique_ptr<Warp[]> warps;
  std::vector<unsigned char> smem;  // from operator new: 16-byte aligned on x86-64 and aarch64
};

struct ThreadState {
  Block* block = nullptr;
  Warp* warp = nullptr;
  int lane = 0;
  unsigned phase = 0;  // warp barrier phases this thread has passed
};

inline thread_local ThreadState tl;

inline unsigned char* dynamic_shared_memory() {
  return tl.block->smem.data();
}

inline void warp_barrier() {
  tl.warp->barrier.arrive_and_wait();
  ++tl.phase;
}

inline void check_mask(unsigned mask, const char* what) {
  if (mask != kFullMask) fail(what);
}

// Every lane publishes `value`; returns the values of all lanes (after one warp barrier).
template <typename T>
inline const unsigned char (*publish(const T& value)) [kSlotBytes] {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kSlotBytes,
                "warp exchange of an unsupported type");
  unsigned char (*slots)[kSlotBytes] = tl.warp->slots[tl.phase % 2];
  std::memcpy(slots[tl.lane], &value, sizeof(T));
  warp_barrier();
  return slots;
}

template <typename T>
inline T read_slot(const unsigned char (*slots)[kSlotBytes], int lane) {
  T out;
  std::memcpy(&out, slots[lane], sizeof(T));
  return out;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: every lane publishes its fragments; each rebuilds A, B
// and C from the fragment layouts of the PTX ISA (see csrc/cuda/common.cuh) and computes its own four
// elements of D = A B + C, in float. Bit-exactness with the hardware is not the point (its summation order
// differs); the layouts are: a kernel that puts an element in the wrong register gets the wrong result here
// too.
template <typename T>
inline float to_float16_value(uint16_t bits) {
  T x;
  std::memcpy(static_cast<void*>(&x), &bits, 2);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

// D = A B + C for one mma over every lane's fragments: each lane publishes its registers, `unpack(f, g, t, A,
// B)` places the A (16 x K) and B (K x 8) elements of a lane's registers f, and each lane computes its own
// four elements of D, whose layout (and C's) every m16n8 shape shares: d[0], d[1] = D[g][2t, 2t+1], d[2],
// d[3] = D[g+8][2t, 2t+1].
struct MmaFragments {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};

template <int K, typename Unpack>
inline void mma_m16n8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], Unpack unpack) {
  const MmaFragments mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {d[0], d[1], d[2], d[3]}};
  const auto slots = publish(mine);
  // This lane's elements of D are in rows g and g + 8 and columns 2t and 2t + 1: it reads A's rows from the
  // lanes that hold them (group g) and B's columns from theirs (groups 2t and 2t + 1), and C is its own d.
  const int g = tl.lane / 4, t = tl.lane % 4;
  float A[16][K], B[K][8];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const int group = lane / 4;
    if (group != g && group != 2 * t && group != 2 * t + 1) continue;
    unpack(read_slot<MmaFragments>(slots, lane), group, lane % 4, A, B);
  }
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i / 2) * 8, col = 2 * t + i % 2;
    float acc = d[i];
    for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
    d[i] = acc;
  }
}

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const auto lo = [](uint32_t r) { return to_float16_value<T>(static_cast<uint16_t>(r & 0xffffu)); };
  const auto hi = [](uint32_t r) { return to_float16_value<T>(static_cast<uint16_t>(r >> 16)); };
  mma_m16n8<16>(d, a, b, [&](const MmaFragments& f, int g, int t, float(&A)[16][16], float(&B)[16][8]) {
    A[g][2 * t] = lo(f.a[0]), A[g][2 * t + 1] = hi(f.a[0]);
    A[g + 8][2 * t] = lo(f.a[1]), A[g + 8][2 * t + 1] = hi(f.a[1]);
    A[g][2 * t + 8] = lo(f.a[2]), A[g][2 * t + 9] = hi(f.a[2]);
    A[g + 8][2 * t + 8] = lo(f.a[3]), A[g + 8][2 * t + 9] = hi(f.a[3]);
    B[2 * t][g] = lo(f.b[0]), B[2 * t + 1][g] = hi(f.b[0]);
    B[2 * t + 8][g] = lo(f.b[1]), B[2 * t + 9][g] = hi(f.b[1]);
  });
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, the same way: A 16x8 and B 8x8 from the fragment
// layouts (csrc/cuda/common.cuh), one element per register; the hardware reads only an operand's tf32 bits
// (the low 13 bits of the mantissa are ignored), so they are cleared here too.
inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const auto tf32 = [](uint32_t r) {
    r &= 0xffffe000u;
    float x;
    std::memcpy(&x, &r, 4);
    return x;
  };
  mma_m16n8<8>(d, a, b, [&](const MmaFragments& f, int g, int t, float(&A)[16][8], float(&B)[8][8]) {
    A[g][t] = tf32(f.a[0]), A[g + 8][t] = tf32(f.a[1]);
    A[g][t + 4] = tf32(f.a[2]), A[g + 8][t + 4] = tf32(f.a[3]);
    B[t][g] = tf32(f.b[0]), B[t + 4][g] = tf32(f.b[1]);
  });
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: every lane publishes its row address; lanes 8m .. 8m + 7
// address the rows of matrix m. Without .trans lane l receives row l / 4, elements 2 (l % 4) and
// 2 (l % 4) + 1 of each matrix; with .trans elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4). A row
// address that is not 16-byte aligned or not inside the block's shared memory aborts, as the hardware would
// fault.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const unsigned char* const lo = dynamic_shared_memory();
  const auto p = static_cast<const unsigned char*>(row);
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0 || p < lo || p + 16 > lo + tl.block->smem.size()) {
    fail("ldmatrix: a row address outside shared memory or not 16-byte aligned");
  }
  const auto slots = publish(row);
  const int g = tl.lane / 4, t = tl.lane % 4;
  const auto element = [&](int m, int row_in_matrix, int col) {
    uint16_t x;
    std::memcpy(&x, read_slot<const unsigned char*>(slots, 8 * m + row_in_matrix) + 2 * col, 2);
    return static_cast<uint32_t>(x);
  };
  for (int m = 0; m < 4; ++m) {
    r[m] = trans ? element(m, 2 * t, g) | element(m, 2 * t + 1, g) << 16
                 : element(m, g, 2 * t) | element(m, g, 2 * t + 1) << 16;
  }
  warp_barrier();  // no lane republishes before every lane has read the rows
}

// cp.async: each thread queues its copies and performs them when cp_async_wait allows no more to be pending,
// i.e. as late as the hardware may; commit closes a group.
struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
};
struct AsyncCopies {
  std::vector<AsyncCopy> queued;
  std::vector<size_t> group_ends;  // end index in `queued` of each committed group
};
inline thread_local AsyncCopies async_copies;

inline void cp_async_16(void* smem, const void* global, bool valid) {
  const unsigned char* const lo = dynamic_shared_memory();
  const auto p = static_cast<const unsigned char*>(smem);
  if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 || reinterpret_cast<uintptr_t>(global) % 16 != 0 ||
      p < lo || p + 16 > lo + tl.block->smem.size()) {
    fail("cp.async: a misaligned address or a destination outside shared memory");
  }
  async_copies.queued.push_back({smem, global, valid});
}

// A 16-byte store from shared memory to global memory (a uint4 move on the GPU): both addresses aligned.
inline void store_16(void* global, const void* smem) {
  const unsigned char* const lo = dynamic_shared_memory();
  const auto p = static_cast<const unsigned char*>(smem);
  if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 || reinterpret_cast<uintptr_t>(global) % 16 != 0 ||
      p < lo || p + 16 > lo + tl.block->smem.size()) {
    fail("store_16: a misaligned address or a source outside shared memory");
  }
  std::memcpy(global, smem, 16);
}

inline void cp_async_commit() {
  async_copies.group_ends.push_back(async_copies.queued.size());
}

inline void cp_async_wait(int pending) {
  AsyncCopies& q = async_copies;
  const int groups = static_cast<int>(q.group_ends.size());
  if (groups <= pending) return;
  const size_t done = q.group_ends[groups - pending - 1];
  for (size_t i = 0; i < done; ++i) {
    if (q.queued[i].valid) {
      std::memcpy(q.queued[i].dst, q.queued[i].src, 16);
    } else {
      std::memset(q.queued[i].dst, 0, 16);
    }
  }
  q.queued.erase(q.queued.begin(), q.queued.begin() + static_cast<std::ptrdiff_t>(done));
  q.group_ends.erase(q.group_ends.begin(), q.group_ends.begin() + (groups - pending));
  for (size_t& end : q.group_ends) end -= done;
}

inline std::vector<std::pair<const void*, int>>& smem_attributes() {
  static std::vector<std::pair<const void*, int>> attributes;
  return attributes;
}

inline cudaError_t& last_error() {
  static cudaError_t error = cudaSuccess;
  return error;
}

// kernel<<<grid, block, smem>>>(args...) on the emulated threads; returns what cudaGetLastError would after
// the launch.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                          Args&&... args);

// Runs body(context, tid) for tid in [0, threads) as the block's threads (fibers or std::threads, see above),
// returning when every one has finished (cuda_shim.cpp).
void run_threads(int threads, void (*body)(void* context, int tid), void* context);

}  // namespace attnx_emu

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = attnx_emu::kWarpSize;

inline void __syncthreads() {
  attnx_emu::tl.block->barrier.arrive_and_wait();
}

inline void __syncwarp(unsigned mask = attnx_emu::kFullMask) {
  attnx_emu::check_mask(mask, "__syncwarp with a partial mask is not emulated");
  attnx_emu::warp_barrier();
}

template <typename T>
inline T __shfl_sync(unsigned mask, T value, int src_lane, int width = attnx_emu::kWarpSize) {
  attnx_emu::check_mask(mask, "__shfl_sync with a partial mask is not emulated");
  if (width != attnx_emu::kWarpSize) attnx_emu::fail("__shfl_sync with width < 32 is not emulated");
  return attnx_emu::read_slot<T>(attnx_emu::publish(value), src_lane & 31);
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = attnx_emu::kWarpSize) {
  attnx_emu::check_mask(mask, "__shfl_xor_sync with a partial mask is not emulated");
  if (width != attnx_emu::kWarpSize) attnx_emu::fail("__shfl_xor_sync with width < 32 is not emulated");
  return attnx_emu::read_slot<T>(attnx_emu::publish(value), (attnx_emu::tl.lane ^ lane_mask) & 31);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  attnx_emu::check_mask(mask, "__ballot_sync with a partial mask is not emulated");
  const auto slots = attnx_emu::publish(predicate != 0);
  unsigned bits = 0;
  for (int lane = 0; lane < attnx_emu::kWarpSize; ++lane) {
    if (attnx_emu::read_slot<bool>(slots, lane)) bits |= 1u << lane;
  }
  return bits;
}

// The position of the lowest set bit, 1-based; 0 when none is set (CUDA's __ffs).
inline int __ffs(int x) {
  return x == 0 ? 0 : __builtin_ctz(static_cast<unsigned>(x)) + 1;
}

inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == attnx_emu::kFullMask;
}
inline int __any_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) != 0;
}

namespace attnx_emu {

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                          Args&&... args) {
  const auto fail_launch = [](cudaError_t err) { return last_error() = err; };
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64) return fail_launch(cudaErrorInvalidConfiguration);
  if (threads % kWarpSize != 0) fail("blocks of a partial warp are not emulated");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    return fail_launch(cudaErrorInvalidConfiguration);
  }
  size_t allowed = kDefaultSharedBytes;
  for (const auto& [fn, bytes] : smem_attributes()) {
    if (fn == reinterpret_cast<const void*>(kernel)) allowed = static_cast<size_t>(bytes);
  }
  if (smem > allowed || smem > kMaxSharedBytes) return fail_launch(cudaErrorInvalidValue);

  // Kernel parameters are copied once, by value, as the runtime does.
  const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  Block state(static_cast<int>(threads), smem);
  const auto body = [&](int tid) {
    tl = ThreadState{&state, &state.warps[tid / kWarpSize], tid % kWarpSize, 0};
    threadIdx = uint3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
    blockDim = block;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          if (tid == 0) std::memset(state.smem.data(), 0xff, state.smem.size());
          state.barrier.arrive_and_wait();
          blockIdx = uint3{x, y, z};
          std::apply(kernel, params);
          if (!async_copies.queued.empty()) fail("a block ended with cp.async copies it never waited for");
          async_copies.group_ends.clear();
          state.barrier.arrive_and_wait();
        }
      }
    }
  };
  using Body = std::remove_const_t<decltype(body)>;
  run_threads(static_cast<int>(threads), [](void* context, int tid) { (*static_cast<const Body*>(context))(tid); },
              const_cast<Body*>(&body));
  return last_error() = cudaSuccess;
}

}  // namespace attnx_emu
