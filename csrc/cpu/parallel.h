// attnx: the CPU kernels' threading interface: parallel_for over a range and the thread count, torch-free.
//
// cpu/parallel.cpp implements it on torch's intra-op pool (the one torch.set_num_threads sizes) through the
// stable C API. The callable is passed as a function reference (no allocation, no std::function), so a kernel
// TU instantiates only the small trampoline below.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace attnx::cpu {

// A non-owning reference to a callable void(int64_t begin, int64_t end), valid for the call it is passed to.
class RangeFn {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, RangeFn>>>
  RangeFn(F&& f)
      : obj_(const_cast<void*>(static_cast<const void*>(&f))), call_(&trampoline<std::decay_t<F>>) {}
  void operator()(int64_t begin, int64_t end) const { call_(obj_, begin, end); }

 private:
  template <typename F>
  static void trampoline(void* obj, int64_t begin, int64_t end) {
    (*static_cast<F*>(obj))(begin, end);
  }
  void* obj_;
  void (*call_)(void*, int64_t, int64_t);
};

// Calls fn(b, e) on disjoint subranges [b, e) covering [begin, end), in parallel over the intra-op threads,
// each subrange at least `grain` long (except the last). Runs inline when already inside a parallel region.
void parallel_for(int64_t begin, int64_t end, int64_t grain, RangeFn fn);

// The number of intra-op threads parallel_for uses.
int64_t num_threads();

}  // namespace attnx::cpu
