// The scalar definition of AMX-BF16's tdpbf16ps that the emulated_amx CPU variant runs on (csrc/cpu/tiles.h's
// tiles::Ops::dot, ATTNX_TILE_BF16 2) against the instruction itself, bit for bit (any NaN equal to any NaN),
// over random tiles whose words are weighted towards the values where the rules differ: zeros, denormals,
// infinities, NaNs, products that overflow or underflow, sums that cancel.
//
// First, on any CPU, a few answers worked out by hand from the instruction's definition.
//
//   tiles_check N SEED   prints "checked K cases", or the first mismatches and exits with 1;
//                        exits with 77 after the known answers when the CPU has no AMX-BF16 or the OS does
//                        not grant the tile state.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#define CPU_CAPABILITY CHECK
#define ATTNX_TILE_BF16 2
#include "check_words.h"
#include "cpu/vec.h"
#include "cpu/dot16.h"
#include "cpu/tiles.h"

namespace {

using namespace attnx::cpu::CHECK;
using Tile = uint32_t[16][16];
using check::pair;
using check::same;
using check::word;

// C + A B on the emulated tile registers 0, 1, 2.
void emulated(const Tile c, const Tile a, const Tile b, Tile out) {
  tiles::Ops::load<0>(c, 64);
  tiles::Ops::load<1>(a, 64);
  tiles::Ops::load<2>(b, 64);
  tiles::Ops::dot<0, 1, 2>();
  tiles::Ops::store<0>(out, 64);
}

__attribute__((target("amx-tile,amx-bf16"))) void native(const Tile c, const Tile a, const Tile b, Tile out) {
  static const tiles::Config config;
  _tile_loadconfig(&config);
  _tile_loadd(0, c, 64);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out, 64);
  _tile_release();
}

int known_answers() {
  check::Expect expect;
  const auto one = [](uint32_t c, const uint32_t* a, const uint32_t* b, int n) {
    Tile tc{}, ta{}, tb{}, out{};
    tc[0][0] = c;
    for (int k = 0; k < n; ++k) {
      ta[0][k] = a[k];  // row 0 of A: n pairs
      tb[k][0] = b[k];  // column 0 of B: n pairs
    }
    emulated(tc, ta, tb, out);
    return out[0][0];
  };
  {
    const uint32_t a[] = {pair(2.0f, 3.0f)}, b[] = {pair(5.0f, 7.0f)};
    expect("2 * 5 + 3 * 7", one(dot16::float_to_bits(1.0f), a, b, 1), dot16::float_to_bits(32.0f));
  }
  {
    // The even elements sum to 1 + 2^-24 (a tie, to 1), the odd ones to 2^-23, exactly; in one chain, as
    // vdpbf16ps sums, each 2^-24 would be lost and the answer 1.
    const float t = std::ldexp(1.0f, -24);
    const uint32_t a[] = {pair(1.0f, t), pair(t, t)}, b[] = {pair(1.0f, 1.0f), pair(1.0f, 1.0f)};
    expect("even and odd sums apart", one(0u, a, b, 2), 0x3f800001u);
  }
  {
    const uint32_t a[] = {pair(0.0f, 0.0f)}, b[] = {pair(0.0f, 0.0f)};
    expect("denormal C flushed", one(0x00000001u, a, b, 1), 0u);
  }
  {
    const float t = std::ldexp(1.0f, -70);
    const uint32_t a[] = {pair(t, 0.0f)}, b[] = {pair(t, 0.0f)};
    expect("underflowing product flushed", one(0u, a, b, 1), 0u);
  }
  {
    const uint32_t a[] = {0x00010001u}, b[] = {pair(1.0f, 1.0f)};  // both halves denormal bfloat16
    expect("denormal inputs read as zero", one(dot16::float_to_bits(2.0f), a, b, 1),
           dot16::float_to_bits(2.0f));
  }
  return expect.bad;
}

bool amx_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 1000;
  std::mt19937 g(argc > 2 ? static_cast<unsigned>(std::atol(argv[2])) : 1u);
  if (known_answers()) return 1;
  if (!amx_usable()) {
    std::puts("this CPU has no AMX-BF16, or the OS does not grant the tile state");
    return 77;
  }
  int bad = 0;
  long cases = 0;
  for (long it = 0; it < n && bad < 10; ++it) {
    Tile c, a, b, want, got;
    // Mostly ordinary tiles (whose sums exercise the order and rounding), some with many specials.
    const int special = it % 4 == 0 ? 300 : it % 4 == 1 ? 20 : 0;
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 16; ++k) {
        a[r][k] = (word(g, special) >> 16) | (word(g, special) & 0xffff0000u);
        b[r][k] = (word(g, special) >> 16) | (word(g, special) & 0xffff0000u);
        c[r][k] = word(g, special);
      }
    }
    native(c, a, b, want);
    emulated(c, a, b, got);
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 16; ++k, ++cases) {
        if (!same(want[r][k], got[r][k]) && bad++ < 10) {
          std::printf("tile %ld, C[%d][%d] (was %08x): native %08x, emulated %08x\n", it, r, k, c[r][k],
                      want[r][k], got[r][k]);
        }
      }
    }
  }
  if (bad) return 1;
  std::printf("checked %ld cases\n", cases);
  return 0;
}
