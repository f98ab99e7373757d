// attnx: the key ranges of attnx/key_range.h (is_causal, the bottom-right window, per-batch key lengths) as
// bool tensors, built on the tensors' device with torch's ops: for the paths that compute attention in whole
// tensors (common/attention_math.cpp, cuda/attention_composite.h). Nothing is built on the host or copied
// from it, so these paths cost no host work per call, never synchronise and can be captured in a CUDA graph.
#pragma once

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "common/aten.h"
#include "common/views.h"

namespace attnx {

// The dtype positions are computed in: float64, which holds every position exactly (key_range_mask keeps them
// below 2^53 in magnitude); float32 on MPS, which has no float64 (exact below 2^24 keys). Not int64: aten.h's
// sub passes a floating alpha, which integer tensors refuse.
inline torch::headeronly::ScalarType position_dtype(const torch::stable::Device& device) {
  return device.type() == torch::headeronly::DeviceType::MPS ? torch::headeronly::ScalarType::Float
                                                             : torch::headeronly::ScalarType::Double;
}

// (n,) on `device` in position_dtype: first, first + 1, ..., first + n - 1 (arange's values; arange takes
// only Scalars, which the stable dispatcher cannot pass), as the cumulative sum of [first, 1, 1, ...].
inline torch::stable::Tensor positions(int64_t first, int64_t n, const torch::stable::Device& device) {
  const torch::stable::Tensor steps = aten::empty({n}, position_dtype(device), device);
  aten::fill_(steps, 1.0);
  if (n > 0) aten::fill_(views::narrow(steps, 0, 0, 1), static_cast<double>(first));
  return aten::cumsum(steps, 0);
}

// The bool tensor of the keys that query rows l0 .. l0 + rows - 1 see at all, of L rows against S keys in
// each of B batches: (B, 1, rows, S) with key_lengths (clamped into [0, S]), (1, 1, rows, S) without; nothing
// when every row sees every key.
//
// Row l sees key s when s < len_b, s >= l + len_b - L - window_left, s <= l + len_b - L + window_right and,
// under is_causal, s <= l. The window tests are made on s - len_b (one (B, 1, 1, S) tensor) against
// l - L - window_left and l - L + window_right (one (1, 1, rows, 1) tensor each). A window that reaches past
// every key is the same as no window: window_left >= S and window_right >= L + S pass every key, so they are
// capped there, which keeps every value small (and the host arithmetic from overflowing).
inline std::optional<torch::stable::Tensor> key_range_mask(
    int64_t B, int64_t L, int64_t S, bool is_causal, int64_t window_left, int64_t window_right,
    const std::optional<torch::stable::Tensor>& key_lengths, int64_t l0, int64_t rows,
    const torch::stable::Device& device) {
  using torch::headeronly::ScalarType;
  using torch::stable::Tensor;
  if (!is_causal && window_left < 0 && window_right < 0 && !key_lengths) return std::nullopt;
  const int64_t batches = key_lengths ? B : 1;
  const ScalarType dtype = position_dtype(device);
  Tensor lengths = aten::empty({batches}, dtype, device);
  if (key_lengths) {
    aten::copy_(lengths, *key_lengths);
    const torch::headeronly::IntHeaderOnlyArrayRef no_dims;  // 0-dim bounds on the device (see aten.h)
    lengths = aten::clamp(lengths, aten::full(no_dims, 0.0, dtype, device),
                          aten::full(no_dims, static_cast<double>(S), dtype, device));
  } else {
    aten::fill_(lengths, static_cast<double>(S));
  }
  lengths = views::view(lengths, {batches, 1, 1, 1});
  const Tensor col = views::view(positions(0, S, device), {1, 1, 1, S});
  Tensor seen = aten::lt(col, lengths);  // (batches, 1, 1, S)
  if (window_left >= 0 || window_right >= 0) {
    const Tensor from_end = aten::sub(col, lengths);  // s - len_b, (batches, 1, 1, S)
    if (window_left >= 0) {
      const Tensor first =
          views::view(positions(l0 - L - std::min(window_left, S), rows, device), {1, 1, rows, 1});
      seen = aten::logical_and(seen, aten::ge(from_end, first));
    }
    if (window_right >= 0) {
      const Tensor last =
          views::view(positions(l0 - L + std::min(window_right, L + S), rows, device), {1, 1, rows, 1});
      seen = aten::logical_and(seen, aten::le(from_end, last));
    }
  }
  if (is_causal) {
    const Tensor row = views::view(positions(l0, rows, device), {1, 1, rows, 1});
    seen = aten::logical_and(seen, aten::le(col, row));
  }
  return seen;
}

}  // namespace attnx
