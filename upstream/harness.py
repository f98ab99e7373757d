"""Apply an upstream patch to a copy of the installed torch's files and load the patched modules.

The patches are unified diffs against torch's source tree (``a/torch/nn/modules/activation.py``), pinned to
:data:`PINNED_TORCH`. Nothing here touches the installed torch: :func:`apply` copies the files a patch names
into a scratch directory and runs ``git apply`` there; :func:`load` imports a patched file as a new module
whose relative imports resolve inside the installed ``torch`` package, so the patched code runs against the
real torch around it; :func:`swapped_in` puts patched modules where torch looks them up, for the code that
imports them by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import re
import subprocess
import sys
import types

import torch

PINNED_TORCH = "2.14.1"
TORCH_ROOT = pathlib.Path(torch.__file__).resolve().parent.parent  # the directory holding torch/
UPSTREAM = pathlib.Path(__file__).resolve().parent


def installed_version() -> str:
    return torch.__version__.split("+")[0]


def is_pinned() -> bool:
    return installed_version() == PINNED_TORCH


def skip_reason() -> str:
    return (f"the upstream patches are against torch {PINNED_TORCH}; this is torch {installed_version()} "
            f"(pip install torch=={PINNED_TORCH} to run them)")


def files_of(patch: pathlib.Path) -> list[str]:
    """The files a patch changes, relative to torch's source root (``torch/nn/modules/activation.py``)."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def apply(patch: pathlib.Path, dest: pathlib.Path) -> dict[str, pathlib.Path]:
    """Copy the installed versions of the files ``patch`` changes into ``dest`` and apply it there; returns
    ``{relative path: patched file}``. Raises ``RuntimeError`` with git's message when it does not apply."""
    paths = files_of(patch)
    for rel in paths:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((TORCH_ROOT / rel).read_bytes())
    result = subprocess.run(["git", "apply", "--verbose", str(patch.resolve())], cwd=dest,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{patch.name} does not apply to torch {installed_version()}:\n{result.stderr}")
    return {rel: dest / rel for rel in paths}


def load(path: pathlib.Path, module_name: str) -> types.ModuleType:
    """Import the patched file ``path`` as a fresh module standing for ``module_name`` (the dotted name of
    the torch module it patches). Not registered in ``sys.modules``: the installed torch is unchanged."""
    package = module_name.rpartition(".")[0]
    spec = importlib.util.spec_from_file_location(f"{module_name}__patched", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def swapped_in(**modules: types.ModuleType):
    """Within the block, ``sys.modules[name]`` and the parent package's attribute are the given patched
    modules (keyword names use ``__`` for dots: ``torch__nn__modules__activation=mod``)."""
    saved = []
    try:
        for key, module in modules.items():
            name = key.replace("__", ".")
            parent, _, child = name.rpartition(".")
            before = getattr(sys.modules[parent], child, None)
            saved.append((name, sys.modules.get(name), parent, child, before))
            sys.modules[name] = module
            setattr(sys.modules[parent], child, module)
        yield
    finally:
        for name, module, parent, child, attribute in reversed(saved):
            sys.modules[name] = module
            setattr(sys.modules[parent], child, attribute)
