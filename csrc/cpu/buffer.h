// attnx: uninitialised, 64-byte aligned heap arrays for the CPU kernels' scratch, torch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

namespace attnx::cpu {

// n elements of a trivial type T, uninitialised (like at::empty), starting on a 64-byte line.
template <typename T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t n) {
    if (n > 0) {
      data_.reset(static_cast<T*>(::operator new(static_cast<size_t>(n) * sizeof(T), std::align_val_t(64))));
    }
  }
  T* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::unique_ptr<T, Free> data_;
};

}  // namespace attnx::cpu
