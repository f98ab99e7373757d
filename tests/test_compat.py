"""The torch compatibility code has an exit condition: once setup.py's MIN_TORCH reaches the torch release
that makes a piece of it unnecessary, this test fails until that piece is removed.

Each entry of COMPAT names a file (relative to the repository root) that exists only for torch releases
below ``until``; add one per compat file, in any language.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# `make test-wheel` runs the suite in a copy of the tree without setup.py and python/ (the installed wheel
# is under test there): MIN_TORCH and the compat files are the checkout's facts, checked by `make test`.
pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, "setup.py")),
    reason="no setup.py in this copy of the tree (the installed wheel's run): checked from the checkout",
)

# path -> the MIN_TORCH from which it must be gone
COMPAT = {
    # torch 2.10-2.12: a fake kernel's error message handed to the C++ library (torch's C API drops it)
    "python/attnx/_compat.py": (2, 13),
    # ... and its C++ halves: the message kept where attnx raised it, the fakes' entry point
    "csrc/common/compat.h": (2, 13),
    "csrc/common/compat.cpp": (2, 13),
}


def min_torch() -> tuple[int, ...]:
    """setup.py's ``MIN_TORCH``, read from its text (setup.py is not imported: importing it runs the build
    configuration)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read(), "setup.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MIN_TORCH" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py assigns no MIN_TORCH")


def test_min_torch_is_read():
    version = min_torch()
    assert len(version) == 2 and all(isinstance(n, int) for n in version) and version >= (2, 10)


@pytest.mark.parametrize("path", sorted(COMPAT))
def test_compat_code_is_removed_once_unneeded(path):
    until = COMPAT[path]
    if min_torch() >= until:
        assert not os.path.exists(os.path.join(ROOT, path)), (
            f"setup.py's MIN_TORCH is {min_torch()}, so {path} (for torch < {until[0]}.{until[1]}) is dead "
            "code: remove it, and its other halves (see its banner)"
        )
