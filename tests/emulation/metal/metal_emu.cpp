// attnx: C entry points to the Metal emulation's runtime (see metal_runtime.h), for ctypes: the shim's own
// tests (test_metal_emulation.py) launch a kernel by its host name and read what the runtime recorded. The
// attention and linear launches go through attnx's glue instead (metal_backend.cpp, launches.h).
#include "metal_runtime.h"

extern "C" {

int attnx_metal_emu_kernel_count() {
  return attnx_emu_metal::kernel_count();
}
const char* attnx_metal_emu_kernel_name(int index) {
  return attnx_emu_metal::kernel_name(index);
}
size_t attnx_metal_emu_last_threadgroup_bytes() {
  return attnx_emu_metal::last_threadgroup_bytes();
}

// Any kernel by host name, with its buffers in [[buffer(i)]] order. 0 on success; 1 unknown kernel name, 2
// bad threadgroup size.
int attnx_metal_emu_launch(const char* name, const int64_t* grid, int threads, void* const* buffers) {
  return attnx_emu_metal::launch(name, grid, threads, buffers);
}

}  // extern "C"
