// attnx: the CUDA backend on the CPU, for the tests (tests/emulation/backends.py builds and loads it). The
// glue is csrc/cuda/attention.cpp and attention_backward.cpp themselves, compiled with ATTNX_CUDA_EMULATION
// (which leaves out their device entry points), and the kernels are csrc/cuda/*.cu compiled for the CPU
// against cuda_shim.h (a library of their own, linked here). attnx_emu_cuda::enable makes these attnx's CPU
// kernels of attention, its backward and _attention_kernel, for a Target given by the test: the kernel
// choice is choose_kernel's, the launches are those a GPU gets, on the emulator's threads.
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <string>

#include "backend.h"
#include "common/attention.h"
#include "cuda/attention.h"
#include "cuda/device.h"

namespace {

using attnx::AttentionBackwardProblem;
using attnx::AttentionKernelProblem;
using attnx::AttentionProblem;

// The device the tests emulate: sm_90 with the tensor cores and the fused backward on, and torch's flash
// kernel off (its stand-in, in cuda/attention.cpp, would take the calls the tensor cores should be tested
// on), unless told otherwise.
attnx::cuda::Target target{90, true, true, false, 227 * 1024};
attnx_emu::Library* library = nullptr;

void run_attention(AttentionProblem& pb) {
  attnx::cuda::run_attention(pb, target, /*stream=*/nullptr);
}

void run_attention_backward(AttentionBackwardProblem& pb) {
  attnx::cuda::run_attention_backward(pb, target, /*stream=*/nullptr);
}

void attention_kernel(AttentionKernelProblem& pb) {
  attnx::cuda::attention_kernel(pb, target);
}

// attnx_emu_cuda::enable: the emulated CUDA backend on (for a device of compute `capability`, with the
// process's ATTNX_CUDA_MMA, ATTNX_CUDA_FUSED_BACKWARD and ATTNX_CUDA_TORCH_FLASH as `mma`, `fused_backward`
// and `torch_flash`, and attnx::_cuda_mma_shape's `mma_shape`) or off.
// The shared memory a block of a device of `capability` may opt into (the CUDA programming guide's table).
int64_t max_smem(int64_t capability) {
  if (capability >= 90 && capability != 120) return 227 * 1024;
  if (capability == 80 || capability == 87) return 163 * 1024;
  if (capability >= 80) return 99 * 1024;
  return 64 * 1024;
}

bool enable(bool on, int64_t capability, bool mma, bool fused_backward, bool torch_flash,
            std::string mma_shape) {
  if (on) {
    const int shape = mma_shape.empty() ? 0 : attnx::cuda::mma_shape_parse(mma_shape);
    ATTNX_CHECK(shape >= 0, "attnx_emu_cuda::enable: no tile shape \"", mma_shape, "\"");
    target = {static_cast<int>(capability), mma, fused_backward, torch_flash, max_smem(capability), shape};
  }
  return attnx_emu::override_cpu_kernels(library, on, [](attnx_emu::Library& m) {
    m.impl("_attention", &attnx::attention_op<run_attention>);
    m.impl("_attention_autograd", &attnx::attention_op<run_attention>);
    m.impl("attention_backward", &attnx::attention_op<run_attention_backward>);
    m.impl("_attention_kernel", &attnx::attention_op<attention_kernel>);
  });
}

}  // namespace

STABLE_TORCH_LIBRARY(attnx_emu_cuda, m) {
  m.def(
      "enable(bool on, int capability=90, bool mma=True, bool fused_backward=True, bool torch_flash=False, "
      "str mma_shape=\"\") -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(attnx_emu_cuda, CompositeExplicitAutograd, m) {
  m.impl("enable", TORCH_BOX(&enable));
}
