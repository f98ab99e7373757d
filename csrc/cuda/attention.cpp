// attnx: attnx::attention on CUDA. The checks and layouts are common/attention.cpp; the kernels are
// cuda/attention_kernel.cu and attention_kernel_mma.cu (torch-free), chosen by choose_kernel
// (cuda/attention_plan.h) and launched on the current stream of the inputs' device. On the LibTorch stable
// ABI: the device guard is the shim's accelerator-generic one, the stream comes from the C shim, and nothing
// here needs libc10_cuda.
#include "cuda/attention.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/aten.h"
#include "common/stable.h"
#include "cuda/attention_composite.h"
#include "cuda/attention_kernel.h"
#include "cuda/device.h"

namespace attnx::cuda {

namespace {

// The forward's kernel for pb, with the error the call raises where no kernel takes it.
Kernel forward_kernel(const AttentionProblem& pb, DType dtype, const Target& target) {
  const Kernel kernel = choose_kernel(pb.params, dtype, target);
  ATTNX_CHECK(kernel != Kernel::kComposite || !pb.params.dropout, "attnx::attention: expected head dims up to ",
              kMaxHeadDim, " on CUDA with dropout_p > 0 (larger ones run on a composite without dropout), got D=",
              pb.params.head_dim, ", Dv=", pb.params.v_head_dim);
  return kernel;
}

}  // namespace

void run_attention(AttentionProblem& pb, const Target& target, cudaStream_t stream) {
  const DType dtype = kernel_dtype(pb.dtype, "attnx::attention");
  const Kernel kernel = forward_kernel(pb, dtype, target);
  if (kernel == Kernel::kComposite) {
    attention_composite(pb);
    return;
  }
  // The tensor-core kernel's mask tile classes and packed bool masks (MaskTiles: a few bytes per key tile
  // and query tile, and an eighth of a bool mask's elements), from the caching allocator on the call's
  // stream; computed again by every call, by the pre-pass the launcher runs first.
  const size_t bytes = attention_workspace_bytes(pb.params, dtype, pb.ptr, kernel);
  std::optional<Tensor> workspace;
  if (bytes > 0) {
    const int64_t words[1] = {static_cast<int64_t>(bytes / sizeof(int32_t))};
    workspace = aten::empty(words, torch::headeronly::ScalarType::Int, pb.lse.device());
  }
  const cudaError_t err = launch_attention(pb.params, dtype, pb.ptr, stream, kernel,
                                           workspace ? workspace->mutable_data_ptr() : nullptr);
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention: CUDA kernel launch failed (B=", pb.params.batch,
              ", H=", pb.params.heads, ", Hkv=", pb.params.kv_heads, ", L=", pb.params.q_len,
              ", S=", pb.params.kv_len, ", D=", pb.params.head_dim, ", Dv=", pb.params.v_head_dim, ", ",
              pb.dtype, "): ", cudaGetErrorString(err));
}

void attention_kernel(AttentionKernelProblem& pb, const Target& target) {
  const AttentionParams& p = pb.call.params;
  const char* op = pb.backward ? "attnx::attention_backward" : "attnx::attention";
  const DType dtype = kernel_dtype(pb.call.dtype, op);
  const std::string bucket = stable::str(dtype_name(dtype), " bucket ", head_dim_bucket(p.head_dim, p.v_head_dim));
  if (pb.backward) {
    pb.kernel = choose_fused_backward(p, target) ? "cuda fused " + bucket : "math";
    return;
  }
  switch (forward_kernel(pb.call, dtype, target)) {
    case Kernel::kMma:
      pb.kernel = "cuda mma " + bucket + (plan_attention_mma(p, dtype, pb.call.ptr).plain ? "" : " general");
      break;
    case Kernel::kSimt:
      pb.kernel = "cuda simt " + bucket;
      break;
    case Kernel::kComposite:
      pb.kernel = "cuda composite";
      break;
  }
}

}  // namespace attnx::cuda

// The CUDA library's entry points: the device of the call made current, its Target and its current stream.
// (The emulated backend compiles the glue above with ATTNX_CUDA_EMULATION and enters it with its own.)
#if !defined(ATTNX_CUDA_EMULATION)
namespace attnx {

void run_attention_cuda(AttentionProblem& pb) {
  // prepare_attention checked that every tensor is on query's device, a CUDA one (this kernel's key).
  const int32_t device = pb.query.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  cuda::run_attention(pb, cuda::target(device), cuda::current_stream(device));
}

void attention_kernel_cuda(AttentionKernelProblem& pb) {
  cuda::attention_kernel(pb, cuda::target(pb.call.query.get_device_index()));
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("_attention", &attnx::attention_op<attnx::run_attention_cuda>);
  m.impl("_attention_autograd", &attnx::attention_op<attnx::run_attention_cuda>);
  m.impl("_attention_kernel", &attnx::attention_op<attnx::attention_kernel_cuda>);
}
#endif
