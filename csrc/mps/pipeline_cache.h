// attnx: the process-wide cache behind mps::pipeline (metal_library.mm): values built once per name from a
// shared resource that is itself built once (the compute pipelines and the Metal library they come from).
// Plain C++ so that the emulation tier tests it under ThreadSanitizer (tests/emulation/metal/
// pipeline_cache_check.cpp): Metal itself exists on macOS only.
#pragma once

#include <mutex>
#include <string>
#include <unordered_map>

namespace attnx::mps {

// One mutex guards the shared resource and the map, and is held while either is built: concurrent first
// uses wait for the one thread building (Metal compiles a library or pipeline in milliseconds, once per
// process, so nothing is gained by building outside the lock and discarding duplicates). A build that throws
// leaves nothing behind; the next call tries again. Values are kept for the life of the process.
template <typename Shared, typename Value>
class OnceCache {
 public:
  // The value cached under `name`, built as make_value(shared) at its first request; `shared` is
  // make_shared() at the first request of all.
  template <typename MakeShared, typename MakeValue>
  Value get(const std::string& name, MakeShared&& make_shared, MakeValue&& make_value) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!shared_) shared_ = make_shared();
    const auto it = values_.find(name);
    if (it != values_.end()) return it->second;
    Value value = make_value(shared_);
    values_.emplace(name, value);
    return value;
  }

 private:
  std::mutex mutex_;
  Shared shared_{};
  std::unordered_map<std::string, Value> values_;
};

}  // namespace attnx::mps
