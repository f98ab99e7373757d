// attnx: what torch 2.10 to 2.12 need and later releases do not: removed in one commit once setup.py's
// MIN_TORCH reaches (2, 13) (tests/test_compat.py fails from then on while this file exists; its Python twin
// is python/attnx/_compat.py).
//
// Those releases do not pass the message of an error raised below a dispatcher call back through their C API
// (they log it to stderr). Where the op that failed is one of attnx's own (the kernel op a router chose, the
// attention mha runs, a fake kernel: python/attnx/_compat.py hands its message over through attnx_note_error,
// common/compat.cpp), the message was raised in this library and is read back from here
// (stable::dispatch).
#pragma once

#include <dlfcn.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/version.h>

#include <string>

namespace attnx::compat {

// The message of the last error attnx raised on this thread.
inline std::string& raised_message() {
  thread_local std::string message;
  return message;
}

// The message of the error that failed the last call into torch's C API: passed through from torch 2.13 on,
// nullptr before.
inline const char* torch_error_message() {
#if defined(TORCH_VERSION_2_13_0) && TORCH_FEATURE_VERSION >= TORCH_VERSION_2_13_0
  return torch_exception_get_what_without_backtrace();
#else
  // Targeting an older torch: the getter, where the running torch has it.
  using Getter = const char* (*)();
  const auto getter =
      reinterpret_cast<Getter>(dlsym(RTLD_DEFAULT, "torch_exception_get_what_without_backtrace"));
  return getter ? getter() : nullptr;
#endif
}

}  // namespace attnx::compat
