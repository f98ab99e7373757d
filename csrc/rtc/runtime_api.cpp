// attnx: the CUDA runtime functions the CUDA glue calls (cuda/device.h, cuda/attention.cpp), on the driver:
// the run-time compiled library links no CUDA runtime, so that it loads under a torch of any CUDA major.
// Hidden (-fvisibility=hidden): the library's calls bind to these, never to the runtime torch has loaded.
#include <cuda_runtime_api.h>

#include <exception>

#include "rtc/driver.h"

extern "C" {

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int ordinal) {
  // The attributes attnx reads (compute capability, opt-in shared memory) have the driver's numbers.
  try {
    const attnx::rtc::Driver& d = attnx::rtc::driver();
    int device = 0;
    if (d.DeviceGet(&device, ordinal) != 0) return cudaErrorInvalidDevice;
    return d.DeviceGetAttribute(value, static_cast<int>(attr), device) == 0 ? cudaSuccess
                                                                            : cudaErrorInvalidValue;
  } catch (const std::exception&) {
    return cudaErrorNoDevice;
  }
}

// The runtime's words for the errors the launchers return.
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected (attnx's run-time compiled kernels: no CUDA driver)";
    default:
      return "unknown error";
  }
}

}  // extern "C"
