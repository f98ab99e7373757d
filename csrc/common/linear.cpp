// attnx: layout canonicalisation for attnx::linear (see linear.h).
#include "common/linear.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <algorithm>

namespace attnx {

void check_linear_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 1 && weight.dim() >= 1, "both arguments to linear need to be at least 1D, but they are ",
              input.dim(), "D and ", weight.dim(), "D");
  TORCH_CHECK(weight.dim() == 2, "attnx::linear: expected weight of shape (out_features, in_features), got a ",
              weight.dim(), "-D tensor of shape ", weight.sizes());
  const auto same_device = [&](const at::Tensor& t) {
    TORCH_CHECK(t.device() == input.device(),
                "Expected all tensors to be on the same device, but found at least two devices, ", input.device(),
                " and ", t.device(), "!");
  };
  same_device(weight);
  if (bias) same_device(*bias);
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(),
              "expected m1 and m2 to have the same dtype, but got: ", input.dtype(), " != ", weight.dtype());

  const int64_t K = input.size(-1);
  const int64_t M = c10::multiply_integers(input.sizes().slice(0, input.dim() - 1));
  const int64_t N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "mat1 and mat2 shapes cannot be multiplied (", M, "x", K, " and ",
              weight.size(1), "x", N, ")");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(), "self and mat2 must have the same dtype, but got ",
                bias->scalar_type(), " and ", weight.scalar_type());
    TORCH_CHECK(bias->dim() == 1, "attnx::linear: expected bias of shape (out_features,) = (", N, ",), got ",
                bias->sizes());
    TORCH_CHECK(bias->size(0) == N || bias->size(0) == 1, "The expanded size of the tensor (", N,
                ") must match the existing size (", bias->size(0), ") at non-singleton dimension 1.  Target sizes: [",
                M, ", ", N, "].  Tensor sizes: [", bias->size(0), "]");
  }
}

RowFold fold_rows(at::IntArrayRef sizes, at::IntArrayRef strides) {
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

std::vector<int64_t> output_strides(at::IntArrayRef out_sizes, const RowFold& fold) {
  const int64_t n = static_cast<int64_t>(out_sizes.size());
  std::vector<int64_t> strides(n);
  int64_t extent = 1;
  if (fold.in_logical_order) {
    // Contiguous, with torch's convention for size-0 and size-1 dims.
    for (int64_t d = n - 1; d >= 0; --d) {
      strides[d] = extent;
      extent *= std::max<int64_t>(out_sizes[d], 1);
    }
    return strides;
  }
  strides[n - 1] = 1;
  extent = std::max<int64_t>(out_sizes[n - 1], 1);
  for (auto it = fold.dims.rbegin(); it != fold.dims.rend(); ++it) {
    strides[*it] = extent;
    extent *= out_sizes[*it];
  }
  for (int64_t d = 0; d < n - 1; ++d) {
    if (out_sizes[d] == 1) strides[d] = extent;
  }
  return strides;
}

namespace {

// A (rows, cols) view with canonical strides on size-1 dims, so that BLAS-compatibility checks downstream see
// the real layout: a stride on a size-1 dim is arbitrary (B=1 transposes leave (D, B*D, 1) behind) and must not
// decide between a direct GEMM and a copy.
at::Tensor as_matrix(const at::Tensor& t, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if (cols == 1) col_stride = 1;
  if (rows == 1) row_stride = col_stride == 1 ? std::max<int64_t>(cols, 1) : 1;
  return t.as_strided({rows, cols}, {row_stride, col_stride}, t.storage_offset());
}

}  // namespace

LinearGemm plan_linear(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  check_linear_args(input, weight, bias);
  const int64_t leading = input.dim() - 1;
  const int64_t K = input.size(-1);
  const int64_t M = c10::multiply_integers(input.sizes().slice(0, leading));
  const int64_t N = weight.size(0);
  std::vector<int64_t> out_sizes(input.sizes().begin(), input.sizes().end());
  out_sizes.back() = N;
  LinearGemm plan;
  if (M == 0 || N == 0) {
    plan.out = at::empty(out_sizes, input.options());
    return plan;
  }

  // Rows repeated through a stride-0 (expanded) dim: run the GEMM on the distinct rows only and broadcast the
  // result into the output. One copy, of the output, instead of a copy of the input plus repeated arithmetic.
  at::Tensor distinct = input;
  for (int64_t d = 0; d < leading; ++d) {
    if (input.size(d) > 1 && input.stride(d) == 0) distinct = distinct.narrow(d, 0, 1);
  }
  if (!distinct.is_same(input)) {
    plan.out = at::empty(out_sizes, input.options());
    plan.out.copy_(linear_via_gemm(distinct, weight, bias));
    return plan;
  }

  RowFold fold = fold_rows(input.sizes(), input.strides());
  at::Tensor rows = input;
  if (!fold.dense) {
    // No single row stride exists (a strided slice such as x[:, ::2], or interleaved dims): copying the input
    // once into a contiguous buffer is the cheapest way to one GEMM.
    rows = input.clone(at::MemoryFormat::Contiguous);
    fold = fold_rows(rows.sizes(), rows.strides());
  }
  plan.out = at::empty_strided(out_sizes, output_strides(out_sizes, fold), input.options());

  // The output was laid out with input's row order, so both are (M, *) matrices walked in the same order.
  plan.a = as_matrix(rows, M, K, fold.row_stride, rows.stride(-1));
  plan.w = as_matrix(weight, N, K, weight.stride(0), weight.stride(1));
  plan.c = plan.out.as_strided({M, N}, {N, 1});
  plan.bias = bias;
  return plan;
}

void run_gemm(const LinearGemm& gemm) {
  if (!gemm.c.defined()) return;
  at::Tensor c = gemm.c;  // the same tensor: the out= ops take a non-const reference
  if (gemm.bias) {
    at::addmm_out(c, *gemm.bias, gemm.a, gemm.w.t());
  } else {
    at::mm_out(c, gemm.a, gemm.w.t());
  }
}

at::Tensor linear_via_gemm(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  LinearGemm gemm = plan_linear(input, weight, bias);
  run_gemm(gemm);
  return gemm.out;
}

}  // namespace attnx
