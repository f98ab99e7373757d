// attnx: the runtime of the Metal emulation (see metal_runtime.h).
#include "metal_runtime.h"

#include "../barrier.h"

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if !defined(ATTNX_METAL_EMU_THREADS)
#include "../fibers.h"
#endif

namespace attnx_emu_metal {

namespace {

constexpr auto kWatchdogSeconds = std::chrono::seconds(120);

void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen);

// Barriers (barrier.h): with std::threads (ATTNX_METAL_EMU_THREADS, the ThreadSanitizer build) waiters sleep
// on the generation word; with fibers (the default) a waiter yields to the scheduler until it moves.
using Barrier = attnx_emu_barrier::Barrier<wait_for_change>;

[[noreturn]] void stalled(long long seconds) {
  fail("no barrier completed for %lld s: a threadgroup_barrier or simd collective that not every thread "
       "reaches?",
       seconds);
}

struct Site {
  const char* file;
  int line;
};

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

struct Slot {
  Site site;
  alignas(16) unsigned char value[kSlotBytes];
};

// The exchange slots of one simdgroup, double-buffered: the slots of phase k are rewritten at phase k + 2,
// after every lane has passed phase k + 1 and so finished reading them.
struct Simdgroup {
  Simdgroup() : barrier(kSimdWidth) {}
  Barrier barrier;
  Slot slots[2][kSimdWidth];
};

struct Threadgroup {
  explicit Threadgroup(int threads)
      : threads(threads),
        barrier(threads),
        sites(2 * threads),
        simdgroups(new Simdgroup[threads / kSimdWidth]) {}
  const int threads;
  Barrier barrier;
  std::vector<Site> sites;  // [phase % 2][tid]: where each thread met the threadgroup barrier
  std::unique_ptr<Simdgroup[]> simdgroups;
  alignas(64) unsigned char memory[kThreadgroupMemoryBytes];
};

struct ThreadState {
  Threadgroup* group = nullptr;
  Simdgroup* simd = nullptr;
  int tid = 0;
  uint32_t lane = 0;
  unsigned simd_phase = 0;
  unsigned group_phase = 0;
  size_t memory_used = 0;
};

#if defined(ATTNX_METAL_EMU_THREADS)
thread_local ThreadState tl_state;
ThreadState& state() {
  return tl_state;
}
#else
ThreadState* current_state = nullptr;  // the running fiber's
ThreadState& state() {
  return *current_state;
}
#endif

const Site kKernelEnd{"<the end of the kernel>", 0};

std::map<std::string, Thunk>& registry() {
  static std::map<std::string, Thunk> kernels;
  return kernels;
}

std::atomic<size_t> threadgroup_bytes_seen{0};

const Slot* exchange(const Site& site, const void* value, size_t bytes, const char* what) {
  Slot* slots = state().simd->slots[state().simd_phase % 2];
  slots[state().lane].site = site;
  if (bytes) std::memcpy(slots[state().lane].value, value, bytes);
  state().simd->barrier.arrive_and_wait();
  ++state().simd_phase;
  for (int lane = 0; lane < kSimdWidth; ++lane) {
    if (!same_site(slots[lane].site, site)) {
      fail(
          "%s at %s:%d: lane %u is there, lane %d is at %s:%d (simd collectives and simdgroup barriers must "
          "be "
          "reached by every lane of the simdgroup)",
          what, site.file, site.line, state().lane, lane, slots[lane].site.file, slots[lane].site.line);
    }
  }
  return slots;
}

void group_barrier(const Site& site) {
  Site* sites = state().group->sites.data() + (state().group_phase % 2) * state().group->threads;
  sites[state().tid] = site;
  state().group->barrier.arrive_and_wait();
  ++state().group_phase;
  for (int t = 0; t < state().group->threads; ++t) {
    if (!same_site(sites[t], site)) {
      fail(
          "threadgroup_barrier at %s:%d: thread %d is there, thread %d is at %s:%d (every thread of the "
          "threadgroup must reach the same barrier)",
          site.file, site.line, state().tid, t, sites[t].file, sites[t].line);
    }
  }
}

}  // namespace

void fail(const char* format, ...) {
  std::fprintf(stderr, "attnx Metal emulation: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

void register_kernel(const char* name, Thunk thunk) {
  if (!registry().emplace(name, thunk).second) fail("kernel %s instantiated twice", name);
}

Thunk find_kernel(const char* name) {
  const auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

int kernel_count() {
  return static_cast<int>(registry().size());
}

const char* kernel_name(int index) {
  auto it = registry().begin();
  std::advance(it, index);
  return it->first.c_str();
}

unsigned char* threadgroup_alloc(size_t bytes) {
  const size_t offset = (state().memory_used + 15) / 16 * 16;
  if (offset + bytes > kThreadgroupMemoryBytes) {
    fail("threadgroup memory: %zu bytes declared, more than the %zu every Apple GPU has", offset + bytes,
         kThreadgroupMemoryBytes);
  }
  state().memory_used = offset + bytes;
  return state().group->memory + offset;
}

void threadgroup_barrier_at(const char* file, int line) {
  group_barrier(Site{file, line});
}

void simdgroup_barrier_at(const char* file, int line) {
  exchange(Site{file, line}, nullptr, 0, "simdgroup_barrier");
}

const unsigned char* simd_exchange(const void* value, size_t bytes, const char* file, int line) {
  if (bytes > static_cast<size_t>(kSlotBytes)) fail("simd exchange of %zu bytes", bytes);
  const Slot* slots = exchange(Site{file, line}, value, bytes, "simd collective");
  // Slot i's value is at slots[i].value: hand back the first, with the Slot stride known to the shim.
  static_assert(sizeof(Slot) == 16 + kSlotBytes, "the shim reads values 80 bytes apart");
  return slots[0].value;
}

uint32_t simd_lane() {
  return state().lane;
}

namespace {

// One thread's whole share of a launch: every threadgroup of the grid in turn.
void run_thread(Thunk thunk, Threadgroup& group, const int64_t* grid, void* const* buffers, int tid) {
  ThreadState& me = state();
  me = ThreadState{};
  me.group = &group;
  me.simd = &group.simdgroups[tid / kSimdWidth];
  me.tid = tid;
  me.lane = static_cast<uint32_t>(tid % kSimdWidth);
  for (int64_t z = 0; z < grid[2]; ++z) {
    for (int64_t y = 0; y < grid[1]; ++y) {
      for (int64_t x = 0; x < grid[0]; ++x) {
        if (tid == 0) std::memset(group.memory, 0xff, sizeof group.memory);
        group.barrier.arrive_and_wait();
        me.memory_used = 0;
        const Invocation inv{buffers,
                             {static_cast<uint32_t>(x), static_cast<uint32_t>(y), static_cast<uint32_t>(z)},
                             static_cast<uint32_t>(tid),
                             me.lane,
                             static_cast<uint32_t>(tid / kSimdWidth)};
        thunk(inv);
        // Every lane and every thread must get here, not stop in a collective or a barrier.
        exchange(kKernelEnd, nullptr, 0, "the end of the kernel");
        group_barrier(kKernelEnd);
        size_t seen = threadgroup_bytes_seen.load();
        while (me.memory_used > seen && !threadgroup_bytes_seen.compare_exchange_weak(seen, me.memory_used)) {
        }
      }
    }
  }
}

#if defined(ATTNX_METAL_EMU_THREADS)

void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen) {
  attnx_emu_barrier::wait_on_word(word, seen);
}

void run_all(Thunk thunk, Threadgroup& group, const int64_t* grid, void* const* buffers, int threads) {
  const attnx_emu_barrier::Watchdog watchdog(kWatchdogSeconds, stalled);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int tid = 0; tid < threads; ++tid)
    pool.emplace_back(run_thread, thunk, std::ref(group), grid, buffers, tid);
  for (auto& t : pool) t.join();
}

#else

// Fibers (../fibers.h) on the calling thread: each fiber's ThreadState is made current as it is resumed.
struct ThreadgroupRun {
  Thunk thunk;
  Threadgroup* group;
  const int64_t* grid;
  void* const* buffers;
  std::vector<ThreadState> states;
};

void wait_for_change(const std::atomic<uint32_t>& word, uint32_t seen) {
  attnx_emu_fibers::wait_for_change(word, seen);
}

void run_all(Thunk thunk, Threadgroup& group, const int64_t* grid, void* const* buffers, int threads) {
  ThreadgroupRun run{thunk, &group, grid, buffers, std::vector<ThreadState>(threads)};
  const int finished = attnx_emu_fibers::run(
      threads, {[](void* r, int tid) {
                  auto* run = static_cast<ThreadgroupRun*>(r);
                  run_thread(run->thunk, *run->group, run->grid, run->buffers, tid);
                },
                [](void* r, int tid, bool in) {
                  current_state = in ? &static_cast<ThreadgroupRun*>(r)->states[tid] : nullptr;
                },
                &run});
  if (finished < threads) {
    fail(
        "every thread waits at a barrier that will never complete: a threadgroup_barrier or simd "
        "collective that not every thread reaches (%d of %d threads have finished)",
        finished, threads);
  }
}

#endif

}  // namespace

int launch(const char* name, const int64_t grid[3], int threads, void* const* buffers) {
  const Thunk thunk = find_kernel(name);
  if (thunk == nullptr) return 1;
  if (threads <= 0 || threads > 1024 || threads % kSimdWidth != 0) return 2;
  threadgroup_bytes_seen = 0;
  if (grid[0] <= 0 || grid[1] <= 0 || grid[2] <= 0) return 0;
  auto group = std::make_unique<Threadgroup>(threads);
  run_all(thunk, *group, grid, buffers, threads);
  return 0;
}

size_t last_threadgroup_bytes() {
  return threadgroup_bytes_seen.load();
}

}  // namespace attnx_emu_metal
