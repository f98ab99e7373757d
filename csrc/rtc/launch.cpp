// attnx: the run-time compiled library's launches (launch.h).
#include "rtc/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <stdexcept>

#include "rtc/compiler.h"
#include "rtc/driver.h"

namespace attnx::rtc {

template <>
const char* type_name<float>() {
  return "float";
}
template <>
const char* type_name<double>() {
  return "double";
}
template <>
const char* type_name<__half>() {
  return "__half";
}
template <>
const char* type_name<__nv_bfloat16>() {
  return "__nv_bfloat16";
}

KernelRef::KernelRef(const char* file, const char* name, const std::string& arguments)
    : expression_(std::string(name) + arguments) {
  const char* slash = std::strrchr(file, '/');
  source_ = slash ? slash + 1 : file;
}

void* KernelRef::function(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::runtime_error("attnx: CUDA device " + std::to_string(device) + " is past the " +
                             std::to_string(kMaxDevices) + " the run-time compiled kernels serve");
  }
  if (void* fn = functions_[device].load(std::memory_order_acquire)) return fn;
  const std::lock_guard<std::mutex> lock(mutex_);
  if (void* fn = functions_[device].load(std::memory_order_relaxed)) return fn;
  const Driver& d = driver();
  int major = 0, minor = 0;
  d.check(d.DeviceGetAttribute(&major, kComputeCapabilityMajor, device), "cuDeviceGetAttribute");
  d.check(d.DeviceGetAttribute(&minor, kComputeCapabilityMinor, device), "cuDeviceGetAttribute");
  const auto compiled = Compiler::get().kernel(source_, expression_, 10 * major + minor).first;
  // Loaded into the current context: the device's primary one, which torch's runtime made current.
  void* module = nullptr;
  d.check(d.ModuleLoadData(&module, compiled->image.data()),
          ("loading " + expression_ + " (cuModuleLoadData)").c_str());
  void* fn = nullptr;
  d.check(d.ModuleGetFunction(&fn, module, compiled->lowered.c_str()), "cuModuleGetFunction");
  functions_[device].store(fn, std::memory_order_release);
  return fn;
}

void KernelRef::reserve_smem(int device, void* function, size_t bytes) {
  // Every launch above 48 KiB asks: one atomic load once the attribute is set, the lock only to set it.
  if (smem_[device].load(std::memory_order_acquire) >= bytes) return;
  const std::lock_guard<std::mutex> lock(mutex_);
  if (smem_[device].load(std::memory_order_relaxed) >= bytes) return;
  const Driver& d = driver();
  d.check(d.FuncSetAttribute(function, kMaxDynamicSharedBytes, static_cast<int>(bytes)),
          ("reserving " + std::to_string(bytes) + " bytes of shared memory for " + expression_).c_str());
  smem_[device].store(bytes, std::memory_order_release);
}

void launch(KernelRef& kernel, int64_t blocks, int threads, size_t smem, cudaStream_t stream, void** argv) {
  const Driver& d = driver();
  void* context = nullptr;
  d.check(d.CtxGetCurrent(&context), "cuCtxGetCurrent");
  if (context == nullptr) {
    throw std::runtime_error("attnx: no current CUDA context for " + kernel.expression() +
                             " (torch sets the device's primary context current before attnx launches)");
  }
  int device = 0;
  d.check(d.CtxGetDevice(&device), "cuCtxGetDevice");
  void* fn = kernel.function(device);
  if (smem > 48 * 1024) kernel.reserve_smem(device, fn, smem);
  d.check(d.LaunchKernel(fn, static_cast<unsigned>(blocks), 1, 1, static_cast<unsigned>(threads), 1, 1,
                         static_cast<unsigned>(smem), stream, argv, nullptr),
          ("launching " + kernel.expression()).c_str());
}

}  // namespace attnx::rtc
