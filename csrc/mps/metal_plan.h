// attnx: the launch plans of the Metal kernels (metal/*.metal): which kernel, under which host name, with how
// many threadgroups of how many threads, and how LinearParams reads the layouts of linear's input and output.
//
// Torch-free, host-only C++. The MPS glue (csrc/mps/*.mm) and the CPU emulation (tests/emulation/metal/) both
// launch from these functions, so the emulated launches are the ones a Mac gets; the emulation's tests check
// the plans on Linux.
#pragma once

#include <stdint.h>
#include <stdio.h>

#include "attnx/metal_config.h"
#include "attnx/params.h"

namespace attnx::mps {

namespace cfg = attnx::metal_config;

// The element type of the tensors a kernel reads and writes. Metal has no float64.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "?";
}

// Buffer indices, the [[buffer(i)]] of every kernel of metal/attention.metal and metal/linear.metal.
enum AttentionBuffer : int {
  kAttentionQuery = 0,
  kAttentionKey = 1,
  kAttentionValue = 2,
  kAttentionMask = 3,            // bound to query's buffer when absent (never read then)
  kAttentionKeyPaddingMask = 4,  // likewise
  kAttentionOut = 5,
  kAttentionLse = 6,         // float32
  kAttentionKeyLengths = 7,  // (B,) int32 or int64 (AttentionParams::key_lengths_kind); query's when absent
  kAttentionSinks = 8,       // (H,) float32, contiguous; query's buffer when absent
  kAttentionParams = 9,      // AttentionParams, by value (setBytes)
  kAttentionBuffers = 10,
};

enum LinearBuffer : int {
  kLinearInput = 0,
  kLinearWeight = 1,
  kLinearBias = 2,  // bound to weight's buffer when absent (never read then)
  kLinearOut = 3,
  kLinearParams = 4,  // LinearParams, by value (setBytes)
  kLinearBuffers = 5,
};

// One dispatch: dispatchThreadgroups(grid, threads) of the pipeline named `name`. A grid with a 0 dimension
// means there is nothing to compute.
struct Launch {
  char name[48];
  int64_t grid[3];            // threadgroups along x, y, z
  int32_t threads;            // threads per threadgroup
  int32_t threadgroup_bytes;  // static threadgroup memory the kernel declares (checked against 32 KiB)
};

// The largest threadgroup count per grid dimension the plans produce (Metal's limit is higher).
constexpr int64_t kMaxGrid = 2147483647;

inline bool launch_empty(const Launch& launch) {
  return launch.grid[0] == 0 || launch.grid[1] == 0 || launch.grid[2] == 0;
}

// ---------------------------------------------------------------------------------------------------------
// attention

enum class AttentionKernel : int32_t { kNone = 0, kVector = 1, kTiled = 2 };

// max(D, Dv) rounded up to 32, 64, 128 or 256; 0 above cfg::kMaxHeadDim (no kernel).
constexpr int attention_bucket(int64_t head_dim, int64_t v_head_dim) {
  const int64_t d = head_dim > v_head_dim ? head_dim : v_head_dim;
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : d <= cfg::kMaxHeadDim ? 256 : 0;
}

struct AttentionPlan {
  AttentionKernel kernel;  // kNone: D or Dv above cfg::kMaxHeadDim, or a grid too large
  int32_t bucket;
  Launch launch;
};

inline AttentionPlan plan_attention(const AttentionParams& p, DType dtype) {
  AttentionPlan plan{};
  plan.bucket = attention_bucket(p.head_dim, p.v_head_dim);
  if (plan.bucket == 0) return plan;
  // Short queries: the vector kernel (one threadgroup per query row) keeps every simdgroup busy on keys; the
  // tiled kernel would leave most of its 32 rows empty. The tiled kernel's matrices stop at 128.
  const bool vector = p.q_len <= cfg::kVectorMaxQueries || plan.bucket > cfg::kTiledMaxHeadDim;
  plan.kernel = vector ? AttentionKernel::kVector : AttentionKernel::kTiled;
  Launch& launch = plan.launch;
  snprintf(launch.name, sizeof launch.name, "attention_%s_d%d_%s", vector ? "vector" : "tiled", plan.bucket,
           dtype_name(dtype));
  launch.grid[0] = vector ? p.q_len : (p.q_len + cfg::kTiledRows - 1) / cfg::kTiledRows;
  launch.grid[1] = p.batch * p.heads;
  launch.grid[2] = 1;
  if (vector) {
    launch.threads = cfg::kVectorThreads;
    launch.threadgroup_bytes = 4 * (cfg::kVectorSimdgroups * plan.bucket + 2 * cfg::kVectorSimdgroups);
  } else {
    launch.threads = cfg::kTiledThreads;
    launch.threadgroup_bytes = 4 * (cfg::kTiledKeys * (plan.bucket + 4) + cfg::kTiledRows * cfg::kTiledKeys +
                                    cfg::kTiledSimdgroups * 64 + cfg::kTiledRows);
  }
  if (launch.grid[0] > kMaxGrid || launch.grid[1] > kMaxGrid) plan.kernel = AttentionKernel::kNone;
  return plan;
}

// ---------------------------------------------------------------------------------------------------------
// linear

enum class LinearKernel : int32_t { kGemv = 0, kGemm = 1 };

// Reads how the rows of an (..., K) input and of its (..., N) output are laid out into p.rows, p.rows_inner,
// p.input_stride and p.out_stride, without copying: size-1 dims are dropped (their stride never moves a
// pointer), then each leading dim merges into the one before it when, in both tensors, that one's stride is
// its stride times its size. Returns false when more than two groups remain (no (outer, inner) indexing
// exists). Nothing is read of an empty input.
inline bool linear_row_layout(int ndim, const int64_t* sizes, const int64_t* strides,
                              const int64_t* out_strides, LinearParams* p) {
  int64_t group_size[2] = {1, 1}, group_stride[2] = {0, 0}, group_out_stride[2] = {0, 0};
  int groups = 0;
  int64_t rows = 1;
  for (int d = 0; d + 1 < ndim; ++d) rows *= sizes[d];
  p->rows = rows;
  p->rows_inner = 1;
  p->in_features = ndim > 0 ? sizes[ndim - 1] : 1;
  p->input_stride[2] = ndim > 0 ? strides[ndim - 1] : 0;
  p->out_stride[2] = ndim > 0 ? out_strides[ndim - 1] : 0;
  if (rows == 0) return true;
  for (int d = 0; d + 1 < ndim; ++d) {
    if (sizes[d] == 1) continue;
    if (groups > 0 && group_stride[groups - 1] == strides[d] * sizes[d] &&
        group_out_stride[groups - 1] == out_strides[d] * sizes[d]) {
      group_size[groups - 1] *= sizes[d];  // dim d continues the previous group
      group_stride[groups - 1] = strides[d];
      group_out_stride[groups - 1] = out_strides[d];
      continue;
    }
    if (groups == 2) return false;
    group_size[groups] = sizes[d];
    group_stride[groups] = strides[d];
    group_out_stride[groups] = out_strides[d];
    ++groups;
  }
  if (groups == 2) p->rows_inner = group_size[1];
  p->input_stride[0] = groups >= 1 ? group_stride[0] : 0;
  p->input_stride[1] = groups == 2 ? group_stride[1] : 0;
  p->out_stride[0] = groups >= 1 ? group_out_stride[0] : 0;
  p->out_stride[1] = groups == 2 ? group_out_stride[1] : 0;
  return true;
}

// Everything attnx::linear's kernels read about the layouts: the rows of the input and of the output
// (linear_row_layout; the output is (..., out_features) with out_strides), the weight (N, K) and an optional
// bias of size N or 1 through their strides. Returns false when no (outer, inner) indexing of the rows exists
// (see linear_row_layout).
inline bool pack_linear_params(int ndim, const int64_t* sizes, const int64_t* strides,
                               const int64_t* out_strides, int64_t out_features, const int64_t* weight_strides,
                               bool has_bias, int64_t bias_size, int64_t bias_stride, LinearParams* p) {
  *p = LinearParams{};
  if (!linear_row_layout(ndim, sizes, strides, out_strides, p)) return false;
  p->out_features = out_features;
  p->weight_stride[0] = weight_strides[0];
  p->weight_stride[1] = weight_strides[1];
  p->has_bias = has_bias ? 1 : 0;
  p->bias_stride = has_bias && bias_size != 1 ? bias_stride : 0;  // a size-1 bias broadcasts
  return true;
}

struct LinearPlan {
  LinearKernel kernel;
  Launch launch;
};

inline LinearPlan plan_linear(const LinearParams& p, DType dtype) {
  LinearPlan plan{};
  const bool gemv = p.rows <= cfg::kGemvMaxRows;
  plan.kernel = gemv ? LinearKernel::kGemv : LinearKernel::kGemm;
  Launch& launch = plan.launch;
  snprintf(launch.name, sizeof launch.name, "linear_%s_%s", gemv ? "gemv" : "gemm", dtype_name(dtype));
  const int64_t tile = gemv ? cfg::kGemvSimdgroups : cfg::kGemmTile;
  launch.grid[0] = (p.out_features + tile - 1) / tile;
  launch.grid[1] = gemv ? (p.rows > 0 ? 1 : 0) : (p.rows + cfg::kGemmTile - 1) / cfg::kGemmTile;
  launch.grid[2] = 1;
  launch.threads = gemv ? cfg::kGemvThreads : cfg::kGemmThreads;
  launch.threadgroup_bytes = gemv ? 0 : 4 * 2 * cfg::kGemmTile * (cfg::kGemmTile + 4);
  return plan;
}

}  // namespace attnx::mps
