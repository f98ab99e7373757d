// attnx: attnx::attention on CUDA. The checks and layouts are common/attention.cpp; the kernels are
// cuda/attention_kernel.cu and attention_kernel_mma.cu (torch-free), or torch's own flash kernel for the
// calls it computes exactly as attnx does, chosen by choose_kernel (cuda/attention_plan.h) and run on the
// current stream of the inputs' device. On the LibTorch stable ABI: the device guard is the shim's
// accelerator-generic one, the stream comes from the C shim, and nothing here needs libc10_cuda.
#include "cuda/attention.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "common/aten.h"
#include "common/stable.h"
#include "common/views.h"
#include "cuda/attention_composite.h"
#include "cuda/attention_kernel.h"
#include "cuda/device.h"
#include "cuda/impls.h"

namespace attnx::cuda {

namespace {

// The forward's kernel for pb, with the error the call raises where no kernel takes it.
Kernel forward_kernel(const AttentionProblem& pb, DType dtype, const Target& target) {
  const AttentionParams& p = pb.params;
  ATTNX_CHECK(mma_block_map_fits(p), "attnx::attention: expected block_q a multiple of 16, block_k a "
              "multiple of 64 and L, S below 2^31 for a block_map on CUDA (the tensor-core kernel's tiles), "
              "got block_q=", p.block_q, ", block_k=", p.block_k, ", L=", p.q_len, ", S=", p.kv_len);
  const Kernel kernel = choose_kernel(p, dtype, pb.ptr, target);
  ATTNX_CHECK(kernel == Kernel::kMma || !p.has_block_map, "attnx::attention: block_map on CUDA runs on the "
              "tensor-core kernel (float16, bfloat16 or float32, head dims up to 128, sm80+, ATTNX_CUDA_MMA "
              "not 0), got ", dtype_name(dtype), ", D=", p.head_dim, ", Dv=", p.v_head_dim,
              target.mma ? "" : ", the tensor cores off");
  ATTNX_CHECK(kernel != Kernel::kComposite || !pb.params.dropout, "attnx::attention: expected head dims up to ",
              kMaxHeadDim, " on CUDA with dropout_p > 0 (larger ones run on a composite without dropout), got D=",
              pb.params.head_dim, ", Dv=", pb.params.v_head_dim);
  return kernel;
}

// torch's flash kernel's results for pb (torch_flash_supports): out (B, L, H, Dv) and lse (B, H, L).
std::array<Tensor, 2> torch_flash(const AttentionProblem& pb) {
  const AttentionParams& p = pb.params;
  const TorchFlashWindow window = torch_flash_window(p);
  const auto bound = [](int64_t w) { return w < 0 ? std::nullopt : std::optional<int64_t>(w); };
  const Tensor q = views::transpose(pb.query, 1, 2), k = views::transpose(pb.key, 1, 2),
               v = views::transpose(pb.value, 1, 2);
#if !defined(ATTNX_CUDA_EMULATION)
  return aten::flash_attention_forward(q, k, v, static_cast<double>(p.scale) + p.scale_lo, bound(window.left),
                                       bound(window.right));
#else
  // The emulated device has no torch to call: the stand-in is attnx's tensor-core kernel given what
  // FlashAttention-2 is given (no is_causal, the window) and writing what it returns (out as empty_like of
  // the (B, L, H, D) query, lse (B, H, L)), so that the window and the results' adoption are what is tested.
  static_cast<void>(bound);
  Tensor out = aten::empty_like(q);
  Tensor lse = aten::empty({p.batch, p.heads, p.q_len}, ScalarType::Float, pb.query.device());
  AttentionParams fp = p;
  fp.is_causal = 0;
  fp.window_left = window.left;
  fp.window_right = window.right;
  const int64_t o[4] = {out.stride(0), out.stride(2), out.stride(1), out.stride(3)};
  std::copy(std::begin(o), std::end(o), fp.out_stride);
  const int64_t l[3] = {lse.stride(0), lse.stride(1), lse.stride(2)};
  std::copy(std::begin(l), std::end(l), fp.lse_stride);
  AttentionPointers ptr = pb.ptr;
  ptr.out = out.mutable_data_ptr();
  ptr.lse = lse.mutable_data_ptr();
  const cudaError_t err = launch_attention(fp, kernel_dtype(pb.dtype, "attnx::attention"), ptr, nullptr,
                                           Kernel::kMma);
  ATTNX_CHECK(err == cudaSuccess, "attnx::attention: the emulated flash kernel failed: ",
              cudaGetErrorString(err));
  return {out, lse};
#endif
}

// Runs pb on torch's flash kernel; false where torch refused it (see torch_flash_refused). Its out is adopted
// where it is in attention's layout ((B, L, H, Dv) memory, as FlashAttention-2 writes it for queries in that
// memory order) and the outputs are attention's own, copied otherwise.
bool run_torch_flash(AttentionProblem& pb) {
  std::array<Tensor, 2> result;
  try {
    result = torch_flash(pb);
  } catch (const std::exception&) {
    torch_flash_refused() = true;
    return false;
  }
  const Tensor out = views::transpose(result[0], 1, 2);
  const AttentionParams& p = pb.params;
  const int64_t Dv = p.v_head_dim;
  const bool layout = out.stride(3) == 1 && out.stride(1) == Dv && out.stride(2) == p.heads * Dv &&
                      out.stride(0) == p.q_len * p.heads * Dv;
  if (layout && !pb.outputs_given) {
    pb.out = out;
    pb.lse = result[1];
  } else {
    aten::copy_(pb.out, out);
    aten::copy_(pb.lse, result[1]);
  }
  return true;
}

}  // namespace

void run_attention(AttentionProblem& pb, const Target& target, cudaStream_t stream) {
  const DType dtype = kernel_dtype(pb.dtype, "attnx::attention");
  Kernel kernel = forward_kernel(pb, dtype, target);
  if (kernel == Kernel::kTorchFlash) {
    if (run_torch_flash(pb)) return;
    Target own = target;  // refused: attnx's kernel for this call (and, by the refusal, every later one)
    own.torch_flash = false;
    kernel = forward_kernel(pb, dtype, own);
  }
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
  const int shape = kernel == Kernel::kMma ? mma_plan(pb.params, dtype, pb.ptr, target).shape : 0;
  const cudaError_t err = launch_attention(pb.params, dtype, pb.ptr, stream, kernel,
                                           workspace ? workspace->mutable_data_ptr() : nullptr, shape);
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
    switch (backward_kernel(p, dtype, target)) {
      case BackwardKernel::kMma:
        pb.kernel = "cuda fused mma " + bucket;
        break;
      case BackwardKernel::kSimt:
        pb.kernel = "cuda fused simt " + bucket;
        break;
      case BackwardKernel::kMath:
        pb.kernel = "math";
    }
    return;
  }
  switch (forward_kernel(pb.call, dtype, target)) {
    case Kernel::kMma:
      // the instantiation: plain (no suffix, or its shape where not the default), " bits" (bool masks or
      // none), " general" (a float mask) or " capped" (soft-capped)
      switch (const AttentionMmaPlan plan = mma_plan(p, dtype, pb.call.ptr, target); plan.variant) {
        case kMmaPlain:
          pb.kernel = "cuda mma " + bucket;
          if (plan.shape != mma_default_shape(mma_element_bytes(dtype), plan.bucket, true)) {
            pb.kernel += " " + mma_shape_name(plan.shape);
          }
          break;
        case kMmaBits:
          pb.kernel = "cuda mma " + bucket + " bits";
          break;
        case kMmaCapped:
          pb.kernel = "cuda mma " + bucket + " capped";
          break;
        default:
          pb.kernel = "cuda mma " + bucket + " general";
      }
      break;
    case Kernel::kSimt:
      pb.kernel = "cuda simt " + bucket;
      break;
    case Kernel::kComposite:
      pb.kernel = "cuda composite";
      break;
    case Kernel::kTorchFlash:
      pb.kernel = stable::str("torch flash ", dtype_name(dtype));
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

// attnx::_cuda_torch_flash: sets (`on`) and returns whether torch's flash kernel takes the calls it computes
// as attnx does (false once it refused one).
bool cuda_torch_flash(std::optional<bool> on) {
  if (on) cuda::torch_flash_enabled() = *on;
  return cuda::torch_flash_enabled() && !cuda::torch_flash_refused();
}

// attnx::_cuda_mma_shape: sets (`shape`: a name of mma_shape_name's, or "" for the default) and returns the
// tile shape the tensor-core forward's plain instantiation runs in where the call's dtype and bucket have it
// (the kernel choice names the shape that runs). The family's other shapes are in the run-time compiled
// library alone (kMmaFamily).
std::string cuda_mma_shape(std::optional<std::string> shape) {
  if (shape) {
    const int code = shape->empty() ? 0 : cuda::mma_shape_parse(*shape);
    ATTNX_CHECK(code >= 0, "attnx::_cuda_mma_shape: expected \"\" or a shape like \"32x64 w4 s2\" (rows a "
                "warp 16 or 32, keys a tile 64 or 128, 4 or 8 warps, 2 or 3 stages), got \"", *shape, "\"");
    ATTNX_CHECK(code == 0 || cuda::kMmaFamily, "attnx::_cuda_mma_shape: this process's CUDA kernels are the "
                "prebuilt ones, which have each dtype and head dim's default shape alone; the others run on "
                "the kernels compiled at run time (ATTNX_CUDA_RUNTIME_COMPILE=1)");
    cuda::mma_shape_selected() = code;
  }
  const int code = cuda::mma_shape_selected();
  return code == 0 ? std::string() : cuda::mma_shape_name(code);
}

void attention_cuda_impls(StableLibrary& cuda) {
  cuda.impl("_attention", &attention_op<run_attention_cuda>);
  cuda.impl("_attention_autograd", &attention_op<run_attention_cuda>);
  cuda.impl("_attention_kernel", &attention_op<attention_kernel_cuda>);
}

// Without tensor arguments: the CompositeExplicitAutograd kernel is the one a call reaches.
void cuda_composite_impls(StableLibrary& composite) {
  composite.impl("_cuda_torch_flash", TORCH_BOX(&cuda_torch_flash));
  composite.impl("_cuda_mma_shape", TORCH_BOX(&cuda_mma_shape));
}

}  // namespace attnx

#if !defined(ATTNX_CUDA_HOST_ONLY)  // the run-time compiled library registers when its route is chosen
STABLE_TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  attnx::attention_cuda_impls(m);
}

STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  attnx::cuda_composite_impls(m);
}
#endif
#endif
