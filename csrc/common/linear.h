// attnx: layout canonicalisation for attnx::linear, shared by every backend that runs the GEMM through
// torch's own matmul ops, and the GEMM plans that mha's in-projections are run from. On the LibTorch stable
// ABI (torch/csrc/stable): no ATen or c10 header.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace attnx {

// Argument checks of attnx::linear. Where F.linear rejects the same input, the message is F.linear's.
void check_linear_args(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                       const std::optional<torch::stable::Tensor>& bias);

// How the leading dims of an (..., K) tensor map onto the rows of one (M, K) matrix.
//
// Size-1 dims are dropped (their stride never moves a pointer) and the others sorted by decreasing stride. The
// dims fold into a single row index when, from the innermost outwards, each stride equals the previous one times
// the previous size: then row r of the matrix starts at r * row_stride, whatever the logical order of the dims.
struct RowFold {
  bool dense = true;            // the leading dims are one block of rows at a fixed row_stride
  int64_t row_stride = 0;       // elements between consecutive rows in memory order (0 when there is one row)
  std::vector<int64_t> dims;    // leading dims of size > 1, outermost in memory first
  bool in_logical_order = true; // `dims` is increasing: memory order equals logical (row-major) order
};

RowFold fold_rows(torch::headeronly::IntHeaderOnlyArrayRef sizes, torch::headeronly::IntHeaderOnlyArrayRef strides);

// Strides of a dense (..., N) output whose leading dims have the memory order of `fold`. Contiguous when the
// input's rows are in logical order; otherwise the permuted layout, size-1 dims outermost.
std::vector<int64_t> output_strides(torch::headeronly::IntHeaderOnlyArrayRef out_sizes, const RowFold& fold);

// A (rows, cols) matrix over a tensor's memory, starting `offset` elements past the tensor's first element.
struct StridedMatrix {
  torch::stable::Tensor base;
  int64_t offset, rows, cols, row_stride, col_stride;
};

// One GEMM: c (M, N) = a (M, K) @ w (N, K)^T (+ bias), bias a (1, N) row or one element (1, 1) broadcast over
// every column. Kept as geometry: the views a GEMM call needs are made when it runs, with the shim's
// reinterpret, not as autograd views: each is a fresh tensor that never requires grad and is made in the
// running thread's inference mode, so the out= GEMM passes autograd's and inference mode's checks on any
// thread, without the caller's dispatch state.
struct LinearOperands {
  StridedMatrix a, w, c;
  std::optional<StridedMatrix> bias;
  torch::headeronly::ScalarType dtype;
};

// An input's leading dims as the rows of a GEMM operand, its layout read once: the input itself when they
// fold into one block of rows (RowFold) or repeat through stride-0 dims, else a contiguous copy, so that
// several GEMMs over one input copy it at most once.
struct LinearRows {
  torch::stable::Tensor rows;  // the input, or its contiguous copy
  RowFold fold;                // of rows
  bool repeated;               // rows repeat through a stride-0 dim (rows is the input as given)
  torch::headeronly::ScalarType dtype;
};
LinearRows linear_rows(const torch::stable::Tensor& input);

// An uninitialised output for rows @ weight.T with out_features columns, laid out as linear lays out its
// output: the memory order of the input's leading dims (output_strides), contiguous when they repeat. A
// column block of it is a valid output for plan_linear_into.
torch::stable::Tensor empty_linear_output(const LinearRows& rows, int64_t out_features);

// The same output for an input read in place whatever its layout, by a backend whose kernels index the rows
// themselves (Metal): laid out as empty_linear_output(linear_rows(input), ...) would lay it out, without
// linear_rows' copy, so that what linear returns never depends on the backend.
torch::stable::Tensor empty_linear_output(const torch::stable::Tensor& input, int64_t out_features);

// out = input @ weight.T + bias, out an empty_linear_output for these rows (or a column block of one): the
// GEMM to run, or nothing when there is nothing to compute or it was computed already (rows repeated through
// stride-0 dims: one GEMM over the distinct rows, run here, broadcast into out).
std::optional<LinearOperands> plan_linear_into(const torch::stable::Tensor& out, const LinearRows& rows,
                                               const torch::stable::Tensor& weight,
                                               const std::optional<torch::stable::Tensor>& bias);

// Runs one GEMM on torch's addmm / mm, through the dispatcher.
void run_gemm(const LinearOperands& gemm);

// input @ weight.T + bias as ONE GEMM on the backend's BLAS (torch's addmm / mm): planned and run.
torch::stable::Tensor linear_via_gemm(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                                      const std::optional<torch::stable::Tensor>& bias);

// Rows [begin, end) of a GEMM's a and c (by_rows), or rows [begin, end) of its w (and bias) with the same
// columns of c, as a GEMM of its own.
LinearOperands gemm_part(const LinearOperands& gemm, bool by_rows, int64_t begin, int64_t end);

// ---------------------------------------------------------------------------------------------------------------
// Independent linears (mha's in-projections), run the way the backend of their device runs them best.

// out = input @ weight^T + bias.
struct LinearCall {
  torch::stable::Tensor input, weight;
  std::optional<torch::stable::Tensor> bias;
};

// Runs linears that do not depend on each other and returns their outputs, each laid out as attnx::linear
// lays out its own (empty_linear_output).
using LinearRunner = std::vector<torch::stable::Tensor> (*)(const std::vector<LinearCall>& calls);

// A backend's way of running independent linears on its device type, registered once at load time
// (cpu/linear.cpp: their GEMMs at once, in shares per thread).
void register_linear_runner(torch::headeronly::DeviceType device_type, LinearRunner runner);

// Runs the linears with the runner registered for their device type; without one, each as one call of the
// backend's attnx::_linear kernel (call_linear).
std::vector<torch::stable::Tensor> run_linears(const std::vector<LinearCall>& calls);

// attnx::_linear through the dispatcher (the kernel of input's device).
torch::stable::Tensor call_linear(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                                  const std::optional<torch::stable::Tensor>& bias);

}  // namespace attnx
