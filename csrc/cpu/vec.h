// attnx: the CPU kernels' own SIMD layer: Vec<float> and Vec<double>, header-only and torch-free.
//
// Included by cpu/attention_kernel_impl.h, once per translation unit, after the TU has defined CPU_CAPABILITY
// (and, in cpu/attention_kernel_avx2.cpp / cpu/attention_kernel_avx512.cpp, raised its target and defined the
// ISA macros). Everything here lives in attnx::cpu::CPU_CAPABILITY, so the inline functions of one ISA level
// never merge with another's at link time, and the implementation is chosen from the ISA macros that the TU
// sees:
//   AVX-512 F/DQ: 16 floats / 8 doubles (zmm); AVX2 + FMA: 8 floats / 4 doubles (ymm);
//   otherwise a portable one of one 16-byte register (4 floats / 2 doubles) of the baseline ISA (SSE2 on
//   x86-64, NEON on AArch64) through the GCC / Clang vector extensions, with std::exp / std::tanh per
//   lane, as ATen's DEFAULT level does.
// <immintrin.h> and the standard headers are included by cpu/attention_kernel.h, before any target is raised.
#pragma once

#ifndef CPU_CAPABILITY
#error "vec.h is included by a kernel TU that defines CPU_CAPABILITY"
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
#define ATTNX_VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTNX_VEC_AVX2 1
#else
#define ATTNX_VEC_PORTABLE 1
#endif

namespace attnx::cpu {
namespace CPU_CAPABILITY {

template <typename T>
struct Vec;

// The operations are free functions rather than friends defined in the class: GCC does not give a friend
// defined in a class body the target of the enclosing `#pragma GCC target`, and then refuses to inline the
// intrinsics into it.

#if defined(ATTNX_VEC_AVX512)

template <>
struct Vec<float> {
  __m512 v;
  static constexpr int size() { return 16; }
  Vec() = default;
  Vec(__m512 x) : v(x) {}
  Vec(float x) : v(_mm512_set1_ps(x)) {}
  static Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  // The first n < size() lanes; the others are 0.
  static Vec loadu(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, int n) const { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
};

inline Vec<float> operator+(Vec<float> a, Vec<float> b) { return _mm512_add_ps(a.v, b.v); }
inline Vec<float> operator-(Vec<float> a, Vec<float> b) { return _mm512_sub_ps(a.v, b.v); }
inline Vec<float> operator*(Vec<float> a, Vec<float> b) { return _mm512_mul_ps(a.v, b.v); }
inline Vec<float> operator/(Vec<float> a, Vec<float> b) { return _mm512_div_ps(a.v, b.v); }
// a * b + c, fused.
inline Vec<float> fmadd(Vec<float> a, Vec<float> b, Vec<float> c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
// Lane-wise max that returns NaN when either lane is NaN (all-ones is a NaN).
inline Vec<float> maximum(Vec<float> a, Vec<float> b) {
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, b.v, _CMP_UNORD_Q);
  return _mm512_or_ps(_mm512_max_ps(a.v, b.v), _mm512_castsi512_ps(_mm512_maskz_set1_epi32(nan, -1)));
}
// The primitives of the polynomial exp (below): min/max that return b when either is NaN, as the instructions
// do.
inline Vec<float> vmin(Vec<float> a, Vec<float> b) { return _mm512_min_ps(a.v, b.v); }
inline Vec<float> vmax(Vec<float> a, Vec<float> b) { return _mm512_max_ps(a.v, b.v); }
inline Vec<float> vfloor(Vec<float> a) {
  return _mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
inline Vec<float> vabs(Vec<float> a) { return _mm512_abs_ps(a.v); }
// |mag| with the sign of s.
inline Vec<float> vcopysign(Vec<float> mag, Vec<float> s) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(mag.v)),
                                             _mm512_and_si512(sign, _mm512_castps_si512(s.v))));
}
// 2^n for integral n in the normal range.
inline Vec<float> vpow2n(Vec<float> n) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23));
}
// a < b ? x : y per lane (false for NaN).
inline Vec<float> select_lt(Vec<float> a, Vec<float> b, Vec<float> x, Vec<float> y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OS), y.v, x.v);
}
inline float reduce_sum(Vec<float> a) { return _mm512_reduce_add_ps(a.v); }
// The max over the lanes, NaN when any lane is NaN (the reduction's max instructions alone would drop it).
inline float reduce_max(Vec<float> a) {
  if (_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)) return std::numeric_limits<float>::quiet_NaN();
  return _mm512_reduce_max_ps(a.v);
}

template <>
struct Vec<double> {
  __m512d v;
  static constexpr int size() { return 8; }
  Vec() = default;
  Vec(__m512d x) : v(x) {}
  Vec(double x) : v(_mm512_set1_pd(x)) {}
  static Vec loadu(const double* p) { return _mm512_loadu_pd(p); }
  void store(double* p) const { _mm512_storeu_pd(p, v); }
};

inline Vec<double> operator+(Vec<double> a, Vec<double> b) { return _mm512_add_pd(a.v, b.v); }
inline Vec<double> operator-(Vec<double> a, Vec<double> b) { return _mm512_sub_pd(a.v, b.v); }
inline Vec<double> operator*(Vec<double> a, Vec<double> b) { return _mm512_mul_pd(a.v, b.v); }
inline Vec<double> operator/(Vec<double> a, Vec<double> b) { return _mm512_div_pd(a.v, b.v); }
inline Vec<double> fmadd(Vec<double> a, Vec<double> b, Vec<double> c) {
  return _mm512_fmadd_pd(a.v, b.v, c.v);
}
inline Vec<double> maximum(Vec<double> a, Vec<double> b) {
  const __mmask8 nan = _mm512_cmp_pd_mask(a.v, b.v, _CMP_UNORD_Q);
  return _mm512_or_pd(_mm512_max_pd(a.v, b.v), _mm512_castsi512_pd(_mm512_maskz_set1_epi64(nan, -1)));
}
inline double reduce_sum(Vec<double> a) { return _mm512_reduce_add_pd(a.v); }

#elif defined(ATTNX_VEC_AVX2)

template <>
struct Vec<float> {
  __m256 v;
  static constexpr int size() { return 8; }
  Vec() = default;
  Vec(__m256 x) : v(x) {}
  Vec(float x) : v(_mm256_set1_ps(x)) {}
  static __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static Vec loadu(const float* p, int n) { return _mm256_maskload_ps(p, lanes_below(n)); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, int n) const { _mm256_maskstore_ps(p, lanes_below(n), v); }
};

inline Vec<float> operator+(Vec<float> a, Vec<float> b) { return _mm256_add_ps(a.v, b.v); }
inline Vec<float> operator-(Vec<float> a, Vec<float> b) { return _mm256_sub_ps(a.v, b.v); }
inline Vec<float> operator*(Vec<float> a, Vec<float> b) { return _mm256_mul_ps(a.v, b.v); }
inline Vec<float> operator/(Vec<float> a, Vec<float> b) { return _mm256_div_ps(a.v, b.v); }
inline Vec<float> fmadd(Vec<float> a, Vec<float> b, Vec<float> c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline Vec<float> maximum(Vec<float> a, Vec<float> b) {
  return _mm256_or_ps(_mm256_max_ps(a.v, b.v), _mm256_cmp_ps(a.v, b.v, _CMP_UNORD_Q));
}
inline Vec<float> vmin(Vec<float> a, Vec<float> b) { return _mm256_min_ps(a.v, b.v); }
inline Vec<float> vmax(Vec<float> a, Vec<float> b) { return _mm256_max_ps(a.v, b.v); }
inline Vec<float> vfloor(Vec<float> a) { return _mm256_floor_ps(a.v); }
inline Vec<float> vabs(Vec<float> a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v); }
inline Vec<float> vcopysign(Vec<float> mag, Vec<float> s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(sign, mag.v), _mm256_and_ps(sign, s.v));
}
inline Vec<float> vpow2n(Vec<float> n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23));
}
inline Vec<float> select_lt(Vec<float> a, Vec<float> b, Vec<float> x, Vec<float> y) {
  return _mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OS));
}
inline float reduce_sum(Vec<float> a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The max over the lanes, NaN when any lane is NaN (the max instructions alone would drop it).
inline float reduce_max(Vec<float> a) {
  if (_mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <>
struct Vec<double> {
  __m256d v;
  static constexpr int size() { return 4; }
  Vec() = default;
  Vec(__m256d x) : v(x) {}
  Vec(double x) : v(_mm256_set1_pd(x)) {}
  static Vec loadu(const double* p) { return _mm256_loadu_pd(p); }
  void store(double* p) const { _mm256_storeu_pd(p, v); }
};

inline Vec<double> operator+(Vec<double> a, Vec<double> b) { return _mm256_add_pd(a.v, b.v); }
inline Vec<double> operator-(Vec<double> a, Vec<double> b) { return _mm256_sub_pd(a.v, b.v); }
inline Vec<double> operator*(Vec<double> a, Vec<double> b) { return _mm256_mul_pd(a.v, b.v); }
inline Vec<double> operator/(Vec<double> a, Vec<double> b) { return _mm256_div_pd(a.v, b.v); }
inline Vec<double> fmadd(Vec<double> a, Vec<double> b, Vec<double> c) {
  return _mm256_fmadd_pd(a.v, b.v, c.v);
}
inline Vec<double> maximum(Vec<double> a, Vec<double> b) {
  return _mm256_or_pd(_mm256_max_pd(a.v, b.v), _mm256_cmp_pd(a.v, b.v, _CMP_UNORD_Q));
}
inline double reduce_sum(Vec<double> a) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a.v), _mm256_extractf128_pd(a.v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

#else  // ATTNX_VEC_PORTABLE

// One 16-byte register of the baseline ISA (SSE2 on x86-64, NEON on AArch64) through the GCC / Clang vector
// extensions, which compile + - * / to single instructions for any target; plain arrays (that the compiler
// may vectorise) for other compilers. fmadd is not fused: the baseline x86-64 ISA has no FMA. Vec<T> derives
// from PortableVec<T>, whose operations return Vec<T> (found by argument-dependent lookup).
#if defined(__GNUC__) || defined(__clang__)
#define ATTNX_VEC_EXTENSIONS 1
typedef float attnx_v4sf __attribute__((vector_size(16)));
typedef double attnx_v2df __attribute__((vector_size(16)));
template <typename T>
using PortableStorage = std::conditional_t<std::is_same_v<T, float>, attnx_v4sf, attnx_v2df>;
#else
template <typename T>
struct PortableStorage {
  T lane[16 / sizeof(T)];
  T& operator[](int i) { return lane[i]; }
  T operator[](int i) const { return lane[i]; }
};
#endif

template <typename T>
struct PortableVec {
  static constexpr int kSize = 16 / sizeof(T);
  PortableStorage<T> v;
  static constexpr int size() { return kSize; }
  static Vec<T> loadu(const T* p) {
    Vec<T> r;
    std::memcpy(&r.v, p, sizeof(r.v));
    return r;
  }
  static Vec<T> loadu(const T* p, int n) {
    Vec<T> r(T(0));
    for (int i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  void store(T* p) const { std::memcpy(p, &v, sizeof(v)); }
  void store(T* p, int n) const {
    for (int i = 0; i < n; ++i) p[i] = v[i];
  }
  template <typename F>
  static Vec<T> zip(const Vec<T>& a, const Vec<T>& b, F f) {
    Vec<T> r;
    for (int i = 0; i < kSize; ++i) r.v[i] = f(a.v[i], b.v[i]);
    return r;
  }
#if defined(ATTNX_VEC_EXTENSIONS)
  static Vec<T> wrap(PortableStorage<T> x) {
    Vec<T> r;
    r.v = x;
    return r;
  }
  friend Vec<T> operator+(const Vec<T>& a, const Vec<T>& b) { return wrap(a.v + b.v); }
  friend Vec<T> operator-(const Vec<T>& a, const Vec<T>& b) { return wrap(a.v - b.v); }
  friend Vec<T> operator*(const Vec<T>& a, const Vec<T>& b) { return wrap(a.v * b.v); }
  friend Vec<T> operator/(const Vec<T>& a, const Vec<T>& b) { return wrap(a.v / b.v); }
  friend Vec<T> fmadd(const Vec<T>& a, const Vec<T>& b, const Vec<T>& c) { return wrap(a.v * b.v + c.v); }
#else
  friend Vec<T> operator+(const Vec<T>& a, const Vec<T>& b) {
    return zip(a, b, [](T x, T y) { return x + y; });
  }
  friend Vec<T> operator-(const Vec<T>& a, const Vec<T>& b) {
    return zip(a, b, [](T x, T y) { return x - y; });
  }
  friend Vec<T> operator*(const Vec<T>& a, const Vec<T>& b) {
    return zip(a, b, [](T x, T y) { return x * y; });
  }
  friend Vec<T> operator/(const Vec<T>& a, const Vec<T>& b) {
    return zip(a, b, [](T x, T y) { return x / y; });
  }
  friend Vec<T> fmadd(const Vec<T>& a, const Vec<T>& b, const Vec<T>& c) { return a * b + c; }
#endif
  friend Vec<T> maximum(const Vec<T>& a, const Vec<T>& b) {
    return zip(a, b, [](T x, T y) { return (x != x || x > y) ? x : y; });
  }
  friend T reduce_sum(const Vec<T>& a) {
    T s = 0;
    for (int i = 0; i < kSize; ++i) s += a.v[i];
    return s;
  }
};

template <>
struct Vec<float> : PortableVec<float> {
  Vec() = default;
  Vec(float x) {
    for (int i = 0; i < kSize; ++i) v[i] = x;
  }
};

template <>
struct Vec<double> : PortableVec<double> {
  Vec() = default;
  Vec(double x) {
    for (int i = 0; i < kSize; ++i) v[i] = x;
  }
};

#endif

// max over the lanes, NaN when any lane is NaN (Vec<float> on AVX2 / AVX-512 has its own, above).
template <typename T>
T reduce_max(Vec<T> a) {
  T buf[Vec<T>::size()];
  a.store(buf);
  T m = buf[0];
  for (int i = 1; i < Vec<T>::size(); ++i) m = (m != m || m > buf[i]) ? m : buf[i];
  return m;
}

// x with its lanes n and above replaced by fill (n < size()): a partial vector's unused lanes kept out of a
// max (fill -inf) or a sum (fill 0).
inline Vec<float> lanes_below_or(Vec<float> x, int n, float fill) {
#if defined(ATTNX_VEC_AVX512)
  return _mm512_mask_blend_ps(static_cast<__mmask16>((1u << n) - 1), _mm512_set1_ps(fill), x.v);
#elif defined(ATTNX_VEC_AVX2)
  return _mm256_blendv_ps(_mm256_set1_ps(fill), x.v, _mm256_castsi256_ps(Vec<float>::lanes_below(n)));
#else
  for (int i = n; i < Vec<float>::size(); ++i) x.v[i] = fill;
  return x;
#endif
}

// Lane-wise f over a stored copy: the double exp and tanh (fp64 is reference-grade, not fast) and the
// portable float ones.
template <typename T, typename F>
Vec<T> map_lanes(Vec<T> a, F f) {
  T buf[Vec<T>::size()];
  a.store(buf);
  for (int i = 0; i < Vec<T>::size(); ++i) buf[i] = f(buf[i]);
  return Vec<T>::loadu(buf);
}

inline Vec<double> vexp(Vec<double> x) {
  return map_lanes(x, [](double e) { return std::exp(e); });
}

inline Vec<double> vtanh(Vec<double> x) {
  return map_lanes(x, [](double e) { return std::tanh(e); });
}

#if defined(ATTNX_VEC_PORTABLE)

inline Vec<float> vexp(Vec<float> x) {
  return map_lanes(x, [](float e) { return std::exp(e); });
}

inline Vec<float> vtanh(Vec<float> x) {
  return map_lanes(x, [](float e) { return std::tanh(e); });
}

#else

// The softmax's exp: ATen's exp_u20 (torch's CPU flash attention uses it), within 20 ulp over x <= 0, which
// the float tolerances absorb. exp(x) = 2^n exp(r), n = floor(x log2(e) + 1/2), r = x - n ln 2, exp(r) by a
// degree-5 polynomial. Below ln(FLT_MIN) (-inf included) it is 0. Its NaN handling does not matter: a NaN
// score makes the row max NaN, and softmax_out_scale / softmax_lse then write NaN for the whole row.
#if defined(ATTNX_VEC_AVX512)
// AVX-512 scales by 2^n with vscalefps, its lanes below ln(FLT_MIN) zeroed by the same instruction's mask:
// 11 instructions instead of 17, the same results where they are normal floats (p 2^n is exact there either
// way; p 2^(n-1) 2 rounded twice where it is not). No lower clamp: the mask zeroes every lane it would have
// raised. The upper one is just above ln(FLT_MAX), so that vscalefps overflows to inf where exp does, and
// takes x second, which vminps returns when either is NaN: a NaN lane stays NaN.
inline Vec<float> vexp(Vec<float> x) {
  const __m512 ln_flt_min = _mm512_set1_ps(-87.3365479f);
  const __m512 src = _mm512_min_ps(_mm512_set1_ps(88.75f), x.v);
  const __m512 fx =
      _mm512_roundscale_ps(_mm512_fmadd_ps(src, _mm512_set1_ps(1.44269502f), _mm512_set1_ps(0.5f)),
                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(fx, _mm512_set1_ps(-0.693147182f), src);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
  // Not below ln(FLT_MIN): true for NaN.
  const __mmask16 keep = _mm512_cmp_ps_mask(x.v, ln_flt_min, _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(keep, p, fx);
}
#else
inline Vec<float> vexp(Vec<float> x) {
  const Vec<float> ln_flt_min(-87.3365479f), ln_flt_max(88.7228394f);  // 0xc2aeac50, 0x42b17218
  const Vec<float> one(1.0f);
  const Vec<float> src = vmax(vmin(x, ln_flt_max), ln_flt_min);
  const Vec<float> fx = vfloor(fmadd(src, Vec<float>(1.44269502f), Vec<float>(0.5f)));  // log2(e)
  const Vec<float> r = fmadd(fx, Vec<float>(-0.693147182f), src);                       // - ln(2)
  Vec<float> p = fmadd(r, Vec<float>(0.00828929059f), Vec<float>(0.0418978221f));
  p = fmadd(r, p, Vec<float>(0.166676521f));
  p = fmadd(r, p, Vec<float>(0.499991506f));
  p = fmadd(r, p, Vec<float>(0.999999701f));
  p = fmadd(r, p, one);
  // 2^(n - 1) * 2: n - 1 keeps 2^n representable at n = 128.
  const Vec<float> scale = select_lt(x, ln_flt_min, Vec<float>(0.0f), vpow2n(fx - one));
  return p * scale * Vec<float>(2.0f);
}
#endif

// exp within about 1 ulp (Cephes' expf: ln 2 split in two, a degree-6 polynomial), for tanh below. For
// x <= 88; NaN stays NaN (the clamps take the NaN operand second, which min/max then return).
inline Vec<float> vexp_accurate(Vec<float> x) {
  const Vec<float> src = vmax(Vec<float>(-88.3762626647949f), vmin(Vec<float>(88.3762626647949f), x));
  const Vec<float> fx = vfloor(fmadd(src, Vec<float>(1.44269504088896341f), Vec<float>(0.5f)));
  Vec<float> r = fmadd(fx, Vec<float>(-0.693359375f), src);
  r = fmadd(fx, Vec<float>(2.12194440e-4f), r);
  const Vec<float> z = r * r;
  Vec<float> p = fmadd(r, Vec<float>(1.9875691500e-4f), Vec<float>(1.3981999507e-3f));
  p = fmadd(p, r, Vec<float>(8.3334519073e-3f));
  p = fmadd(p, r, Vec<float>(4.1665795894e-2f));
  p = fmadd(p, r, Vec<float>(1.6666665459e-1f));
  p = fmadd(p, r, Vec<float>(5.0000001201e-1f));
  p = fmadd(p, z, r + Vec<float>(1.0f));
  return p * vpow2n(fx);
}

// tanh within a few ulp (Cephes' tanhf): an odd polynomial below |x| = 0.625, else 1 - 2 / (exp(2|x|) + 1)
// (saturating to 1 for large |x|), with x's sign. NaN stays NaN.
inline Vec<float> vtanh(Vec<float> x) {
  const Vec<float> ax = vabs(x);
  const Vec<float> z = x * x;
  Vec<float> p = fmadd(z, Vec<float>(-5.70498872745e-3f), Vec<float>(2.06390887954e-2f));
  p = fmadd(p, z, Vec<float>(-5.37397155531e-2f));
  p = fmadd(p, z, Vec<float>(1.33314422036e-1f));
  p = fmadd(p, z, Vec<float>(-3.33332819422e-1f));
  const Vec<float> small = fmadd(p * z, x, x);
  const Vec<float> e = vexp_accurate(vmin(Vec<float>(88.0f), ax + ax));  // NaN stays NaN
  const Vec<float> large = Vec<float>(1.0f) - Vec<float>(2.0f) / (e + Vec<float>(1.0f));
  // ax < 0.625 is false for NaN: the large branch, whose 1 - 2 / (exp(NaN) + 1) is NaN.
  return select_lt(ax, Vec<float>(0.625f), small, vcopysign(large, x));
}

#endif

// exp(x) for the softmax's x = score - row max <= 0 when the results are rounded to bfloat16 next (P of the
// pair products: dot16.h), where bfloat16's rounding (2^-9 relative) dwarfs vexp's 20 ulp: a degree-4
// polynomial fitted to exp's relative error over r in [-ln 2 / 2, ln 2 / 2] (within 2.9e-6 relative over
// x in [-87.3, 0], float32 rounding included), and no upper clamp, since x <= 0 (a row whose max is NaN or
// +inf is NaN whatever the exp gives). -inf (a masked score) gives 0, a NaN stays NaN. 9 instructions
// instead of vexp's 11 on AVX-512; vexp elsewhere.
#if defined(ATTNX_VEC_AVX512)
inline Vec<float> vexp_for_bf16(Vec<float> x) {
  const __m512 t = _mm512_fmadd_ps(x.v, _mm512_set1_ps(1.44269502f), _mm512_set1_ps(0.5f));
  const __m512 fx = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(fx, _mm512_set1_ps(-0.693147182f), x.v);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.0414585242f), _mm512_set1_ps(0.167909020f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.500043592f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999963408f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999261f));
  const __mmask16 keep = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-87.3365479f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(keep, p, fx);
}
#else
inline Vec<float> vexp_for_bf16(Vec<float> x) {
  return vexp(x);
}
#endif

// -----------------------------------------------------------------------------------------------------------
// Transposes.

// dst (cols, rows) = src (rows, cols)^T, row-major with leading dimensions.
template <typename T>
void transpose(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  int64_t r0 = 0;
#if !defined(ATTNX_VEC_PORTABLE)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint32_t>) {
    // 8 x 8 blocks in ymm registers (AVX is part of both wide levels); a word is moved as a float (bfloat16
    // pairs: dot16.h), whose bits the loads, shuffles and stores keep.
    for (; r0 + 8 <= rows; r0 += 8) {
      int64_t c0 = 0;
      for (; c0 + 8 <= cols; c0 += 8) {
        const float* s = reinterpret_cast<const float*>(src + r0 * ld_src + c0);
        float* d = reinterpret_cast<float*>(dst + c0 * ld_dst + r0);
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * ld_src);
        t[0] = _mm256_unpacklo_ps(r[0], r[1]);
        t[1] = _mm256_unpackhi_ps(r[0], r[1]);
        t[2] = _mm256_unpacklo_ps(r[2], r[3]);
        t[3] = _mm256_unpackhi_ps(r[2], r[3]);
        t[4] = _mm256_unpacklo_ps(r[4], r[5]);
        t[5] = _mm256_unpackhi_ps(r[4], r[5]);
        t[6] = _mm256_unpacklo_ps(r[6], r[7]);
        t[7] = _mm256_unpackhi_ps(r[6], r[7]);
        r[0] = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(1, 0, 1, 0));
        r[1] = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(3, 2, 3, 2));
        r[2] = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(1, 0, 1, 0));
        r[3] = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(3, 2, 3, 2));
        r[4] = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(1, 0, 1, 0));
        r[5] = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(3, 2, 3, 2));
        r[6] = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(1, 0, 1, 0));
        r[7] = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(3, 2, 3, 2));
        _mm256_storeu_ps(d + 0 * ld_dst, _mm256_permute2f128_ps(r[0], r[4], 0x20));
        _mm256_storeu_ps(d + 1 * ld_dst, _mm256_permute2f128_ps(r[1], r[5], 0x20));
        _mm256_storeu_ps(d + 2 * ld_dst, _mm256_permute2f128_ps(r[2], r[6], 0x20));
        _mm256_storeu_ps(d + 3 * ld_dst, _mm256_permute2f128_ps(r[3], r[7], 0x20));
        _mm256_storeu_ps(d + 4 * ld_dst, _mm256_permute2f128_ps(r[0], r[4], 0x31));
        _mm256_storeu_ps(d + 5 * ld_dst, _mm256_permute2f128_ps(r[1], r[5], 0x31));
        _mm256_storeu_ps(d + 6 * ld_dst, _mm256_permute2f128_ps(r[2], r[6], 0x31));
        _mm256_storeu_ps(d + 7 * ld_dst, _mm256_permute2f128_ps(r[3], r[7], 0x31));
      }
      for (int64_t c = c0; c < cols; ++c) {
        for (int64_t r = r0; r < r0 + 8; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
      }
    }
  }
#endif
  for (int64_t r = r0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace attnx::cpu
