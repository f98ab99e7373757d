// The AVX-512 softmax exps of csrc/cpu/vec.h against double-precision exp, over every 7th float32 in
// [ln(FLT_MIN), 0] (the softmax's x = score - row max): vexp within 20 ulp, vexp_for_bf16 (the bfloat16 pair
// kernels', whose results are rounded to bfloat16 next) within 3e-6 relative, 1 - 7e-7 at 0; both 0 below
// ln(FLT_MIN) and at -inf, NaN for NaN.
//
//   exp_check   prints "checked K cases" and the largest errors, or the first failures and exits with 1;
//               exits with 77 when the CPU has no AVX-512 (F, DQ) with FMA, the kernels' AVX-512 variants'.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,avx,fma,f16c")
#include "cpu/isa_avx512.h"
#define CPU_CAPABILITY CHECK
#include "cpu/vec.h"

namespace {

using attnx::cpu::CHECK::Vec;

// out[i] = vexp(x[i]), out_bf16[i] = vexp_for_bf16(x[i]) for 16 lanes.
void both(const float* x, float* out, float* out_bf16) {
  const Vec<float> v = Vec<float>::loadu(x);
  attnx::cpu::CHECK::vexp(v).store(out);
  attnx::cpu::CHECK::vexp_for_bf16(v).store(out_bf16);
}

}  // namespace
#pragma GCC pop_options

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq") ||
      !__builtin_cpu_supports("fma")) {
    std::puts("this CPU has no AVX-512 F/DQ with FMA");
    return 77;
  }
  const float ln_flt_min = std::log(1.17549435e-38f);
  int bad = 0;
  long cases = 0;
  double worst_ulp = 0, worst_rel = 0;
  float x[16], e[16], eb[16];
  // The negative floats from -0 down to ln(FLT_MIN), 16 at a time.
  const uint32_t last = 0x80000000u | [&] {
    uint32_t u;
    const float m = -ln_flt_min;
    std::memcpy(&u, &m, 4);
    return u;
  }();
  for (uint32_t u = 0x80000000u; u <= last && bad < 10; u += 16 * 7) {
    for (int l = 0; l < 16; ++l) x[l] = from_bits(std::min<uint32_t>(u + 7 * l, last));
    both(x, e, eb);
    for (int l = 0; l < 16 && bad < 10; ++l, ++cases) {
      const double want = std::exp(static_cast<double>(x[l]));
      const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
      const double err_ulp = std::abs(e[l] - want) / ulp, rel = std::abs(eb[l] - want) / want;
      worst_ulp = std::max(worst_ulp, err_ulp);
      worst_rel = std::max(worst_rel, rel);
      if (err_ulp > 20 || rel > 3e-6) {
        std::printf("exp(%.9g) = %.9g: vexp %.9g (%.1f ulp), vexp_for_bf16 %.9g (%.3g relative)\n", x[l],
                    want, e[l], err_ulp, eb[l], rel);
        ++bad;
      }
    }
  }
  // Special values: 0 (both signs) as above, 0 below ln(FLT_MIN) and at -inf, NaN for NaN.
  const float special[16] = {0.0f, -0.0f, -88.0f, -100.0f, -1e30f, -INFINITY, NAN, -NAN,
                             0.0f, 0.0f,  0.0f,   0.0f,    0.0f,   0.0f,      0.0f, 0.0f};
  both(special, e, eb);
  for (int l = 0; l < 8; ++l, ++cases) {
    const bool ok = l < 2   ? e[l] == 1.0f && std::abs(eb[l] - 1.0) <= 3e-6
                    : l < 6 ? e[l] == 0.0f && eb[l] == 0.0f
                            : std::isnan(e[l]) && std::isnan(eb[l]);
    if (!ok) {
      std::printf("exp(%g): vexp %.9g, vexp_for_bf16 %.9g\n", special[l], e[l], eb[l]);
      ++bad;
    }
  }
  if (bad) return 1;
  std::printf("checked %ld cases: vexp within %.2f ulp, vexp_for_bf16 within %.3g relative\n", cases,
              worst_ulp, worst_rel);
  return 0;
}
