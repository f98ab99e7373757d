// attnx: attnx::attention on CPU. The checks and layouts are common/attention.cpp; the kernel is
// cpu/attention_kernel_impl.h, compiled here for the baseline ISA and in cpu/attention_kernel_avx2.cpp /
// cpu/attention_kernel_avx512.cpp for wider vectors, and picked at run time like torch's own CPU kernels.
#include "cpu/attention.h"

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "cpu/attention_kernel_impl.h"
// The backward kernel is built from the forward kernel's helpers, so it is compiled here, after them.
#include "cpu/attention_backward_kernel_impl.h"

namespace attnx {

namespace {

#if ATTNX_CPU_X86_VARIANTS
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and the tile state granted to the process: Linux
// enables it only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once for every thread;
// where that is refused (an older kernel, a sandbox) the variant below it runs.
bool amx_bf16_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
#ifdef __linux__
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

cpu::CpuCapability detect_cpu_capability() {
  using cpu::CpuCapability;
  const char* forced = std::getenv("ATTNX_CPU_CAPABILITY");
  // The emulations run on any CPU, and are built everywhere.
  if (forced && std::strcmp(forced, "emulated_bf16") == 0) return CpuCapability::kEmulatedBf16;
  if (forced && std::strcmp(forced, "emulated_amx") == 0) return CpuCapability::kEmulatedAmx;
#if ATTNX_CPU_X86_VARIANTS
  __builtin_cpu_init();
  CpuCapability level = CpuCapability::kDefault;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = CpuCapability::kAvx2;
  if (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    level = CpuCapability::kAvx512;
  }
  // torch lowers its level to the one asked for, never raises it; an unknown value leaves it as it is.
  if (const char* asked = std::getenv("ATEN_CPU_CAPABILITY")) {
    if (std::strcmp(asked, "default") == 0) level = CpuCapability::kDefault;
    if (std::strcmp(asked, "avx2") == 0 && level == CpuCapability::kAvx512) level = CpuCapability::kAvx2;
  }
  if (level == CpuCapability::kAvx512 && __builtin_cpu_supports("avx512bf16")) {
    level = CpuCapability::kAvx512Bf16;
    if (amx_bf16_usable()) level = CpuCapability::kAmxBf16;
  }
  // No wider than the widest variant built.
  level = std::min(level, static_cast<CpuCapability>(ATTNX_CPU_MAX_VARIANT));
  // ATTNX_CPU_CAPABILITY picks any level up to that.
  if (forced) {
    const char* names[] = {"default", "avx2", "avx512", "avx512_bf16", "amx_bf16"};
    for (int i = 0; i < 5; ++i) {
      if (std::strcmp(forced, names[i]) == 0) return std::min(level, static_cast<CpuCapability>(i));
    }
  }
  // On an Intel core (a Xeon with AMX, its tiles set aside) bfloat16 attention ran slower on vdpbf16ps than
  // on the float32 products (0.62x at B=4, H=8, L=S=2048, D=64; AMD's Zen 4 runs it 1.66x faster): there,
  // without AMX, bfloat16 takes the float32 products.
  if (level == CpuCapability::kAvx512Bf16 && __builtin_cpu_is("intel")) level = CpuCapability::kAvx512;
  return level;
#else
  return CpuCapability::kDefault;
#endif
}

}  // namespace

cpu::CpuCapability cpu::cpu_capability() {
  static const CpuCapability level = detect_cpu_capability();
  return level;
}

// attnx::_cpu_capability: cpu_capability() as ATTNX_CPU_CAPABILITY spells it (ATEN_CPU_CAPABILITY's names for
// torch's levels).
std::string cpu_capability_name() {
  switch (cpu::cpu_capability()) {
    case cpu::CpuCapability::kEmulatedAmx:
      return "emulated_amx";
    case cpu::CpuCapability::kEmulatedBf16:
      return "emulated_bf16";
    case cpu::CpuCapability::kAmxBf16:
      return "amx_bf16";
    case cpu::CpuCapability::kAvx512Bf16:
      return "avx512_bf16";
    case cpu::CpuCapability::kAvx512:
      return "avx512";
    case cpu::CpuCapability::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

void run_attention_cpu(AttentionProblem& pb) {
  static const cpu::AttentionKernel kernel = ATTNX_CPU_VARIANT(attention_kernel);
  kernel(pb.params, pb.ptr, pb.dtype);
}

// attnx::_attention_kernel on CPU: one forward and one fused backward kernel, compiled per ISA level and
// picked once per process (their plans, tiles and threads, are chosen inside them per call).
void attention_kernel_cpu(AttentionKernelProblem& pb) {
  pb.kernel = "cpu " + cpu_capability_name();
}

}  // namespace attnx

STABLE_TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("_attention", &attnx::attention_op<attnx::run_attention_cpu>);
  m.impl("_attention_autograd", &attnx::attention_op<attnx::run_attention_cpu>);
  m.impl("_attention_kernel", &attnx::attention_op<attnx::attention_kernel_cpu>);
}

// An op without tensor arguments gives the dispatcher no backend key: the CompositeExplicitAutograd kernel is
// the one such a call reaches.
STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("_cpu_capability", TORCH_BOX(&attnx::cpu_capability_name));
}
