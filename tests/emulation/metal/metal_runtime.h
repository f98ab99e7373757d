// attnx: the Metal execution model on CPU threads: the runtime behind the metal_stdlib shim.
//
// Macro-free on purpose: the shim turns `device`, `constant`, `thread`, `threadgroup` and `kernel` into
// nothing in the kernels' translation units, so everything that uses std::thread lives in metal_runtime.cpp
// and talks to the shim through the declarations below.
//
// Model (one launch = one dispatchThreadgroups):
//   - one fiber (../fibers.h) per Metal thread of a threadgroup, all on the calling thread, switched at barriers
//     in a fixed round-robin order; or, built with -DATTNX_METAL_EMU_THREADS (the ThreadSanitizer build), one
//     std::thread each. The threadgroups of the grid run one after another on the same fibers or threads;
//   - threadgroup memory: one 32 KiB arena (every Apple GPU's limit), filled with 0xff bytes (NaN as float,
//     half and bfloat) before each threadgroup, handed out in declaration order; more than 32 KiB aborts;
//   - threadgroup_barrier: a barrier of the group's threads; simdgroup_barrier and every simd_* collective:
//     a barrier of the simdgroup's 32 lanes. Each records its call site, and every participant checks that
//     all the others arrived at the same one: a barrier or collective inside divergent control flow, or a
//     lane that returns while its simdgroup waits in a collective, aborts with both sites named. The end of
//     the kernel is such a site too;
//   - a barrier that can never complete aborts instead of hanging: at once with fibers (no fiber can run),
//     after two minutes without progress with threads.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace attnx_emu_metal {

constexpr int kSimdWidth = 32;
constexpr size_t kThreadgroupMemoryBytes = 32768;
constexpr int kSlotBytes = 64;  // the largest value a lane exchanges in a simd collective

// What a kernel's thunk needs to call it: its buffers in [[buffer(i)]] order and the thread's positions.
struct Invocation {
  void* const* buffers;
  uint32_t tgid[3];
  uint32_t tid, lane, sg;
};

using Thunk = void (*)(const Invocation&);

[[noreturn]] void fail(const char* format, ...);

// The registry of host names: ATTNX_INSTANTIATE_KERNEL registers each instantiation when the library loads.
void register_kernel(const char* name, Thunk thunk);
Thunk find_kernel(const char* name);
int kernel_count();
const char* kernel_name(int index);

// The calling thread's next `bytes` of threadgroup memory (16-byte aligned).
unsigned char* threadgroup_alloc(size_t bytes);

void threadgroup_barrier_at(const char* file, int line);
void simdgroup_barrier_at(const char* file, int line);

// Every lane of the simdgroup publishes `bytes` of `value` at the call site (file, line); returns the 32
// lanes' values, slot i = lane i, each kSlotBytes apart. Valid until the lane's next exchange.
const unsigned char* simd_exchange(const void* value, size_t bytes, const char* file, int line);
uint32_t simd_lane();

// Runs `name` on grid[0] x grid[1] x grid[2] threadgroups of `threads` threads. Returns 0, or 1 for an
// unknown name, 2 for a threadgroup size Metal refuses (0, above 1024, not a whole number of simdgroups).
int launch(const char* name, const int64_t grid[3], int threads, void* const* buffers);

// The threadgroup memory the last launch's kernel declared, in bytes (the largest over its threads).
size_t last_threadgroup_bytes();

}  // namespace attnx_emu_metal
