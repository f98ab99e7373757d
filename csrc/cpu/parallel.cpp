// attnx: parallel.h on torch's intra-op thread pool (the one torch.set_num_threads sizes), reached through
// the stable C API (torch_parallel_for, torch_get_num_threads; torch 2.10 on). An error thrown by `fn` on any
// thread comes back as the call's error and is raised again here with its message.
#include "cpu/parallel.h"

#include <torch/csrc/stable/c/shim.h>

#include "common/stable.h"

namespace attnx::cpu {

void parallel_for(int64_t begin, int64_t end, int64_t grain, RangeFn fn) {
  const auto call = [](int64_t b, int64_t e, void* ctx) { (*static_cast<const RangeFn*>(ctx))(b, e); };
  stable::check(torch_parallel_for(begin, end, grain, call, &fn), "attnx: parallel_for");
}

int64_t num_threads() {
  uint32_t threads = 1;
  stable::check(torch_get_num_threads(&threads), "attnx: get_num_threads");
  return threads;
}

}  // namespace attnx::cpu
