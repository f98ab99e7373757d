// attnx: the tile and threadgroup sizes of the Metal kernels, shared by the kernels (metal/*.metal) and the
// host's launch plan (csrc/mps/metal_plan.h), so that the two cannot disagree.
//
// Written in the common subset of C++ and the Metal Shading Language. Enumerators rather than constexpr
// variables: a program-scope variable must live in Metal's `constant` address space, an enumerator lives
// nowhere.
#pragma once

namespace attnx {
namespace metal_config {

enum : int {
  kSimdWidth = 32,  // threads per simdgroup on every Apple GPU

  // attention, vector kernel: one threadgroup per (b*h, query row); simdgroup g scores keys g, g + 4, ...
  kVectorSimdgroups = 4,
  kVectorThreads = kVectorSimdgroups * kSimdWidth,
  kVectorMaxQueries = 8,  // query lengths up to this take the vector kernel (MLX's and PyTorch's threshold)

  // attention, tiled kernel: one threadgroup per (b*h, block of kTiledRows query rows); simdgroup g owns rows
  // 8g .. 8g + 7 as 8x8 simdgroup matrices; keys come in tiles of kTiledKeys.
  kTiledSimdgroups = 4,
  kTiledThreads = kTiledSimdgroups * kSimdWidth,
  kTiledRows = kTiledSimdgroups * 8,
  kTiledKeys = 32,
  kTiledMaxHeadDim = 128,  // above, the vector kernel runs at every query length

  kMaxHeadDim = 256,  // max(D, Dv); above, no Metal kernel (the host raises a clear error)

  // linear: GEMV for up to kGemvMaxRows rows (one simdgroup per output feature, lanes along K); a GEMM on
  // 8x8 simdgroup matrices otherwise, kGemmTile x kGemmTile outputs per threadgroup, K in steps of kGemmTile.
  kGemvMaxRows = 8,
  kGemvSimdgroups = 4,
  kGemvThreads = kGemvSimdgroups * kSimdWidth,
  kGemmTile = 32,
  kGemmSimdgroups = 4,  // simdgroup g computes rows 8g .. 8g + 7 of the tile
  kGemmThreads = kGemmSimdgroups * kSimdWidth,

  kMaxThreadgroupMemory = 32768,  // bytes: the limit of every Apple GPU
};

}  // namespace metal_config
}  // namespace attnx
