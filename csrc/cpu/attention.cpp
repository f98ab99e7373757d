// attnx: attnx::attention on CPU. The checks and layouts are common/attention.cpp; the kernel is
// cpu/attention_kernel_impl.h, compiled here for the baseline ISA and in cpu/attention_kernel_avx2.cpp /
// cpu/attention_kernel_avx512.cpp for wider vectors, and picked at run time like torch's own CPU kernels.
#include "cpu/attention.h"

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "cpu/attention_kernel_impl.h"
// The backward kernel is built from the forward kernel's helpers, so it is compiled here, after them.
#include "cpu/attention_backward_kernel_impl.h"

namespace attnx {

namespace {

cpu::CpuCapability detect_cpu_capability() {
  using cpu::CpuCapability;
  const char* forced = std::getenv("ATTNX_CPU_CAPABILITY");
  // The emulation runs on any CPU, and is built everywhere.
  if (forced && std::strcmp(forced, "emulated_bf16") == 0) return CpuCapability::kEmulatedBf16;
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
  }
  // ATTNX_CPU_CAPABILITY picks any level up to the CPU's.
  if (forced) {
    const char* names[] = {"default", "avx2", "avx512", "avx512_bf16"};
    for (int i = 0; i < 4; ++i) {
      if (std::strcmp(forced, names[i]) == 0) {
        level = std::min(level, static_cast<CpuCapability>(i));
      }
    }
  }
  // No wider than the widest variant built.
  return std::min(level, static_cast<CpuCapability>(ATTNX_CPU_MAX_VARIANT));
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
    case cpu::CpuCapability::kEmulatedBf16:
      return "emulated_bf16";
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
