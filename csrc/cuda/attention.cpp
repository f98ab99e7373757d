// attnx: attnx::attention on CUDA. The checks and layouts are common/attention.cpp; the kernel is
// cuda/attention_kernel.cu (torch-free), launched here on the current stream of the inputs' device. On the
// LibTorch stable ABI: the device guard is the shim's accelerator-generic one, the stream comes from the C
// shim, and nothing here needs libc10_cuda.
#include "common/attention.h"

#include <cuda_runtime_api.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/stable.h"
#include "cuda/attention_composite.h"
#include "cuda/attention_kernel.h"
#include "cuda/stream.h"

namespace attnx {

namespace {

// The tensor-core kernel where it covers the problem (cuda::mma_supports: float16/bfloat16 with max(D, Dv)
// <= 128, float32 as 3xTF32 with max(D, Dv) <= 64, no dropout) and the device is sm80+; the SIMT kernel
// otherwise, or everywhere when ATTNX_CUDA_MMA=0 (read once per process).
cuda::Kernel select_kernel(const AttentionParams& p, cuda::DType dtype, int32_t device) {
  static const bool requested = [] {
    const char* flag = std::getenv("ATTNX_CUDA_MMA");
    return flag == nullptr || std::strcmp(flag, "0") != 0;
  }();
  if (!requested || !cuda::mma_supports(p, dtype)) return cuda::Kernel::kSimt;
  int major = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention: cannot read the compute capability of device ", device,
              ": ", cudaGetErrorString(err));
  return major >= 8 ? cuda::Kernel::kMma : cuda::Kernel::kSimt;
}

}  // namespace

void run_attention_cuda(AttentionProblem& pb) {
  // prepare_attention checked that every tensor is on query's device, a CUDA one (this kernel's key).
  const int32_t device = pb.query.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const cuda::DType dtype = cuda::kernel_dtype(pb.dtype, "attnx::attention");
  if (cuda::plan_attention(pb.params, dtype).bucket == 0) {
    ATTNX_CHECK(!pb.params.dropout, "attnx::attention: expected head dims up to ", cuda::kMaxHeadDim,
                " on CUDA with dropout_p > 0 (larger ones run on a composite without dropout), got D=",
                pb.params.head_dim, ", Dv=", pb.params.v_head_dim);
    cuda::attention_composite(pb);
    return;
  }
  const cudaError_t err = cuda::launch_attention(pb.params, dtype, pb.ptr, cuda::current_stream(device),
                                                 select_kernel(pb.params, dtype, device));
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention: CUDA kernel launch failed (B=", pb.params.batch,
              ", H=", pb.params.heads, ", Hkv=", pb.params.kv_heads, ", L=", pb.params.q_len,
              ", S=", pb.params.kv_len, ", D=", pb.params.head_dim, ", Dv=", pb.params.v_head_dim, ", ",
              pb.dtype, "): ", cudaGetErrorString(err));
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("_attention", &attnx::attention_op<attnx::run_attention_cuda>);
  m.impl("_attention_autograd", &attnx::attention_op<attnx::run_attention_cuda>);
}
