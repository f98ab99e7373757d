// attnx: layout canonicalisation for attnx::linear (see linear.h), on the LibTorch stable ABI.
//
// Tensors are made and viewed through the C shim's direct calls (common/aten.h, common/views.h), which skip
// the boxed dispatcher; the GEMM itself is torch's own addmm / mm, reached through the dispatcher.
#include "common/linear.h"

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <vector>

#include "common/aten.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {

namespace {

using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

using stable::contiguous_strides;
using stable::device_name;
using stable::product;
using stable::Sizes;
using stable::type_meta_name;
using views::reinterpret;

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

namespace {

// Whether rows repeat through a stride-0 (expanded) leading dim.
bool has_repeated_rows(IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides) {
  for (size_t d = 0; d + 1 < sizes.size(); ++d) {
    if (sizes[d] > 1 && strides[d] == 0) return true;
  }
  return false;
}

// The leading dim whose stride steps from one row to the next in memory: the innermost folded one (any, when
// there is one row).
size_t fold_inner_dim(const RowFold& fold, size_t leading) {
  return fold.dims.empty() ? leading : static_cast<size_t>(fold.dims.back());
}

}  // namespace

namespace {

// linear_rows before its copy: `copy` says whether it copies the input, and then r.fold is the copy's.
LinearRows rows_layout(const Tensor& input, bool* copy) {
  const IntHeaderOnlyArrayRef sizes = input.sizes(), strides = input.strides();
  LinearRows r{input, fold_rows(sizes, strides), has_repeated_rows(sizes, strides), input.scalar_type()};
  // No single row stride exists (a strided slice such as x[:, ::2], or interleaved dims): copying the input
  // once into a contiguous buffer is the cheapest way to one GEMM.
  *copy = !r.repeated && !r.fold.dense;
  if (*copy) r.fold = fold_rows(sizes, stable::contiguous_strides(sizes));
  return r;
}

}  // namespace

LinearRows linear_rows(const Tensor& input) {
  bool copy = false;
  LinearRows r = rows_layout(input, &copy);
  if (copy) r.rows = aten::contiguous(input);
  return r;
}

Tensor empty_linear_output(const LinearRows& rows, int64_t out_features) {
  const IntHeaderOnlyArrayRef in_sizes = rows.rows.sizes();
  std::vector<int64_t> out_sizes(in_sizes.begin(), in_sizes.end());
  out_sizes.back() = out_features;
  // An empty output, and repeated rows (computed once and broadcast into a fresh output) are contiguous.
  // Otherwise the output takes the rows' memory order (a contiguous copy's is the logical one).
  const bool empty =
      out_features == 0 || product(IntHeaderOnlyArrayRef(out_sizes).slice(0, out_sizes.size() - 1)) == 0;
  const std::vector<int64_t> strides =
      rows.repeated || empty ? stable::contiguous_strides(out_sizes) : output_strides(out_sizes, rows.fold);
  return aten::empty_strided(out_sizes, strides, rows.dtype, rows.rows.device());
}

Tensor empty_linear_output(const Tensor& input, int64_t out_features) {
  bool copy = false;  // the caller reads the input in place; the output is laid out as if it were copied
  return empty_linear_output(rows_layout(input, &copy), out_features);
}

std::optional<LinearOperands> plan_linear_into(const Tensor& out, const LinearRows& rows,
                                               const Tensor& weight, const std::optional<Tensor>& bias) {
  const IntHeaderOnlyArrayRef in_sizes = rows.rows.sizes();
  const size_t leading = in_sizes.size() - 1;
  const int64_t K = in_sizes.back();
  const int64_t M = product(in_sizes.slice(0, leading));
  const IntHeaderOnlyArrayRef w_sizes = weight.sizes(), w_strides = weight.strides();
  const int64_t N = w_sizes[0];
  if (M == 0 || N == 0) return std::nullopt;

  // Rows repeated through a stride-0 (expanded) dim: run the GEMM on the distinct rows only and broadcast the
  // result into the output. One copy, of the output, instead of a copy of the input plus repeated arithmetic.
  if (rows.repeated) {
    const IntHeaderOnlyArrayRef in_strides = rows.rows.strides();
    std::vector<int64_t> distinct_sizes(in_sizes.begin(), in_sizes.end());
    for (size_t d = 0; d < leading; ++d) {
      if (in_strides[d] == 0) distinct_sizes[d] = 1;
    }
    aten::copy_(out, linear_via_gemm(reinterpret(rows.rows, distinct_sizes, in_strides), weight, bias));
    return std::nullopt;
  }

  // out was laid out with the rows' order (empty_linear_output), so both are (M, *) matrices walked in the
  // same order.
  const IntHeaderOnlyArrayRef out_strides = out.strides();
  const int64_t out_row_stride = out_strides[fold_inner_dim(rows.fold, leading)];
  const int64_t in_col_stride = rows.rows.stride(static_cast<int64_t>(leading));
  LinearOperands gemm{as_matrix(rows.rows, M, K, rows.fold.row_stride, in_col_stride),
                      as_matrix(weight, N, K, w_strides[0], w_strides[1]),
                      as_matrix(out, M, N, out_row_stride, out_strides[leading]), std::nullopt, rows.dtype};
  if (bias) {
    const int64_t size = bias->size(0);
    gemm.bias = StridedMatrix{*bias, 0, 1, size, size, size == 1 ? 1 : bias->stride(0)};
  }
  return gemm;
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
  stable::naming("attnx::linear", [&] {
    if (g.bias) {
      // F.linear's GEMM for a 2-D input, addmm_out(c, bias, a, w^T). (addmm.out itself takes Scalars, beta
      // and alpha, which a stable dispatcher call cannot pass.)
      aten::linear_out(view(g.c), view(g.a), view(g.w), row_view(*g.bias));
    } else {
      aten::mm_out(view(g.c), view(g.a), transposed_view(g.w));
    }
  });
}

Tensor linear_via_gemm(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  check_linear_args(input, weight, bias);
  const LinearRows rows = linear_rows(input);
  const Tensor out = empty_linear_output(rows, weight.size(0));
  if (const std::optional<LinearOperands> gemm = plan_linear_into(out, rows, weight, bias)) run_gemm(*gemm);
  return out;
}

Tensor call_linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  return stable::call("attnx::_linear", "", input, weight, bias);
}

// ---------------------------------------------------------------------------------------------------------------

namespace {

using Runners = std::array<LinearRunner,
                           static_cast<size_t>(torch::headeronly::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>;

Runners& linear_runners() {
  static Runners runners{};
  return runners;
}

}  // namespace

void register_linear_runner(torch::headeronly::DeviceType device_type, LinearRunner runner) {
  linear_runners()[static_cast<size_t>(device_type)] = runner;
}

std::vector<Tensor> run_linears(const std::vector<LinearCall>& calls) {
  if (calls.empty()) return {};
  if (const LinearRunner runner = linear_runners()[static_cast<size_t>(calls[0].input.device().type())]) {
    return runner(calls);
  }
  std::vector<Tensor> outs;
  outs.reserve(calls.size());
  for (const LinearCall& c : calls) outs.push_back(call_linear(c.input, c.weight, c.bias));
  return outs;
}

}  // namespace attnx
