// attnx: attnx::attention's CPU kernels compiled for AVX-512 with AVX512-BF16: the AVX512 variant, whose
// bfloat16 products run on vdpbf16ps (cpu/dot16.h), or on AMX-BF16 tiles (cpu/tiles.h) in the amx_bf16
// variant. See cpu/attention_kernel.h for why the target is raised here, after every non-vector header.
#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

#if ATTNX_CPU_X86_VARIANTS && ATTNX_CPU_MAX_VARIANT >= 3
#pragma GCC push_options
#if ATTNX_CPU_MAX_VARIANT >= 4
#pragma GCC target( \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,avx,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#define ATTNX_TILE_BF16 1
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,avx,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#include "cpu/isa_avx512.h"
#define __AVX512BF16__ 1
#define CPU_CAPABILITY AVX512_BF16
#define CPU_CAPABILITY_AVX512
#define ATTNX_DOT_BF16 1
#include "cpu/attention_kernel_impl.h"
// The backward kernel is built from the forward kernel's helpers: after them.
#include "cpu/attention_backward_kernel_impl.h"
#pragma GCC pop_options
#endif
