// attnx: torch's view ops (view, reshape, transpose, permute, narrow, select, unsqueeze) computed from sizes
// and strides and made with the shim's reinterpret: a direct call, where the op through the dispatcher would
// cost microseconds per view. The sizes and strides are the ones torch's own op gives, down to the strides of
// size-1 dims, so that outputs keep the layouts the fake kernels (python/attnx/_fake.py) state. The views are
// not autograd views: for code below autograd, as the glue is. The one view vocabulary of the C++ glue.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "common/aten.h"
#include "common/stable.h"

namespace attnx::views {

using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::stable::Tensor;

// A view of t's memory with the given sizes and strides, starting `offset` elements past t's first element
// (torch's _reinterpret_tensor). Not an autograd view: a fresh tensor that never requires grad.
inline Tensor reinterpret(const Tensor& t, IntHeaderOnlyArrayRef sizes, IntHeaderOnlyArrayRef strides,
                          int64_t offset = 0) {
  AtenTensorHandle view = nullptr;
  stable::check(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()), sizes.data(),
                                               strides.data(), offset, &view),
                "attnx: a view");
  return Tensor(view);
}

// The strides of `sizes` over memory laid out as (old_sizes, old_strides) without a copy, as torch's view
// computes them (at::detail::computeStride), or nothing where no view exists. The element counts must agree.
inline std::optional<std::vector<int64_t>> view_strides(IntHeaderOnlyArrayRef old_sizes,
                                                        IntHeaderOnlyArrayRef old_strides,
                                                        IntHeaderOnlyArrayRef sizes) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  if (old_sizes.empty()) return std::vector<int64_t>(n, 1);
  if (stable::product(old_sizes) == 0) {
    if (old_sizes.equals(sizes)) return std::vector<int64_t>(old_strides.begin(), old_strides.end());
    return stable::contiguous_strides(sizes);
  }
  // Old dims that are dense with each other form a chunk; the new dims must tile each chunk exactly.
  std::vector<int64_t> strides(n);
  int64_t view_d = n - 1;
  int64_t chunk_base_stride = old_strides.back(), tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_sizes.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_sizes[d];
    if (d == 0 || (old_sizes[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || sizes[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= sizes[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

inline void check_numel(const Tensor& t, IntHeaderOnlyArrayRef sizes) {
  const int64_t numel = t.numel();
  ATTNX_CHECK(stable::product(sizes) == numel, "shape '", stable::Sizes{sizes},
              "' is invalid for input of size ", numel);
}

// t.view(sizes), for callers whose layout always allows the view (a split dim, a contiguous tensor).
inline Tensor view(const Tensor& t, IntHeaderOnlyArrayRef sizes) {
  check_numel(t, sizes);
  const std::optional<std::vector<int64_t>> strides = view_strides(t.sizes(), t.strides(), sizes);
  ATTNX_CHECK(strides.has_value(),
              "view size is not compatible with input tensor's size and stride (at least one dimension spans "
              "across two contiguous subspaces). Use .reshape(...) instead.");
  return reinterpret(t, sizes, *strides);
}

// t.reshape(sizes): a view where the memory allows one, else a view of a contiguous copy, as torch's reshape.
inline Tensor reshape(const Tensor& t, IntHeaderOnlyArrayRef sizes) {
  check_numel(t, sizes);
  if (const auto strides = view_strides(t.sizes(), t.strides(), sizes)) {
    return reinterpret(t, sizes, *strides);
  }
  const Tensor copy = aten::contiguous(t);
  return reinterpret(copy, sizes, *view_strides(copy.sizes(), copy.strides(), sizes));
}

// t's sizes and strides, to edit into a view's.
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> layout(const Tensor& t) {
  const IntHeaderOnlyArrayRef sizes = t.sizes(), strides = t.strides();
  return {std::vector<int64_t>(sizes.begin(), sizes.end()),
          std::vector<int64_t>(strides.begin(), strides.end())};
}

inline int64_t wrap_dim(int64_t dim, int64_t ndim) {
  return dim < 0 ? dim + ndim : dim;
}

inline Tensor transpose(const Tensor& t, int64_t a, int64_t b) {
  auto [sizes, strides] = layout(t);
  a = wrap_dim(a, t.dim());
  b = wrap_dim(b, t.dim());
  std::swap(sizes[a], sizes[b]);
  std::swap(strides[a], strides[b]);
  return reinterpret(t, sizes, strides);
}

// Dim d of the result is dim dims[d] of t.
inline Tensor permute(const Tensor& t, IntHeaderOnlyArrayRef dims) {
  const IntHeaderOnlyArrayRef old_sizes = t.sizes(), old_strides = t.strides();
  std::vector<int64_t> sizes(dims.size()), strides(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    sizes[d] = old_sizes[dims[d]];
    strides[d] = old_strides[dims[d]];
  }
  return reinterpret(t, sizes, strides);
}

// Elements [start, start + length) of dim `dim`.
inline Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  dim = wrap_dim(dim, t.dim());
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes[dim] = length;
  return reinterpret(t, sizes, t.strides(), start * t.stride(dim));
}

// Element `index` of dim `dim`, that dim dropped.
inline Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  dim = wrap_dim(dim, t.dim());
  auto [sizes, strides] = layout(t);
  const int64_t offset = index * strides[dim];
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return reinterpret(t, sizes, strides, offset);
}

// A size-1 dim inserted at `dim` (negative: counted from the end of the result), with torch's stride for it.
inline Tensor unsqueeze(const Tensor& t, int64_t dim) {
  const int64_t ndim = t.dim();
  if (dim < 0) dim += ndim + 1;
  auto [sizes, strides] = layout(t);
  const int64_t stride = dim >= ndim ? 1 : sizes[dim] * strides[dim];
  sizes.insert(sizes.begin() + dim, 1);
  strides.insert(strides.begin() + dim, stride);
  return reinterpret(t, sizes, strides);
}

}  // namespace attnx::views
