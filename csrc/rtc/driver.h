// attnx: the CUDA driver (libcuda.so.1), opened at run time by the run-time compiled kernels' library: it
// links no CUDA runtime, so one library serves every CUDA major the driver supports.
#pragma once

#include <string>

namespace attnx::rtc {

// The driver's version (12080 for CUDA 12.8), after cuInit. Throws std::runtime_error saying what is missing
// where there is no driver (no libcuda.so.1: a machine without an NVIDIA GPU) or it does not initialise.
int driver_version();

}  // namespace attnx::rtc
