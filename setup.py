"""Build attnx's compiled libraries:

  attnx._C       the op schemas, the CPU kernels and the composites, on the LibTorch stable ABI: one binary
                 for every torch >= MIN_TORCH (built with TORCH_TARGET_VERSION, no at::/c10:: symbol, no
                 libtorch_python)
  attnx._C_cuda  the CUDA kernels and their glue, on the stable ABI too, when torch is a CUDA build and nvcc
                 is found; a library of its own because it needs the CUDA runtime, which a CPU torch lacks
  attnx._C_nvrtc the CUDA glue and launchers without the kernels, whose sources (csrc/cuda/*.cu) it embeds
                 and compiles at run time with the user's NVRTC for their GPU, cached on disk (csrc/rtc/):
                 built by the host compiler where the CUDA library is (a toolkit's headers are enough for
                 it), it links nothing of CUDA and serves CUDA where _C_cuda does not load
  attnx._C_mps   the MPS glue on macOS (with the Metal kernels of metal/*.metal embedded as source, compiled
                 at first use), on torch's regular ABI: it encodes on torch's MPS stream (at::mps::MPSStream)
                 and binds its parameters with setBytes, which the stable ABI has no equivalent of before
                 torch 2.14; so it loads only under the torch minor release it was built against

attnx/_loader.py loads _C, then the backend libraries the running torch can take.

Environment:
  ATTNX_WITH_CUDA / ATTNX_WITH_MPS   auto (default) | 0 | 1 (1 fails the build when the backend is impossible;
                                     without CUDA, _C_nvrtc is left out too)
  ATTNX_DEBUG=1                      -O0 -g
  ATTNX_SANITIZE=1                   AddressSanitizer + UndefinedBehaviorSanitizer, any report fatal (`make
                                     sanitize` builds a CPU-only copy with it and runs the kernel tests)
  ATTNX_CPU_MAX_VARIANT              amx_bf16 (default) | avx512_bf16 | avx512 | avx2 | default: the
                                     widest x86 variant of the CPU kernels built (`make sanitize` builds
                                     those its machine runs)
  CUDA_HOME                          toolkit root; by default read from `nvcc --dryrun`
                                     (nvcc may be a wrapper)
  TORCH_CUDA_ARCH_LIST               default "8.0;9.0+PTX" when no GPU is visible
  MAX_JOBS                           parallel compile jobs (ninja)
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
SANITIZE = os.environ.get("ATTNX_SANITIZE") == "1"
# The oldest torch the stable-ABI libraries load under: the stable C API of torch 2.10 has what they call
# (torch_call_dispatcher with the extension's version, torch_parallel_for, the accelerator device guard).
MIN_TORCH = (2, 10)
TARGET_VERSION = f"-DTORCH_TARGET_VERSION=0x{MIN_TORCH[0]:02x}{MIN_TORCH[1]:02x}000000000000"
# Sources shared by every library: argument checks and layouts (each library has its own copy; nothing is
# exported, -fvisibility=hidden).
COMMON = ("common/attention.cpp", "common/attention_math.cpp", "common/linear.cpp")


def _flag(name):
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        sys.exit(f"attnx: {name} must be auto, 0 or 1, got {value!r}")
    return value


def _cuda_home():
    """The toolkit root: $CUDA_HOME, else the TOP that nvcc itself reports (robust to wrapper scripts)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dry = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^#\$ TOP=(.*)$", dry.stdout + dry.stderr, re.MULTILINE)
    return os.path.realpath(match.group(1).strip()) if match else os.path.dirname(os.path.dirname(nvcc))


def _configure():
    import torch

    with_cuda, with_mps = _flag("ATTNX_WITH_CUDA"), _flag("ATTNX_WITH_MPS")
    notes = []

    cuda_home = None
    if with_cuda != "0":
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU build"
        else:
            cuda_home = _cuda_home()
            reason = None if cuda_home else "nvcc not found (set CUDA_HOME)"
        if reason:
            if with_cuda == "1":
                sys.exit(f"attnx: ATTNX_WITH_CUDA=1 but {reason}")
            notes.append(f"CUDA skipped ({reason})")
            cuda_home = None
    if cuda_home:
        # cpp_extension reads CUDA_HOME when it is imported; its own guess (dirname of `which nvcc`) is wrong
        # when nvcc is a wrapper script.
        os.environ["CUDA_HOME"] = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # Without a visible GPU, torch derives no arch and the build crashes: name Ampere and Hopper,
            # with Hopper's PTX, which the driver compiles for later GPUs (Blackwell) at first use.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"

    mps = False
    if with_mps != "0":
        mps = sys.platform == "darwin" and torch.backends.mps.is_built()
        if not mps:
            if with_mps == "1":
                sys.exit("attnx: ATTNX_WITH_MPS=1 but this is not macOS with an MPS build of torch")
            notes.append("MPS skipped (macOS only)")

    backends = ["CPU"] + (["CUDA"] if cuda_home else []) + (["MPS"] if mps else [])
    detail = f"; CUDA at {cuda_home}, archs {os.environ['TORCH_CUDA_ARCH_LIST']}" if cuda_home else ""
    print(f"attnx: building {' + '.join(backends)} for torch {torch.__version__}{detail}"
          + (f"; {'; '.join(notes)}" if notes else ""))
    return backends, cuda_home


def _write_build_info(backends):
    import torch

    path = os.path.join(ROOT, "python", "attnx", "_build_info.py")
    with open(path, "w") as f:
        f.write("# Generated by setup.py: what this build of attnx._C contains.\n")
        f.write(f"BACKENDS = {tuple(backends)!r}\n")
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write(f"MIN_TORCH = {'.'.join(map(str, MIN_TORCH))!r}\n")
        f.write(f"CUDA_VERSION = {torch.version.cuda if 'CUDA' in backends else None!r}\n")
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") if "CUDA" in backends else None
        f.write(f"CUDA_ARCH_LIST = {arch_list!r}\n")
        f.write(f"NVRTC = {_with_nvrtc(CUDA_HOME)!r}\n")


def _openmp():
    """True when torch's intra-op threads are OpenMP's (its Linux builds)."""
    import torch

    return torch.backends.openmp.is_available() and sys.platform.startswith("linux")


def _embed_metal_sources():
    """Writes build/generated/attnx_metal_sources.h (metal/*.metal as one string, see metal/embed.py);
    returns its directory. csrc/mps/metal_library.mm compiles it at run time: no Xcode needed to build."""
    out_dir = os.path.join(ROOT, "build", "generated")
    subprocess.run([sys.executable, os.path.join(ROOT, "metal", "embed.py"),
                    os.path.join(out_dir, "attnx_metal_sources.h")], check=True)
    return out_dir


def _embed_cuda_sources():
    """Writes build/generated/attnx_cuda_sources.h (each csrc/cuda/*.cu with its headers, see
    csrc/cuda/embed.py); returns its directory."""
    out_dir = os.path.join(ROOT, "build", "generated")
    subprocess.run([sys.executable, os.path.join(ROOT, CSRC, "cuda", "embed.py"),
                    os.path.join(out_dir, "attnx_cuda_sources.h")], check=True)
    return out_dir


def _with_nvrtc(cuda_home):
    """Whether to build attnx._C_nvrtc: torch is a CUDA build (it brings NVRTC) on Linux (dlopen), with a
    CUDA toolkit's headers at `cuda_home` (the CUDA build's condition too)."""
    import torch

    return torch.version.cuda is not None and sys.platform.startswith("linux") and cuda_home is not None


def _extensions(backends, cuda_home):
    from torch.utils import cpp_extension

    def sources(*patterns):
        return sorted(p for pattern in patterns for p in glob.glob(os.path.join(CSRC, pattern)))

    debug = os.environ.get("ATTNX_DEBUG") == "1"
    # -O1 under the sanitizers, as they recommend: every access stays checked, and the kernels, which take
    # minutes to compile at -O3 with their instrumentation, compile four times faster. With GCC's FMA
    # contraction, which -O2 and -O3 do (-fexpensive-optimizations gates it): the kernels' scalar a * b + c
    # then rounds as their vector fmadd does, as in the shipped build; without it, a score recomputed by the
    # backward can differ from the forward's by an ulp, which at a scale of 1e30 is exp of 1e14.
    opt = ["-O0", "-g"] if debug else ["-O1", "-fexpensive-optimizations"] if SANITIZE else ["-O3"]
    cxx = opt + ["-fvisibility=hidden"]
    if not debug:
        # setuptools passes Python's own CFLAGS first, -g among them: the variables' debug information took a
        # third of the CPU kernels' compile time and three quarters of their objects. -g1 keeps the line
        # tables that a crash's, a sanitizer report's or a profiler's stack needs.
        cxx.append("-g1")
    link = []
    if SANITIZE:
        # The process loads the ASan runtime first (LD_PRELOAD, see the Makefile's sanitize target): Python
        # and torch are not instrumented, attnx's code is.
        sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
        cxx += sanitizers + ["-fno-omit-frame-pointer"]
        link += sanitizers
    variant = os.environ.get("ATTNX_CPU_MAX_VARIANT")
    if variant:
        levels = {"default": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3, "amx_bf16": 4}
        if variant not in levels:
            sys.exit(f"ATTNX_CPU_MAX_VARIANT={variant!r}: expected one of {', '.join(levels)}")
        cxx.append(f"-DATTNX_CPU_MAX_VARIANT={levels[variant]}")
    if _openmp():
        # The CPU kernels run on torch's threads (torch_parallel_for) and use no OpenMP themselves; the
        # linear shares only need to know whether those threads are OpenMP's (csrc/cpu/linear.cpp), which
        # the stable headers do not say.
        cxx.append("-DATTNX_TORCH_OPENMP")

    def kwargs():
        # py_limited_api=True makes torch define Py_LIMITED_API (3.10) and leave libtorch_python out: _C is an
        # empty module (csrc/schemas.cpp), the others are plain shared libraries loaded with
        # torch.ops.load_library.
        return dict(include_dirs=[os.path.join(ROOT, CSRC), os.path.join(ROOT, CSRC, "include")],
                    py_limited_api=True, extra_link_args=list(link))

    stable = cxx + [TARGET_VERSION]
    cpu_sources = sources("*.cpp", "common/*.cpp", "cpu/*.cpp", "pytorch/*.cpp")
    exts = [cpp_extension.CppExtension("attnx._C", cpu_sources, extra_compile_args={"cxx": stable},
                                       **kwargs())]
    if "CUDA" in backends:
        nvcc = opt + ["--expt-relaxed-constexpr", "-lineinfo"]
        exts.append(cpp_extension.CUDAExtension(
            "attnx._C_cuda", sources("cuda/*.cu", "cuda/*.cpp", *COMMON),
            extra_compile_args={"cxx": stable, "nvcc": nvcc}, **kwargs()))
    if _with_nvrtc(cuda_home):
        # The CUDA glue and csrc/cuda/*.cu's launchers (rtc/launchers.cpp) compiled by the host compiler,
        # without the kernels (ATTNX_CUDA_HOST_ONLY), against the toolkit's headers for the runtime's types;
        # torch_cuda for the current stream (the C shim's).
        rtc = kwargs()
        rtc["include_dirs"] += [_embed_cuda_sources(), os.path.join(cuda_home, "include")]
        rtc["libraries"] = ["torch_cuda", "dl"]
        exts.append(cpp_extension.CppExtension(
            "attnx._C_nvrtc", sources("rtc/*.cpp", "cuda/*.cpp", *COMMON),
            extra_compile_args={"cxx": stable + ["-DATTNX_CUDA_HOST_ONLY"]}, **rtc))
    if "MPS" in backends:
        mps = kwargs()
        mps["include_dirs"].append(_embed_metal_sources())
        mps["extra_link_args"] += ["-framework", "Metal", "-framework", "Foundation"]
        exts.append(cpp_extension.CppExtension("attnx._C_mps", sources("mps/*.mm", *COMMON),
                                               extra_compile_args={"cxx": list(cxx)}, **mps))
    return exts


backends, CUDA_HOME = _configure()
_write_build_info(backends)

from torch.utils.cpp_extension import BuildExtension  # noqa: E402  (after CUDA_HOME is settled)


class _BuildExtension(BuildExtension.with_options(use_ninja=True)):
    """Object files in build/temp-<backends>/<library>, kept between builds: pip's editable build would
    otherwise use a fresh temporary directory and recompile every source each time. One folder per library:
    the libraries share csrc/common's sources, compiled with other flags, which in one folder would overwrite
    each other's objects and be compiled again by every build."""

    def finalize_options(self):
        super().finalize_options()
        flavour = "-".join(backends) + ("-sanitize" if SANITIZE else "")
        self.build_temp = os.path.join(ROOT, "build", "temp-" + flavour)

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


setup(
    ext_modules=_extensions(backends, CUDA_HOME),
    cmdclass={"build_ext": _BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
