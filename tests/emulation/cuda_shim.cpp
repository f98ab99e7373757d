// attnx: the CUDA runtime functions the emulated kernels' launchers call (see cuda_shim.h).
#include "cuda_shim.h"

cudaError_t CUDARTAPI cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > attnx_emu::kMaxSharedBytes) {
      return attnx_emu::last_error() = cudaErrorInvalidValue;
    }
    for (auto& entry : attnx_emu::smem_attributes()) {
      if (entry.first == func) {
        entry.second = value;
        return cudaSuccess;
      }
    }
    attnx_emu::smem_attributes().emplace_back(func, value);
  }
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t err = attnx_emu::last_error();
  attnx_emu::last_error() = cudaSuccess;
  return err;
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    default:
      return "unrecognized error code";
  }
}
