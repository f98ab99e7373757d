// attnx: the CUDA runtime functions the emulated kernels' launchers call, and the threads of a block: fibers or
// std::threads (see cuda_shim.h).
#include "cuda_shim.h"

#if !defined(ATTNX_CUDA_EMU_THREADS)
#include <ucontext.h>
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

// Fibers on the calling thread: a fiber runs until it waits at a barrier (a __syncthreads, a warp collective),
// then the scheduler resumes the next one that can go on, round-robin, deterministically: thread 0 runs as far
// as it can before thread 1 starts, so a missing barrier reads poisoned or stale shared memory. The shim's
// thread-locals (threadIdx & co., the thread's warp state, its queued cp.async copies) are one set per OS
// thread: the scheduler swaps each fiber's in when it resumes it and out when it yields.
constexpr size_t kFiberStackBytes = 256 * 1024;

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

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  FiberLocals locals;
  const std::atomic<uint32_t>* waiting_on = nullptr;  // the barrier generation it waits to change
  uint32_t waiting_seen = 0;
  bool done = false;
};

struct Scheduler {
  ucontext_t context;
  Fiber* current = nullptr;
  void (*body)(void*, int);
  void* body_context;
  std::vector<Fiber> fibers;
};

thread_local Scheduler* scheduler = nullptr;

void fiber_main(unsigned tid) {
  scheduler->body(scheduler->body_context, static_cast<int>(tid));
  scheduler->current->done = true;
  // Returning resumes uc_link, the scheduler.
}

}  // namespace

void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen) {
  Fiber* self = scheduler->current;
  self->waiting_on = &word;
  self->waiting_seen = seen;
  swapcontext(&self->context, &scheduler->context);
}

void run_threads(int threads, void (*body)(void* context, int tid), void* context) {
  Scheduler sched;
  sched.body = body, sched.body_context = context;
  sched.fibers = std::vector<Fiber>(threads);
  Scheduler* const outer = scheduler;
  scheduler = &sched;
  for (int tid = 0; tid < threads; ++tid) {
    Fiber& f = sched.fibers[tid];
    f.stack.reset(new char[kFiberStackBytes]);  // uninitialised: committed page by page as it is used
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kFiberStackBytes;
    f.context.uc_link = &sched.context;
    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_main), 1, static_cast<unsigned>(tid));
  }
  // The calling thread's own locals are set aside while the fibers run, and given back after.
  FiberLocals caller;
  caller.swap_with_thread();
  for (int remaining = threads; remaining > 0;) {
    bool progressed = false;
    for (Fiber& f : sched.fibers) {
      if (f.done) continue;
      if (f.waiting_on != nullptr) {
        if (f.waiting_on->load(std::memory_order_acquire) == f.waiting_seen) continue;
        f.waiting_on = nullptr;
      }
      sched.current = &f;
      f.locals.swap_with_thread();
      swapcontext(&sched.context, &f.context);
      f.locals.swap_with_thread();
      progressed = true;
      if (f.done) --remaining;
    }
    if (!progressed) {
      char message[200];
      std::snprintf(message, sizeof message,
                    "every thread waits at a barrier that will never complete: a __syncthreads, __syncwarp or "
                    "warp shuffle that not every thread reaches (%d of %d threads have finished)",
                    threads - remaining, threads);
      fail(message);
    }
  }
  caller.swap_with_thread();
  scheduler = outer;
}

#endif

}  // namespace attnx_emu
