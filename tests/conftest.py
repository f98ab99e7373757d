"""Shared test set-up: the devices a test runs on (absent ones show as skipped, with the reason), seeding, and
the markers that choose what runs where (pyproject.toml lists them; the Makefile's tiers select by them).

A test that takes the ``device`` fixture runs once per device of DEVICES: the CPU, a CUDA GPU and an MPS
device where this machine has them, and the emulated backends everywhere (tests/emulation/backends.py: attnx's
CUDA and MPS backends run on the CPU, behind attnx's own ops). ``device`` is the torch device string its
tensors are made on ("cpu" for the emulated ones), with the backend whose kernels run there as
``device.backend``; ``attention_helpers.kernel_or_skip`` asks that backend which kernel a call takes (or
skips, saying why it takes none).
"""

import os

import pytest
import torch

import attnx  # noqa: F401  (registers torch.ops.attnx)

EMULATED = ("cuda-emu", "cuda-emu-sm75", "metal-emu")


class Device(str):
    """A torch device string (``"cpu"``, ``"cuda"``, ``"mps"``) that knows which attnx backend its kernels
    are: ``backend`` is the device itself, or an emulated backend (EMULATED) on ``"cpu"``."""

    def __new__(cls, backend: str):
        device = super().__new__(cls, "cpu" if backend in EMULATED else backend)
        device.backend = backend
        return device

    @property
    def emulated(self) -> bool:
        return self.backend in EMULATED

    @property
    def cuda_like(self) -> bool:
        """Runs attnx's CUDA backend (a GPU's, or its emulation)."""
        return self.backend == "cuda" or self.backend.startswith("cuda-emu")


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="no CUDA device")]),
    pytest.param("mps", id="mps", marks=[pytest.mark.mps, pytest.mark.skipif(
        not torch.backends.mps.is_available(), reason="no MPS device")]),
    *(pytest.param(name, id=name, marks=pytest.mark.emulated) for name in EMULATED),
]


def _require_backend_library(backend: str) -> None:
    """Skips (visibly) where attnx's library for ``backend`` is not loaded in this build."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}[backend]
    if not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::_attention", key):
        pytest.skip(f"this build of attnx has no {key} kernels")


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device of DEVICES in turn; an emulated backend is enabled for the test's duration."""
    backend = request.param
    if backend not in EMULATED:
        _require_backend_library(backend)
        yield Device(backend)
        return
    from emulation import backends

    try:
        backends.load(backend)
    except backends.Unavailable as e:
        # CI installs clang: there the Metal emulation must run, not skip.
        if backend == "metal-emu" and os.environ.get("ATTNX_REQUIRE_METAL_EMULATION") == "1":
            pytest.fail(f"the Metal emulation must run here (ATTNX_REQUIRE_METAL_EMULATION=1): {e}")
        pytest.skip(f"{backend} cannot be built here: {e}")
    with backends.enabled(backend):
        yield Device(backend)


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
    """tools/gpu_check.py, loaded from its path (a script, not a package module)."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
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
