// attnx: a CPU kernel's entry point instantiated for the floating dtypes attnx's ops take.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

namespace attnx::cpu {

// Calls f(scalar_t{}) for the C++ type of `dtype` (float, double, BFloat16, Half); any other dtype fails,
// naming `op` (the checks before the kernel refuse those first: this is the last line of defence).
template <typename F>
void dispatch_float_types(torch::headeronly::ScalarType dtype, const char* op, F&& f) {
  using torch::headeronly::ScalarType;
  switch (dtype) {
    case ScalarType::Float:
      return f(float{});
    case ScalarType::Double:
      return f(double{});
    case ScalarType::BFloat16:
      return f(torch::headeronly::BFloat16{});
    case ScalarType::Half:
      return f(torch::headeronly::Half{});
    default:
      STD_TORCH_CHECK(false, op, ": no CPU kernel for dtype ", dtype);
  }
}

}  // namespace attnx::cpu
