// attnx: the ISA macros of a kernel TU compiled for AVX-512 (cpu/attention_kernel_avx512.cpp and
// cpu/attention_kernel_avx512_bf16.cpp), included right after its `#pragma GCC target`: the pragma raises the
// target but does not define the macros that vec.h tests to pick its implementation.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
