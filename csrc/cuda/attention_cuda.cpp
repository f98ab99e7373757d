// attnx: attnx::attention on CUDA. The checks and layouts are common/attention.cpp; the kernel is
// attention.cu (torch-free), launched here on the current stream of the inputs' device.
//
// c10/cuda headers only: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE/cuSOLVER headers that a plain
// CUDA toolkit install lacks.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>

#include "common/attention.h"
#include "cuda/attention.h"
#include "cuda/attention_composite.h"

namespace attnx {

namespace {

cuda::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return cuda::DType::kFloat32;
    case at::kDouble:
      return cuda::DType::kFloat64;
    case at::kHalf:
      return cuda::DType::kFloat16;
    case at::kBFloat16:
      return cuda::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "attnx::attention: no CUDA kernel for dtype ", t);
  }
}

// The tensor-core kernel where it covers the problem (float16/bfloat16, max(D, Dv) <= 128, no dropout) and the
// device is sm80+; the SIMT kernel otherwise, or everywhere when ATTNX_CUDA_MMA=0 (read once per process).
cuda::Kernel select_kernel(const AttentionParams& p, cuda::DType dtype, c10::DeviceIndex device) {
  static const bool requested = [] {
    const char* flag = std::getenv("ATTNX_CUDA_MMA");
    return flag == nullptr || std::strcmp(flag, "0") != 0;
  }();
  if (!requested || !cuda::mma_supports(p, dtype)) return cuda::Kernel::kSimt;
  int major = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  TORCH_CHECK(err == cudaSuccess, "attnx::attention: cannot read the compute capability of device ", device,
              ": ", cudaGetErrorString(err));
  return major >= 8 ? cuda::Kernel::kMma : cuda::Kernel::kSimt;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value,
                                                  const std::optional<at::Tensor>& attn_mask,
                                                  const std::optional<at::Tensor>& key_padding_mask,
                                                  bool is_causal, std::optional<double> scale,
                                                  double dropout_p,
                                                  const std::optional<at::Tensor>& dropout_seed,
                                                  int64_t window_left, int64_t window_right,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  std::optional<double> softcap,
                                                  const std::optional<at::Tensor>& sinks) {
  // Only a CUDA query sets the device; any other mix of devices fails prepare_attention's device checks.
  c10::cuda::OptionalCUDAGuard guard;
  if (query.is_cuda()) guard.set_device(query.device());
  AttentionProblem pb = prepare_attention(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                                          dropout_p, dropout_seed, window_left, window_right, key_lengths,
                                          softcap, sinks);
  const cuda::DType dtype = kernel_dtype(pb.dtype);
  if (cuda::plan_attention(pb.params, dtype).bucket == 0) {
    TORCH_CHECK(!pb.params.dropout, "attnx::attention: expected head dims up to ", cuda::kMaxHeadDim,
                " on CUDA with dropout_p > 0 (larger ones run on a composite without dropout), got D=",
                pb.params.head_dim, ", Dv=", pb.params.v_head_dim);
    cuda::attention_composite(query, key, value, attn_mask, key_padding_mask, key_lengths, scale, softcap,
                              pb);
    return {pb.out, pb.lse};
  }
  const AttentionPointers ptr{pb.query,          pb.key,           pb.value,       pb.attn_mask,
                              pb.key_padding_mask, pb.out.data_ptr(), pb.lse.data_ptr(), pb.key_lengths,
                              pb.sinks};
  const c10::DeviceIndex device = query.device().index();
  const cudaError_t err =
      cuda::launch_attention(pb.params, dtype, ptr, c10::cuda::getCurrentCUDAStream(device),
                             select_kernel(pb.params, dtype, device));
  TORCH_CHECK(err == cudaSuccess, "attnx::attention: CUDA kernel launch failed (B=", pb.params.batch,
              ", H=", pb.params.heads, ", Hkv=", pb.params.kv_heads, ", L=", pb.params.q_len,
              ", S=", pb.params.kv_len, ", D=", pb.params.head_dim, ", Dv=", pb.params.v_head_dim, ", ", pb.dtype,
              "): ", cudaGetErrorString(err));
  return {pb.out, pb.lse};
}

}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("_attention", &attnx::attention_cuda);
  m.impl("_attention_autograd", &attnx::attention_cuda);
}
