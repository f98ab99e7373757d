// attnx: attnx::attention's CPU kernels with AVX512-BF16's and AMX-BF16's bfloat16 products emulated on the
// baseline ISA: the code the AVX512_BF16 variant runs, with vdpbf16ps, vcvtne2ps2bf16 and the tile
// instructions replaced by their scalar definitions (cpu/dot16.h, ATTNX_DOT_BF16 2; cpu/tiles.h,
// ATTNX_TILE_BF16 2) over the portable vectors, so that any machine runs and tests it. Chosen only when asked
// for (ATTNX_CPU_CAPABILITY=emulated_bf16 or emulated_amx; see cpu/attention.cpp).
#include "cpu/attention_backward_kernel.h"
#include "cpu/attention_kernel.h"

#define CPU_CAPABILITY EMULATED_BF16
#define ATTNX_DOT_BF16 2
#define ATTNX_TILE_BF16 2
#include "cpu/attention_kernel_impl.h"
// The backward kernel is built from the forward kernel's helpers: after them.
#include "cpu/attention_backward_kernel_impl.h"
