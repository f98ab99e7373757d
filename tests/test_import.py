"""A build of attnx that cannot load under the installed torch fails to import with an ImportError that says
what it needs and how to get it, not with a missing symbol or library; a backend library that this torch
cannot take is left out with a warning."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import attnx
from attnx._loader import backend_mismatch, build_mismatch

pytestmark = pytest.mark.wheel

PACKAGE = os.path.dirname(attnx.__file__)


@pytest.mark.parametrize(
    "min_torch, running, needs",
    [
        ("2.10", "2.14.1+cu130", ""),
        ("2.10", "2.13.0+cpu", ""),
        ("2.10", "2.10.0", ""),
        ("2.10", "2.9.1+cpu", "torch >= 2.10"),
        ("2.10", "1.13.1", "torch >= 2.10"),
    ],
)
def test_build_mismatch(min_torch, running, needs):
    assert build_mismatch(min_torch, running) == needs


@pytest.mark.parametrize(
    "backend, built, built_cuda, running, running_cuda, loads",
    [
        ("CUDA", "2.14.1+cu130", "13.0", "2.14.1+cu130", "13.0", True),
        ("CUDA", "2.14.1+cu130", "13.0", "2.11.0+cu130", "13.0", True),  # stable ABI: any torch >= MIN_TORCH
        ("CUDA", "2.14.1+cu130", "13.0", "2.14.1+cu126", "12.6", False),  # another CUDA runtime
        ("CUDA", "2.14.1+cu130", "13.0", "2.13.0+cpu", None, False),
        ("MPS", "2.14.1", None, "2.14.0", None, True),  # regular ABI: the same minor release
        ("MPS", "2.14.1", None, "2.13.0", None, False),
    ],
)
def test_backend_mismatch(backend, built, built_cuda, running, running_cuda, loads):
    assert (backend_mismatch(backend, built, built_cuda, running, running_cuda) == "") == loads


def _import_copy(tmp_path, edit, code="import attnx", python_flags=()):
    """Runs ``code`` (by default ``import attnx``) in a fresh interpreter started with ``python_flags``, on a
    copy of the installed package changed by ``edit(copy_dir)``."""
    copy = tmp_path / "attnx"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    edit(copy)
    return subprocess.run([sys.executable, *python_flags, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)))


def _build_info(backends, torch_version, min_torch):
    """An ``edit`` for _import_copy: the copy's _build_info.py says it was built with ``backends`` against
    ``torch_version``, and needs torch >= ``min_torch``. Skips where this build has no _build_info.py."""
    if not os.path.exists(os.path.join(PACKAGE, "_build_info.py")):
        pytest.skip("this build of attnx has no _build_info.py (not built by setup.py)")

    def edit(copy):
        (copy / "_build_info.py").write_text(
            f"BACKENDS = {backends!r}\nTORCH_VERSION = {torch_version!r}\nMIN_TORCH = {min_torch!r}\n"
            "CUDA_VERSION = None\nCUDA_ARCH_LIST = None\n"
        )

    return edit


def test_a_torch_below_the_floor_is_a_clear_import_error(tmp_path):
    result = _import_copy(tmp_path, _build_info(("CPU",), "99.0.0", "99.0"))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: attnx needs torch >= 99.0, but torch {torch.__version__} is installed. "
                    "Upgrade torch, or use a release of attnx made for this torch."), last


def test_a_library_that_does_not_load_is_a_clear_import_error(tmp_path):
    def broken_library(copy):
        for name in os.listdir(copy):
            if name.startswith("_C") and name.endswith(".so"):
                (copy / name).write_bytes(b"not a shared library")

    result = _import_copy(tmp_path, broken_library)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: attnx's compiled library could not be loaded under torch "
                           f"{torch.__version__}"), last
    assert "pip install --force-reinstall --no-deps" in last


def test_a_backend_library_this_torch_cannot_take_is_left_out_with_a_warning(tmp_path):
    mps_for_another_torch = _build_info(("CPU", "MPS"), "1.0.0", "2.10")
    code = ("import torch, attnx; x = torch.ones(2, 3); w = torch.ones(4, 3); "
            "print(torch.ops.attnx.linear(x, w, None).sum().item(), attnx._loader.loaded_backends())")
    result = _import_copy(tmp_path, mps_for_another_torch, code, python_flags=("-W", "always"))
    assert result.returncode == 0, result.stderr
    expected = ("RuntimeWarning: attnx's MPS kernels are not loaded: they were built against torch 1.0.x "
                f"(torch's regular ABI) and torch {torch.__version__} is installed.")
    assert expected in result.stderr, result.stderr
    assert "pip install --force-reinstall --no-deps --no-build-isolation" in result.stderr, result.stderr
    assert result.stdout.split() == ["24.0", "('CPU',)"], result.stdout


@pytest.mark.skipif(
    not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), "python", "attnx")),
    reason="no python/attnx in this copy of the tree (the installed wheel's run)",
)
def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages the wheel ships: a subpackage missing there imports in a checkout and
    fails in the installed wheel."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {
        os.path.relpath(d, os.path.join(root, "python")).replace(os.sep, ".")
        for d, _, files in os.walk(os.path.join(root, "python", "attnx"))
        if "__init__.py" in files
    }
    assert found == listed


def _cuda_build(cuda_version, *, broken_runtime_library=False):
    """An ``edit`` for _import_copy: the copy says its CUDA library was built for ``cuda_version`` and that it
    has the run-time compiler (attnx._C_nvrtc), whose file is garbage where ``broken_runtime_library``."""
    if not os.path.exists(os.path.join(PACKAGE, "_build_info.py")):
        pytest.skip("this build of attnx has no _build_info.py (not built by setup.py)")
    if torch.version.cuda is None or not any(n.startswith("_C_nvrtc.") for n in os.listdir(PACKAGE)):
        pytest.skip("needs a CUDA torch and a build with attnx._C_nvrtc")

    def edit(copy):
        info = (copy / "_build_info.py").read_text().splitlines()
        kept = [line for line in info if not line.startswith(("CUDA_VERSION", "NVRTC"))]
        (copy / "_build_info.py").write_text("\n".join(
            kept + [f"CUDA_VERSION = {cuda_version!r}", "NVRTC = True"]) + "\n")
        if broken_runtime_library:
            for name in os.listdir(copy):
                if name.startswith("_C_nvrtc."):
                    (copy / name).write_bytes(b"not a shared library")

    return edit


ROUTE = ("import warnings, torch, attnx; from attnx import _loader; "
         "print(_loader.cuda_route(), _loader.loaded_backends(), "
         "sorted(p.rsplit('/', 1)[1].split('.')[0] for p in torch.ops.loaded_libraries))")


@pytest.mark.parametrize("route_env, expected", [
    (None, "run-time compiled ('CPU', 'CUDA') ['_C_nvrtc']"),
    ("1", "run-time compiled ('CPU', 'CUDA') ['_C_nvrtc']"),
    ("0", "None ('CPU',) ['_C_nvrtc']"),
])
def test_the_run_time_compiled_kernels_serve_another_cuda_major(tmp_path, monkeypatch, route_env, expected):
    # The prebuilt library, built for CUDA 99, does not load under this torch: the run-time compiled kernels
    # serve CUDA instead, silently, unless ATTNX_CUDA_RUNTIME_COMPILE=0 says not to (then a warning says why).
    monkeypatch.setenv("ATTNX_CUDA_CACHE", str(tmp_path / "cache"))
    if route_env is None:
        monkeypatch.delenv("ATTNX_CUDA_RUNTIME_COMPILE", raising=False)
    else:
        monkeypatch.setenv("ATTNX_CUDA_RUNTIME_COMPILE", route_env)
    result = _import_copy(tmp_path, _cuda_build("99.0"), ROUTE, python_flags=("-W", "always"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected, result.stdout
    if route_env == "0":
        assert ("attnx's CUDA kernels are not loaded: they were built for CUDA 99 and torch "
                f"{torch.__version__} uses CUDA {torch.version.cuda} (ATTNX_CUDA_RUNTIME_COMPILE=0)") \
            in result.stderr, result.stderr
    else:
        assert "RuntimeWarning" not in result.stderr, result.stderr


def test_the_run_time_compiled_kernels_can_be_asked_for(tmp_path, monkeypatch):
    # Where the prebuilt library loads, ATTNX_CUDA_RUNTIME_COMPILE=1 leaves it out for the run-time route.
    monkeypatch.setenv("ATTNX_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNX_CUDA_RUNTIME_COMPILE", "1")
    result = _import_copy(tmp_path, _cuda_build(torch.version.cuda), ROUTE, python_flags=("-W", "always"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "run-time compiled ('CPU', 'CUDA') ['_C_nvrtc']", result.stdout
    monkeypatch.delenv("ATTNX_CUDA_RUNTIME_COMPILE")
    result = _import_copy(tmp_path / "prebuilt", _cuda_build(torch.version.cuda), ROUTE)
    if any(n.startswith("_C_cuda.") for n in os.listdir(PACKAGE)):
        assert result.stdout.strip() == "prebuilt ('CPU', 'CUDA') ['_C_cuda', '_C_nvrtc']", result.stdout


def test_neither_cuda_library_is_a_warning_that_says_why(tmp_path):
    result = _import_copy(tmp_path, _cuda_build("99.0", broken_runtime_library=True), ROUTE,
                          python_flags=("-W", "always"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None ('CPU',) []", result.stdout
    assert ("attnx's CUDA kernels are not loaded: they were built for CUDA 99 and torch "
            f"{torch.__version__} uses CUDA {torch.version.cuda} (the run-time compiler's library does not "
            "load: ") in result.stderr, result.stderr
