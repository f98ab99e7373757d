// attnx: the CUDA driver (libcuda.so.1), opened at run time by the run-time compiled library: it links no
// CUDA runtime, so one library serves every CUDA major the driver supports. The driver API's types are
// declared here as their ABI has them (cuda.h): handles are pointers, results and devices ints.
#pragma once

#include <string>

namespace attnx::rtc {

struct Driver {
  using Result = int;  // CUresult
  Result (*Init)(unsigned flags);
  Result (*DriverGetVersion)(int* version);
  Result (*GetErrorString)(Result error, const char** text);
  Result (*DeviceGet)(int* device, int ordinal);
  Result (*DeviceGetAttribute)(int* value, int attribute, int device);
  Result (*CtxGetCurrent)(void** context);
  Result (*CtxGetDevice)(int* device);
  Result (*ModuleLoadData)(void** module, const void* image);
  Result (*ModuleGetFunction)(void** function, void* module, const char* name);
  Result (*FuncSetAttribute)(void* function, int attribute, int value);
  Result (*LaunchKernel)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                         unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream,
                         void** params, void** extra);
  int version = 0;

  // `what` failed with `result`, in the driver's words.
  std::string error(const char* what, Result result) const;
  // Throws error(what, result) where result is not CUDA_SUCCESS.
  void check(Result result, const char* what) const;
};

// The process's driver, opened and initialised (cuInit) at the first call. Throws std::runtime_error saying
// what is missing where there is no driver (no libcuda.so.1: a machine without an NVIDIA GPU) or it does not
// initialise; every call throws again.
const Driver& driver();

// The driver's version (12080 for CUDA 12.8).
inline int driver_version() {
  return driver().version;
}

// cuDeviceAttribute values attnx reads (the runtime's cudaDeviceAttr has the same numbers).
constexpr int kComputeCapabilityMajor = 75;
constexpr int kComputeCapabilityMinor = 76;
constexpr int kMaxSharedMemoryPerBlockOptin = 97;
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
constexpr int kMaxDynamicSharedBytes = 8;

}  // namespace attnx::rtc
