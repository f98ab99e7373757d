// attnx: mps::OnceCache (csrc/mps/pipeline_cache.h, the cache of mps::pipeline) under concurrent first use,
// built with ThreadSanitizer by test_metal_emulation.py. Stand-ins for Metal: the shared resource counts how
// often it is built, each value records the name and the shared resource it was built from; builds are slow
// (a few ms, as a Metal compile) so that the threads pile up on the first use. Exits non-zero, saying why,
// on any inconsistency; TSan reports any unordered access.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mps/pipeline_cache.h"

namespace {

struct Library {
  int serial;
};
struct Pipeline {
  std::string name;
  const Library* library;
};

std::atomic<int> libraries_built{0}, pipelines_built{0}, failures{0};

void fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  failures.fetch_add(1);
}

void slow() { std::this_thread::sleep_for(std::chrono::milliseconds(3)); }

}  // namespace

int main() {
  using Cache = attnx::mps::OnceCache<std::shared_ptr<Library>, std::shared_ptr<Pipeline>>;
  const std::vector<std::string> names = {"attention_f32", "attention_f16", "linear_gemm", "linear_gemv"};
  constexpr int kThreads = 16, kRounds = 50;

  // 1. Concurrent first use: every thread waits at the start line, then asks for every name in its own order.
  Cache cache;
  std::atomic<int> ready{0};
  std::vector<std::vector<const Pipeline*>> seen(kThreads, std::vector<const Pipeline*>(names.size()));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int round = 0; round < kRounds; ++round) {
        for (size_t i = 0; i < names.size(); ++i) {
          const size_t n = (i + t) % names.size();
          auto value = cache.get(
              names[n],
              [] {
                slow();
                return std::make_shared<Library>(Library{libraries_built.fetch_add(1)});
              },
              [&](const std::shared_ptr<Library>& library) {
                slow();
                pipelines_built.fetch_add(1);
                return std::make_shared<Pipeline>(Pipeline{names[n], library.get()});
              });
          if (value->name != names[n]) fail("thread got the value of another name");
          if (round == 0) seen[t][n] = value.get();
          if (value.get() != seen[t][n]) fail("a name's value changed between calls");
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  if (libraries_built.load() != 1) fail("the shared resource was built " + std::to_string(libraries_built) + " times");
  if (pipelines_built.load() != static_cast<int>(names.size())) {
    fail(std::to_string(pipelines_built) + " values built for " + std::to_string(names.size()) + " names");
  }
  for (int t = 1; t < kThreads; ++t) {
    if (seen[t] != seen[0]) fail("threads got different values for one name");
  }

  // 2. Builds that throw leave nothing behind and are tried again: the shared resource's first build and a
  //    value's first build fail, then both succeed.
  Cache retry;
  int shared_attempts = 0, value_attempts = 0;
  const auto make_shared = [&] {
    if (shared_attempts++ == 0) throw std::runtime_error("library");
    return std::make_shared<Library>(Library{100});
  };
  const auto make_value = [&](const std::shared_ptr<Library>& library) {
    if (value_attempts++ == 0) throw std::runtime_error("pipeline");
    return std::make_shared<Pipeline>(Pipeline{"k", library.get()});
  };
  for (const char* expected : {"library", "pipeline"}) {
    try {
      retry.get("k", make_shared, make_value);
      fail(std::string("the failing ") + expected + " build did not throw");
    } catch (const std::runtime_error& e) {
      if (e.what() != std::string(expected)) fail(std::string("unexpected error ") + e.what());
    }
  }
  const auto first = retry.get("k", make_shared, make_value);
  if (first->library->serial != 100 || retry.get("k", make_shared, make_value) != first) {
    fail("the retried builds were not cached");
  }
  if (shared_attempts != 2 || value_attempts != 2) fail("builds ran more often than needed");

  if (failures.load() == 0) std::printf("ok\n");
  return failures.load() == 0 ? 0 : 1;
}
