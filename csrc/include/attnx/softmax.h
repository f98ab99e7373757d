// attnx: the online-softmax recurrence, shared by every backend (host, CUDA device and Metal inline).
//
// One query row keeps (m, l): the running maximum of its scores and the running sum of exp(score - m). A new
// tile of scores with maximum `tile_max` moves the maximum to m' = max(m, tile_max); the row's partial sums
// (l and the output accumulator) are rescaled by alpha = exp(m - m') and the tile contributes exp(score -
// m').
//
// -inf is the identity of this recurrence: a masked score is -inf and a row that has seen only masked scores
// has m = -inf. exp(-inf - -inf) would be NaN, so the value subtracted from scores is the "safe" maximum, 0
// when m' = -inf: masked scores then give exp(-inf) = 0 and alpha = 0 (nothing accumulated yet), never NaN.
// The maximum propagates NaN, so a NaN score poisons its row's statistics as it does in the reference.
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#define ATTNX_HOST_DEVICE
#elif defined(__CUDACC__) || defined(__HIPCC__)
#if !defined(__CUDACC_RTC__)  // NVRTC: attnx/rtc.h
#include <math.h>
#endif
#define ATTNX_HOST_DEVICE __host__ __device__
#else
#include <math.h>
#define ATTNX_HOST_DEVICE
#endif

namespace attnx {

// The accumulator type of an element type: float for float, half and bfloat16 inputs; double for double.
template <typename T>
struct AccType {
  typedef float type;
};
#if !defined(__METAL_VERSION__)
template <>
struct AccType<double> {
  typedef double type;
};

// A value AttentionParams carries as a pair of floats hi + lo (scale, dropout_scale, softcap), in the
// accumulator type A: the double the pair stands for in float64, hi in float. (Metal has no double; its
// float kernels read hi alone.)
template <typename A>
ATTNX_HOST_DEVICE inline A split_value(float hi, float lo) {
  return sizeof(A) == 8 ? A(double(hi) + double(lo)) : A(hi);
}
#endif

template <typename T>
ATTNX_HOST_DEVICE inline bool is_nan(T x) {
  return x != x;
}

// max(a, b) that returns NaN when either is NaN (IEEE 754-2019 `maximum`); fmax would drop the NaN.
template <typename T>
ATTNX_HOST_DEVICE inline T nan_max(T a, T b) {
  return (is_nan(a) || a > b) ? a : b;
}

// The value subtracted from a row's scores: its maximum, or 0 while every score seen is -inf.
template <typename T>
ATTNX_HOST_DEVICE inline T safe_max(T m) {
  return m == -T(INFINITY) ? T(0) : m;
}

// exp and log of the argument's type: the accurate ones (expf and logf in float on CUDA, never the SFU's
// __expf). Metal's live in namespace metal, the others' in the global namespace.
#if defined(__METAL_VERSION__)
using metal::exp;
using metal::log;
#endif

template <typename T>
ATTNX_HOST_DEVICE inline T softmax_exp(T x) {
  return exp(x);
}

template <typename T>
ATTNX_HOST_DEVICE inline T softmax_log(T x) {
  return log(x);
}

// One row's running statistics. Passed and returned by value: Metal has no unqualified references.
template <typename T>
struct SoftmaxRow {
  T max;  // m: maximum of the scores seen so far (-inf: none yet, or all masked)
  T sum;  // l: sum of exp(score - safe_max(m)) over the scores seen so far
};

template <typename T>
ATTNX_HOST_DEVICE inline SoftmaxRow<T> softmax_row_init() {
  SoftmaxRow<T> row;
  row.max = -T(INFINITY);
  row.sum = T(0);
  return row;
}

// How a row moves when a tile whose scores have maximum `tile_max` arrives.
template <typename T>
struct SoftmaxStep {
  T max;    // the row's new maximum m'
  T base;   // safe_max(m'): subtract it from the tile's scores before exp
  T alpha;  // exp(m - base): multiply the row's sum and output accumulator by it before adding the tile
};

template <typename T>
ATTNX_HOST_DEVICE inline SoftmaxStep<T> softmax_step(SoftmaxRow<T> row, T tile_max) {
  SoftmaxStep<T> step;
  step.max = nan_max(row.max, tile_max);
  step.base = safe_max(step.max);
  step.alpha = softmax_exp(row.max - step.base);  // 0 while the row has seen only masked scores
  return step;
}

// The row after the tile: `tile_sum` is the sum of exp(score - step.base) over the tile.
template <typename T>
ATTNX_HOST_DEVICE inline SoftmaxRow<T> softmax_advance(SoftmaxRow<T> row, SoftmaxStep<T> step, T tile_sum) {
  row.sum = row.sum * step.alpha + tile_sum;
  row.max = step.max;
  return row;
}

// True for a row whose every score was -inf (or that saw no keys): its output is 0, and its accumulator may
// never have been written, so callers write 0 without reading it.
template <typename T>
ATTNX_HOST_DEVICE inline bool softmax_row_empty(SoftmaxRow<T> row) {
  return row.max == -T(INFINITY);
}

// The factor that turns the row's output accumulator into its output: 1 / l. NaN when a score was NaN or
// +inf, since the reference's probabilities are then NaN (exp(inf - inf)); 0 for an empty row.
template <typename T>
ATTNX_HOST_DEVICE inline T softmax_out_scale(SoftmaxRow<T> row) {
  if (softmax_row_empty(row)) return T(0);
  if (is_nan(row.max) || row.max == T(INFINITY)) return T(NAN);
  return T(1) / row.sum;
}

// The natural-log logsumexp of the row's scores: m + log(l). +inf for an empty row, so that exp(score - lse)
// is 0 in a backward; +inf when a score was +inf; NaN when a score was NaN.
template <typename T>
ATTNX_HOST_DEVICE inline T softmax_lse(SoftmaxRow<T> row) {
  if (softmax_row_empty(row) || row.max == T(INFINITY)) return T(INFINITY);
  return row.max + softmax_log(row.sum);  // NaN stays NaN
}

// Attention sinks: a sink logit joins the row's denominator as one more score that adds no value. Folded in
// once, at the end, so that the loop over keys is the same with and without a sink. M = max(m, sink) keeps
// both exponentials <= 1. An empty row stays empty (out 0, lse = +inf: it saw no key, whatever the sink); a
// row with a NaN or +inf score keeps softmax_out_scale's and softmax_lse's answers.
template <typename T>
ATTNX_HOST_DEVICE inline bool softmax_sink_applies(SoftmaxRow<T> row) {
  return !softmax_row_empty(row) && !is_nan(row.max) && row.max != T(INFINITY);
}

// softmax_out_scale with a sink: exp(m - M) / (l exp(m - M) + exp(sink - M)). A sink of +inf takes all the
// mass (out 0), where exp(inf - inf) would be NaN; a NaN sink makes the row NaN.
template <typename T>
ATTNX_HOST_DEVICE inline T softmax_out_scale_sink(SoftmaxRow<T> row, T sink) {
  if (!softmax_sink_applies(row)) return softmax_out_scale(row);
  if (sink == T(INFINITY)) return T(0);
  const T big = nan_max(row.max, sink);
  const T keys = softmax_exp(row.max - big);
  return keys / (row.sum * keys + softmax_exp(sink - big));
}

// softmax_lse with a sink: log(exp(sink) + sum_s exp(score_s)) = M + log(l exp(m - M) + exp(sink - M)).
template <typename T>
ATTNX_HOST_DEVICE inline T softmax_lse_sink(SoftmaxRow<T> row, T sink) {
  if (!softmax_sink_applies(row)) return softmax_lse(row);
  if (sink == T(INFINITY)) return sink;
  const T big = nan_max(row.max, sink);
  return big + softmax_log(row.sum * softmax_exp(row.max - big) + softmax_exp(sink - big));
}

}  // namespace attnx
