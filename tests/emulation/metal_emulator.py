"""attnx's Metal kernels compiled for the CPU with clang and the metal_stdlib shim, driven through ctypes.

``build()`` compiles every ``metal/*.metal`` file as C++ (against ``tests/emulation/metal/metal_stdlib``) with
the runtime (``metal_runtime.cpp``) and the C entry points (``metal_emu.cpp``) into a shared library under
``build/emulation/``, cached by the hash of every source, header and flag. ``MetalEmulator.attention`` and
``.linear`` mirror the MPS glue (``csrc/mps/attention.mm``, ``linear.mm``): they read the tensors'
layouts into AttentionParams / LinearParams without copying, allocate the outputs as the glue does, and
launch the kernel that ``csrc/mps/metal_plan.h`` picks, with its grid and threadgroup size.
"""

import ctypes
import glob
import os
import shutil

import torch

from emulation import emulator as cuda_emulator
from emulation.build_cache import ROOT, cached_build
from emulation.emulator import MASK_KINDS, AttentionParams, data_ptr, empty_outputs, make_params

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "metal")
CSRC = os.path.join(ROOT, "csrc")
METAL = os.path.join(ROOT, "metal")

RUNTIME = [os.path.join(SHIM, "metal_runtime.cpp")]
SOURCES = [*RUNTIME, os.path.join(SHIM, "metal_emu.cpp")]  # the ctypes library, beside the .metal files
RACE_CHECK_SOURCES = [*SOURCES, os.path.join(SHIM, "race_check.cpp")]  # the TSan executable
# .metal files are C++ here. -fno-exceptions -fno-rtti: Metal has neither; -Werror=double-promotion: Metal has
# no double, so a float silently promoted to double is a kernel bug.
FLAGS = ["-std=c++20", "-pthread", "-O1", "-fPIC", "-fno-exceptions", "-fno-rtti", "-Wall",
         "-Wno-unknown-attributes", "-Werror=double-promotion", "-Wno-unknown-pragmas"]


class Unavailable(Exception):
    """The emulation cannot be built on this machine (no clang++)."""


def metal_files():
    return sorted(glob.glob(os.path.join(METAL, "*.metal")))


def _depends():
    files = glob.glob(os.path.join(METAL, "*")) + glob.glob(os.path.join(SHIM, "*"))
    files += [os.path.join(HERE, "barrier.h"), os.path.join(HERE, "race_check.h")]
    files += glob.glob(os.path.join(CSRC, "include", "attnx", "*.h"))
    files += glob.glob(os.path.join(CSRC, "mps", "*.h"))
    return sorted(set(files))


def compiler():
    """clang++: the shim relies on clang's __builtin_FILE in default arguments and C++20 template lambdas."""
    cxx = os.environ.get("ATTNX_METAL_EMU_CXX") or shutil.which("clang++")
    if cxx is None:
        for version in range(30, 13, -1):
            cxx = shutil.which(f"clang++-{version}")
            if cxx:
                break
    return cxx


def has_thread_sanitizer():
    return cuda_emulator.has_thread_sanitizer(compiler())


def build(extra_flags=(), sources=SOURCES, shared=True, metal_sources=None):
    """Compiles the emulation (a shared library, or an executable unless ``shared``); returns its path.

    ``metal_sources``: the .metal files to compile (default: every file in metal/).
    """
    cxx = compiler()
    if cxx is None:
        raise Unavailable("no clang++ (apt-get install clang; or set ATTNX_METAL_EMU_CXX)")
    metal_sources = metal_files() if metal_sources is None else list(metal_sources)
    flags = [*FLAGS, *extra_flags, "-I" + SHIM, "-I" + CSRC, "-I" + os.path.join(CSRC, "include")]
    flags += ["-shared"] if shared else []
    cmd = [cxx, *flags, "-x", "c++", *metal_sources, "-x", "none", *sources]
    return cached_build("metal", cxx, flags, [*metal_sources, *sources], _depends(), cmd, shared=shared,
                        what="Metal emulation", unavailable=Unavailable)


# ------------------------------------------------------------------------------------------------------------
# ctypes mirrors of csrc/include/attnx/params.h (LinearParams; AttentionParams is emulator.py's) and
# csrc/mps/metal_plan.h.

i64, i32 = ctypes.c_int64, ctypes.c_int32


class LinearParams(ctypes.Structure):
    _fields_ = [
        ("rows", i64), ("rows_inner", i64), ("in_features", i64), ("out_features", i64),
        ("input_stride", i64 * 3), ("weight_stride", i64 * 2), ("bias_stride", i64), ("out_stride", i64 * 2),
        ("has_bias", i32), ("reserved", i32),
    ]


class Launch(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 48), ("grid", i64 * 3), ("threads", i32), ("threadgroup_bytes", i32)]


class AttentionPlan(ctypes.Structure):
    _fields_ = [("kernel", i32), ("bucket", i32), ("launch", Launch)]


class LinearPlan(ctypes.Structure):
    _fields_ = [("kernel", i32), ("launch", Launch)]


DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ATTENTION_KERNELS = {0: "none", 1: "vector", 2: "tiled"}
LINEAR_KERNELS = {0: "gemv", 1: "gemm"}
ERRORS = {1: "unknown kernel name", 2: "bad threadgroup size", 3: "no kernel for this problem"}


class MetalEmulator:
    def __init__(self, path):
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        for fn in ("attention_params", "linear_params", "attention_plan", "linear_plan"):
            getattr(lib, f"attnx_metal_emu_sizeof_{fn}").restype = ctypes.c_size_t
        for fn, mirror, header in [("attention_params", AttentionParams, "params.h"),
                                   ("linear_params", LinearParams, "params.h"),
                                   ("attention_plan", AttentionPlan, "metal_plan.h"),
                                   ("linear_plan", LinearPlan, "metal_plan.h")]:
            size = getattr(lib, f"attnx_metal_emu_sizeof_{fn}")()
            assert size == ctypes.sizeof(mirror), f"{header} changed: update the ctypes mirror"
        lib.attnx_metal_emu_kernel_name.restype = ctypes.c_char_p
        lib.attnx_metal_emu_last_threadgroup_bytes.restype = ctypes.c_size_t
        lib.attnx_metal_emu_attention.argtypes = [ctypes.POINTER(AttentionParams), ctypes.c_int,
                                                  *[ctypes.c_void_p] * 9]
        lib.attnx_metal_emu_linear.argtypes = [ctypes.POINTER(LinearParams), ctypes.c_int,
                                               *[ctypes.c_void_p] * 4]
        lib.attnx_metal_emu_linear_input_layout.argtypes = [ctypes.c_int, ctypes.POINTER(i64),
                                                            ctypes.POINTER(i64), ctypes.POINTER(LinearParams)]
        lib.attnx_metal_emu_pack_linear_params.argtypes = [
            ctypes.c_int, ctypes.POINTER(i64), ctypes.POINTER(i64), i64, ctypes.POINTER(i64), ctypes.c_int,
            i64, i64, ctypes.POINTER(LinearParams),
        ]
        self.last_plan = None

    def launch(self, name, grid, threads, buffers):
        """Any instantiated kernel by host name; ``buffers``: tensors in [[buffer(i)]] order."""
        ptrs = (ctypes.c_void_p * len(buffers))(*[t.data_ptr() for t in buffers])
        err = self.lib.attnx_metal_emu_launch(name.encode(), (i64 * 3)(*grid), threads, ptrs)
        if err != 0:
            raise RuntimeError(f"emulated Metal launch failed: {ERRORS.get(err, err)}")

    def kernel_names(self):
        return sorted(self.lib.attnx_metal_emu_kernel_name(i).decode()
                      for i in range(self.lib.attnx_metal_emu_kernel_count()))

    def last_threadgroup_bytes(self):
        return self.lib.attnx_metal_emu_last_threadgroup_bytes()

    def plan_attention(self, params, dtype):
        plan = AttentionPlan()
        self.lib.attnx_metal_emu_plan_attention(ctypes.byref(params), DTYPES[dtype], ctypes.byref(plan))
        return plan

    def plan_linear(self, params, dtype):
        plan = LinearPlan()
        self.lib.attnx_metal_emu_plan_linear(ctypes.byref(params), DTYPES[dtype], ctypes.byref(plan))
        return plan

    def linear_input_layout(self, sizes, strides):
        """metal_plan.h's linear_input_layout: LinearParams with the rows filled in, or None (copy needed)."""
        n = len(sizes)
        p = LinearParams()
        ok = self.lib.attnx_metal_emu_linear_input_layout(n, (i64 * n)(*sizes), (i64 * n)(*strides),
                                                          ctypes.byref(p))
        return p if ok else None

    def attention(self, q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                  out_layout="blhd", window_left=-1, window_right=-1, key_lengths=None, softcap=0.0,
                  sinks=None):
        """attnx.attention on the emulated Metal kernels: (out, lse) as the MPS op returns them.

        ``out_layout="bhld"`` writes into a contiguous (B, H, L, Dv) out instead of the op's (B, L, H, Dv)
        memory order, to check that the kernels honour out's strides. key (B, Hkv, S, D) and value may have
        fewer heads than query (grouped KV heads); key_lengths (B,) int32 or int64 is read in place, through
        its stride; sinks (H,) is converted to contiguous float32 as the glue does (common/attention.cpp's
        sinks_for_kernels).
        """
        if q.dtype not in DTYPES:
            raise TypeError(f"attnx::attention: no Metal kernel for dtype {q.dtype}")
        for mask in (attn_mask, key_padding_mask, sinks):
            if mask is not None and mask.dtype == torch.float64:
                raise TypeError("attnx::attention: no Metal kernel reads float64 masks or sinks")
        if key_lengths is not None and key_lengths.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"attnx::attention: expected key_lengths of dtype int32 or int64, got "
                            f"{key_lengths.dtype}")
        out, lse = empty_outputs(q, v, out_layout, torch.float32)
        sinks_acc = None if sinks is None else sinks.to(torch.float32).contiguous()
        p = make_params(q, k, v, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                        window_left=window_left, window_right=window_right, key_lengths=key_lengths,
                        softcap=softcap, sinks=sinks_acc)
        self.last_plan = self.plan_attention(p, q.dtype)
        tensors = (q, k, v, attn_mask, key_padding_mask, out, lse, key_lengths, sinks_acc)
        err = self.lib.attnx_metal_emu_attention(ctypes.byref(p), DTYPES[q.dtype],
                                                 *(data_ptr(t) for t in tensors))
        if err != 0:
            raise RuntimeError(f"emulated Metal launch failed: {ERRORS.get(err, err)}")
        return out, lse

    def pack_linear_params(self, input, weight, bias=None):
        """metal_plan.h's pack_linear_params: every layout the kernels read, or None (input copy needed)."""
        n = input.dim()
        p = LinearParams()
        bias_size, bias_stride = (0, 0) if bias is None else (bias.shape[0], bias.stride(0))
        ok = self.lib.attnx_metal_emu_pack_linear_params(
            n, (i64 * n)(*input.shape), (i64 * n)(*input.stride()), weight.shape[0],
            (i64 * 2)(*weight.stride()), int(bias is not None), bias_size, bias_stride, ctypes.byref(p))
        return p if ok else None

    def linear(self, input, weight, bias=None):
        """attnx.linear on the emulated Metal kernels, as mps/linear.mm runs it: the input read in place
        when pack_linear_params accepts its layout, else copied once; a contiguous (..., N) output."""
        if input.dtype not in DTYPES:
            raise TypeError(f"attnx::linear: no Metal kernel for dtype {input.dtype}")
        p = self.pack_linear_params(input, weight, bias)
        if p is None:
            input = input.contiguous()
            p = self.pack_linear_params(input, weight, bias)
        out = torch.empty(*input.shape[:-1], weight.shape[0], dtype=input.dtype)
        self.last_plan = self.plan_linear(p, input.dtype)
        err = self.lib.attnx_metal_emu_linear(ctypes.byref(p), DTYPES[input.dtype], input.data_ptr(),
                                              weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                              out.data_ptr())
        if err != 0:
            raise RuntimeError(f"emulated Metal launch failed: {ERRORS.get(err, err)}")
        return out


__all__ = ["MASK_KINDS", "MetalEmulator", "Unavailable", "build", "has_thread_sanitizer", "metal_files"]
