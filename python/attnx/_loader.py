"""Loads attnx's compiled libraries (loading them registers torch.ops.attnx.*), or raises an ImportError that
says what attnx needs and how to get it, instead of a missing symbol or library, or a crash.

``_C`` (the schemas, the CPU kernels, the composites) and ``_C_cuda`` (the CUDA kernels) are on the LibTorch
stable ABI: built once, they load under every torch from ``MIN_TORCH`` on, CPU or CUDA build. ``_C_cuda``
is loaded only under a CUDA build of torch whose CUDA major version is the one it was compiled with (it links
that CUDA runtime, which torch brings). ``_C_mps`` is on torch's regular ABI (see setup.py) and loads only
under the torch minor release it was built against. ``_C_nvrtc`` (the run-time CUDA compiler) links nothing of
CUDA and loads under every CUDA build of torch. A backend library that this torch cannot take is left out
with a warning that says why: attnx then runs on the other backends.
"""

import glob
import os
import warnings

import torch

REINSTALL = (
    "Reinstall attnx for the installed torch: `pip install --force-reinstall --no-deps <attnx wheel or "
    "source>` (or `make build` in a checkout)."
)
# A backend library is built for the torch of the build environment; pip's isolated build fetches the newest
# torch, so a build for the installed one (another CUDA major, another minor on macOS) must see it.
REBUILD = (
    "To have them, build attnx against the installed torch: `pip install --force-reinstall --no-deps "
    "--no-build-isolation <attnx source>` (or `make build` in a checkout)."
)

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _release(version: str) -> tuple:
    """(major, minor) of a torch or CUDA version string such as ``2.14.1+cu130`` or ``13.0``."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def build_mismatch(min_torch: str, running: str) -> str:
    """What attnx's stable-ABI library, built for torch ``min_torch`` and later, needs that torch ``running``
    lacks, or ``""`` when it loads there."""
    return f"torch >= {min_torch}" if _release(running) < _release(min_torch) else ""


def backend_mismatch(backend: str, built_against: str, built_cuda: str | None, running: str,
                     running_cuda: str | None) -> str:
    """Why the library of ``backend`` (CUDA or MPS), built against torch ``built_against`` (``built_cuda``:
    its CUDA version), cannot load under torch ``running`` (``running_cuda``), or ``""`` when it can."""
    if backend == "CUDA":
        if running_cuda is None:
            return f"torch {running} is a CPU build"
        if built_cuda is not None and _release(built_cuda)[0] != _release(running_cuda)[0]:
            return (f"they were built for CUDA {_release(built_cuda)[0]} and torch {running} uses CUDA "
                    f"{running_cuda}")
        return ""
    if _release(built_against) != _release(running):
        return (f"they were built against torch {'.'.join(map(str, _release(built_against)))}.x (torch's "
                f"regular ABI) and torch {running} is installed")
    return ""


def _library(name: str) -> str | None:
    """The path of the package's compiled library ``name`` (``_C_cuda``: ``_C_cuda.abi3.so`` and the like)."""
    found = sorted(glob.glob(os.path.join(_PACKAGE, name + ".*so"))) + sorted(
        glob.glob(os.path.join(_PACKAGE, name + ".*pyd"))
    )
    return found[0] if found else None


def _load() -> None:
    try:
        from attnx import _build_info
    except ImportError:  # built by something other than setup.py: nothing to compare with
        built, info = "an unknown torch", None
    else:
        info = _build_info
        built = f"torch {info.TORCH_VERSION} (backends {', '.join(info.BACKENDS)})"
        needs = build_mismatch(info.MIN_TORCH, torch.__version__)
        if needs:
            raise ImportError(
                f"attnx needs {needs}, but torch {torch.__version__} is installed. Upgrade torch, or use a "
                f"release of attnx made for this torch."
            )
    try:
        from attnx import _C  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(
            f"attnx's compiled library could not be loaded under torch {torch.__version__} (attnx was built "
            f"against {built}): {error}. {REINSTALL}"
        ) from error
    if info is None:
        return
    route = os.environ.get("ATTNX_CUDA_RUNTIME_COMPILE", "").strip()
    cuda_missing = None  # why the prebuilt CUDA library is not loaded
    for backend, name in (("CUDA", "_C_cuda"), ("MPS", "_C_mps")):
        if backend not in info.BACKENDS:
            continue
        why = backend_mismatch(backend, info.TORCH_VERSION, getattr(info, "CUDA_VERSION", None),
                               torch.__version__, torch.version.cuda)
        path = _library(name)
        if why == "" and path is None:
            why = f"its library ({name}) is missing from {_PACKAGE}"
        if backend == "CUDA" and route == "1" and not why:
            why = "ATTNX_CUDA_RUNTIME_COMPILE=1 asks for the kernels compiled at run time"
        if why:
            if backend == "CUDA":
                cuda_missing = why  # the run-time compiled kernels may serve instead (below)
            else:
                warnings.warn(f"attnx's {backend} kernels are not loaded: {why}. attnx runs on the other "
                              f"backends. {REBUILD}", RuntimeWarning, stacklevel=3)
            continue
        try:
            torch.ops.load_library(path)
        except (ImportError, OSError) as error:
            raise ImportError(
                f"attnx's {backend} library could not be loaded under torch {torch.__version__} (attnx was "
                f"built against {built}): {error}. {REINSTALL}"
            ) from error
    if torch.version.cuda is None:
        return  # a CPU torch has no CUDA to run: nothing to say
    # The run-time compiled CUDA kernels (attnx._C_nvrtc, python/attnx/_cuda_runtime.py): loading the library
    # opens nothing of CUDA, so it loads under every CUDA torch; its kernels serve CUDA where the prebuilt
    # library does not (another CUDA major) or ATTNX_CUDA_RUNTIME_COMPILE=1 asks, unless it is 0.
    path = _library("_C_nvrtc") if getattr(info, "NVRTC", False) else None
    no_runtime = "this build has no run-time compiler"
    if path is not None:
        try:
            torch.ops.load_library(path)
        except (ImportError, OSError) as error:
            path = None
            no_runtime = f"the run-time compiler's library does not load: {error}"
            if cuda_missing is None:
                warnings.warn(f"attnx's {no_runtime}", RuntimeWarning, stacklevel=3)
    if cuda_missing is None:
        return
    if path is None or route == "0":
        no_runtime = "ATTNX_CUDA_RUNTIME_COMPILE=0" if route == "0" else no_runtime
        warnings.warn(f"attnx's CUDA kernels are not loaded: {cuda_missing} ({no_runtime}). attnx runs on "
                      f"the other backends. {REBUILD}", RuntimeWarning, stacklevel=3)
        return
    from attnx import _cuda_runtime

    try:
        _cuda_runtime.enable()
    except (RuntimeError, ValueError) as error:  # ValueError: a malformed ATTNX_CUDA_CACHE_MAX_BYTES
        warnings.warn(f"attnx's CUDA kernels are not loaded: {cuda_missing}, and the run-time compiled ones "
                      f"cannot serve: {error}. attnx runs on the other backends.", RuntimeWarning,
                      stacklevel=3)


def _loaded(lib: str) -> bool:
    return any(os.path.basename(path).startswith(lib + ".") for path in torch.ops.loaded_libraries)


def cuda_route() -> str | None:
    """What serves attnx's CUDA kernels in this process: "prebuilt" (attnx._C_cuda), "run-time compiled"
    (attnx._C_nvrtc's, python/attnx/_cuda_runtime.py) or None."""
    if _loaded("_C_cuda"):
        return "prebuilt"
    from attnx import _cuda_runtime

    return "run-time compiled" if _cuda_runtime.enabled() else None


def loaded_backends() -> tuple:
    """The backends whose kernels are loaded in this process."""
    return tuple(name for name, lib in (("CPU", "_C"), ("CUDA", "_C_cuda"), ("MPS", "_C_mps"))
                 if lib == "_C" or _loaded(lib) or (name == "CUDA" and cuda_route() is not None))


_load()
