"""attnx's CUDA kernels compiled for the CPU with g++ and the shim in cuda_shim.h.

``build()`` compiles ``csrc/cuda/*.cu`` (the real sources, as C++) with ``cuda_shim.cpp`` into a shared
library under ``build/emulation/``, cached by the hash of every source, header and flag: the kernels of the
emulated CUDA backend (backends.py links its extension against it). With ``shared=False`` it builds a C++
check program instead: the ThreadSanitizer race check (RACE_CHECK_SOURCES, the kernels compiled into it), or
one linked against the kernels' library (``check_program``).
"""

import glob
import os
import re
import shutil
import subprocess
import tempfile

from emulation.build_cache import ROOT, BuildFailed, cached_build

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")

KERNELS_AND_SHIM = [os.path.join(CSRC, "cuda", "attention_kernel.cu"),
                    os.path.join(CSRC, "cuda", "attention_kernel_mma.cu"),
                    os.path.join(CSRC, "cuda", "attention_backward_kernel.cu"),
                    os.path.join(CSRC, "cuda", "attention_backward_kernel_mma.cu"),
                    os.path.join(HERE, "cuda_shim.cpp")]
RACE_CHECK_SOURCES = [*KERNELS_AND_SHIM, os.path.join(HERE, "race_check.cpp")]  # the TSan executable
# torch compiles .cu files with these; so does the emulation, so that the same conversions are exercised.
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]
# -fno-strict-aliasing: like nvcc, which lets kernels read fragments through casts.
FLAGS = ["-std=c++20", "-pthread", "-O1", "-fno-strict-aliasing", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
         "-DATTNX_CUDA_EMULATION", *TORCH_NVCC_DEFINES]


class Unavailable(Exception):
    """The emulation cannot be built on this machine (no C++20 compiler or no CUDA toolkit headers)."""


def _depends():
    patterns = ["cuda/*.h", "cuda/*.cuh", "cuda/*.cu", "include/attnx/*.h"]
    files = sorted(p for pattern in patterns for p in glob.glob(os.path.join(CSRC, pattern)))
    return files + sorted(glob.glob(os.path.join(HERE, "*.h"))) + KERNELS_AND_SHIM


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


def build(extra_flags=(), sources=KERNELS_AND_SHIM, shared=True, link=()):
    """Compiles ``sources`` (by default the kernels and the shim) into a shared library, or an executable
    unless ``shared``, linked against the shared libraries ``link`` (paths: found where they lie at run
    time); returns its path."""
    cxx = compiler()
    if cxx is None:
        raise Unavailable("no C++ compiler (g++ or clang++; or set CXX)")
    inc = toolkit_include()
    if inc is None:
        raise Unavailable("no CUDA toolkit headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h); set CUDA_HOME")
    flags = [*FLAGS, *extra_flags, "-I" + HERE, "-I" + CSRC, "-I" + os.path.join(CSRC, "include"), "-I" + inc]
    if (shared or link) and os.environ.get("ATTNX_SANITIZE") == "1":
        # `make sanitize`: the library is loaded into the test process, which has the ASan runtime preloaded;
        # a program linked against it is instrumented as it is.
        flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    # -Bsymbolic: the library's cudaFuncSetAttribute & co. are the shim's, even in a process where torch has
    # loaded the real libcudart (whose versions fail without a driver).
    flags += ["-shared", "-Wl,-Bsymbolic"] if shared else []
    libraries = [arg for lib in link for arg in (lib, "-Wl,-rpath," + os.path.dirname(lib))]
    try:
        # .cu files are C++ here.
        return cached_build("attention", cxx, flags, list(sources), _depends(),
                            cxx_sources=[s for s in sources if s.endswith(".cu")], libraries=libraries,
                            shared=shared, what="emulation", unavailable=Unavailable)
    except BuildFailed as e:
        if "C++20" in e.stderr or "-std=c++20" in e.stderr:
            raise Unavailable(f"{cxx} does not support C++20:\n{e.stderr[-2000:]}") from e
        raise


def check_program(source):
    """The C++ check program ``source`` (with a main of its own, calling the kernels' launchers and plans),
    built and linked against the kernels' library; returns the executable's path."""
    return build(sources=[source], shared=False, link=[build()])
