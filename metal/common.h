// attnx: helpers shared by the Metal kernels (metal/*.metal): element types, masks, the kernel signature
// convention and the instantiation macro.
//
// Metal only. Apple's compiler sees this file through the source that metal/embed.py embeds in the extension;
// tests/emulation/metal/ compiles it as C++ against a metal_stdlib shim (ATTNX_METAL_EMULATION is defined
// there), which is where the two branches below differ.
#pragma once

#include <metal_stdlib>

#include "attnx/metal_config.h"
#include "attnx/params.h"
#include "attnx/softmax.h"

using namespace metal;

namespace attnx {

// Every kernel's parameter list is its buffers, in [[buffer(i)]] order starting at 0, then these positions.
// One convention for all kernels lets the emulation bind arguments by position exactly as the host binds
// buffer indices.
#define ATTNX_THREAD_POSITIONS                                                           \
  uint3 tgid [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]

// Threadgroup memory is declared through this macro at the top of a kernel: Metal's `threadgroup T name[n]`,
// or the emulation's per-group arena.
#if defined(ATTNX_METAL_EMULATION)
#define ATTNX_THREADGROUP_ARRAY(T, name, n) T* name = ::attnx_emu_metal::threadgroup_array<T>(n)
#else
#define ATTNX_THREADGROUP_ARRAY(T, name, n) threadgroup T name[n]
#endif

// One kernel instantiation under its host name (MLX's instantiate_kernel). The host asks for the name that
// metal_plan's *_kernel_name() builds; tests/test_metal_emulation.py checks that every such name exists.
#if defined(ATTNX_METAL_EMULATION)
#define ATTNX_INSTANTIATE_KERNEL(name, func, ...) ATTNX_EMU_REGISTER_KERNEL(name, func<__VA_ARGS__>)
#else
#define ATTNX_INSTANTIATE_KERNEL(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#endif

// Loads and stores in the element type, arithmetic in float (fp16 and bf16 accumulate in float, as on every
// other backend).
template <typename T>
inline float load_float(const device T* base, int64_t index) {
  return float(base[index]);
}

template <typename T>
inline void store_float(device T* base, int64_t index, float x) {
  base[index] = T(x);
}

// A mask element as the additive term it stands for: bool true = -inf (masked out), false = 0; a float mask
// as it is. Read in place through the caller's index (broadcast dims have stride 0). float64 masks never
// reach Metal (MPS has no float64; the host refuses them).
inline float mask_value(int32_t kind, const device uchar* mask, int64_t index) {
  switch (kind) {
    case kMaskBool:
      return mask[index] != 0 ? -INFINITY : 0.0f;
    case kMaskFloat16:
      return float(((const device half*)mask)[index]);
    case kMaskBFloat16:
      return float(((const device bfloat*)mask)[index]);
    case kMaskFloat32:
      return ((const device float*)mask)[index];
    default:
      return 0.0f;
  }
}

}  // namespace attnx
