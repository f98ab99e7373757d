"""A build of attnx that cannot load under the installed torch fails to import with an ImportError that says
what it was built against and how to rebuild, not with a missing symbol or library."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import attnx
from attnx._loader import build_mismatch

PACKAGE = os.path.dirname(attnx.__file__)


@pytest.mark.parametrize(
    "built, backends, running, cuda, needs",
    [
        ("2.14.1+cu130", ("CPU", "CUDA"), "2.14.1+cu130", "13.0", ""),
        ("2.14.0", ("CPU",), "2.14.1+cu130", "13.0", ""),  # a patch release keeps the C++ API
        ("2.13.0+cpu", ("CPU",), "2.14.1+cu130", "13.0", "torch 2.13.x"),
        ("2.14.1+cu130", ("CPU", "CUDA"), "2.13.0+cpu", None, "torch 2.14.x"),
        ("2.14.1+cu130", ("CPU", "CUDA"), "2.14.1+cpu", None, "a CUDA build of torch"),
        ("2.14.1+cu130", ("CPU",), "2.14.1+cpu", None, ""),
    ],
)
def test_build_mismatch(built, backends, running, cuda, needs):
    assert build_mismatch(built, backends, running, cuda) == needs


def _import_copy(tmp_path, edit):
    """Imports a copy of the installed package, changed by ``edit(copy_dir)``, in a fresh interpreter."""
    copy = tmp_path / "attnx"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    edit(copy)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-c", "import attnx"], capture_output=True, text=True, env=env)


def test_built_against_another_torch_is_a_clear_import_error(tmp_path):
    if not os.path.exists(os.path.join(PACKAGE, "_build_info.py")):
        pytest.skip("this build of attnx has no _build_info.py (not built by setup.py)")

    def other_release(copy):
        (copy / "_build_info.py").write_text(
            "BACKENDS = ('CPU',)\nTORCH_VERSION = '2.9.0'\nCUDA_ARCH_LIST = None\n"
        )

    result = _import_copy(tmp_path, other_release)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: attnx was built against torch 2.9.0 (backends CPU), but torch "
                           f"{torch.__version__} is installed; its compiled library needs torch 2.9.x."), last
    assert "pip install --no-build-isolation" in last


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
    assert "pip install --no-build-isolation" in last
