// attnx: which keys a query row may see before the masks are read: SDPA's top-left is_causal, the
// bottom-right window and per-batch key lengths (AttentionParams::window_left, window_right, key_lengths).
// Shared by every backend (host, CUDA device and Metal inline); scalar arguments only, so that it needs no
// address-space qualifiers on Metal.
//
// Each of the three keeps, for query row l, one interval of keys, and both ends of that interval grow with l.
// So their intersection is one interval [key_begin(l), key_end(l)) too, and, the other way round, the queries
// that see key s are one interval [query_begin(s), query_end(s)). Kernels loop over these intervals instead
// of testing every (l, s): a query tile visits only the key tiles its window reaches, so the cost grows with
// the window, not with S. An empty interval (begin >= end) is a row that sees no key: out 0 and lse = +inf.
// With packed sequences (AttentionParams::varlen) q_len and kv_len_b are those of one sequence: the rules
// hold per sequence, bottom-right aligned in each.
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#define ATTNX_KEY_RANGE_FN inline
#elif defined(__CUDACC__) || defined(__HIPCC__)
#if !defined(__CUDACC_RTC__)  // NVRTC: attnx/rtc.h
#include <stdint.h>
#endif
#define ATTNX_KEY_RANGE_FN __host__ __device__ inline
#else
#include <stdint.h>
#define ATTNX_KEY_RANGE_FN inline
#endif

namespace attnx {

ATTNX_KEY_RANGE_FN int64_t range_min(int64_t a, int64_t b) {
  return a < b ? a : b;
}

ATTNX_KEY_RANGE_FN int64_t range_max(int64_t a, int64_t b) {
  return a > b ? a : b;
}

// The valid keys of a batch: key_lengths[b] clamped into [0, S] (the host checks the range where it can
// read the values, the CPU; on a GPU a value out of range cannot be reported without a sync, so it is
// clamped), or S without key lengths.
ATTNX_KEY_RANGE_FN int64_t range_kv_len(int64_t length, int64_t kv_len) {
  return range_min(range_max(length, 0), kv_len);
}

// The first key query row l may see. q_len = L, kv_len_b = S_b.
ATTNX_KEY_RANGE_FN int64_t range_key_begin(int64_t l, int64_t q_len, int64_t kv_len_b, int64_t window_left) {
  return window_left < 0 ? 0 : range_max(l + kv_len_b - q_len - window_left, 0);
}

// One past the last key query row l may see (never below 0).
ATTNX_KEY_RANGE_FN int64_t range_key_end(int64_t l, int64_t q_len, int64_t kv_len_b, int64_t window_right,
                                         int32_t is_causal) {
  int64_t end = kv_len_b;
  if (window_right >= 0) end = range_min(end, l + kv_len_b - q_len + window_right + 1);
  if (is_causal != 0) end = range_min(end, l + 1);
  return range_max(end, 0);
}

// The first query row that sees key s (q_len when none does).
ATTNX_KEY_RANGE_FN int64_t range_query_begin(int64_t s, int64_t q_len, int64_t kv_len_b, int64_t window_right,
                                             int32_t is_causal) {
  if (s >= kv_len_b) return q_len;
  int64_t begin = 0;
  if (window_right >= 0) begin = range_max(begin, s - (kv_len_b - q_len) - window_right);
  if (is_causal != 0) begin = range_max(begin, s);
  return range_min(begin, q_len);
}

// One past the last query row that sees key s (never below 0).
ATTNX_KEY_RANGE_FN int64_t range_query_end(int64_t s, int64_t q_len, int64_t kv_len_b, int64_t window_left) {
  if (s >= kv_len_b) return 0;
  if (window_left < 0) return q_len;
  return range_max(range_min(s - (kv_len_b - q_len) + window_left + 1, q_len), 0);
}

}  // namespace attnx
