// attnx: the barrier and the watchdog both GPU emulations run on (the CUDA shim, cuda_shim.h, and the Metal
// runtime, metal/metal_runtime.cpp).
//
// A barrier is an arrival counter and a generation word that waiters wait on; how a waiter waits is the
// emulation's: std::atomic::wait (a futex on Linux) for one OS thread per GPU thread, a yield to the
// scheduler for the Metal tier's fibers. The acquire/release pairs order memory written before a barrier
// before what other threads read after it, and ThreadSanitizer follows them: an access no barrier orders is
// a reported race. Barriers cannot time out by themselves, so every completed phase counts as progress and a
// Watchdog aborts a launch that makes none for its timeout: a barrier or warp/simd collective that not every
// thread reaches would otherwise hang.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace attnx_emu_barrier {

// Barrier phases completed in this process.
inline std::atomic<uint64_t>& progress() {
  static std::atomic<uint64_t> counter{0};
  return counter;
}

// Sleeps until `word` no longer holds `seen` (the wait of one OS thread per GPU thread).
inline void wait_on_word(const std::atomic<uint32_t>& word, uint32_t seen) {
  for (uint32_t g = seen; g == seen; g = word.load(std::memory_order_acquire)) {
    word.wait(seen, std::memory_order_acquire);
  }
}

// `wait(word, seen)` returns once `word` no longer holds `seen`.
template <void (*wait)(const std::atomic<uint32_t>&, uint32_t)>
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}

  void arrive_and_wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      progress().fetch_add(1, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      generation_.notify_all();
      return;
    }
    wait(generation_, generation);
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
};

// While alive, calls on_stall(seconds) (which must not return) once no barrier has completed for `timeout`.
class Watchdog {
 public:
  Watchdog(std::chrono::seconds timeout, void (*on_stall)(long long seconds))
      : timeout_(timeout), on_stall_(on_stall), thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    uint64_t seen = progress().load();
    auto last = std::chrono::steady_clock::now();
    while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return done_; })) {
      const uint64_t now = progress().load();
      if (now != seen) {
        seen = now;
        last = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - last > timeout_) {
        on_stall_(static_cast<long long>(timeout_.count()));
      }
    }
  }

  const std::chrono::seconds timeout_;
  void (*const on_stall_)(long long seconds);
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace attnx_emu_barrier
