"""Shared test set-up: devices as parameters (absent backends show as skipped, with the reason), dtypes,
seeding."""

import pytest
import torch

import attnx  # noqa: F401  (registers torch.ops.attnx)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
    pytest.param(
        "mps",
        id="mps",
        marks=[
            pytest.mark.mps,
            pytest.mark.skipif(not torch.backends.mps.is_available(), reason="no MPS device"),
        ],
    ),
]

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def require_kernel(op: str, device: str) -> None:
    """Skip (visibly) when ``op`` has no kernel for ``device``'s dispatch key in this build. The kernels of
    the routed ops (``attnx::linear``, ``attention``, ``mha``) are those of ``_linear``, ``_attention``,
    ``_mha``."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}[device]
    namespace, name = op.split("::")
    if name in ("linear", "attention", "mha"):
        op = f"{namespace}::_{name}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, key):
        pytest.skip(f"{op} has no {key} kernel in this build")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def intra_op_threads():
    """Sets torch's intra-op thread count for one test (call it with the count) and restores it afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gpu_check():
    """tools/gpu_check.py, loaded from its path (a script, not a package module; see gpu_check_helpers)."""
    import importlib.util
    import sys

    from gpu_check_helpers import TOOL

    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def float64_softmax(monkeypatch):
    """torch.nn.functional.softmax keeping float64 inputs in float64: several eager attention implementations
    (transformers') take the softmax in float32 (``softmax(..., dtype=torch.float32)``), which would cap
    float64 comparisons at float32's precision."""
    softmax = torch.nn.functional.softmax

    def exact(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = None
        return softmax(input, dim=dim, dtype=dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", exact)
