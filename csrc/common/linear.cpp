// attnx: layout canonicalisation for attnx::linear (see linear.h), on the LibTorch stable ABI.
//
// Tensors are made and viewed through the C shim's direct calls (aoti_torch_empty_strided,
// aoti_torch__reinterpret_tensor, aoti_torch_copy_), which skip the boxed dispatcher; the GEMM itself is torch's
// own addmm / mm, reached through torch_call_dispatcher.
#include "common/linear.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/stable.h"

namespace attnx {

namespace {

using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

using stable::contiguous_strides;
using stable::copy_into;
using stable::device_name;
using stable::product;
using stable::reinterpret;
using stable::Sizes;
using stable::type_meta_name;

// An uninitialised tensor with the given sizes and strides, of `like`'s dtype and device.
Tensor empty_strided(IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides, const Tensor& like) {
  return stable::empty_strided(sizes, strides, like.scalar_type(), like.device());
}

// A (rows, cols) matrix with canonical strides on size-1 dims, so that BLAS-compatibility checks downstream see
// the real layout: a stride on a size-1 dim is arbitrary (B=1 transposes leave (D, B*D, 1) behind) and must not
// decide between a direct GEMM and a copy.
StridedMatrix as_matrix(const Tensor& t, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if (cols == 1) col_stride = 1;
  if (rows == 1) row_stride = col_stride == 1 ? std::max<int64_t>(cols, 1) : 1;
  return {t, 0, rows, cols, row_stride, col_stride};
}

Tensor view(const StridedMatrix& m) {
  const int64_t sizes[2] = {m.rows, m.cols}, strides[2] = {m.row_stride, m.col_stride};
  return reinterpret(m.base, sizes, strides, m.offset);
}

// m^T, (cols, rows).
Tensor transposed_view(const StridedMatrix& m) {
  const int64_t sizes[2] = {m.cols, m.rows}, strides[2] = {m.col_stride, m.row_stride};
  return reinterpret(m.base, sizes, strides, m.offset);
}

// A (1, n) row as the 1-D (n,) tensor the GEMM ops take for a bias.
Tensor row_view(const StridedMatrix& m) {
  return reinterpret(m.base, IntHeaderOnlyArrayRef(&m.cols, 1), IntHeaderOnlyArrayRef(&m.col_stride, 1), m.offset);
}

// Calls an aten op through the dispatcher whose one return (an out= argument, already held by the caller) is
// dropped.
void call_out_op(const char* name, const char* overload, StableIValue* stack, const char* what) {
  stable::dispatch(name, overload, stack, what);
  stable::check(aoti_torch_delete_tensor_object(torch::stable::detail::to<AtenTensorHandle>(stack[0])), what);
}

}  // namespace

void check_linear_args(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  const int64_t input_dim = input.dim(), weight_dim = weight.dim();
  ATTNX_CHECK(input_dim >= 1 && weight_dim >= 1,
                     "both arguments to linear need to be at least 1D, but they are ", input_dim, "D and ",
                     weight_dim, "D");
  ATTNX_CHECK(weight_dim == 2, "attnx::linear: expected weight of shape (out_features, in_features), got a ",
                     weight_dim, "-D tensor of shape ", Sizes{weight.sizes()});
  const torch::stable::Device device = input.device();
  const auto same_device = [&](const Tensor& t) {
    const torch::stable::Device other = t.device();
    ATTNX_CHECK(other == device,
                       "Expected all tensors to be on the same device, but found at least two devices, ",
                       device_name(device), " and ", device_name(other), "!");
  };
  same_device(weight);
  if (bias) same_device(*bias);
  const ScalarType dtype = input.scalar_type(), weight_dtype = weight.scalar_type();
  ATTNX_CHECK(dtype == weight_dtype, "expected m1 and m2 to have the same dtype, but got: ",
                     type_meta_name(dtype), " != ", type_meta_name(weight_dtype));

  const IntHeaderOnlyArrayRef sizes = input.sizes();
  const int64_t K = sizes.back();
  const int64_t M = product(sizes.slice(0, sizes.size() - 1));
  const int64_t N = weight.size(0);
  ATTNX_CHECK(weight.size(1) == K, "mat1 and mat2 shapes cannot be multiplied (", M, "x", K, " and ",
                     weight.size(1), "x", N, ")");
  if (bias) {
    const ScalarType bias_dtype = bias->scalar_type();
    ATTNX_CHECK(bias_dtype == weight_dtype, "self and mat2 must have the same dtype, but got ", bias_dtype,
                       " and ", weight_dtype);
    ATTNX_CHECK(bias->dim() == 1, "attnx::linear: expected bias of shape (out_features,) = (", N,
                       ",), got ", Sizes{bias->sizes()});
    const int64_t bias_size = bias->size(0);
    ATTNX_CHECK(bias_size == N || bias_size == 1, "The expanded size of the tensor (", N,
                       ") must match the existing size (", bias_size,
                       ") at non-singleton dimension 1.  Target sizes: [", M, ", ", N, "].  Tensor sizes: [",
                       bias_size, "]");
  }
}

RowFold fold_rows(IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides) {
  RowFold fold;
  const int64_t leading = static_cast<int64_t>(sizes.size()) - 1;
  for (int64_t d = 0; d < leading; ++d) {
    if (sizes[d] != 1) fold.dims.push_back(d);
  }
  // Stable, so that equal strides (only possible for overlapping dims, which never fold) keep logical order.
  std::stable_sort(fold.dims.begin(), fold.dims.end(),
                   [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  fold.in_logical_order = std::is_sorted(fold.dims.begin(), fold.dims.end());
  if (fold.dims.empty()) return fold;

  fold.row_stride = strides[fold.dims.back()];
  int64_t expected = fold.row_stride;
  for (auto it = fold.dims.rbegin(); it != fold.dims.rend(); ++it) {
    if (strides[*it] != expected) {
      fold.dense = false;
      break;
    }
    expected *= sizes[*it];
  }
  // A stride-0 row index would make every row the same memory: not a GEMM operand.
  fold.dense = fold.dense && fold.row_stride > 0;
  return fold;
}

std::vector<int64_t> output_strides(IntHeaderOnlyArrayRef out_sizes, const RowFold& fold) {
  if (fold.in_logical_order) return contiguous_strides(out_sizes);  // with torch's convention for size 0 and 1
  const int64_t n = static_cast<int64_t>(out_sizes.size());
  std::vector<int64_t> strides(n);
  strides[n - 1] = 1;
  int64_t extent = std::max<int64_t>(out_sizes[n - 1], 1);
  for (auto it = fold.dims.rbegin(); it != fold.dims.rend(); ++it) {
    strides[*it] = extent;
    extent *= out_sizes[*it];
  }
  for (int64_t d = 0; d < n - 1; ++d) {
    if (out_sizes[d] == 1) strides[d] = extent;
  }
  return strides;
}

LinearGemm plan_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  check_linear_args(input, weight, bias);
  const IntHeaderOnlyArrayRef in_sizes = input.sizes(), in_strides = input.strides();
  const size_t leading = in_sizes.size() - 1;
  const int64_t K = in_sizes.back();
  const int64_t M = product(in_sizes.slice(0, leading));
  const int64_t N = weight.size(0);
  std::vector<int64_t> out_sizes(in_sizes.begin(), in_sizes.end());
  out_sizes.back() = N;
  if (M == 0 || N == 0) return {empty_strided(out_sizes, contiguous_strides(out_sizes), input), std::nullopt};

  // Rows repeated through a stride-0 (expanded) dim: run the GEMM on the distinct rows only and broadcast the
  // result into the output. One copy, of the output, instead of a copy of the input plus repeated arithmetic.
  std::vector<int64_t> distinct_sizes(in_sizes.begin(), in_sizes.end());
  bool repeated = false;
  for (size_t d = 0; d < leading; ++d) {
    if (in_sizes[d] > 1 && in_strides[d] == 0) {
      distinct_sizes[d] = 1;
      repeated = true;
    }
  }
  if (repeated) {
    LinearGemm plan{empty_strided(out_sizes, contiguous_strides(out_sizes), input), std::nullopt};
    copy_into(plan.out, linear_via_gemm(reinterpret(input, distinct_sizes, in_strides), weight, bias));
    return plan;
  }

  RowFold fold = fold_rows(in_sizes, in_strides);
  Tensor rows = input;
  if (!fold.dense) {
    // No single row stride exists (a strided slice such as x[:, ::2], or interleaved dims): copying the input
    // once into a contiguous buffer is the cheapest way to one GEMM.
    const std::vector<int64_t> strides = contiguous_strides(in_sizes);
    rows = empty_strided(in_sizes, strides, input);
    copy_into(rows, input);
    fold = fold_rows(in_sizes, strides);
  }
  LinearGemm plan{empty_strided(out_sizes, output_strides(out_sizes, fold), input), std::nullopt};

  // The output was laid out with input's row order, so both are (M, *) matrices walked in the same order.
  const ScalarType dtype = input.scalar_type();
  StridedMatrix a = as_matrix(rows, M, K, fold.row_stride, rows.stride(leading));
  StridedMatrix w = as_matrix(weight, N, K, weight.stride(0), weight.stride(1));
  plan.gemm = LinearOperands{std::move(a), std::move(w), StridedMatrix{plan.out, 0, M, N, N, 1}, std::nullopt, dtype};
  if (bias) {
    const int64_t size = bias->size(0);
    plan.gemm->bias = StridedMatrix{*bias, 0, 1, size, size, size == 1 ? 1 : bias->stride(0)};
  }
  return plan;
}

LinearOperands gemm_part(const LinearOperands& g, bool by_rows, int64_t begin, int64_t end) {
  LinearOperands part = g;
  const int64_t n = end - begin;
  if (by_rows) {
    part.a.offset += begin * g.a.row_stride;
    part.a.rows = n;
    part.c.offset += begin * g.c.row_stride;
    part.c.rows = n;
  } else {
    part.w.offset += begin * g.w.row_stride;
    part.w.rows = n;
    part.c.offset += begin * g.c.col_stride;
    part.c.cols = n;
    // A bias of one element broadcasts over every column; a full one is cut like the columns.
    if (g.bias && g.bias->cols != 1) {
      part.bias->offset += begin * g.bias->col_stride;
      part.bias->cols = n;
    }
  }
  return part;
}

void run_gemm(const LinearOperands& g) {
  if (g.bias) {
    // aten::linear.out runs addmm_out(c, bias, a, w^T) for a 2-D input, the GEMM F.linear runs. (addmm.out
    // itself takes Scalars, beta and alpha, which a stable dispatcher call cannot pass.)
    StableIValue stack[4] = {torch::stable::detail::from(view(g.a)), torch::stable::detail::from(view(g.w)),
                             torch::stable::detail::from(std::optional<Tensor>(row_view(*g.bias))),
                             torch::stable::detail::from(view(g.c))};
    call_out_op("aten::linear", "out", stack, "attnx::linear: aten::linear.out");
  } else {
    StableIValue stack[3] = {torch::stable::detail::from(view(g.a)),
                             torch::stable::detail::from(transposed_view(g.w)),
                             torch::stable::detail::from(view(g.c))};
    call_out_op("aten::mm", "out", stack, "attnx::linear: aten::mm.out");
  }
}

void run_gemm(const LinearGemm& gemm) {
  if (gemm.gemm) run_gemm(*gemm.gemm);
}

Tensor linear_via_gemm(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  LinearGemm gemm = plan_linear(input, weight, bias);
  run_gemm(gemm);
  return gemm.out;
}

}  // namespace attnx
