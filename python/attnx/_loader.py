"""Loads attnx._C, the compiled library (importing it registers torch.ops.attnx.*), or raises an ImportError
that says what attnx was built against and how to rebuild it, instead of a missing symbol or library, or a
crash."""

import torch

REBUILD = (
    "Rebuild attnx against the installed torch: `pip install --no-build-isolation --no-deps "
    "--force-reinstall <attnx source>` (or `make build` in a checkout)."
)


def build_mismatch(built_against: str, built_backends: tuple, running: str, running_cuda: str | None) -> str:
    """What a build of attnx made against torch ``built_against`` with ``built_backends`` needs that torch
    ``running`` (``running_cuda``: its ``torch.version.cuda``) lacks, or ``""`` when it can load there: the
    library links against libtorch's C++ API, which changes between minor releases, and its CUDA kernels
    against torch's CUDA libraries."""

    def minor(version: str) -> tuple:
        return tuple(version.split("+")[0].split(".")[:2])

    if minor(built_against) != minor(running):
        return f"torch {'.'.join(minor(built_against))}.x"
    if "CUDA" in built_backends and running_cuda is None:
        return "a CUDA build of torch"
    return ""


def _load() -> None:
    try:
        from attnx import _build_info
    except ImportError:  # built by something other than setup.py: nothing to compare with
        built = "an unknown torch"
    else:
        built = f"torch {_build_info.TORCH_VERSION} (backends {', '.join(_build_info.BACKENDS)})"
        needs = build_mismatch(_build_info.TORCH_VERSION, _build_info.BACKENDS, torch.__version__,
                               torch.version.cuda)
        if needs:
            raise ImportError(
                f"attnx was built against {built}, but torch {torch.__version__} is installed; its compiled "
                f"library needs {needs}. {REBUILD}"
            )
    try:
        from attnx import _C  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(
            f"attnx's compiled library could not be loaded under torch {torch.__version__} (attnx was built "
            f"against {built}): {error}. {REBUILD}"
        ) from error


_load()
