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
