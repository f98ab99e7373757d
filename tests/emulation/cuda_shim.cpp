// attnx: the CUDA runtime functions the emulated kernels' launchers call, and the threads of a block: fibers or
// std::threads (see cuda_shim.h).
#include "cuda_shim.h"

#if !defined(ATTNX_CUDA_EMU_THREADS)
#include "fibers.h"
#endif

cudaError_t CUDARTAPI cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > attnx_emu::kMaxSharedBytes) {
      return attnx_emu::last_error() = cudaErrorInvalidValue;
    }
    for (auto& entry : attnx_emu::smem_attributes()) {
      if (entry.first == func) {
        entry.second = value;
        return cudaSuccess;
      }
    }
    attnx_emu::smem_attributes().emplace_back(func, value);
  }
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t err = attnx_emu::last_error();
  attnx_emu::last_error() = cudaSuccess;
  return err;
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    default:
      return "unrecognized error code";
  }
}

namespace attnx_emu {

#if defined(ATTNX_CUDA_EMU_THREADS)

void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen) {
  attnx_emu_barrier::wait_on_word(word, seen);
}

void run_threads(int threads, void (*body)(void* context, int tid), void* context) {
  const attnx_emu_barrier::Watchdog watchdog(kBarrierTimeout, stalled);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int tid = 0; tid < threads; ++tid) pool.emplace_back(body, context, tid);
  for (auto& t : pool) t.join();
}

#else

namespace {

// The shim's thread-locals (threadIdx & co., the thread's warp state, its queued cp.async copies) are one set
// per OS thread: each fiber's are swapped in as the scheduler resumes it and out as it yields.
struct FiberLocals {
  ThreadState state;
  AsyncCopies copies;
  uint3 thread_idx{}, block_idx{};
  dim3 block_dim, grid_dim;

  void swap_with_thread() {
    std::swap(state, tl);
    std::swap(copies, async_copies);
    std::swap(thread_idx, threadIdx);
    std::swap(block_idx, blockIdx);
    std::swap(block_dim, blockDim);
    std::swap(grid_dim, gridDim);
  }
};

struct FiberBlock {
  void (*body)(void* context, int tid);
  void* context;
  std::vector<FiberLocals> locals;
};

}  // namespace

void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen) {
  attnx_emu_fibers::wait_for_change(word, seen);
}

void run_threads(int threads, void (*body)(void* context, int tid), void* context) {
  FiberBlock block{body, context, std::vector<FiberLocals>(threads)};
  // The calling thread's own locals are set aside while the fibers run, and given back after.
  FiberLocals caller;
  caller.swap_with_thread();
  const int finished = attnx_emu_fibers::run(
      threads, {[](void* b, int tid) { static_cast<FiberBlock*>(b)->body(static_cast<FiberBlock*>(b)->context, tid); },
                [](void* b, int tid, bool) { static_cast<FiberBlock*>(b)->locals[tid].swap_with_thread(); }, &block});
  caller.swap_with_thread();
  if (finished < threads) {
    char message[200];
    std::snprintf(message, sizeof message,
                  "every thread waits at a barrier that will never complete: a __syncthreads, __syncwarp or warp "
                  "shuffle that not every thread reaches (%d of %d threads have finished)",
                  finished, threads);
    fail(message);
  }
}

#endif

}  // namespace attnx_emu
