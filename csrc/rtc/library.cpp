// attnx: attnx._C_nvrtc, the library of the CUDA kernels compiled at run time (compiler.h), loaded with
// attnx. Its ops configure the compiler, compile (or find) one kernel for an architecture, report the disk
// cache and the driver (python/attnx/_cuda_runtime.py, `python -m attnx.info` and the tests, which run them
// on machines without a GPU), and register its CUDA kernels where the loader chooses this route.
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "attnx_cuda_sources.h"  // kSourcesHash
#include "common/stable.h"
#include "cuda/impls.h"
#include "rtc/compiler.h"
#include "rtc/driver.h"

namespace attnx::rtc {

namespace {

// f(), with its std::runtime_error raised as the op's RuntimeError (stable::raise: also under torch < 2.13).
template <typename F>
auto raising(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    stable::raise(e.what());
  }
}

// attnx::_cuda_runtime_configure: NVRTC from the path `nvrtc`, the folders of its headers (`include_dirs`,
// separated by ':'), the disk cache in `cache_dir` ("" for none) bounded to `cache_max_bytes`. Returns
// [NVRTC's version, why the cache folder was refused ("" when it is used), the embedded sources' hash].
std::vector<std::string> configure(std::string nvrtc, std::string include_dirs, std::string cache_dir,
                                   int64_t cache_max_bytes) {
  return raising([&] {
    std::vector<std::string> dirs;
    for (size_t at = 0; at < include_dirs.size();) {
      const size_t end = std::min(include_dirs.find(':', at), include_dirs.size());
      if (end > at) dirs.push_back(include_dirs.substr(at, end - at));
      at = end + 1;
    }
    Compiler& compiler = Compiler::get();
    const std::string refusal = compiler.configure(
        nvrtc, std::move(dirs), cache_dir, static_cast<uint64_t>(std::max<int64_t>(cache_max_bytes, 0)));
    return std::vector<std::string>{compiler.nvrtc_version(), refusal, kSourcesHash};
  });
}

// attnx::_cuda_runtime_compile: the name expression `kernel` of the embedded source `source` for sm_`arch`.
// Returns [where it came from ("memory", "disk" or "compiled"), its cache key, its lowered name].
std::vector<std::string> compile(std::string source, std::string kernel, int64_t arch) {
  return raising([&] {
    Compiler& compiler = Compiler::get();
    const auto [image, origin] = compiler.kernel(source, kernel, static_cast<int>(arch));
    return std::vector<std::string>{origin_name(origin), compiler.key(source, kernel, static_cast<int>(arch)),
                                    image->lowered};
  });
}

// attnx::_cuda_runtime_options: the options NVRTC is given for a GPU of compute capability `arch`.
std::vector<std::string> options(int64_t arch) {
  return raising([&] {
    const Compiler& compiler = Compiler::get();
    return compile_options(compiler.target(static_cast<int>(arch)), compiler.include_dirs());
  });
}

// attnx::_cuda_runtime_cache: [its folder's entries, their bytes]; [] where no cache is in use.
std::vector<int64_t> cache() {
  const DiskCache* c = Compiler::get().cache();
  if (c == nullptr) return {};
  const DiskCache::Usage usage = c->usage();
  return {usage.entries, usage.bytes};
}

// attnx::_cuda_runtime_driver: the CUDA driver's version (12080 for 12.8); raises where there is none.
int64_t installed_driver() {
  return raising([] { return static_cast<int64_t>(driver_version()); });
}

// attnx::_cuda_runtime_enable: registers this library's CUDA kernels of attnx's ops (the glue of csrc/cuda/,
// launching through rtc/launch.h), once; returns whether they were registered before. The loader calls it
// where the prebuilt library is not loaded: one library serves CUDA.
bool enable() {
  static std::mutex mutex;
  static StableLibrary* cuda = nullptr;
  static StableLibrary* composite = nullptr;
  const std::lock_guard<std::mutex> lock(mutex);
  if (cuda != nullptr) return true;
  cuda = new StableLibrary(StableLibrary::Kind::IMPL, "attnx", "CUDA", __FILE__, __LINE__);
  composite =
      new StableLibrary(StableLibrary::Kind::IMPL, "attnx", "CompositeExplicitAutograd", __FILE__, __LINE__);
  linear_cuda_impls(*cuda);
  attention_cuda_impls(*cuda);
  attention_backward_cuda_impls(*cuda);
  cuda_composite_impls(*composite);
  return false;
}

}  // namespace

}  // namespace attnx::rtc

STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("_cuda_runtime_configure", TORCH_BOX(&attnx::rtc::configure));
  m.impl("_cuda_runtime_compile", TORCH_BOX(&attnx::rtc::compile));
  m.impl("_cuda_runtime_options", TORCH_BOX(&attnx::rtc::options));
  m.impl("_cuda_runtime_cache", TORCH_BOX(&attnx::rtc::cache));
  m.impl("_cuda_runtime_driver", TORCH_BOX(&attnx::rtc::installed_driver));
  m.impl("_cuda_runtime_enable", TORCH_BOX(&attnx::rtc::enable));
}
