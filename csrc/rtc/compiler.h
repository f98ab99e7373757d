// attnx: the CUDA kernels compiled at run time, for the GPU of the machine they run on, by the NVRTC of the
// user's torch (libnvrtc.so.12 or .13, opened with dlopen: nothing of CUDA is linked), from the sources
// embedded at build time (csrc/cuda/embed.py), and cached on disk (cache.h). The prebuilt library
// (attnx._C_cuda) stays the fast path where it loads; this serves another CUDA major and GPUs it has no
// code for. Torch-free: the errors are std::runtime_error, which the ops (library.cpp) raise as Python's.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rtc/cache.h"

namespace attnx::rtc {

// The NVRTC library, opened once from a path (or a name the dynamic loader searches for).
class Nvrtc {
 public:
  // Throws std::runtime_error naming `library` and what dlopen said where it cannot be opened or lacks a
  // function attnx calls.
  explicit Nvrtc(const std::string& library);
  Nvrtc(const Nvrtc&) = delete;
  Nvrtc& operator=(const Nvrtc&) = delete;

  const std::string& version() const { return version_; }  // "13.0"

  // What to compile for a GPU of compute capability `arch` (90): "sm_90" where NVRTC knows it, else the
  // newest virtual architecture it knows below ("compute_90" for a newer GPU: PTX, which the driver
  // compiles for it); throws where it knows none.
  std::string target(int arch) const;

  // The name expression `kernel` (attnx::cuda::attention_forward_mma<__half, 64, 0>) of the embedded source
  // `source` (attention_kernel_mma.cu) compiled with `options` to SASS; throws with NVRTC's log.
  KernelImage compile(const std::string& source, const std::string& kernel,
                      const std::vector<std::string>& options) const;

 private:
  struct Api;
  std::shared_ptr<const Api> api_;
  std::string version_;
  std::vector<int> archs_;  // the architectures NVRTC compiles for (nvrtcGetSupportedArchs)
};

// The options NVRTC is given for `target` (Nvrtc::target): the AOT build's (torch's half-precision defines,
// line info) and the folders holding cuda_fp16.h and cuda_bf16.h.
std::vector<std::string> compile_options(const std::string& target,
                                         const std::vector<std::string>& include_dirs);

// Where a kernel came from: this process's memory, the disk cache, or NVRTC just now.
enum class Origin { kMemory, kDisk, kCompiled };
const char* origin_name(Origin origin);

// The process's run-time compiler: NVRTC, the include folders, the disk cache and the last kernels
// compiled (a bounded map, most recent kept).
class Compiler {
 public:
  static Compiler& get();

  // Opens NVRTC from `nvrtc` (throws where it cannot) and the cache folder `cache_dir` ("" for none);
  // returns why the folder was refused, "" when it is used.
  std::string configure(const std::string& nvrtc, std::vector<std::string> include_dirs,
                        const std::string& cache_dir, uint64_t cache_max_bytes);

  // `kernel` of `source` for sm_`arch`, and where it came from. Throws where NVRTC is not configured or
  // the compile fails.
  std::pair<std::shared_ptr<const KernelImage>, Origin> kernel(const std::string& source,
                                                               const std::string& kernel, int arch);

  // The cache key of (`source`, `kernel`, `arch`): a hash of the embedded sources, the NVRTC version, the
  // options and the instantiation.
  std::string key(const std::string& source, const std::string& kernel, int arch) const;

  std::string nvrtc_version() const;
  std::string target(int arch) const;
  std::vector<std::string> include_dirs() const;
  const DiskCache* cache() const { return cache_.get(); }

  static constexpr size_t kMemoryEntries = 64;

 private:
  std::string key_locked(const std::string& source, const std::string& kernel, int arch) const;

  mutable std::mutex mutex_;
  std::unique_ptr<Nvrtc> nvrtc_;
  std::vector<std::string> include_dirs_;
  std::unique_ptr<DiskCache> cache_;
  std::list<std::pair<std::string, std::shared_ptr<const KernelImage>>> recent_;  // most recent first
};

}  // namespace attnx::rtc
