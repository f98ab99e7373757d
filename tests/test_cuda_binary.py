"""The built CUDA library's kernels, read with cuobjdump (no GPU needed): no kernel spills registers to local
memory, on any arch the library is built for.

The check is tools/gpu_check.py's `binary` step (its cuobjdump parsers and `spill_verdict`) run on
attnx/_C_cuda*.so for every arch in it, not only the visible GPU's. A spill is a kernel whose resource usage
has a LOCAL size or whose SASS has LDL/STL instructions; ptxas's register choice differs by arch (see
csrc/cuda/README.md), so every arch of the wheel is checked. It skips, saying why, when there is no CUDA
library (a CPU torch, or no nvcc at build time), no cuobjdump, or no tools/ (the installed-wheel run).
"""

import glob
import importlib.util
import os

import pytest

from gpu_check_helpers import requires_tool

pytestmark = requires_tool

# The instantiations each arch must hold (attention_kernel.cu's launch_simt, attention_kernel_mma.cu's
# launch_mma, attention_backward_kernel.cu's launch_backward, attention_backward_kernel_mma.cu's
# launch_passes): a renamed or missing kernel must fail here, not
# pass as "no kernel spills".
SIMT = {("simt", dtype, bucket) for dtype in ("fp32", "fp64", "fp16", "bf16")
        for bucket in (32, 64, 128, 256)}
MMA = {("mma", dtype, bucket) for dtype in ("fp16", "bf16", "fp32") for bucket in (32, 64, 128)}
BACKWARD = {(kind, dtype, bucket) for kind in ("backward_keys", "backward_queries")
            for dtype in ("fp32", "fp64", "fp16", "bf16") for bucket in (32, 64, 128, 256)}
# float32's (3xTF32) up to bucket 64 (kMmaBackwardMaxHeadDimTf32)
BACKWARD_MMA = {(kind, dtype, bucket) for kind in ("backward_mma_keys", "backward_mma_queries")
                for dtype in ("fp16", "bf16", "fp32") for bucket in (32, 64, 128)
                if dtype != "fp32" or bucket <= 64}


def _cuda_library():
    """The attnx package's _C_cuda library and whether the build says it has one (without importing torch)."""
    spec = importlib.util.find_spec("attnx")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("attnx is not importable")
    package = list(spec.submodule_search_locations)[0]
    libs = sorted(glob.glob(os.path.join(package, "_C_cuda*.so")))
    backends = ()
    info = os.path.join(package, "_build_info.py")
    if os.path.exists(info):
        scope = {}
        with open(info) as f:
            exec(f.read(), scope)
        backends = scope.get("BACKENDS", ())
    return libs, "CUDA" in backends, package


@pytest.fixture(scope="module")
def kernels(gpu_check):
    libs, built_with_cuda, package = _cuda_library()
    if not libs:
        assert not built_with_cuda, f"the build says it has CUDA kernels but {package} has no _C_cuda*.so"
        pytest.skip(f"no CUDA library in {package} (a CPU torch, or no nvcc at build time)")
    cuobjdump = gpu_check.find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit, or triton's copy beside torch)")
    rows, _ = gpu_check.binary_report(libs[0], cuobjdump, None, timeout=300)
    return rows


def test_every_arch_has_every_kernel(kernels):
    archs = sorted({r["arch"] for r in kernels})
    assert archs, "cuobjdump found no attnx attention kernel in the library"
    for arch in archs:
        found = {(r["kernel"], r["dtype"], r["head_dim"]) for r in kernels if r["arch"] == arch}
        expected = SIMT | MMA | BACKWARD | BACKWARD_MMA
        assert found == expected, (arch, sorted(found ^ expected))


def test_no_kernel_spills(kernels):
    # Every kernel, on the default path or not (gpu-check's verdict on a GPU fails only the default path's).
    spills = [f"{r['arch']} {r['kernel']} {r['dtype']} D<={r['head_dim']}: {r['ldl_stl']} LDL/STL, "
              f"local {r['local']} B, {r['registers']} registers" for r in kernels if r["spills"]]
    assert not spills, "\n".join(spills)
