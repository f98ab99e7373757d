// Random float32 words for the instruction checks (dot16_check.cpp, tiles_check.cpp), weighted towards the
// values where the instructions' rules differ, and their comparison.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace check {

// A pair of bfloat16 values given as floats (truncated to their high halves), the lower one in the low half.
inline uint32_t pair(float low, float high) {
  uint32_t l, h;
  std::memcpy(&l, &low, 4);
  std::memcpy(&h, &high, 4);
  return (l >> 16) | (h & 0xffff0000u);
}

// A known answer: prints and counts the wrong ones.
struct Expect {
  int bad = 0;
  void operator()(const char* what, uint32_t got, uint32_t want) {
    if (got != want) {
      std::printf("%s: %08x, expected %08x\n", what, got, want);
      ++bad;
    }
  }
};

// Equal bits, or both NaN (payloads aside, which the kernels never read).
inline bool same(uint32_t x, uint32_t y) {
  const auto nan = [](uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; };
  return x == y || (nan(x) && nan(y));
}

// A float32 word: with probability special / 1000 one of the rare classes (zero, denormal, infinity or NaN,
// a tiny normal whose products underflow, a huge one whose products overflow), else an ordinary value near 1
// (so that sums cancel and round) or, two times in five, uniform bits.
inline uint32_t word(std::mt19937& g, int special) {
  const uint32_t sign = (g() & 1u) << 31;
  if (static_cast<int>(g() % 1000) < special) {
    switch (g() % 5) {
      case 0:
        return sign;
      case 1:
        return sign | (g() & 0x007fffffu);
      case 2:
        return sign | 0x7f800000u | ((g() % 4 == 0) ? 0u : (g() & 0x007fffffu) | 1u);
      case 3:
        return sign | ((g() % 8) << 23) | (g() & 0x007fffffu);
      default:
        return sign | ((0xf8u + g() % 7) << 23) | (g() & 0x007fffffu);
    }
  }
  return g() % 5 < 3 ? sign | ((0x78u + g() % 16) << 23) | (g() & 0x007fffffu) : g();
}

}  // namespace check
