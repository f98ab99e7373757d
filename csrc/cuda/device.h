// attnx: what the CUDA glue files (cuda/attention.cpp, cuda/attention_backward.cpp) need from torch and the
// device: the kernels' dtype of a tensor's, the stream torch runs a device's work on (through the C shim:
// nothing here needs libc10_cuda) and the Target the kernel choice reads.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/headeronly/core/ScalarType.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

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

// Whether the process lets torch's flash kernel take the calls it computes as attnx does:
// ATTNX_CUDA_TORCH_FLASH (0: no) when first asked, then what attnx::_cuda_torch_flash last set (benchmarks
// time attnx's own kernel beside it).
inline std::atomic<bool>& torch_flash_enabled() {
  static std::atomic<bool> enabled{[] {
    const char* flag = std::getenv("ATTNX_CUDA_TORCH_FLASH");
    return flag == nullptr || std::strcmp(flag, "0") != 0;
  }()};
  return enabled;
}

// Set when torch's flash kernel refused a call it was chosen for (a torch built without it, a device it does
// not run on, a schema this attnx does not know): from then on the process's calls take attnx's kernels.
inline std::atomic<bool>& torch_flash_refused() {
  static std::atomic<bool> refused{false};
  return refused;
}

// A tile shape's name, as attnx::_cuda_mma_shape takes it and the kernel choice prints it: "32x64 w4 s2" for
// 32 query rows a warp, 64 keys a tile, 4 warps, 2 stages.
inline std::string mma_shape_name(int code) {
  const MmaShape s = mma_shape_of(code);
  return std::to_string(s.groups * kMmaRowsPerWarp) + "x" + std::to_string(s.keys) + " w" +
         std::to_string(s.warps) + " s" + std::to_string(s.stages);
}

// The shape (mma_shape_code) a name of mma_shape_name's names, -1 where it names none of the family.
inline int mma_shape_parse(const std::string& name) {
  for (const int code : kMmaShapes) {
    if (mma_shape_name(code) == name) return code;
  }
  return -1;
}

// The plain mma instantiation's shape the process asked for (mma_shape_code; 0: the default), which
// attnx::_cuda_mma_shape sets: gpu-check's sweep times the family with it.
inline std::atomic<int>& mma_shape_selected() {
  static std::atomic<int> shape{0};
  return shape;
}

// The Target of `device` (cuda/attention_plan.h): its compute capability and the shared memory a block may
// opt into; the process's ATTNX_CUDA_MMA (any value but 0 leaves the tensor cores on) and
// ATTNX_CUDA_FUSED_BACKWARD (1 turns the fused backward on), read once per process; and whether torch's flash
// kernel may take calls (torch_flash_enabled, unless it refused one).
inline Target target(int32_t device) {
  static const bool mma = [] {
    const char* flag = std::getenv("ATTNX_CUDA_MMA");
    return flag == nullptr || std::strcmp(flag, "0") != 0;
  }();
  static const bool fused_backward = [] {
    const char* flag = std::getenv("ATTNX_CUDA_FUSED_BACKWARD");
    return flag != nullptr && std::strcmp(flag, "1") == 0;
  }();
  int major = 0, minor = 0, smem = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention: cannot read the compute capability of device ", device,
              ": ", cudaGetErrorString(err));
  const bool torch_flash = torch_flash_enabled() && !torch_flash_refused();
  return Target{major * 10 + minor, mma, fused_backward, torch_flash, smem, mma_shape_selected()};
}

}  // namespace attnx::cuda
