// attnx: parallel.h on ATen's intra-op thread pool. The only ATen the CPU attention kernels' threading uses;
// under the stable ABI this file moves to torch::stable::parallel_for / torch::stable::get_num_threads.
#include "cpu/parallel.h"

#include <ATen/Parallel.h>

namespace attnx::cpu {

void parallel_for(int64_t begin, int64_t end, int64_t grain, RangeFn fn) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(b, e); });
}

int64_t num_threads() {
  return at::get_num_threads();
}

}  // namespace attnx::cpu
