"""The CUDA kernels compiled at run time (``attnx._C_nvrtc``, csrc/rtc/): where the NVRTC of the running
torch and its headers are, where the compiled kernels are cached, and the library's set-up.

The library embeds the kernels' sources (csrc/cuda/*.cu) and compiles each instantiation a call needs with
the user's NVRTC, for the exact GPU, once per machine: the way to serve a CUDA major that the prebuilt
``_C_cuda`` was not built for (torch's CUDA 12 builds) and GPUs it holds no code for. It opens NVRTC and the
driver itself (dlopen): nothing of CUDA is linked into it.

Environment:
  ATTNX_CUDA_RUNTIME_COMPILE  1: these kernels serve CUDA even where the prebuilt library would load (tests);
                              0: never (the prebuilt library or none); unset: where the prebuilt one does not
  ATTNX_CUDA_CACHE            the folder of the compiled kernels (default: $XDG_CACHE_HOME/attnx/cuda, else
                              ~/.cache/attnx/cuda); ``0`` or empty: no disk cache (compiled in each process)
  ATTNX_CUDA_CACHE_MAX_BYTES  its bound (default 1 GiB): past it the least recently used kernels are removed
"""

import glob
import os
import sys
import warnings

import torch

CACHE_MAX_BYTES = 1 << 30
_state = None


def _nvidia_roots():
    """The nvidia-* wheels' folders beside torch: nvidia/cu13 (CUDA 13's single wheel layout) and
    nvidia/cuda_* (CUDA 12's, one wheel per component)."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return [os.path.join(site, "nvidia", "cu13"), *sorted(glob.glob(os.path.join(site, "nvidia", "cuda_*")))]


def nvrtc_library():
    """(path, "") of the NVRTC library of torch's CUDA major (libnvrtc.so.<major>), beside torch or in
    $CUDA_HOME; (None, why) where there is none."""
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU build"
    major = torch.version.cuda.split(".")[0]
    dirs = [os.path.join(root, "lib") for root in _nvidia_roots()]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, f"libnvrtc.so.{major}*")))
        if found:
            return found[0], ""
    return None, (f"no libnvrtc.so.{major} beside torch {torch.__version__} or in $CUDA_HOME (pip install "
                  f"nvidia-cuda-nvrtc-cu{major}, or set CUDA_HOME)")


def include_dirs():
    """The folders holding cuda_fp16.h and cuda_bf16.h, which the kernels include: the CUDA runtime wheel's
    headers beside torch, or $CUDA_HOME/include."""
    dirs = [os.path.join(root, "include") for root in _nvidia_roots()]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        dirs.append(os.path.join(cuda_home, "include"))
    return [d for d in dirs if os.path.exists(os.path.join(d, "cuda_fp16.h"))]


def cache_dir():
    """The disk cache's folder, "" for none (ATTNX_CUDA_CACHE=0 or empty)."""
    chosen = os.environ.get("ATTNX_CUDA_CACHE")
    if chosen is not None:
        return "" if chosen.strip() in ("", "0") else os.path.abspath(os.path.expanduser(chosen))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "attnx", "cuda")


def _cache_max_bytes():
    value = os.environ.get("ATTNX_CUDA_CACHE_MAX_BYTES")
    try:
        return CACHE_MAX_BYTES if value is None else int(value)
    except ValueError:
        raise ValueError(f"ATTNX_CUDA_CACHE_MAX_BYTES={value!r}: expected a number of bytes") from None


def library():
    """The path of attnx._C_nvrtc, or None where this build has none (a CPU torch, not Linux)."""
    from attnx._loader import _library

    return _library("_C_nvrtc")


def missing():
    """Why the run-time compiler cannot work here, or "" where it can: this build has no attnx._C_nvrtc, or
    there is no NVRTC of torch's CUDA major or no cuda_fp16.h."""
    if library() is None:
        return (f"this build has no attnx._C_nvrtc (torch {torch.__version__} is a CPU build, not Linux, or "
                f"the build had no CUDA toolkit)")
    nvrtc, why = nvrtc_library()
    if nvrtc is None:
        return why
    if not include_dirs():
        return (f"no cuda_fp16.h beside torch {torch.__version__} or in $CUDA_HOME (pip install "
                f"nvidia-cuda-runtime-cu{torch.version.cuda.split('.')[0]}, or set CUDA_HOME)")
    return ""


def load():
    """Loads attnx._C_nvrtc (its ops); raises RuntimeError where this build has none."""
    path = library()
    if path is None:
        raise RuntimeError(f"attnx's run-time CUDA compiler is not in this build ({sys.platform}, torch "
                           f"{torch.__version__}: it is built where torch is a CUDA build on Linux)")
    if path not in torch.ops.loaded_libraries:
        torch.ops.load_library(path)


def configure(reconfigure=False):
    """Loads attnx._C_nvrtc and sets its compiler up (once per process unless ``reconfigure``, after the
    environment above changed); returns {"nvrtc": its version, "nvrtc_path", "cache": the folder or "",
    "refused": why the folder was refused or "", "sources": the embedded sources' hash}. Raises RuntimeError
    saying what is missing where this cannot be done. A refused cache folder warns and leaves the kernels
    compiled in memory."""
    global _state
    if _state is not None and not reconfigure:
        return _state
    why = missing()
    if why:
        raise RuntimeError(f"attnx's run-time CUDA compiler cannot work here: {why}")
    load()
    nvrtc = nvrtc_library()[0]
    folder = cache_dir()
    version, refused, sources = torch.ops.attnx._cuda_runtime_configure(
        nvrtc, os.pathsep.join(include_dirs()), folder, _cache_max_bytes())
    if refused:
        warnings.warn(f"attnx: the CUDA kernel cache is not used: {refused}. Kernels are compiled in memory "
                      f"by each process; set ATTNX_CUDA_CACHE to a folder of your own.", RuntimeWarning,
                      stacklevel=2)
    _state = {"nvrtc": version, "nvrtc_path": nvrtc, "cache": "" if refused else folder, "refused": refused,
              "sources": sources, "enabled": bool(_state and _state.get("enabled"))}
    return _state


def enable():
    """Sets the compiler up (configure) and registers attnx._C_nvrtc's CUDA kernels of attnx's ops, which
    then serve CUDA; the loader calls it where the prebuilt library is not loaded. Raises RuntimeError where
    they cannot serve (no NVRTC, no headers)."""
    configure()
    torch.ops.attnx._cuda_runtime_enable()
    _state["enabled"] = True


def enabled():
    """Whether attnx._C_nvrtc's CUDA kernels serve CUDA in this process."""
    return bool(_state and _state.get("enabled"))


def compile(source, kernel, arch):
    """Compiles (or finds) ``kernel``, a name expression of the embedded ``source``
    (``attention_kernel_mma.cu``: ``attnx::cuda::attention_forward_mma<__half, 64, 0>``), for sm_``arch``
    (90); returns (where it came from: "memory", "disk" or "compiled"; its cache key; its lowered name)."""
    configure()
    return tuple(torch.ops.attnx._cuda_runtime_compile(source, kernel, arch))


def cache_usage():
    """(entries, bytes) of the disk cache in use, or None."""
    usage = torch.ops.attnx._cuda_runtime_cache()
    return tuple(usage) if usage else None
