// attnx: what the emulated backends (cuda_backend.cpp, metal/metal_backend.cpp) share: while a test enables
// one, its run functions are attnx's CPU kernels. They are registered on attnx's CPU key in a library made at
// run time, as csrc/pytorch/sdpa.cpp does for PyTorch's ops; destroying it gives the CPU kernels back. A call
// then goes the way every user's call goes (attnx.attention, the router, autograd, mha's composite), and
// attnx's own glue (common/attention.cpp's prepare_attention, the backend's plan) fills what the kernels
// read.
#pragma once

#include <torch/csrc/stable/library.h>

#include <mutex>

namespace attnx_emu {

using Library = torch::stable::detail::StableLibrary;

// Turns a backend on (`on`, registering its kernels with `impls(Library&)`) or off; returns whether it was on.
// One library per backend; a second backend enabled on top of the first hides it until it is turned off.
template <typename Impls>
bool override_cpu_kernels(Library*& library, bool on, Impls impls) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const bool was_on = library != nullptr;
  if (on && !was_on) {
    library = new Library(Library::Kind::IMPL, "attnx", "CPU", __FILE__, __LINE__);
    impls(*library);
  } else if (!on && was_on) {
    delete library;
    library = nullptr;
  }
  return was_on;
}

}  // namespace attnx_emu
