// attnx: the CPU kernels' 16-bit products: bfloat16 pairs multiplied and summed into float32 lanes, on the
// instructions that do it natively (AVX512-BF16's vdpbf16ps) or on their scalar definitions.
//
// Included by cpu/attention_kernel_impl.h after vec.h, in the same CPU_CAPABILITY namespace. The TU says
// which implementation it wants with ATTNX_DOT_BF16 before including the kernel:
//   0 (or undefined): none; bfloat16 inputs are converted to float32 and multiplied on Vec<float> (gemm.h);
//   1: AVX512-BF16 (vdpbf16ps, vcvtne2ps2bf16), in a TU whose target has avx512bf16;
//   2: the same operations defined lane by lane on the portable Vec<float>: the emulation that lets every
//      machine run the code that AVX512-BF16 machines run (cpu/attention_kernel_bf16_emulated.cpp), with the
//      instructions' rounding, order and denormal rules (tests/test_cpu_dot16.py compares the two bit for bit
//      where the CPU has the instructions).
//
// A pair is two bfloat16 values in one 32-bit word, the lower-addressed one in the low half: a row of
// bfloat16 elements read as words. Products run along pairs: C (M, N) += A (M, K) B (K, N) with A's rows
// as K/2 pairs and B as (K/2, N) words whose pair k holds B[2k][n] (low) and B[2k + 1][n] (high), the layout
// the instruction wants (Intel calls it VNNI).
#pragma once

#ifndef CPU_CAPABILITY
#error "dot16.h is included by a kernel TU that defines CPU_CAPABILITY"
#endif

#ifndef ATTNX_DOT_BF16
#define ATTNX_DOT_BF16 0
#endif

namespace attnx::cpu {
namespace CPU_CAPABILITY {

// Whether this TU multiplies bfloat16 inputs as pairs (ATTNX_DOT_BF16 1 or 2).
constexpr bool kDotBf16 = ATTNX_DOT_BF16 != 0;

namespace dot16 {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The instructions' inputs and outputs: a denormal reads and is written as a zero of its sign (they neither
// consult nor update MXCSR, whatever its DAZ and FTZ bits say).
inline float flush_denormal(float x) {
  const uint32_t u = float_to_bits(x);
  return (u & 0x7f800000u) == 0 ? bits_to_float(u & 0x80000000u) : x;
}

// vcvtne2ps2bf16 per element: round to nearest even; a denormal input is a signed zero; a NaN stays a NaN,
// made quiet.
inline uint16_t to_bf16(float x) {
  const uint32_t u = float_to_bits(flush_denormal(x));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A pair's low and high bfloat16 values as float32, a denormal read as zero (the instructions' inputs).
inline float low(uint32_t pair) {
  return flush_denormal(bits_to_float(pair << 16));
}
inline float high(uint32_t pair) {
  return flush_denormal(bits_to_float(pair & 0xffff0000u));
}

// vdpbf16ps per lane: acc + a.high * b.high, rounded, then + a.low * b.low, rounded (each step one fused
// multiply-add: a product of two bfloat16 values is exact in float32), inputs and each step's result with
// denormals flushed. NaN payloads aside, which the attention never reads.
inline float dot_pair(float acc, uint32_t a, uint32_t b) {
  acc = flush_denormal(std::fma(high(a), high(b), flush_denormal(acc)));
  return flush_denormal(std::fma(low(a), low(b), acc));
}

}  // namespace dot16

#if ATTNX_DOT_BF16 == 1

#if !defined(ATTNX_VEC_AVX512)
#error "ATTNX_DOT_BF16 1 is AVX512-BF16: the TU's vectors must be AVX-512's"
#endif

// Vec<float>::size() pairs.
struct Pairs {
  __m512i v;
  static Pairs loadu(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
  // The first n < 16 pairs; the others are 0.
  static Pairs loadu(const uint32_t* p, int n) {
    return {_mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1), p)};
  }
  static Pairs broadcast(uint32_t pair) { return {_mm512_set1_epi32(static_cast<int>(pair))}; }
};

// acc[l] + a[l] . b[l] per lane l (vdpbf16ps).
inline Vec<float> dot_pairs(Vec<float> acc, Pairs a, Pairs b) {
  return _mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(a.v), reinterpret_cast<__m512bh>(b.v));
}

// dst[j] = the pair (bf16(x[2j]), bf16(x[2j + 1])) for j < ceil(n / 2), the high half of the last one 0 when
// n is odd (vcvtne2ps2bf16: 32 floats, two vectors, a step).
inline void to_bf16_pairs(const float* x, int64_t n, uint32_t* dst) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(x + j));
    _mm512_storeu_si512(dst + j / 2, reinterpret_cast<__m512i>(h));
  }
  if (j < n) {
    const int t = static_cast<int>(n - j);
    const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(t >= 16 ? 0xffffu : (1u << t) - 1), x + j);
    const __m512 hi = t > 16 ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (t - 16)) - 1), x + j + 16)
                             : _mm512_setzero_ps();
    const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    const int words = (t + 1) / 2;
    _mm512_mask_storeu_epi32(dst + j / 2, static_cast<__mmask16>((1u << words) - 1), h);
  }
}

// dst[0, 16) = the pairs of the 32 floats lo, hi, rounded (vcvtne2ps2bf16).
inline void store_bf16_pairs(Vec<float> lo, Vec<float> hi, uint32_t* dst) {
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi.v, lo.v)));
}

// dst[j] = the pair (bf16(a[j]), bf16(b[j])) for j < n: two rows rounded and interleaved (vcvtne2ps2bf16 and
// a word interleave, 32 elements of each row a step).
inline void to_bf16_row_pairs(const float* a, const float* b, int64_t n, uint32_t* dst) {
  alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512i x =
        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(a + j)));
    const __m512i y =
        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(b + j + 16), _mm512_loadu_ps(b + j)));
    _mm512_storeu_si512(dst + j, _mm512_permutex2var_epi16(x, low, y));
    _mm512_storeu_si512(dst + j + 16, _mm512_permutex2var_epi16(x, high, y));
  }
  for (; j < n; ++j) dst[j] = dot16::to_bf16(a[j]) | static_cast<uint32_t>(dot16::to_bf16(b[j])) << 16;
}

#elif ATTNX_DOT_BF16 == 2

// The same operations, lane by lane, over the portable Vec<float>'s lanes.
struct Pairs {
  uint32_t v[Vec<float>::size()];
  static Pairs loadu(const uint32_t* p) {
    Pairs r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static Pairs loadu(const uint32_t* p, int n) {
    Pairs r{};
    std::memcpy(r.v, p, n * sizeof(uint32_t));
    return r;
  }
  static Pairs broadcast(uint32_t pair) {
    Pairs r;
    std::fill_n(r.v, Vec<float>::size(), pair);
    return r;
  }
};

inline Vec<float> dot_pairs(Vec<float> acc, Pairs a, Pairs b) {
  float lanes[Vec<float>::size()];
  acc.store(lanes);
  for (int l = 0; l < Vec<float>::size(); ++l) lanes[l] = dot16::dot_pair(lanes[l], a.v[l], b.v[l]);
  return Vec<float>::loadu(lanes);
}

inline void store_bf16_pairs(Vec<float> lo, Vec<float> hi, uint32_t* dst) {
  constexpr int W = Vec<float>::size();
  float x[2 * W];
  lo.store(x);
  hi.store(x + W);
  for (int j = 0; j < W; ++j)
    dst[j] = dot16::to_bf16(x[2 * j]) | static_cast<uint32_t>(dot16::to_bf16(x[2 * j + 1])) << 16;
}

inline void to_bf16_row_pairs(const float* a, const float* b, int64_t n, uint32_t* dst) {
  for (int64_t j = 0; j < n; ++j)
    dst[j] = dot16::to_bf16(a[j]) | static_cast<uint32_t>(dot16::to_bf16(b[j])) << 16;
}

inline void to_bf16_pairs(const float* x, int64_t n, uint32_t* dst) {
  for (int64_t j = 0; j < n; j += 2) {
    const uint32_t high = j + 1 < n ? dot16::to_bf16(x[j + 1]) : 0u;
    dst[j / 2] = dot16::to_bf16(x[j]) | high << 16;
  }
}

#endif

}  // namespace CPU_CAPABILITY
}  // namespace attnx::cpu
