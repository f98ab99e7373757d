"""Every CUDA kernel compiles with NVRTC, the run-time compiler that CUDA torch wheels ship: no GPU needed.

The kernel sources (csrc/cuda/*.cu) are compiled by nvcc into the wheel's CUDA library, for one CUDA major.
NVRTC compiles the same sources to SASS for any GPU on the user's machine, with the user's own CUDA (12 or
13): the way to serve every CUDA major and every architecture from one wheel. This test keeps that way open:
each instantiation the launchers use, forward, tensor-core and backward, is compiled through the NVRTC
library beside the installed torch (libnvrtc.so.13 from nvidia-cuda-nvrtc under torch 2.14, libnvrtc.so.12
under the floor's torch 2.10), to PTX for compute_80, with attnx/rtc.h standing in for the C++ headers
NVRTC lacks. It records how long each file takes: the front end's share of the first-call cost of compiling
at run time (ptxas takes about three times as long again; docs/design/cuda.md has the whole, to SASS).

Skips, saying why, where torch has no NVRTC beside it (a CPU torch) or its headers (cuda_fp16.h) are missing.
"""

import ctypes
import glob
import os
import time

import pytest
import torch

pytestmark = pytest.mark.floor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]
# To PTX for compute_80, the oldest arch the kernels are built for: NVRTC's own part is the front end and
# NVVM (headers, templates, the inline PTX's constraints); ptxas, which turns PTX into SASS, is the same one
# nvcc runs on these sources for sm_80 and sm_90 in every build, and would cost four times as much again here.
ARCHS = ("compute_80",)
DTYPES = {"fp32": ("float", 4), "fp64": ("double", 8), "fp16": ("__half", 4), "bf16": ("__nv_bfloat16", 4)}
BUCKETS = (32, 64, 128, 256)


def _rows_per_warp(acc_bytes, bucket):  # attention_plan.h's rows_per_warp
    return 2 if acc_bytes == 8 and bucket == 256 else 4


# The kernels each file instantiates (its launcher's dispatch), as NVRTC name expressions.
KERNELS = {
    "attention_kernel.cu": [f"attnx::cuda::attention_forward_simt<{t}, {b}, {_rows_per_warp(a, b)}>"
                            for t, a in DTYPES.values() for b in BUCKETS],
    # the instantiations plain, bits and general (MmaVariant, attention_plan.h)
    "attention_kernel_mma.cu": [f"attnx::cuda::attention_forward_mma<{t}, {b}, {variant}>"
                                for t in ("__half", "__nv_bfloat16", "float") for b in (32, 64, 128)
                                for variant in (0, 1, 2)]
    + ["attnx::cuda::attention_mask_tiles"],
    "attention_backward_kernel.cu": [f"attnx::cuda::attention_backward_delta<{t}>"
                                     for t, _ in DTYPES.values()]
    + [f"attnx::cuda::attention_backward_{kind}<{t}, {b}>" for kind in ("keys", "queries")
       for t, _ in DTYPES.values() for b in BUCKETS],
    "attention_backward_kernel_mma.cu": [f"attnx::cuda::attention_backward_mma_{kind}<{t}, {b}, {variant}>"
                                         for kind in ("queries", "keys")
                                         for t in ("__half", "__nv_bfloat16") for b in (32, 64, 128)
                                         for variant in (0, 1, 2)],
}


def _torch_nvidia_dirs():
    """The lib and include dirs of the nvidia-* wheels beside torch (CUDA 13: nvidia/cu13; 12: nvidia/*)."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    roots = [os.path.join(site, "nvidia", "cu13"), *glob.glob(os.path.join(site, "nvidia", "cuda_*"))]
    libs = [os.path.join(r, "lib") for r in roots if os.path.isdir(os.path.join(r, "lib"))]
    incs = [os.path.join(r, "include") for r in roots if os.path.isdir(os.path.join(r, "include"))]
    return libs, incs


class Nvrtc:
    def __init__(self):
        if torch.version.cuda is None:
            pytest.skip(f"torch {torch.__version__} is a CPU build: no NVRTC beside it")
        major = torch.version.cuda.split(".")[0]
        libs, incs = _torch_nvidia_dirs()
        found = [p for d in libs for p in glob.glob(os.path.join(d, f"libnvrtc.so.{major}*"))]
        if not found:
            pytest.skip(f"no libnvrtc.so.{major} beside torch {torch.__version__} ({libs})")
        self.include = [d for d in incs if os.path.exists(os.path.join(d, "cuda_fp16.h"))]
        if not self.include:
            pytest.skip(f"no cuda_fp16.h beside torch {torch.__version__} ({incs})")
        # libnvrtc loads libnvrtc-builtins from its own directory by name: preload it there.
        lib_dir = os.path.dirname(found[0])
        for builtins in sorted(glob.glob(os.path.join(lib_dir, "libnvrtc-builtins.so.*"))):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(found[0])
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major_v, minor_v = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major_v), ctypes.byref(minor_v))
        self.version = f"{major_v.value}.{minor_v.value}"

    def compile(self, path, arch, names):
        """Compiles `path` to PTX for the virtual `arch` with `names` instantiated; returns (PTX bytes, the
        lowered names, seconds, log)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        with open(path, "rb") as f:
            source = f.read()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, path.encode(), 0, None, None) == 0
        try:
            for name in names:
                assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0, name
            options = ["-std=c++17", f"--gpu-architecture={arch}", "-I" + CSRC,
                       "-I" + os.path.join(CSRC, "include"), *("-I" + d for d in self.include),
                       "--pre-include=attnx/rtc.h", "-default-device", *TORCH_NVCC_DEFINES]
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            start = time.perf_counter()
            result = lib.nvrtcCompileProgram(prog, len(options), argv)
            seconds = time.perf_counter() - start
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            log = log.value.decode(errors="replace")
            assert result == 0, f"{os.path.basename(path)} for {arch}: " \
                                f"{lib.nvrtcGetErrorString(result).decode()}\n{log[-6000:]}"
            lowered = []
            for name in names:
                out = ctypes.c_char_p()
                assert lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)) == 0, name
                lowered.append(out.value.decode())
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            assert lib.nvrtcGetPTX(prog, ptx) == 0
            return ptx.raw, lowered, seconds, log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def nvrtc():
    return Nvrtc()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", list(KERNELS))
def test_every_kernel_compiles_with_nvrtc(nvrtc, source, arch, record_property):
    names = KERNELS[source]
    ptx, lowered, seconds, _ = nvrtc.compile(os.path.join(CSRC, "cuda", source), arch, names)
    # Every instantiation is an entry of the PTX under the name NVRTC lowered it to (what a launcher would
    # look up).
    assert len(set(lowered)) == len(names)
    for name in lowered:
        assert f".entry {name}(".encode() in ptx, name
    record_property("nvrtc", nvrtc.version)
    record_property("seconds", round(seconds, 2))
    print(f"NVRTC {nvrtc.version}: {source} for {arch}, {len(names)} kernels, {seconds:.1f} s, "
          f"PTX {len(ptx) / 2**10:.0f} KiB")


def test_rtc_header_is_only_for_nvrtc():
    # The sources include the standard headers themselves under nvcc and g++, never attnx/rtc.h.
    for path in glob.glob(os.path.join(CSRC, "**", "*.*"), recursive=True):
        with open(path, errors="replace") as f:
            assert '#include "attnx/rtc.h"' not in f.read(), path
