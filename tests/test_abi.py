"""attnx's stable-ABI libraries (``_C``, ``_C_cuda``, ``_C_nvrtc``) reach torch only through its stable C API:
no undefined symbol of torch's C++ API (``at::``, ``c10::``, ``torch::``), which changes between releases, and
no dependency on libtorch_python; ``_C`` needs no CUDA library either, so that one build loads under CPU and
CUDA builds of torch alike, and ``_C_nvrtc`` none but torch's own, so that it loads under a torch of any CUDA
major. Checked on the libraries this process loaded (an editable build, or an installed wheel)."""

import os
import shutil
import subprocess
import sys

import attnx._C
import pytest
import torch

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ELF libraries (Linux only)"),
    pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None,
                       reason="needs binutils (nm, readelf)"),
]


def _libraries():
    found = [("_C", attnx._C.__file__)]
    for name in ("_C_cuda", "_C_nvrtc"):
        found += [(name, path) for path in sorted(torch.ops.loaded_libraries)
                  if os.path.basename(path).startswith(name + ".")]
    return found


def _undefined_cxx(path):
    out = subprocess.run(["nm", "-D", "-C", "--undefined-only", path], capture_output=True, text=True,
                         check=True).stdout
    return [line.split(None, 1)[1] for line in out.splitlines()
            if any(f" {ns}::" in f" {line.split(None, 1)[1]}" for ns in ("at", "c10", "torch"))]


def _needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.parametrize("name, path", _libraries(), ids=lambda value: os.path.basename(str(value)))
def test_no_symbol_of_torchs_cxx_api(name, path):
    assert _undefined_cxx(path) == []


@pytest.mark.parametrize("name, path", _libraries(), ids=lambda value: os.path.basename(str(value)))
def test_no_dependency_on_libtorch_python(name, path):
    needed = _needed(path)
    assert not [lib for lib in needed if lib.startswith("libtorch_python")], needed


CUDA_LIBS = ("libcudart", "libcuda.", "libnvrtc", "libc10_cuda", "libtorch_cuda")


def test_the_main_library_needs_no_cuda():
    needed = _needed(attnx._C.__file__)
    cuda = [lib for lib in needed if lib.startswith(CUDA_LIBS)]
    assert cuda == [], needed


def test_the_run_time_compiler_links_nothing_of_cuda():
    # It opens NVRTC and the driver with dlopen and links no CUDA runtime, so it loads under torch's CUDA 12
    # builds as under 13's; of torch's CUDA libraries it needs libtorch_cuda (the current stream), which every
    # CUDA torch has.
    from attnx import _cuda_runtime

    path = _cuda_runtime.library()
    if path is None:
        pytest.skip("this build has no attnx._C_nvrtc (a CPU torch at build time, or not Linux)")
    if torch.version.cuda is not None:
        assert path in torch.ops.loaded_libraries  # loaded with attnx
    needed = _needed(path)
    assert [lib for lib in needed if lib.startswith(CUDA_LIBS) and lib != "libtorch_cuda.so"] == [], needed


def test_the_checks_can_fail(tmp_path):
    """The symbol check sees a C++ symbol of torch's when one is there: a library that calls c10's."""
    source = tmp_path / "uses_c10.cpp"
    source.write_text("namespace c10 { void f(); }\nvoid g() { c10::f(); }\n")
    library = tmp_path / "libuses_c10.so"
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    assert _undefined_cxx(str(library)) == ["c10::f()"]
