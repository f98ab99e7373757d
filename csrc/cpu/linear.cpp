// attnx: attnx::linear on CPU, and the in-projections of mha run at once. The layout work is
// common/linear.cpp; the GEMMs are torch's CPU BLAS, the one F.linear uses, run in shares per thread where
// that beats BLAS's own threading (run_gemms_in_shares), or attnx's own kernel where they are too small for a
// call into BLAS to pay (small_linear_f32). On the LibTorch stable ABI.
#include "common/linear.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "common/views.h"
#include "cpu/linear_kernel.h"
#include "cpu/parallel.h"

namespace attnx {

namespace {

// Below this many multiply-adds in all, sharing out costs more than it saves.
constexpr int64_t kMinSharedWork = int64_t(1) << 20;
// From this many multiply-adds per thread on, a GEMM is better left to BLAS's own threading (measured: two
// 1024 x 512 x 512 fp32 GEMMs on 2 threads run as fast either way, smaller ones 4-15% faster in shares).
constexpr int64_t kMaxBlasShare = int64_t(1) << 27;
// Shares are cut at multiples of this many rows or columns (a 64-byte line of fp32 output), ends excepted.
constexpr int64_t kCutAlign = 16;
// Where shares were measured to pay: MKL under ATen's OpenMP threads, where a GEMM called inside a parallel
// region runs on the calling thread alone. The stable ABI does not say which BLAS and thread pool torch was
// built with (ATen's AT_MKL_ENABLED / AT_PARALLEL_OPENMP); torch's x86-64 builds are MKL under OpenMP, and
// setup.py defines ATTNX_TORCH_OPENMP when the torch it builds against runs OpenMP, so the target and that
// stand in for them. A wrong guess costs speed, never a result. Other builds keep BLAS's own threading.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(ATTNX_TORCH_OPENMP)
constexpr bool kSharesMeasured = true;
#else
constexpr bool kSharesMeasured = false;
#endif

// An fp32 GEMM with at most this many outputs and multiply-adds runs on small_linear_f32
// (cpu/linear_kernel.h) rather than on torch's BLAS, whose call through the stable dispatcher (with its
// views) costs a few us more. The kernel reduces each output's partial sums on its own, so the outputs bound
// it as much as the arithmetic. Measured, one thread, us per call with a bias (BLAS / kernel): (1, 64) x (64,
// 64) 6.9-7.2 / 4.1, (1, 128) x (128, 128) 7.5-8.1 / 5.4-5.7, (1, 256) x (256, 256) 11.5-13.5 / 9.7-10.0;
// with more outputs BLAS wins: (4, 128) x (128, 128) 9.7 / 11.4-13.0, (16, 64) x (64, 64) 8.8-9.5 / 14.1.
constexpr int64_t kMaxSmallOutputs = 256;
constexpr int64_t kMaxSmallWork = int64_t(1) << 16;

float* data(const StridedMatrix& m) {
  return static_cast<float*>(m.base.data_ptr()) + m.offset;
}

void run_gemm_cpu(const LinearOperands& g) {
  const int64_t M = g.c.rows, N = g.c.cols, K = g.a.cols;
  if (g.dtype == torch::headeronly::ScalarType::Float && M * N <= kMaxSmallOutputs &&
      M * N * K <= kMaxSmallWork && g.a.col_stride == 1 && g.w.col_stride == 1) {
    const float* bias = g.bias ? data(*g.bias) : nullptr;
    const int64_t bias_stride = g.bias && g.bias->cols != 1 ? g.bias->col_stride : 0;
    cpu::small_linear_f32(M, N, K, data(g.a), g.a.row_stride, data(g.w), g.w.row_stride, bias, bias_stride,
                          data(g.c), g.c.row_stride);
    return;
  }
  run_gemm(g);
}

// A GEMM seen as a line of `units` rows or columns (the larger of its output dims, so that the operand every
// share reads in full is the smaller one), each worth `unit_work` multiply-adds.
struct GemmLine {
  const LinearOperands* gemm;
  bool by_rows;
  int64_t units, unit_work;
};

// Units [begin, end) of a GEMM: rows of a and c, or rows of w (and bias) with columns of c.
void run_part(const GemmLine& line, int64_t begin, int64_t end) {
  if (begin >= end) return;
  run_gemm_cpu(gemm_part(*line.gemm, line.by_rows, begin, end));
}

void run_gemms_in_shares(const std::vector<LinearOperands>& gemms) {
  std::vector<GemmLine> lines;
  int64_t total = 0, largest = 0;
  for (const LinearOperands& g : gemms) {
    const int64_t M = g.c.rows, N = g.c.cols, K = std::max<int64_t>(g.a.cols, 1);
    const bool by_rows = M > N;
    lines.push_back({&g, by_rows, by_rows ? M : N, (by_rows ? N : M) * K});
    total += M * N * K;
    largest = std::max(largest, M * N * K);
  }
  // One GEMM is shared out only when it has few rows for its columns: BLAS's own threading splits the rows,
  // so every thread packs the whole weight, where column shares pack a part each (measured: 0.77-0.97x the
  // time at 8-64 rows, 1.1x at as many rows as columns).
  const bool skinny = lines.size() == 1 && !lines[0].by_rows && 2 * lines[0].gemm->c.rows <= lines[0].units;
  const int64_t threads = kSharesMeasured ? cpu::num_threads() : 1;
  // Inside a parallel region already (no stable call tells), parallel_for runs the shares inline one after
  // another: the same results, from a few more, smaller GEMM calls.
  if (threads == 1 || (lines.size() == 1 && !skinny) || total < kMinSharedWork ||
      largest >= kMaxBlasShare * threads) {
    for (const GemmLine& line : lines) run_gemm_cpu(*line.gemm);
    return;
  }

  // Share t is the work [t * total / threads, (t + 1) * total / threads) of the GEMMs laid end to end,
  // each end moved to the nearest cut (a multiple of kCutAlign units, or a GEMM's end). Adjacent shares meet
  // at the same cut, so every unit is computed exactly once.
  struct Cut {
    size_t line;
    int64_t unit;
  };
  const auto cut = [&](int64_t t) -> Cut {
    int64_t work = t * (total / threads) + std::min(t, total % threads);
    for (size_t i = 0; i < lines.size(); ++i) {
      const int64_t line_work = lines[i].units * lines[i].unit_work;
      if (work < line_work) {
        const int64_t unit = (work / lines[i].unit_work + kCutAlign / 2) / kCutAlign * kCutAlign;
        return unit < lines[i].units ? Cut{i, unit} : Cut{i + 1, 0};
      }
      work -= line_work;
    }
    return {lines.size(), 0};
  };
  // Worker threads start with the default dispatch state (grad mode on, inference mode off), not the
  // caller's: the views of each share are made on the thread that runs it (see LinearOperands), so none needs
  // it.
  cpu::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Cut from = cut(t);
      const Cut to = cut(t + 1);
      for (; from.line < to.line; ++from.line, from.unit = 0) {
        run_part(lines[from.line], from.unit, lines[from.line].units);
      }
      if (from.line < lines.size()) run_part(lines[from.line], from.unit, to.unit);
    }
  });
}

// Each call's GEMM planned into its output, then all of them run in shares.
std::vector<torch::stable::Tensor> run_linears_in_shares(const std::vector<LinearCall>& calls) {
  std::vector<torch::stable::Tensor> outs;
  std::vector<LinearOperands> gemms;
  for (const LinearCall& c : calls) {
    check_linear_args(c.input, c.weight, c.bias);
    const LinearRows rows = linear_rows(c.input);
    const torch::stable::Tensor out = empty_linear_output(rows, c.weight.size(0));
    if (std::optional<LinearOperands> gemm = plan_linear_into(out, rows, c.weight, c.bias)) {
      gemms.push_back(std::move(*gemm));
    }
    outs.push_back(out);
  }
  run_gemms_in_shares(gemms);
  return outs;
}

// mha's in-projections on CPU tensors run in shares too (common/linear.h, run_linears).
[[maybe_unused]] const bool kRegistered =
    (register_linear_runner(torch::headeronly::DeviceType::CPU, &run_linears_in_shares), true);

}  // namespace

// One linear, run_linears_in_shares' work without its lists: linear is called per layer and step.
torch::stable::Tensor linear_cpu(const torch::stable::Tensor& input, const torch::stable::Tensor& weight,
                                 const std::optional<torch::stable::Tensor>& bias) {
  check_linear_args(input, weight, bias);
  const LinearRows rows = linear_rows(input);
  torch::stable::Tensor out = empty_linear_output(rows, weight.size(0));
  if (std::optional<LinearOperands> gemm = plan_linear_into(out, rows, weight, bias)) {
    run_gemms_in_shares({std::move(*gemm)});
  }
  return out;
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("_linear", TORCH_BOX(&attnx::linear_cpu));
  m.impl("_linear_autograd", TORCH_BOX(&attnx::linear_cpu));
}
