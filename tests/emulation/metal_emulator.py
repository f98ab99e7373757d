"""attnx's Metal kernels compiled for the CPU with clang and the metal_stdlib shim.

``build()`` compiles every ``metal/*.metal`` file as C++ (against ``tests/emulation/metal/metal_stdlib``) with
the runtime (``metal_runtime.cpp``) and its C entry points (``metal_emu.cpp``) into a shared library under
``build/emulation/``, cached by the hash of every source, header and flag: the kernels of the emulated MPS
backend (backends.py links its extension against it, and attnx's glue launches them). ``Shim`` reaches the
runtime itself through ctypes (a kernel launched by its host name, the registered names, the threadgroup
memory of the last launch), for the shim's own tests; ``check_program`` builds a C++ check program against
the library.
"""

import ctypes
import glob
import os
import shutil

from emulation import emulator as cuda_emulator
from emulation.build_cache import ROOT, cached_build

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "metal")
CSRC = os.path.join(ROOT, "csrc")
METAL = os.path.join(ROOT, "metal")

RUNTIME = [os.path.join(SHIM, "metal_runtime.cpp")]
SOURCES = [*RUNTIME, os.path.join(SHIM, "metal_emu.cpp")]  # the library, beside the .metal files
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
    files += [os.path.join(HERE, name) for name in ("barrier.h", "fibers.h", "race_check.h")]
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
    # Without clang++ there is nothing to ask (the CUDA tier's compiler is not this tier's).
    cxx = compiler()
    return cxx is not None and cuda_emulator.has_thread_sanitizer(cxx)


def build(extra_flags=(), sources=SOURCES, shared=True, metal_sources=None, link=()):
    """Compiles the emulation (a shared library, or an executable unless ``shared``), linked against the
    shared libraries ``link`` (paths: found where they lie at run time); returns its path.

    ``metal_sources``: the .metal files to compile (default: every file in metal/).
    """
    cxx = compiler()
    if cxx is None:
        raise Unavailable("no clang++ (apt-get install clang; or set ATTNX_METAL_EMU_CXX)")
    metal_sources = metal_files() if metal_sources is None else list(metal_sources)
    flags = [*FLAGS, *extra_flags, "-I" + SHIM, "-I" + CSRC, "-I" + os.path.join(CSRC, "include")]
    flags += ["-shared"] if shared else []
    libraries = [arg for lib in link for arg in (lib, "-Wl,-rpath," + os.path.dirname(lib))]
    return cached_build("metal", cxx, flags, [*metal_sources, *sources], _depends(),
                        cxx_sources=metal_sources, libraries=libraries, shared=shared, what="Metal emulation",
                        unavailable=Unavailable)


def check_program(source):
    """The C++ check program ``source`` (with a main of its own, calling the plans and the runtime), built and
    linked against the kernels' library; returns the executable's path."""
    return build(sources=[source], shared=False, metal_sources=[], link=[build()])


ERRORS = {1: "unknown kernel name", 2: "bad threadgroup size"}


class Shim:
    """The runtime's C entry points (metal_emu.cpp) in the library at ``path``."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.attnx_metal_emu_kernel_name.restype = ctypes.c_char_p
        self.lib.attnx_metal_emu_last_threadgroup_bytes.restype = ctypes.c_size_t

    def launch(self, name, grid, threads, buffers):
        """Any instantiated kernel by host name; ``buffers``: tensors in [[buffer(i)]] order."""
        ptrs = (ctypes.c_void_p * len(buffers))(*[t.data_ptr() for t in buffers])
        err = self.lib.attnx_metal_emu_launch(name.encode(), (ctypes.c_int64 * 3)(*grid), threads, ptrs)
        if err != 0:
            raise RuntimeError(f"emulated Metal launch failed: {ERRORS.get(err, err)}")

    def kernel_names(self):
        return sorted(self.lib.attnx_metal_emu_kernel_name(i).decode()
                      for i in range(self.lib.attnx_metal_emu_kernel_count()))

    def last_threadgroup_bytes(self):
        return self.lib.attnx_metal_emu_last_threadgroup_bytes()


__all__ = ["Shim", "Unavailable", "build", "check_program", "compiler", "has_thread_sanitizer", "metal_files"]
