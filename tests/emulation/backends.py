"""The emulated backends: attnx's CUDA and MPS backends run on the CPU, behind attnx's own ops.

Each is a torch extension built here (``torch.utils.cpp_extension.load``, cached under ``build/emulation/``)
from the backend's real glue (csrc/cuda/attention.cpp and attention_backward.cpp; csrc/mps/glue.h) and
common/attention.cpp's ``prepare_attention``, linked against the backend's kernels compiled for the CPU
(``emulator.build``: csrc/cuda/*.cu with cuda_shim.h; ``metal_emulator.build``: metal/*.metal with the
metal_stdlib shim). While one is enabled (``enabled("cuda-emu")``), its run functions are attnx's CPU kernels
of the ops it has: ``attnx.attention(q, k, v)`` on CPU tensors takes the emulated CUDA kernel the CUDA plan
chooses, ``torch.ops.attnx._attention_kernel`` names it, and mha, the module, autograd and torch.compile reach
it as they reach a GPU's.

Backends (``BACKENDS``): ``cuda-emu`` (an sm_90 device: tensor cores where they cover the call, the fused
backward), ``cuda-emu-sm75`` (a Turing device: the SIMT kernel for every call) and ``metal-emu``; and,
outside the matrix, ``cuda-emu-flash`` (sm_90 with the calls torch's flash kernel computes as attnx does
routed to it).
"""

import contextlib
import os
import warnings

import torch

from emulation import emulator, metal_emulator
from emulation.build_cache import BUILD_DIR, ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")

# (extension, the csrc glue it compiles, the enable op's arguments) per backend name.
_CUDA_GLUE = ["common/attention.cpp", "common/attention_math.cpp", "cuda/attention.cpp",
              "cuda/attention_backward.cpp"]
_METAL_GLUE = ["common/attention.cpp", "common/attention_math.cpp", "common/linear.cpp"]
BACKENDS = {
    "cuda-emu": ("cuda", {"capability": 90, "mma": True, "fused_backward": True}),
    "cuda-emu-sm75": ("cuda", {"capability": 75, "mma": True, "fused_backward": True}),
    # sm_90 with torch's flash kernel on: its stand-in runs the calls it takes (tests/test_cuda_emulation.py)
    "cuda-emu-flash": ("cuda", {"capability": 90, "mma": True, "fused_backward": True, "torch_flash": True}),
    "metal-emu": ("metal", {}),
}

Unavailable = (emulator.Unavailable, metal_emulator.Unavailable)
_loaded = {}


def _sanitize_flags():
    # `make sanitize`: the process has the ASan runtime preloaded; the extensions are instrumented like _C.
    if os.environ.get("ATTNX_SANITIZE") == "1":
        return ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    return []


def _target_version():
    """attnx's stable-ABI floor (setup.py's MIN_TORCH) as TORCH_TARGET_VERSION: the extensions are built as
    attnx's own libraries are, so that they load under every torch attnx does."""
    from attnx import _build_info

    major, minor = (int(x) for x in _build_info.MIN_TORCH.split("."))
    return f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"


def _unit(build_dir, source):
    """A translation unit in ``build_dir`` that includes csrc's ``source``: cpp_extension names each object
    file after its source's base name, and common/attention.cpp and cuda/attention.cpp share one."""
    path = os.path.join(build_dir, source.replace("/", "_"))
    text = f'#include "{os.path.join(CSRC, source)}"\n'
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return path


def _load(kind):
    """Builds (if needed) and loads one backend's extension; returns its ops namespace."""
    if kind in _loaded:
        return _loaded[kind]
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise emulator.Unavailable("cannot build a torch extension here: no ninja (pip install ninja)")
    sanitize = _sanitize_flags()
    if kind == "cuda":
        kernels = emulator.build(sources=emulator.KERNELS_AND_SHIM)
        include = [emulator.toolkit_include()]
        glue, backend = _CUDA_GLUE, os.path.join(HERE, "cuda_backend.cpp")
        defines = ["-DATTNX_CUDA_EMULATION", *emulator.TORCH_NVCC_DEFINES]
    else:
        kernels = metal_emulator.build()
        include = [metal_emulator.SHIM]
        glue, backend = _METAL_GLUE, os.path.join(metal_emulator.SHIM, "metal_backend.cpp")
        defines = []
    name = f"attnx_emu_{kind}" + ("_sanitize" if sanitize else "")
    build_dir = os.path.join(BUILD_DIR, name)
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(
        name, [backend, *(_unit(build_dir, f) for f in glue)],
        extra_include_paths=[CSRC, os.path.join(CSRC, "include"), HERE, *include],
        # -fvisibility=hidden: this library's copy of the glue never interposes _C's, nor _C's it.
        extra_cflags=["-O1", "-std=c++20", "-fvisibility=hidden", _target_version(), *defines, *sanitize],
        # -Bsymbolic in the kernels' library binds the CUDA runtime calls to the shim's own definitions.
        extra_ldflags=[kernels, f"-Wl,-rpath,{os.path.dirname(kernels)}", *sanitize],
        build_directory=build_dir, is_python_module=False)
    _loaded[kind] = getattr(torch.ops, f"attnx_emu_{kind}")
    return _loaded[kind]


def load(backend):
    """The ops namespace of ``backend`` (a key of BACKENDS), built and loaded; raises Unavailable where it
    cannot be built here."""
    return _load(BACKENDS[backend][0])


@contextlib.contextmanager
def enabled(backend, **device):
    """Within the block, attnx's CPU kernels of the ops ``backend`` has are its kernels; ``device`` overrides
    its enable op's arguments (``capability=80``: an sm_80 device)."""
    ops = load(backend)
    kwargs = {**BACKENDS[backend][1], **device}
    with warnings.catch_warnings():  # PyTorch warns once per process that a kernel is being overridden
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        ops.enable(True, **kwargs)
    try:
        yield
    finally:
        ops.enable(False, **kwargs)
