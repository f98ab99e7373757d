// attnx: what the CUDA glue files (cuda/attention.cpp, cuda/attention_backward.cpp) need from torch and the
// device: the kernels' dtype of a tensor's, the stream torch runs a device's work on (through the C shim:
// nothing here needs libc10_cuda) and the Target the kernel choice reads.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/stable.h"
#include "cuda/attention_plan.h"

// The C shim declares its CUDA calls only where torch's own USE_CUDA is defined, which an extension's build
// does not define; this is the shim's declaration. It lives in libtorch_cuda.
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);

namespace attnx::cuda {

// The kernels' DType of `t`; an error naming `op` for a dtype no kernel takes.
inline DType kernel_dtype(torch::headeronly::ScalarType t, const char* op) {
  using torch::headeronly::ScalarType;
  switch (t) {
    case ScalarType::Float:
      return DType::kFloat32;
    case ScalarType::Double:
      return DType::kFloat64;
    case ScalarType::Half:
      return DType::kFloat16;
    case ScalarType::BFloat16:
      return DType::kBFloat16;
    default:
      stable::fail(op, ": no CUDA kernel for dtype ", t);
  }
}

// The stream torch runs `device`'s work on now (torch.cuda.current_stream), so that a kernel is ordered with
// the ops around it.
inline cudaStream_t current_stream(int32_t device) {
  void* stream = nullptr;
  stable::check(aoti_torch_get_current_cuda_stream(device, &stream), "attnx: the current CUDA stream");
  return static_cast<cudaStream_t>(stream);
}

// The Target of `device` (cuda/attention_plan.h): its compute capability, and the process's ATTNX_CUDA_MMA
// (any value but 0 leaves the tensor cores on) and ATTNX_CUDA_FUSED_BACKWARD (1 turns the fused backward on),
// read once per process.
inline Target target(int32_t device) {
  static const bool mma = [] {
    const char* flag = std::getenv("ATTNX_CUDA_MMA");
    return flag == nullptr || std::strcmp(flag, "0") != 0;
  }();
  static const bool fused_backward = [] {
    const char* flag = std::getenv("ATTNX_CUDA_FUSED_BACKWARD");
    return flag != nullptr && std::strcmp(flag, "1") == 0;
  }();
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention: cannot read the compute capability of device ", device,
              ": ", cudaGetErrorString(err));
  return Target{major * 10 + minor, mma, fused_backward};
}

}  // namespace attnx::cuda
