"""CPU emulation of attnx's CUDA kernels: the real .cu sources compiled with g++ against cuda_shim.h."""
