// attnx: the MPS glue that is plain C++ on the LibTorch stable ABI: the kernels' dtype, the checks of what the
// Metal kernels cannot do, and the plans, for a call's tensors. mps/attention.mm and mps/linear.mm encode
// what these say on torch's MPS stream; the emulated Metal backend (tests/emulation/metal/metal_backend.cpp)
// runs the same on the CPU, so both refuse, plan and name every call alike. Every check is here, before
// anything is encoded (mps::encode must not throw).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/aten.h"
#include "common/attention.h"
#include "common/linear.h"
#include "common/stable.h"
#include "mps/metal_plan.h"

namespace attnx::mps {

// The kernels' element type for `dtype`; a clear error for the others (float64 above all: Metal has no
// double). `op` names the op in the message.
inline DType metal_dtype(ScalarType dtype, const char* op) {
  ATTNX_CHECK(dtype != ScalarType::Double, op,
              ": float64 is not supported on MPS (Metal has no double); got float64 inputs");
  ATTNX_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Half || dtype == ScalarType::BFloat16, op,
              ": expected float32, float16 or bfloat16 on MPS, got ", dtype);
  return dtype == ScalarType::Float ? DType::kFloat32
         : dtype == ScalarType::Half ? DType::kFloat16
                                     : DType::kBFloat16;
}

// attention's Metal launch for a prepared call. Grouped KV heads, key_lengths (int32 or int64, read in place
// and clamped into [0, S] by the kernels: reading their values here would cost a device sync), windows,
// softcap and sinks are parameters of both kernels; sinks reach them as float32 (H,) contiguous
// (pb.sinks_acc).
inline AttentionPlan attention_plan(const AttentionProblem& pb) {
  const AttentionOptions& o = pb.options;
  ATTNX_CHECK(o.dropout_p == 0.0, "attnx::attention: dropout is not implemented on MPS yet");
  ATTNX_CHECK(!o.block_map,
              "attnx::attention: block_map is not implemented on MPS yet (the CPU kernels take it)");
  const DType dtype = metal_dtype(pb.dtype, "attnx::attention");
  for (const auto* mask : {&o.attn_mask, &o.key_padding_mask}) {
    ATTNX_CHECK(!*mask || (*mask)->scalar_type() != ScalarType::Double,
                "attnx::attention: float64 masks are not supported on MPS (Metal has no double)");
  }
  ATTNX_CHECK(!o.sinks || o.sinks->scalar_type() != ScalarType::Double,
              "attnx::attention: float64 sinks are not supported on MPS (Metal has no double)");
  const AttentionParams& p = pb.params;
  const AttentionPlan plan = plan_attention(p, dtype);
  ATTNX_CHECK(plan.kernel != AttentionKernel::kNone, "attnx::attention: expected head dims D and Dv up to ",
              metal_config::kMaxHeadDim, " on MPS, got D=", p.head_dim, ", Dv=", p.v_head_dim,
              " (B*H=", p.batch * p.heads, ", L=", p.q_len, ")");
  return plan;
}

// attnx::_attention_kernel on MPS: the Metal kernel of the forward; the backward has no Metal kernel and runs
// the whole-tensor math (common/attention_backward_math.cpp).
inline void attention_kernel(AttentionKernelProblem& pb) {
  if (pb.backward) {
    pb.kernel = "math";
    return;
  }
  const AttentionPlan plan = attention_plan(pb.call);
  const DType dtype = metal_dtype(pb.call.dtype, "attnx::attention");
  pb.kernel = stable::str("metal ", plan.kernel == AttentionKernel::kVector ? "vector" : "tiled", " ",
                          dtype_name(dtype), " bucket ", plan.bucket);
}

// One attnx::linear call as the Metal kernels read it: the input (the caller's, or its one contiguous copy
// when no (outer, inner) row indexing of it exists, e.g. a 4-D input with two gaps), the params, the output
// laid out as on every other backend (common/linear.h's empty_linear_output: the memory order of the input's
// rows, contiguous when they repeat or are copied) and the launch.
struct MetalLinear {
  Tensor input;
  LinearParams params;
  Tensor out;
  LinearPlan plan;
};

inline MetalLinear metal_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  check_linear_args(input, weight, bias);
  const DType dtype = metal_dtype(input.scalar_type(), "attnx::linear");
  const int64_t N = weight.size(0);
  MetalLinear call{input, LinearParams{}, empty_linear_output(input, N), LinearPlan{}};
  const auto pack = [&](int ndim, const int64_t* sizes, const int64_t* strides, const int64_t* out_strides) {
    return pack_linear_params(ndim, sizes, strides, out_strides, N, weight.strides().data(), bias.has_value(),
                              bias ? bias->size(0) : 0, bias ? bias->stride(0) : 0, &call.params);
  };
  const int ndim = static_cast<int>(input.dim());
  if (!pack(ndim, input.sizes().data(), input.strides().data(), call.out.strides().data())) {
    const RowFold fold = fold_rows(input.sizes(), input.strides());
    if (fold.dense) {
      // One block of rows in an order that two groups do not describe (e.g. a 4-D permute): an (M, K)
      // matrix in memory order, as is the output, laid out in the same order (the GEMM of common/linear.cpp).
      const int64_t d = fold.dims.back(), k = ndim - 1;
      const int64_t sizes[2] = {stable::product(input.sizes().slice(0, k)), input.size(k)};
      const int64_t strides[2] = {fold.row_stride, input.stride(k)};
      const int64_t out_strides[2] = {call.out.stride(d), call.out.stride(k)};
      pack(2, sizes, strides, out_strides);
    } else {
      // Not one block of rows, so the output is contiguous: so is the one copy, which always packs.
      call.input = aten::contiguous(input);
      pack(ndim, call.input.sizes().data(), call.input.strides().data(), call.out.strides().data());
    }
  }
  call.plan = plan_linear(call.params, dtype);
  return call;
}

}  // namespace attnx::mps
