// attnx: what the CUDA kernels use of the C and C++ standard headers, for NVRTC, which has none of them.
//
// Included first (NVRTC's --pre-include) when the kernel sources are compiled at run time or checked with
// NVRTC (tests/test_cuda_nvrtc.py); the sources include the standard headers themselves otherwise, and never
// this file. Only the fixed-width integers, INFINITY, NAN and the few <type_traits>/<utility> names the
// kernels use, with the standard's meaning.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;

// Constant expressions under NVRTC (unlike __int_as_float(0x7f800000)) that its front end folds: 1.0f / 0.0f
// is no constant expression in C++, and NVRTC emitted a division for each use (87 in one kernel).
#define INFINITY __builtin_bit_cast(float, 0x7f800000u)
#define NAN __builtin_bit_cast(float, 0x7fc00000u)

namespace std {
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  using value_type = T;
  constexpr operator T() const { return v; }
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;

template <class T, class U>
struct is_same : false_type {};
template <class T>
struct is_same<T, T> : true_type {};

template <class T>
struct remove_reference {
  using type = T;
};
template <class T>
struct remove_reference<T&> {
  using type = T;
};
template <class T>
struct remove_reference<T&&> {
  using type = T;
};

template <bool B, class T, class F>
struct conditional {
  using type = T;
};
template <class T, class F>
struct conditional<false, T, F> {
  using type = F;
};

template <class T>
constexpr T&& forward(typename remove_reference<T>::type& t) noexcept {
  return static_cast<T&&>(t);
}
}  // namespace std
#endif
