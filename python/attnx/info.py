"""``python -m attnx.info``: what this build of attnx contains and which kernels each op has."""

import platform

import torch

import attnx
from attnx import _loader

# Dispatch keys a kernel of an attnx op can be registered for, in the order they are reported.
# CompositeExplicitAutograd: one kernel built from other ops, serving every backend those ops have.
# CompositeImplicitAutograd: the routers of linear, attention and mha, which choose a kernel op by grad mode.
DISPATCH_KEYS = (
    "CPU", "CUDA", "MPS", "CompositeExplicitAutograd", "CompositeImplicitAutograd", "Meta", "Autograd",
)


def ops() -> list[str]:
    """Every op registered under the attnx namespace, e.g. ``attnx::linear``."""
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("attnx::"))


def kernels(op: str) -> list[str]:
    """The dispatch keys that have a kernel for ``op``."""
    return [key for key in DISPATCH_KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]


def report() -> str:
    try:
        from attnx import _build_info

        backends, built_against = ", ".join(_build_info.BACKENDS), _build_info.TORCH_VERSION
        archs, floor = _build_info.CUDA_ARCH_LIST, _build_info.MIN_TORCH
    except ImportError:  # built by something other than setup.py
        backends, built_against, archs, floor = "unknown", "unknown", None, "unknown"
    lines = [
        f"attnx {attnx.__version__}",
        f"python {platform.python_version()}, torch {torch.__version__} "
        f"(attnx built against {built_against}, loads under torch >= {floor})",
        f"backends compiled: {backends}" + (f" (CUDA archs {archs})" if archs else "")
        + f"; loaded: {', '.join(_loader.loaded_backends())}",
        f"devices: cuda available={torch.cuda.is_available()}, "
        f"mps available={torch.backends.mps.is_available()}",
        "ops (dispatch keys with a kernel):",
    ]
    width = max((len(op) for op in ops()), default=0)
    lines += [f"  {op:<{width}}  {' '.join(kernels(op))}" for op in ops()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
