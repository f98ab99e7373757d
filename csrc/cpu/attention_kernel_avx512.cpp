// attnx: attnx::attention's CPU kernel compiled for AVX-512 F/BW/VL/DQ + FMA (torch's AVX512 capability
// level). See cpu/attention_kernel.h for why the target is raised here, after every non-vector header.
#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

#if ATTNX_CPU_X86_VARIANTS && ATTNX_CPU_MAX_VARIANT >= 2
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,avx,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#include "cpu/isa_avx512.h"
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "cpu/attention_kernel_impl.h"
// The backward kernel is built from the forward kernel's helpers: after them.
#include "cpu/attention_backward_kernel_impl.h"
#pragma GCC pop_options
#endif
