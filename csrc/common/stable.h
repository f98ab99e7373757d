// attnx: helpers for code on the LibTorch stable ABI (torch/csrc/stable), which reaches torch through a C API.
#pragma once

#include <dlfcn.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/version.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <string>

namespace attnx::stable {

// The message of an error that crossed torch's C API, as the op raised it: a Python exception raised below
// the call (a Python autograd kernel's, say) arrives as "<type>: <message>\n\nAt:\n<traceback>", and a
// NotImplementedError from a C++ kernel as "NotImplementedError: <message>". The error is raised again as a
// RuntimeError (the C API does not carry its type), so only the message is kept.
inline std::string error_message(std::string message) {
  const size_t traceback = message.find("\n\nAt:\n");
  if (traceback != std::string::npos) message.resize(traceback);
  const size_t colon = message.find(": ");
  const auto is_name = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
  };
  if (colon != std::string::npos && colon >= 5 && message.compare(colon - 5, 5, "Error") == 0 &&
      std::all_of(message.begin(), message.begin() + colon, is_name)) {
    message.erase(0, colon + 2);
  }
  return message;
}

// Raises the error of a failed call into torch's C API (a dispatcher call whose op raised) as a RuntimeError
// that carries the op's own message. (torch's STABLE_TORCH_ERROR_CODE_CHECK also prints the backtrace to stderr
// and appends its own call site to the message.) The message is passed through from torch 2.13 on; torch 2.10
// to 2.12 log it to stderr, and the exception then says so.
inline void check(AOTITorchError error, const char* what) {
  if (error == TORCH_SUCCESS) return;
#if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_13_0
  const char* message = torch_exception_get_what_without_backtrace();
#else
  // Targeting an older torch: the getter, where the running torch has it.
  using Getter = const char* (*)();
  const auto getter = reinterpret_cast<Getter>(dlsym(RTLD_DEFAULT, "torch_exception_get_what_without_backtrace"));
  const char* message = getter ? getter() : nullptr;
#endif
  throw std::runtime_error(message ? error_message(message)
                                   : std::string(what) + " failed (torch < 2.13 logs the error to stderr)");
}

}  // namespace attnx::stable
