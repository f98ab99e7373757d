"""The C++ sources compile against the headers of the oldest torch attnx supports (setup.py's MIN_TORCH).

The wheel is built once, against a recent torch with TORCH_TARGET_VERSION set to the floor, and the floor's
venv of `make test-wheel` checks that it loads and runs there. A user who builds from source against the floor
compiles against the floor's own headers instead, and with the C++ standard its cpp_extension picks (C++17 for
torch 2.10, where recent torches pick C++20). This test is that compile, for every C++ source of the CPU and
CUDA libraries (the CUDA glue with the CUDA runtime's headers; .cu kernels include no torch header), as a
syntax-only pass. It runs where the installed torch is the floor release; elsewhere the build itself has just
compiled every source against the installed torch.
"""

import glob
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.floor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def _floor():
    try:
        from attnx import _build_info
    except ImportError:
        pytest.skip("attnx has no _build_info (not built by setup.py)")
    return tuple(int(x) for x in _build_info.MIN_TORCH.split("."))


def _cuda_include():
    """A directory with the CUDA runtime's headers, complete (cuda_runtime_api.h includes crt/): a CUDA
    toolkit ($CUDA_HOME, the one nvcc reports, /usr/local/cuda), else torch's CUDA runtime wheel if it has
    them."""
    roots = [os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:  # nvcc may be a wrapper: its own report of the toolkit root, as setup.py reads
        dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True)
        roots += [line[len("#$ TOP="):].strip() for line in (dry.stdout + dry.stderr).splitlines()
                  if line.startswith("#$ TOP=")]
    roots.append("/usr/local/cuda")
    candidates = [os.path.join(r, "include") for r in roots if r]
    candidates.append(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cuda_runtime", "include"))
    complete = ("cuda_runtime_api.h", os.path.join("crt", "host_defines.h"))
    return next((c for c in candidates if all(os.path.exists(os.path.join(c, f)) for f in complete)), None)


def test_sources_compile_against_the_floor_headers():
    floor = _floor()
    installed = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if installed != floor:
        pytest.skip(f"torch {torch.__version__} is not the floor {floor[0]}.{floor[1]} (the build compiled "
                    "every source against it)")
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    from torch.utils import cpp_extension

    target = f"-DTORCH_TARGET_VERSION=0x{floor[0]:02x}{floor[1]:02x}000000000000"
    flags = ["-std=c++17", "-fsyntax-only", "-fvisibility=hidden", target, "-DPy_LIMITED_API=0x030A0000",
             f"-I{CSRC}", f"-I{os.path.join(CSRC, 'include')}", f"-I{sysconfig.get_paths()['include']}"]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    sources = sorted(glob.glob(os.path.join(CSRC, pattern))
                     for pattern in ("*.cpp", "common/*.cpp", "cpu/*.cpp", "pytorch/*.cpp"))
    sources = sorted(s for group in sources for s in group)
    cuda_include = _cuda_include()
    cuda_sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cpp")))
    assert sources and cuda_sources, f"no C++ sources under {CSRC}"

    def compile_one(args):
        source, extra = args
        result = subprocess.run([cxx, *flags, *extra, source], capture_output=True, text=True)
        return source, result.returncode, result.stderr

    jobs = [(s, []) for s in sources]
    if cuda_include is not None:
        jobs += [(s, [f"-I{cuda_include}"]) for s in cuda_sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failed = [(s, err) for s, rc, err in pool.map(compile_one, jobs) if rc != 0]
    assert not failed, "\n\n".join(f"{os.path.relpath(s, ROOT)}:\n{err[-3000:]}" for s, err in failed)
    if cuda_include is None:
        pytest.skip(f"{len(sources)} sources compiled; no cuda_runtime_api.h found for the CUDA glue "
                    f"({len(cuda_sources)} sources)")
