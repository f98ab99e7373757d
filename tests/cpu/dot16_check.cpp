// The scalar definitions of the AVX512-BF16 instructions that the emulated CPU variant runs on
// (csrc/cpu/dot16.h's dot16::dot_pair and dot16::to_bf16) against the instructions themselves, bit for bit
// (any NaN equal to any NaN), over random words weighted towards the values where the rules differ: zeros,
// denormals, infinities, NaNs, products that overflow or underflow, sums that cancel.
//
// First, on any CPU, a few answers worked out by hand from the instructions' definitions.
//
//   dot16_check N SEED   prints "checked K cases", or the first mismatches and exits with 1;
//                        exits with 77 after the known answers when the CPU has no AVX512-BF16.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#define CPU_CAPABILITY CHECK
#include "check_words.h"
#include "cpu/dot16.h"

namespace {

using namespace attnx::cpu::CHECK;
using check::pair;
using check::same;
using check::word;

__attribute__((target("avx512f,avx512bf16"))) void native_dot(const float* acc, const uint32_t* a,
                                                              const uint32_t* b, float* out) {
  const __m512 r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc), reinterpret_cast<__m512bh>(_mm512_loadu_si512(a)),
                                    reinterpret_cast<__m512bh>(_mm512_loadu_si512(b)));
  _mm512_storeu_ps(out, r);
}

__attribute__((target("avx512f,avx512bf16"))) void native_convert(const float* x, uint16_t* out) {
  const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
  _mm512_storeu_si512(out, reinterpret_cast<__m512i>(h));
}

int known_answers() {
  check::Expect expect;
  const float half_ulp = std::ldexp(1.0f, -24);  // half an ulp of 1
  // Two roundings, the high product first: 1 + 2^-24 ties to 1, twice (one rounding would give 1 + 2^-23).
  expect("two roundings", dot16::float_to_bits(dot16::dot_pair(1.0f, pair(half_ulp, half_ulp), pair(1, 1))),
         dot16::float_to_bits(1.0f));
  // The high product first: (2^100 - 2^100) + 1 = 1, where the low product first would lose the 1.
  const float big = std::ldexp(1.0f, 100);
  expect("order", dot16::float_to_bits(dot16::dot_pair(big, pair(1, -big), pair(1, 1))),
         dot16::float_to_bits(1.0f));
  // A denormal accumulator reads as 0; a denormal product is written as 0.
  expect("denormal in", dot16::float_to_bits(dot16::dot_pair(1e-40f, pair(0, 0), pair(0, 0))), 0u);
  expect("denormal out", dot16::float_to_bits(dot16::dot_pair(0.0f, pair(0, 1e-20f), pair(0, 1e-20f))), 0u);
  // Round to nearest even, denormals to zero, NaN quiet.
  expect("even down", dot16::to_bf16(dot16::bits_to_float(0x3f808000u)), 0x3f80u);
  expect("even up", dot16::to_bf16(dot16::bits_to_float(0x3f818000u)), 0x3f82u);
  expect("above half", dot16::to_bf16(dot16::bits_to_float(0x3f808001u)), 0x3f81u);
  expect("denormal", dot16::to_bf16(dot16::bits_to_float(0x80000001u)), 0x8000u);
  expect("quiet NaN", dot16::to_bf16(dot16::bits_to_float(0x7f800001u)), 0x7fc0u);
  return expect.bad;
}

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 100000;
  std::mt19937 g(argc > 2 ? static_cast<unsigned>(std::atol(argv[2])) : 1u);
  if (known_answers()) return 1;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::puts("this CPU has no AVX512-BF16");
    return 77;
  }
  int bad = 0;
  long cases = 0;
  for (long it = 0; it < n && bad < 10; ++it) {
    float acc[16], out[16], x[32];
    uint32_t a[16], b[16];
    uint16_t cvt[32];
    for (int l = 0; l < 16; ++l) {
      // Pairs from the high halves of two float32 words: bfloat16 values of every class.
      a[l] = (word(g, 500) >> 16) | (word(g, 500) & 0xffff0000u);
      b[l] = (word(g, 500) >> 16) | (word(g, 500) & 0xffff0000u);
      acc[l] = dot16::bits_to_float(word(g, 500));
    }
    for (float& v : x) v = dot16::bits_to_float(word(g, 500));
    native_dot(acc, a, b, out);
    native_convert(x, cvt);
    for (int l = 0; l < 16; ++l, ++cases) {
      const float e = dot16::dot_pair(acc[l], a[l], b[l]);
      if (!same(dot16::float_to_bits(e), dot16::float_to_bits(out[l]))) {
        std::printf("dot: acc %08x a %08x b %08x: native %08x, emulated %08x\n", dot16::float_to_bits(acc[l]),
                    a[l], b[l], dot16::float_to_bits(out[l]), dot16::float_to_bits(e));
        ++bad;
      }
    }
    for (int l = 0; l < 32; ++l, ++cases) {
      const uint16_t e = dot16::to_bf16(x[l]);
      if (!same(uint32_t{e} << 16, uint32_t{cvt[l]} << 16)) {
        std::printf("convert: %08x: native %04x, emulated %04x\n", dot16::float_to_bits(x[l]), cvt[l], e);
        ++bad;
      }
    }
  }
  if (bad) return 1;
  std::printf("checked %ld cases\n", cases);
  return 0;
}
