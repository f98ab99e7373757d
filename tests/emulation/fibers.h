// attnx: the fibers both GPU emulations run a block's (threadgroup's) threads on (cuda_shim.cpp,
// metal/metal_runtime.cpp), unless a build asks for one std::thread each (the ThreadSanitizer builds).
//
// One fiber (ucontext) per GPU thread, all on the calling thread: a fiber runs until it waits at a barrier
// (barrier.h's Barrier with wait_for_change as its wait), then the scheduler resumes the next one that can go
// on, round-robin. Context switches cost nanoseconds where 128 OS threads meeting at a futex cost
// microseconds each on a busy machine; the order is deterministic (thread 0 runs as far as it can before
// thread 1 starts, so a missing barrier reads poisoned or stale memory), and a barrier that not every thread
// reaches is found at once (no fiber can run) instead of after a timeout. Under AddressSanitizer every switch
// is announced to it (__sanitizer_start/finish_switch_fiber), so that it follows the stacks.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <ucontext.h>

#include <atomic>
#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define ATTNX_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNX_EMU_ASAN 1
#endif
#endif
#if defined(ATTNX_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

namespace attnx_emu_fibers {

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  const std::atomic<uint32_t>* waiting_on = nullptr;  // the barrier generation it waits to change
  uint32_t waiting_seen = 0;
  bool done = false;
};

// What run() runs: body(context, i) is thread i; switched(context, i, in) is called as fiber i is resumed
// (in) and as it yields (!in), for the state an emulation keeps per OS thread.
struct Work {
  void (*body)(void* context, int i);
  void (*switched)(void* context, int i, bool in);
  void* context;
};

struct Scheduler {
  ucontext_t context;
  Work work;
  std::vector<Fiber> fibers;
  int current = -1;
  // The scheduler's stack, as AddressSanitizer reports it at the first switch into a fiber.
  const void* stack_bottom = nullptr;
  size_t stack_size = 0;
};

inline thread_local Scheduler* scheduler = nullptr;

// Announces a switch to the stack [bottom, bottom + size) (nullptr save: the fiber leaving ends), and its end.
inline void start_switch([[maybe_unused]] void** save, [[maybe_unused]] const void* bottom,
                         [[maybe_unused]] size_t size) {
#if defined(ATTNX_EMU_ASAN)
  __sanitizer_start_switch_fiber(save, bottom, size);
#endif
}
inline void finish_switch([[maybe_unused]] void* save, [[maybe_unused]] const void** bottom,
                          [[maybe_unused]] size_t* size) {
#if defined(ATTNX_EMU_ASAN)
  __sanitizer_finish_switch_fiber(save, bottom, size);
#endif
}

inline void fiber_main(unsigned i) {
  Scheduler* const s = scheduler;
  finish_switch(nullptr, &s->stack_bottom, &s->stack_size);
  s->work.body(s->work.context, static_cast<int>(i));
  s->fibers[i].done = true;
  start_switch(nullptr, s->stack_bottom, s->stack_size);
  // Returning resumes uc_link, the scheduler.
}

// The wait of barrier.h's Barrier on a fiber: yield to the scheduler until `word` no longer holds `seen`.
inline void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen) {
  Scheduler* const s = scheduler;
  Fiber& self = s->fibers[s->current];
  self.waiting_on = &word;
  self.waiting_seen = seen;
  void* save = nullptr;
  start_switch(&save, s->stack_bottom, s->stack_size);
  swapcontext(&self.context, &s->context);
  finish_switch(save, &s->stack_bottom, &s->stack_size);
}

// Runs `threads` fibers of `work` to the end; returns how many finished, fewer than `threads` when every one
// left waits at a barrier that will never complete.
inline int run(int threads, Work work) {
  Scheduler sched;
  sched.work = work;
  sched.fibers = std::vector<Fiber>(threads);
  Scheduler* const outer = scheduler;
  scheduler = &sched;
  for (int i = 0; i < threads; ++i) {
    Fiber& f = sched.fibers[i];
    f.stack.reset(new char[kStackBytes]);  // uninitialised: committed page by page as it is used
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &sched.context;
    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_main), 1, static_cast<unsigned>(i));
  }
  int remaining = threads;
  while (remaining > 0) {
    bool progressed = false;
    for (int i = 0; i < threads; ++i) {
      Fiber& f = sched.fibers[i];
      if (f.done) continue;
      if (f.waiting_on != nullptr) {
        if (f.waiting_on->load(std::memory_order_acquire) == f.waiting_seen) continue;
        f.waiting_on = nullptr;
      }
      sched.current = i;
      work.switched(work.context, i, true);
      void* save = nullptr;
      start_switch(&save, f.stack.get(), kStackBytes);
      swapcontext(&sched.context, &f.context);
      finish_switch(save, nullptr, nullptr);
      work.switched(work.context, i, false);
      progressed = true;
      if (f.done) --remaining;
    }
    if (!progressed) break;
  }
  scheduler = outer;
  return threads - remaining;
}

}  // namespace attnx_emu_fibers
