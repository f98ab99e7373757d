// attnx: the Philox4x32-10 counter-based RNG and the dropout keep decision built on it, shared by every
// backend (host, CUDA device and Metal inline).
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123) maps a
// 128-bit counter and a 64-bit key to 128 random bits through 10 rounds of 32x32->64 multiplications. Being
// a pure function of (counter, key), it lets every kernel regenerate any element's draw on its own, whatever
// its tiling, thread count or backend: dropout needs no stored mask, and the backward sees the forward's.
//
// The dropout stream. Element (b, h, l, s) of a (B, H, L, S) problem has the row-major index
// e = ((b * H + h) * L + l) * S + s, and its draw is word e % 4 of the Philox block at counter
// (e / 4 low, e / 4 high, offset low, offset high) under key (seed low, seed high): the stream is Philox over
// consecutive counters, as torch's own CUDA RNG lays it out, so four neighbouring keys of a row share one
// block. The element is kept when its draw is below threshold = floor((1 - p) * 2^32).
// python/attnx/reference.py implements the same in plain PyTorch; tests check both against Random123's
// known-answer vectors.
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#define ATTNX_PHILOX_INLINE inline
#elif defined(__CUDACC__) || defined(__HIPCC__)
#if !defined(__CUDACC_RTC__)  // NVRTC: attnx/rtc.h
#include <stdint.h>
#endif
#define ATTNX_PHILOX_INLINE __host__ __device__ inline
#else
#include <stdint.h>
#define ATTNX_PHILOX_INLINE inline
#endif

namespace attnx {

// Four 32-bit words: a Philox counter or the random block it maps to.
struct Philox4x32 {
  uint32_t x, y, z, w;
};

// Philox4x32's constants (an enum: namespace-scope variables would need an address space in Metal).
enum PhiloxConstant : uint32_t {
  kPhiloxM0 = 0xD2511F53u,  // round multipliers
  kPhiloxM1 = 0xCD9E8D57u,
  kPhiloxW0 = 0x9E3779B9u,  // Weyl key increments: the golden ratio and sqrt(3) - 1, in 32-bit fixed point
  kPhiloxW1 = 0xBB67AE85u,
};

// Philox4x32-10 of counter c under key (k0, k1).
ATTNX_PHILOX_INLINE Philox4x32 philox4x32_10(Philox4x32 c, uint32_t k0, uint32_t k1) {
  const uint32_t kM0 = kPhiloxM0, kM1 = kPhiloxM1, kW0 = kPhiloxW0, kW1 = kPhiloxW1;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c.x;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c.z;
    Philox4x32 next;
    next.x = static_cast<uint32_t>(p1 >> 32) ^ c.y ^ k0;
    next.y = static_cast<uint32_t>(p1);
    next.z = static_cast<uint32_t>(p0 >> 32) ^ c.w ^ k1;
    next.w = static_cast<uint32_t>(p0);
    c = next;
  }
  return c;
}

// Word i (0..3) of a block.
ATTNX_PHILOX_INLINE uint32_t philox_word(Philox4x32 r, uint32_t i) {
  return i == 0 ? r.x : (i == 1 ? r.y : (i == 2 ? r.z : r.w));
}

// The dropout stream's block g: the draws of elements 4g .. 4g + 3. seed and offset are (low, high) pairs.
ATTNX_PHILOX_INLINE Philox4x32 dropout_block(uint64_t g, uint32_t seed_lo, uint32_t seed_hi,
                                             uint32_t offset_lo, uint32_t offset_hi) {
  Philox4x32 c;
  c.x = static_cast<uint32_t>(g);
  c.y = static_cast<uint32_t>(g >> 32);
  c.z = offset_lo;
  c.w = offset_hi;
  return philox4x32_10(c, seed_lo, seed_hi);
}

// Whether element e (the row-major index of (b, h, l, s)) is kept. Kernels that walk a row of keys share
// each dropout_block between four elements instead.
ATTNX_PHILOX_INLINE bool dropout_keep(uint64_t e, uint32_t threshold, uint32_t seed_lo, uint32_t seed_hi,
                                      uint32_t offset_lo, uint32_t offset_hi) {
  const Philox4x32 r = dropout_block(e >> 2, seed_lo, seed_hi, offset_lo, offset_hi);
  return philox_word(r, static_cast<uint32_t>(e & 3)) < threshold;
}

}  // namespace attnx
