// attnx: the interface of attnx::attention's CPU kernel, which is compiled once per x86 ISA level.
//
// cpu/attention_kernel_impl.h holds the kernel. cpu/attention.cpp compiles it for the baseline ISA (namespace
// DEFAULT) and cpu/attention_kernel_avx2.cpp / cpu/attention_kernel_avx512.cpp for AVX2 and AVX-512, each in
// its own namespace named after torch's CPU_CAPABILITY, as torch does for its own kernels;
// cpu/attention_kernel_avx512_bf16.cpp compiles the AVX-512 one again with bfloat16 products on AVX512-BF16
// or AMX-BF16 tiles, and cpu/attention_kernel_bf16_emulated.cpp those products emulated on the baseline ISA
// (cpu/dot16.h, cpu/tiles.h). ATTNX_CPU_VARIANT picks one at run time (cpu_capability(): torch's rule, so
// that ATEN_CPU_CAPABILITY=avx2|default selects the lower levels, then AVX512-BF16 and AMX where the CPU has
// them; ATTNX_CPU_CAPABILITY chooses any level the CPU runs, and the emulations).
//
// Every header the kernel needs is included here, before an ISA TU raises its target: inline functions from
// these headers are then compiled for the baseline ISA in every TU, and only the kernel and its SIMD layer
// (vec.h, gemm.h: each in a CPU_CAPABILITY namespace) carry wider instructions. The kernel is torch-free: the
// standard library, attnx/*.h, torch/headeronly (ScalarType, Half, BFloat16, STD_TORCH_CHECK: ABI-stable) and
// its own headers (parallel.h: threads, buffer.h: scratch, vec.h: SIMD, gemm.h: tile GEMMs).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
// Every intrinsic carries its own target attribute, so the header is included for the baseline ISA (first:
// Half.h includes it too). GCC 12 reports the deliberate `__Y = __Y` of _mm512_undefined_*() inside the
// AVX-512 intrinsics as uninitialised wherever they are inlined: a false positive in the compiler's header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

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
#include "cpu/buffer.h"
#include "cpu/dispatch.h"
#include "cpu/parallel.h"

// GCC on x86-64 builds the AVX2 and AVX-512 variants through `#pragma GCC target`; elsewhere only DEFAULT.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ATTNX_CPU_X86_VARIANTS 1
#else
#define ATTNX_CPU_X86_VARIANTS 0
#endif

// The widest x86 variant built: 4 (AVX-512 with AVX512-BF16 and AMX-BF16, every build users get), 3 (the same
// without AMX), 2 (AVX-512), 1 (AVX2) or 0 (DEFAULT alone). A build whose kernels only ever run on the
// machine that built it (`make sanitize`'s) leaves out the variants that machine cannot run (setup.py's
// ATTNX_CPU_MAX_VARIANT). The emulated variants run anywhere and are always built.
#ifndef ATTNX_CPU_MAX_VARIANT
#define ATTNX_CPU_MAX_VARIANT 4
#endif

namespace attnx::cpu {

// dtype: of query, key, value and out.
using AttentionKernel = void (*)(const AttentionParams&, const AttentionPointers&,
                                 torch::headeronly::ScalarType);

// The ISA levels the kernels run at, numbered as ATTNX_CPU_MAX_VARIANT, and the emulated ones. kAmxBf16 is
// the AVX512-BF16 kernels with their bfloat16 pair products on AMX tiles (cpu/tiles.h), kEmulatedAmx the
// same in the emulation's kernels: the tiles are a run-time switch inside those two compilations.
enum class CpuCapability {
  kDefault = 0,
  kAvx2 = 1,
  kAvx512 = 2,
  kAvx512Bf16 = 3,
  kAmxBf16 = 4,
  kEmulatedBf16 = 5,
  kEmulatedAmx = 6,
};

// The variant the kernels run: the level torch's own CPU kernels run at
// (torch.backends.cpu.get_cpu_capability()), by torch's rule: the highest the CPU supports (AVX-512 with VL,
// BW, DQ and FMA; AVX2 with FMA), lowered by ATEN_CPU_CAPABILITY (default, avx2, avx512), so that one
// environment variable moves torch and attnx together (the stable ABI has no at::get_cpu_capability); then
// AVX512-BF16 where AVX-512 is chosen and the CPU has it (not on Intel cores, where it measured slower than
// the float32 products), and AMX-BF16 on top where the CPU has it and the OS grants the process its tile
// state. ATTNX_CPU_CAPABILITY (default, avx2, avx512, avx512_bf16, amx_bf16: a
// level no higher than that; emulated_bf16, emulated_amx: the emulations) overrides the choice; other values
// are ignored, as torch ignores them. Read once per process; kDefault where the variants are not built.
CpuCapability cpu_capability();

// The variant of a kernel for cpu_capability(): ATTNX_CPU_VARIANT(attention_kernel), say.
template <typename Kernel>
Kernel pick_variant(Kernel portable, [[maybe_unused]] Kernel avx2, [[maybe_unused]] Kernel avx512,
                    [[maybe_unused]] Kernel avx512_bf16, Kernel emulated_bf16) {
  switch (cpu_capability()) {
    case CpuCapability::kEmulatedBf16:
    case CpuCapability::kEmulatedAmx:
      return emulated_bf16;
    case CpuCapability::kAvx512Bf16:
    case CpuCapability::kAmxBf16:
      return avx512_bf16;
    case CpuCapability::kAvx512:
      return avx512;
    case CpuCapability::kAvx2:
      return avx2;
    default:
      return portable;
  }
}
// The namespace each level's kernels are taken from: its own where it is built, else the widest built below
// it (cpu_capability() never names a level above ATTNX_CPU_MAX_VARIANT, so those are never called).
#if ATTNX_CPU_X86_VARIANTS && ATTNX_CPU_MAX_VARIANT >= 3
#define ATTNX_CPU_AVX2_NAMESPACE AVX2
#define ATTNX_CPU_AVX512_NAMESPACE AVX512
#define ATTNX_CPU_AVX512_BF16_NAMESPACE AVX512_BF16
#elif ATTNX_CPU_X86_VARIANTS && ATTNX_CPU_MAX_VARIANT == 2
#define ATTNX_CPU_AVX2_NAMESPACE AVX2
#define ATTNX_CPU_AVX512_NAMESPACE AVX512
#define ATTNX_CPU_AVX512_BF16_NAMESPACE AVX512
#elif ATTNX_CPU_X86_VARIANTS && ATTNX_CPU_MAX_VARIANT == 1
#define ATTNX_CPU_AVX2_NAMESPACE AVX2
#define ATTNX_CPU_AVX512_NAMESPACE AVX2
#define ATTNX_CPU_AVX512_BF16_NAMESPACE AVX2
#else
#define ATTNX_CPU_AVX2_NAMESPACE DEFAULT
#define ATTNX_CPU_AVX512_NAMESPACE DEFAULT
#define ATTNX_CPU_AVX512_BF16_NAMESPACE DEFAULT
#endif
#define ATTNX_CPU_VARIANT(name)                                                                          \
  ::attnx::cpu::pick_variant(&::attnx::cpu::DEFAULT::name, &::attnx::cpu::ATTNX_CPU_AVX2_NAMESPACE::name, \
                             &::attnx::cpu::ATTNX_CPU_AVX512_NAMESPACE::name,                             \
                             &::attnx::cpu::ATTNX_CPU_AVX512_BF16_NAMESPACE::name,                        \
                             &::attnx::cpu::EMULATED_BF16::name)
// One line per namespace: not clang-format's layout.
// clang-format off
// Declares a kernel's entry point in each ISA namespace it may be compiled in.
#define ATTNX_CPU_DECLARE_VARIANTS(...) \
  namespace DEFAULT { __VA_ARGS__; } namespace AVX2 { __VA_ARGS__; } namespace AVX512 { __VA_ARGS__; } \
  namespace AVX512_BF16 { __VA_ARGS__; } namespace EMULATED_BF16 { __VA_ARGS__; }
// clang-format on

ATTNX_CPU_DECLARE_VARIANTS(void attention_kernel(const AttentionParams& p, const AttentionPointers& ptr,
                                                 torch::headeronly::ScalarType dtype))

}  // namespace attnx::cpu
