"""attnx's CUDA kernels compiled for the CPU with g++ and the shim in cuda_shim.h, driven through ctypes.

``build()`` compiles ``csrc/cuda/attention_kernel.cu`` (the real source, as C++) with ``attention_emu.cpp``
and ``cuda_shim.cpp`` into a shared library under ``build/emulation/``, cached by the hash of every source,
header and flag. ``Emulator.attention`` mirrors the glue (csrc/cuda/attention.cpp and
common/attention.cpp): it reads the tensors' layouts into AttentionParams without copying, allocates out in
(B, L, H, Dv) memory order and lse, and calls the same launcher a GPU build calls.
"""

import ctypes
import glob
import math
import os
import re
import shutil
import subprocess
import tempfile

import torch

from emulation.build_cache import ROOT, BuildFailed, cached_build

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")

KERNELS_AND_SHIM = [os.path.join(CSRC, "cuda", "attention_kernel.cu"),
                    os.path.join(CSRC, "cuda", "attention_kernel_mma.cu"),
                    os.path.join(CSRC, "cuda", "attention_backward_kernel.cu"),
                    os.path.join(HERE, "cuda_shim.cpp")]
SOURCES = [*KERNELS_AND_SHIM, os.path.join(HERE, "attention_emu.cpp")]  # the ctypes library
RACE_CHECK_SOURCES = [*KERNELS_AND_SHIM, os.path.join(HERE, "race_check.cpp")]  # the TSan executable
# torch compiles .cu files with these; so does the emulation, so that the same conversions are exercised.
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]
# -fno-strict-aliasing: like nvcc, which lets kernels read fragments through casts.
FLAGS = ["-std=c++20", "-pthread", "-O1", "-fno-strict-aliasing", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
         "-DATTNX_CUDA_EMULATION", *TORCH_NVCC_DEFINES]


class Unavailable(Exception):
    """The emulation cannot be built on this machine (no C++20 compiler or no CUDA toolkit headers)."""


def load():
    """The emulation library as an Emulator, built if needed; for a test where it cannot be built, a skip
    that says why."""
    import pytest

    try:
        return Emulator(build())
    except Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")


def _depends():
    patterns = ["cuda/*.h", "cuda/*.cuh", "cuda/*.cu", "include/attnx/*.h"]
    files = sorted(p for pattern in patterns for p in glob.glob(os.path.join(CSRC, pattern)))
    return files + sorted(glob.glob(os.path.join(HERE, "*.h"))) + SOURCES


def toolkit_include():
    """A CUDA toolkit include dir with host-capable cuda_runtime.h, cuda_fp16.h and cuda_bf16.h, or None."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:  # nvcc may be a wrapper script: ask it where its toolkit is
        try:
            dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                 capture_output=True, text=True, timeout=60)
            match = re.search(r"^#\$ TOP=(.*)$", dry.stdout + dry.stderr, re.MULTILINE)
            if match:
                roots.append(match.group(1).strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in filter(None, roots):
        inc = os.path.join(root, "include")
        headers = ("cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h")
        if all(os.path.exists(os.path.join(inc, h)) for h in headers):
            return inc
    return None


def compiler():
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def has_thread_sanitizer(cxx=None):
    """Whether ``cxx`` (default: this tier's compiler) builds and links a -fsanitize=thread program (libtsan
    present)."""
    cxx = cxx or compiler()
    if cxx is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write("#include <thread>\nint main() { std::thread t([] {}); t.join(); }\n")
        result = subprocess.run([cxx, "-std=c++20", "-pthread", "-fsanitize=thread", src, "-o", src + ".out"],
                                capture_output=True, text=True)
        return result.returncode == 0


def build(extra_flags=(), sources=SOURCES, shared=True):
    """Compiles the emulation (a shared library, or an executable unless ``shared``); returns its path."""
    cxx = compiler()
    if cxx is None:
        raise Unavailable("no C++ compiler (g++ or clang++; or set CXX)")
    inc = toolkit_include()
    if inc is None:
        raise Unavailable("no CUDA toolkit headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h); set CUDA_HOME")
    flags = [*FLAGS, *extra_flags, "-I" + HERE, "-I" + CSRC, "-I" + os.path.join(CSRC, "include"), "-I" + inc]
    if shared and os.environ.get("ATTNX_SANITIZE") == "1":
        # `make sanitize`: the library is loaded into the test process, which has the ASan runtime preloaded.
        flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    # -Bsymbolic: the library's cudaFuncSetAttribute & co. are the shim's, even in a process where torch has
    # loaded the real libcudart (whose versions fail without a driver).
    flags += ["-shared", "-Wl,-Bsymbolic"] if shared else []
    # .cu files are C++ here; the -x c++ / -x none pair scopes that to them.
    cmd = [cxx, *flags]
    for src in sources:
        cmd += ["-x", "c++", src, "-x", "none"] if src.endswith(".cu") else [src]
    try:
        return cached_build("attention", cxx, flags, list(sources), _depends(), cmd, shared=shared,
                            what="emulation", unavailable=Unavailable)
    except BuildFailed as e:
        if "C++20" in e.stderr or "-std=c++20" in e.stderr:
            raise Unavailable(f"{cxx} does not support C++20:\n{e.stderr[-2000:]}") from e
        raise


# ------------------------------------------------------------------------------------------------------------
# ctypes mirrors of csrc/include/attnx/params.h and csrc/cuda/attention_plan.h.

i64, i32, u32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32


class AttentionParams(ctypes.Structure):
    _fields_ = [
        ("batch", i64), ("heads", i64), ("q_len", i64), ("kv_len", i64),
        ("head_dim", i64), ("v_head_dim", i64),
        ("q_stride", i64 * 4), ("k_stride", i64 * 4), ("v_stride", i64 * 4), ("out_stride", i64 * 4),
        ("lse_stride", i64 * 3), ("attn_mask_stride", i64 * 4), ("key_padding_mask_stride", i64 * 2),
        ("attn_mask_kind", i32), ("key_padding_mask_kind", i32), ("is_causal", i32),
        ("scale", ctypes.c_float), ("scale_lo", ctypes.c_float),
        ("dropout_seed", u32 * 2), ("dropout_offset", u32 * 2), ("dropout_threshold", u32), ("dropout", i32),
        ("dropout_p", ctypes.c_float), ("dropout_scale", ctypes.c_float),
        ("dropout_scale_lo", ctypes.c_float),
        ("kv_heads", i64), ("window_left", i64), ("window_right", i64), ("key_lengths_stride", i64),
        ("key_lengths_kind", i32), ("has_sinks", i32), ("softcap", ctypes.c_float),
        ("softcap_lo", ctypes.c_float),
        ("page_size", i64), ("block_table_stride", i64 * 2), ("pages_per_seq", i64), ("varlen", i32),
        ("varlen_reserved", i32),
    ]


class AttentionPlan(ctypes.Structure):
    _fields_ = [
        ("bucket", i32), ("rows_per_warp", i32), ("rows_per_block", i32), ("threads", i32),
        ("q_blocks", i64), ("bh", i64), ("blocks", i64), ("ldq", i32), ("ldk", i32), ("ldv", i32),
        ("q_off", i64), ("k_off", i64), ("v_off", i64), ("p_off", i64), ("smem_bytes", ctypes.c_size_t),
    ]


class AttentionBackwardParams(ctypes.Structure):
    _fields_ = [
        ("fwd", AttentionParams), ("grad_out_stride", i64 * 4), ("grad_query_stride", i64 * 4),
        ("grad_key_stride", i64 * 4), ("grad_value_stride", i64 * 4), ("grad_attn_mask_size", i64 * 4),
    ]


DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
MASK_KINDS = {torch.bool: 1, torch.float16: 2, torch.bfloat16: 3, torch.float32: 4, torch.float64: 5}
KERNELS = {"simt": 0, "mma": 1}
CUDA_ERRORS = {1: "cudaErrorInvalidValue", 9: "cudaErrorInvalidConfiguration"}


def attn_mask_strides(mask, B, H, L, S):
    """common/attention.cpp's attn_mask_strides: the mask as (B, H, L, S), stride 0 on broadcast dims."""
    if mask.dim() == 2:
        st = [0, 0, mask.stride(0), mask.stride(1)]
    elif mask.dim() == 3:
        st = [H * mask.stride(0), mask.stride(0), mask.stride(1), mask.stride(2)]
    else:
        st = list(mask.stride())
    for d, n in enumerate((B, H, L, S)):
        if n == 1 or (mask.dim() == 4 and mask.size(d) == 1):
            st[d] = 0
    return st


def split_scale(scale):
    """The unevaluated float32 pair hi + lo closest to ``scale`` (AttentionParams::scale, scale_lo)."""
    hi = float(torch.tensor(scale, dtype=torch.float32))
    lo = float(torch.tensor(scale - hi, dtype=torch.float32)) if math.isfinite(hi) else 0.0
    return hi, lo


KEY_LENGTHS_KINDS = {torch.int32: 1, torch.int64: 2}


def empty_outputs(q, v, out_layout, lse_dtype):
    """Uninitialised (out, lse) of attention over q and v, as the glue allocates them: out (B, H, L, Dv) in
    the op's (B, L, H, Dv) memory order for ``out_layout`` "blhd", contiguous for "bhld"; lse (B, H, L) of
    ``lse_dtype``."""
    B, H, L, _ = q.shape
    Dv = v.shape[3]
    if out_layout == "blhd":
        out = torch.empty(B, L, H, Dv, dtype=q.dtype).transpose(1, 2)
    else:
        out = torch.empty(B, H, L, Dv, dtype=q.dtype)
    return out, torch.empty(B, H, L, dtype=lse_dtype)


def data_ptr(t):
    """The address of t's data for ctypes, or None for an absent tensor."""
    return None if t is None else t.data_ptr()


def make_params(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None, out=None,
                lse=None, dropout_p=0.0, dropout_seed=None, window_left=-1, window_right=-1, key_lengths=None,
                softcap=0.0, sinks=None):
    """common/attention.cpp's attention_params. ``sinks``, when given, must already be the contiguous
    accumulator-dtype (H,) tensor the kernels read."""
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    p = AttentionParams(batch=B, heads=H, q_len=L, kv_len=S, head_dim=D, v_head_dim=Dv, kv_heads=k.shape[1],
                        window_left=window_left, window_right=window_right)
    if key_lengths is not None:
        p.key_lengths_kind = KEY_LENGTHS_KINDS[key_lengths.dtype]
        p.key_lengths_stride = key_lengths.stride(0)
    p.has_sinks = int(sinks is not None)
    if softcap > 0:
        p.softcap, p.softcap_lo = split_scale(softcap)
    p.q_stride[:], p.k_stride[:], p.v_stride[:] = q.stride(), k.stride(), v.stride()
    if out is not None:
        p.out_stride[:] = out.stride()
    if lse is not None:
        p.lse_stride[:] = lse.stride()
    if attn_mask is not None:
        p.attn_mask_kind = MASK_KINDS[attn_mask.dtype]
        p.attn_mask_stride[:] = attn_mask_strides(attn_mask, B, H, L, S)
    if key_padding_mask is not None:
        p.key_padding_mask_kind = MASK_KINDS[key_padding_mask.dtype]
        p.key_padding_mask_stride[:] = [0 if key_padding_mask.size(d) == 1 else key_padding_mask.stride(d)
                                        for d in range(2)]
    p.is_causal = int(is_causal)
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    p.scale, p.scale_lo = split_scale(scale)
    if dropout_p > 0:  # common/attention.cpp's attention_params
        seed, offset = (int(x) & 0xFFFFFFFFFFFFFFFF for x in dropout_seed.tolist())
        p.dropout = 1
        p.dropout_seed[:] = [seed & 0xFFFFFFFF, seed >> 32]
        p.dropout_offset[:] = [offset & 0xFFFFFFFF, offset >> 32]
        p.dropout_threshold = min(int((1.0 - dropout_p) * 4294967296.0), 0xFFFFFFFF)
        p.dropout_p = dropout_p
        p.dropout_scale, p.dropout_scale_lo = split_scale(1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)
    return p


class Emulator:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.attnx_emu_sizeof_params.restype = ctypes.c_size_t
        self.lib.attnx_emu_sizeof_plan.restype = ctypes.c_size_t
        assert self.lib.attnx_emu_sizeof_params() == ctypes.sizeof(AttentionParams), "params.h changed"
        assert self.lib.attnx_emu_sizeof_plan() == ctypes.sizeof(AttentionPlan), "attention_plan.h changed"
        self.lib.attnx_emu_sizeof_backward_params.restype = ctypes.c_size_t
        assert self.lib.attnx_emu_sizeof_backward_params() == ctypes.sizeof(AttentionBackwardParams)
        self.lib.attnx_emu_attention_backward.restype = ctypes.c_int
        self.lib.attnx_emu_attention_backward.argtypes = [
            ctypes.POINTER(AttentionBackwardParams), ctypes.c_int, *[ctypes.c_void_p] * 14
        ]
        self.lib.attnx_emu_attention.restype = ctypes.c_int
        self.lib.attnx_emu_attention.argtypes = [
            ctypes.POINTER(AttentionParams), ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 9
        ]

    def plan(self, params, dtype):
        plan = AttentionPlan()
        self.lib.attnx_emu_plan(ctypes.byref(params), DTYPES[dtype], ctypes.byref(plan))
        return plan

    def attention(self, q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                  dropout_p=0.0, dropout_seed=None, window_left=-1, window_right=-1, key_lengths=None,
                  softcap=0.0, sinks=None, out_layout="blhd", kernel="simt"):
        """attnx.attention on the emulated CUDA kernel: (out, lse) as the CUDA op returns them.

        ``kernel``: "simt" (attention_kernel.cu) or "mma" (attention_kernel_mma.cu, with mma.sync emulated).

        key (B, Hkv, S, D) and value (B, Hkv, S, Dv) may have fewer heads than query (grouped KV heads);
        ``key_lengths`` is an int32 or int64 (B,) tensor of any stride, read in place; ``sinks`` (H,) of any
        floating dtype is converted to the contiguous accumulator-dtype tensor the kernels read, as the glue
        does (common/attention.cpp's sinks_for_kernels). ``softcap`` 0 or None: no soft-capping.

        ``out_layout="bhld"`` writes into a contiguous (B, H, L, Dv) out instead of the op's (B, L, H, Dv)
        memory order, to check that the kernel honours out's strides.
        """
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = empty_outputs(q, v, out_layout, acc)
        if sinks is not None:
            sinks = sinks.to(lse.dtype).contiguous()
        p = make_params(q, k, v, attn_mask, key_padding_mask, is_causal, scale, out, lse, dropout_p,
                        dropout_seed, window_left, window_right, key_lengths, softcap or 0.0, sinks)
        tensors = (q, k, v, attn_mask, key_padding_mask, out, lse, key_lengths, sinks)
        err = self.lib.attnx_emu_attention(ctypes.byref(p), DTYPES[q.dtype], KERNELS[kernel],
                                           *(data_ptr(t) for t in tensors))
        if err != 0:
            raise RuntimeError(f"emulated launch failed: {CUDA_ERRORS.get(err, err)}")
        return out, lse

    def attention_backward(self, grad_out, q, k, v, out, lse, attn_mask=None, key_padding_mask=None,
                           is_causal=False, scale=None, dropout_p=0.0, dropout_seed=None, window_left=-1,
                           window_right=-1, key_lengths=None, softcap=0.0, sinks=None, grad_attn_mask=False):
        """attnx.attention_backward on the emulated CUDA kernels (attention_backward_kernel.cu): (grad_query,
        grad_key, grad_value, grad_attn_mask) as the op returns them, the gradients in the op's (B, N, H, E)
        memory order; grad_attn_mask is None unless asked for with a float attn_mask. The sinks' gradient is
        not the kernels' (AttentionBackwardProblem::box computes it)."""
        B, H, L, D = q.shape
        Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if sinks is not None:
            sinks = sinks.to(acc).contiguous()

        def bnhe(n, heads, e):
            return torch.empty(B, n, heads, e, dtype=q.dtype).transpose(1, 2)

        dq, dk, dv = bnhe(L, H, D), bnhe(S, Hkv, D), bnhe(S, Hkv, Dv)
        bp = AttentionBackwardParams()
        bp.fwd = make_params(q, k, v, attn_mask, key_padding_mask, is_causal, scale, out, lse, dropout_p,
                             dropout_seed, window_left, window_right, key_lengths, softcap or 0.0, sinks)
        bp.grad_out_stride[:], bp.grad_query_stride[:] = grad_out.stride(), dq.stride()
        bp.grad_key_stride[:], bp.grad_value_stride[:] = dk.stride(), dv.stride()
        mask_grad = None
        if grad_attn_mask and attn_mask is not None and attn_mask.dtype != torch.bool:
            # common/attention.cpp's mask_grad_shape
            m = attn_mask
            size = ([1, 1, *m.shape] if m.dim() == 2 else [B, H, m.shape[1], m.shape[2]] if m.dim() == 3
                    else list(m.shape))
            bp.grad_attn_mask_size[:] = size
            mask_grad = torch.zeros(size, dtype=acc)
        tensors = (q, k, v, attn_mask, key_padding_mask, out, lse, key_lengths, sinks, grad_out, dq, dk, dv,
                   mask_grad)
        err = self.lib.attnx_emu_attention_backward(ctypes.byref(bp), DTYPES[q.dtype],
                                                    *(data_ptr(t) for t in tensors))
        if err != 0:
            raise RuntimeError(f"emulated launch failed: {CUDA_ERRORS.get(err, err)}")
        if mask_grad is not None:
            mask_grad = mask_grad.reshape(attn_mask.shape).to(attn_mask.dtype)
        return dq, dk, dv, mask_grad
