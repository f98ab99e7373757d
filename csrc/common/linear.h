// attnx: layout canonicalisation for attnx::linear, shared by every backend that runs the GEMM through ATen.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace attnx {

// Argument checks of attnx::linear. Where F.linear rejects the same input, the message is F.linear's.
void check_linear_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

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

RowFold fold_rows(at::IntArrayRef sizes, at::IntArrayRef strides);

// Strides of a dense (..., N) output whose leading dims have the memory order of `fold`. Contiguous when the
// input's rows are in logical order; otherwise the permuted layout, size-1 dims outermost.
std::vector<int64_t> output_strides(at::IntArrayRef out_sizes, const RowFold& fold);

// input @ weight.T + bias as ONE GEMM on the backend's BLAS (at::addmm_out). Copies nothing when the leading
// dims fold (see RowFold); otherwise copies the input exactly once. Rows repeated through stride-0 dims are
// computed once and broadcast into the output.
at::Tensor linear_via_gemm(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias);

// linear_via_gemm in two steps: plan_linear checks the arguments, allocates the output and makes the views of
// its GEMM, c (M, N) = a (M, K) @ w (N, K)^T (+ bias), c a view of out; run_gemm runs it. A plan whose c is
// undefined needs no GEMM (an empty output, or rows broadcast from a GEMM already run).
struct LinearGemm {
  at::Tensor out;
  at::Tensor a, w, c;
  std::optional<at::Tensor> bias;
};

LinearGemm plan_linear(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);
void run_gemm(const LinearGemm& gemm);

// Runs independent CPU GEMMs (csrc/cpu/linear_cpu.cpp): their work, laid end to end, is cut into one share
// per intra-op thread along rows or columns, and each thread runs its share on one thread of BLAS. For the
// few, small GEMMs of attention's in-projections, and for a single GEMM with few rows, this beats one
// multi-threaded GEMM after another (measured with MKL under OpenMP, the only build that uses it); large
// GEMMs, a lone GEMM with many rows, one thread: one after another.
void run_gemms_in_shares(const std::vector<LinearGemm>& gemms);

}  // namespace attnx
