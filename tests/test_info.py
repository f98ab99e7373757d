"""`python -m attnx.info` reports the build and every op's kernels."""

import subprocess
import sys

import torch

from attnx import info


def test_info_lists_linear_kernels():
    out = subprocess.run(
        [sys.executable, "-m", "attnx.info"], capture_output=True, text=True, check=True
    ).stdout
    assert f"torch {torch.__version__}" in out
    assert "backends compiled: CPU" in out
    line = next(line for line in out.splitlines() if line.strip().startswith("attnx::linear"))
    assert line.split()[1:] == info.kernels("attnx::linear")
    assert info.kernels("attnx::linear") == ["CompositeImplicitAutograd"]  # the router
    assert {"CPU", "Meta"} <= set(info.kernels("attnx::_linear"))
    assert "Autograd" not in info.kernels("attnx::_linear")
    assert {"CPU", "Meta", "Autograd"} <= set(info.kernels("attnx::_linear_autograd"))
