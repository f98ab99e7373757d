"""Every CUDA kernel compiles with NVRTC, the run-time compiler that CUDA torch wheels ship: no GPU needed.

The kernel sources (csrc/cuda/*.cu) are compiled by nvcc into the wheel's CUDA library, for one CUDA major,
and embedded in attnx._C_nvrtc (csrc/cuda/embed.py), which compiles them at run time with the user's NVRTC
(12 or 13) for their GPU: the way to serve every CUDA major and every architecture from one wheel. This test
compiles every instantiation the launchers use, forward, tensor-core and backward, from the embedded sources
(attnx/rtc.h first, standing in for the C++ headers NVRTC lacks) with the library's own options, through the
NVRTC it is configured with (libnvrtc.so.13 from nvidia-cuda-nvrtc under torch 2.14, libnvrtc.so.12 under the
floor's torch 2.10), to PTX for compute_80: all of a file's instantiations in one program, where the
library compiles one at a time (tests/test_cuda_runtime.py compiles one of each file to SASS through it). It
records how long each file takes: the front end's share of the cost.

Skips, saying why, where torch has no NVRTC beside it (a CPU torch) or its headers (cuda_fp16.h) are missing.
"""

import ctypes
import glob
import importlib.util
import os
import time

import pytest
import torch

from attnx import _cuda_runtime

pytestmark = pytest.mark.floor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
_spec = importlib.util.spec_from_file_location("embed", os.path.join(CSRC, "cuda", "embed.py"))
embed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(embed)
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
    # the instantiations plain, bits, general and capped (MmaVariant, attention_plan.h)
    "attention_kernel_mma.cu": [f"attnx::cuda::attention_forward_mma<{t}, {b}, {variant}>"
                                for t in ("__half", "__nv_bfloat16", "float") for b in (32, 64, 128)
                                for variant in (0, 1, 2, 3)]
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


class Nvrtc:
    """The NVRTC attnx._C_nvrtc is configured with (python/attnx/_cuda_runtime.py finds it beside torch),
    called through ctypes to compile many instantiations in one program, with the library's own options."""

    def __init__(self):
        why = _cuda_runtime.missing()
        if why:
            pytest.skip(why)
        path = _cuda_runtime.nvrtc_library()[0]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ATTNX_CUDA_CACHE", "0")  # nothing written: this compiles through ctypes
            self.state = _cuda_runtime.configure(reconfigure=True)
        self.lib = ctypes.CDLL(path)  # the library configure opened, and its builtins beside it
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.version = self.state["nvrtc"]

    def options(self, arch):
        """The run-time compiler's options for sm_XY, for the virtual `arch` (compute_XY) instead."""
        number = arch.removeprefix("compute_")
        options = torch.ops.attnx._cuda_runtime_options(int(number))
        assert f"--gpu-architecture=sm_{number}" in options, options
        return [f"--gpu-architecture={arch}" if o.startswith("--gpu-architecture=") else o for o in options]

    def compile(self, source, arch, names):
        """Compiles the embedded `source` (as csrc/cuda/embed.py makes it) to PTX for the virtual `arch` with
        `names` instantiated; returns (PTX bytes, the lowered names, seconds, log)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        text = embed.cuda_sources()[source].encode()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), text, source.encode(), 0, None, None) == 0
        try:
            for name in names:
                assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0, name
            options = self.options(arch)
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            start = time.perf_counter()
            result = lib.nvrtcCompileProgram(prog, len(options), argv)
            seconds = time.perf_counter() - start
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            log = log.value.decode(errors="replace")
            error = lib.nvrtcGetErrorString(result).decode()
            assert result == 0, f"{source} for {arch}: {error}\n{log[-6000:]}"
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
    ptx, lowered, seconds, _ = nvrtc.compile(source, arch, names)
    # Every instantiation is an entry of the PTX under the name NVRTC lowered it to (what a launcher would
    # look up).
    assert len(set(lowered)) == len(names)
    for name in lowered:
        assert f".entry {name}(".encode() in ptx, name
    record_property("nvrtc", nvrtc.version)
    record_property("seconds", round(seconds, 2))
    print(f"NVRTC {nvrtc.version}: {source} for {arch}, {len(names)} kernels, {seconds:.1f} s, "
          f"PTX {len(ptx) / 2**10:.0f} KiB")


def test_the_library_embeds_these_sources(nvrtc):
    # What this file compiles is what attnx._C_nvrtc holds: the sources as embed.py makes them now (a stale
    # build fails here).
    assert nvrtc.state["sources"] == embed.sources_hash(embed.cuda_sources())
    assert sorted(embed.cuda_sources()) == sorted(KERNELS)


def test_rtc_header_is_only_for_nvrtc():
    # The sources include the standard headers themselves under nvcc and g++, never attnx/rtc.h.
    for path in glob.glob(os.path.join(CSRC, "**", "*.*"), recursive=True):
        with open(path, errors="replace") as f:
            assert '#include "attnx/rtc.h"' not in f.read(), path
