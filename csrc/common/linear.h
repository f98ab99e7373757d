// attnx: layout canonicalisation for attnx::linear, shared by every backend that runs the GEMM through
// torch's own matmul ops. On the LibTorch stable ABI (torch/csrc/stable): no ATen or c10 header.
#pragma once

#include <torch/csrc/stable/tensor.h>
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

// input @ weight.T + bias as ONE GEMM on the backend's BLAS (torch's addmm / mm). Copies nothing when the
// leading dims fold (see RowFold); otherwise copies the input exactly once. Rows repeated through stride-0 dims
// are computed once and broadcast into the output.
torch::stable::Tensor linear_via_gemm(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                                      const std::optional<torch::stable::Tensor>& bias);

// A (rows, cols) matrix over a tensor's memory, starting `offset` elements past the tensor's first element.
struct StridedMatrix {
  torch::stable::Tensor base;
  int64_t offset, rows, cols, row_stride, col_stride;
};

// The GEMM of a plan: c (M, N) = a (M, K) @ w (N, K)^T (+ bias), c over the plan's output, bias a (1, N) row or
// one element (1, 1) broadcast over every column. Kept as geometry: the views a GEMM call needs are made when it
// runs, with the shim's reinterpret (aoti_torch__reinterpret_tensor), not as autograd views: each is a fresh
// tensor that never requires grad and is made in the running thread's inference mode, so the out= GEMM passes
// autograd's and inference mode's checks on any thread, without the caller's dispatch state.
struct LinearOperands {
  StridedMatrix a, w, c;
  std::optional<StridedMatrix> bias;
  torch::headeronly::ScalarType dtype;
};

// linear_via_gemm in two steps: plan_linear checks the arguments, allocates the output and lays out its GEMM;
// run_gemm runs it. A plan without a GEMM needs none (an empty output, or rows broadcast from a GEMM already
// run).
struct LinearGemm {
  torch::stable::Tensor out;
  std::optional<LinearOperands> gemm;
};

LinearGemm plan_linear(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                       const std::optional<torch::stable::Tensor>& bias);
// On torch's addmm / mm, through the dispatcher.
void run_gemm(const LinearOperands& gemm);
void run_gemm(const LinearGemm& gemm);

// Rows [begin, end) of a GEMM's a and c (by_rows), or rows [begin, end) of its w (and bias) with the same
// columns of c, as a GEMM of its own.
LinearOperands gemm_part(const LinearOperands& gemm, bool by_rows, int64_t begin, int64_t end);

// Runs independent CPU GEMMs (csrc/cpu/linear_cpu.cpp): their work, laid end to end, is cut into one share
// per intra-op thread along rows or columns, and each thread runs its share on one thread of BLAS. For the
// few, small GEMMs of attention's in-projections, and for a single GEMM with few rows, this beats one
// multi-threaded GEMM after another (measured with MKL under OpenMP, the builds that use it: see
// linear_cpu.cpp); large GEMMs, a lone GEMM with many rows, one thread: one after another. Small fp32 GEMMs
// run on attnx's own kernel (cpu/linear_cpu_kernel.h) instead of BLAS.
void run_gemms_in_shares(const std::vector<LinearGemm>& gemms);

}  // namespace attnx

#if defined(__OBJC__) && !defined(TORCH_TARGET_VERSION)
// mps/linear_mps.mm, still on the regular ABI, checks its at::Tensor arguments through the bridge.
#include "common/stable_bridge.h"
#endif
