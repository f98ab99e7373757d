// attnx: the interface of attnx::attention's CPU kernel, which is compiled once per x86 ISA level.
//
// attention_cpu_kernel_impl.h holds the kernel. attention_cpu.cpp compiles it for the baseline ISA (namespace
// DEFAULT) and attention_cpu_avx2.cpp / attention_cpu_avx512.cpp for AVX2 and AVX-512, each in its own
// namespace named after torch's CPU_CAPABILITY, as torch does for its own kernels; attention_cpu.cpp picks
// one at run time from at::get_cpu_capability() (so ATEN_CPU_CAPABILITY=avx2|default selects the others).
//
// Every header the kernel needs apart from ATen's vector headers is included here, before an ISA TU raises
// its target: inline functions from these headers are then compiled for the baseline ISA in every TU, and
// only the kernel and at::vec (each in a CPU_CAPABILITY namespace) carry wider instructions.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

// Headers that ATen's vector headers pull in, so that they are compiled for the baseline ISA here.
#include <ATen/NumericUtils.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <ATen/native/quantized/AffineQuantizerBase.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/Load.h>
#include <c10/util/copysign.h>
#include <c10/util/qint32.h>
#include <c10/util/qint8.h>
#include <c10/util/quint8.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "attnx/key_range.h"
#include "attnx/params.h"
#include "attnx/philox.h"
#include "attnx/softmax.h"

// GCC on x86-64 builds the AVX2 and AVX-512 variants through `#pragma GCC target`; elsewhere only DEFAULT.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ATTNX_CPU_X86_VARIANTS 1
#else
#define ATTNX_CPU_X86_VARIANTS 0
#endif

namespace attnx::cpu {

// The call's data pointers and the dtype of query, key, value and out.
struct AttentionData : AttentionPointers {
  at::ScalarType dtype;
};

using AttentionKernel = void (*)(const AttentionParams&, const AttentionData&);

namespace DEFAULT {
void attention_kernel(const AttentionParams& p, const AttentionData& d);
}
#if ATTNX_CPU_X86_VARIANTS
namespace AVX2 {
void attention_kernel(const AttentionParams& p, const AttentionData& d);
}
namespace AVX512 {
void attention_kernel(const AttentionParams& p, const AttentionData& d);
}
#endif

}  // namespace attnx::cpu
