// Random float32 words for the instruction checks (dot16_check.cpp, tiles_check.cpp), weighted towards the
// values where the instructions' rules differ, and their comparison.
#pragma once

#include <cstdint>
#include <random>

namespace check {

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
