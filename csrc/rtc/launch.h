// attnx: the launches of the run-time compiled library (attnx._C_nvrtc). Its launchers are csrc/cuda/*.cu's
// own, compiled by the host compiler with ATTNX_CUDA_HOST_ONLY (cuda/common.cuh): without the kernels, each
// launch names its kernel instantiation (ATTNX_KERNEL: a KernelRef, one per instantiation a launcher can
// reach) and passes the addresses of its arguments, which nvcc's build checks are exactly the kernel's
// parameter types. The first launch of an instantiation on a device compiles it (compiler.h: from memory, the
// disk cache or NVRTC) and loads it into the device's primary context; later ones find its function in one
// atomic load. A module stays loaded for the process: at most one per instantiation and device.
#pragma once

#include <cuda_runtime_api.h>  // cudaStream_t (a CUstream): types only, nothing of the runtime is linked

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace attnx::rtc {

// The spelling of a kernel's element type in a name expression.
template <typename T>
const char* type_name();

// "<T, V...>" as a name expression's template arguments ("<__half, 64, 0>").
template <typename T, auto... V>
std::string template_arguments() {
  std::string out = std::string("<") + type_name<T>();
  ((out += ", " + std::to_string(static_cast<long long>(V))), ...);
  return out + ">";
}

class KernelRef {
 public:
  // The kernel `name` (qualified) of the .cu file `file` (its path, as __FILE__ gives it) with `arguments`
  // (template_arguments, or "" for a kernel that is no template).
  KernelRef(const char* file, const char* name, const std::string& arguments);

  // The kernel's function on the current context's device, compiled and loaded on its first use there;
  // raises std::runtime_error saying what failed.
  void* function(int device);
  // Sets the kernel's dynamic shared memory bound on `device` to `bytes` where it is below (the driver's
  // attribute, which a launch above 48 KiB needs).
  void reserve_smem(int device, void* function, size_t bytes);

  const std::string& source() const { return source_; }
  const std::string& expression() const { return expression_; }

  static constexpr int kMaxDevices = 64;

 private:
  std::string source_;      // attention_kernel_mma.cu
  std::string expression_;  // attnx::cuda::attention_forward_mma<__half, 64, 0>
  std::array<std::atomic<void*>, kMaxDevices> functions_{};
  std::array<std::atomic<size_t>, kMaxDevices> smem_{};  // the attribute set, per device
  std::mutex mutex_;
};

// kernel<<<blocks, threads, smem, stream>>>(*argv...) through the driver; raises std::runtime_error with the
// driver's or the compiler's message where it fails.
void launch(KernelRef& kernel, int64_t blocks, int threads, size_t smem, cudaStream_t stream, void** argv);

}  // namespace attnx::rtc
