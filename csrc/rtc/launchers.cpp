// attnx: csrc/cuda/*.cu's launchers, compiled by the host compiler for the run-time compiled library
// (setup.py defines ATTNX_CUDA_HOST_ONLY for it: cuda/common.cuh then leaves the kernels out, and each launch
// names its instantiation for rtc/launch.h). One unit: the files' host code shares no name.
#include "cuda/attention_backward_kernel.cu"
#include "cuda/attention_backward_kernel_mma.cu"
#include "cuda/attention_kernel.cu"
#include "cuda/attention_kernel_mma.cu"
