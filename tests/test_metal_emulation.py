"""What only the Metal emulation can check: the launch plans against the kernels they launch, the source the
MPS build embeds, the shim's own rules, and data races under ThreadSanitizer.

Every .metal file is compiled as C++ against tests/emulation/metal/metal_stdlib (threadgroup memory poisoned
per threadgroup, threadgroup_barrier as a barrier of the group's threads, simd collectives that check every
lane arrives at the same call site, 8x8 simdgroup matrices; the threads are fibers here, std::threads in the
ThreadSanitizer build). The kernels' values, on every feature, are checked through attnx's own ops on the
``metal-emu`` device of the test matrix (tests/emulation/backends.py: the MPS glue, csrc/mps/glue.h, launching
the emulated kernels); here, C++ programs check the plans of csrc/mps/metal_plan.h against the library
(tests/emulation/metal/plan_check.cpp), and the shim is driven directly. It cannot check that Apple's compiler
accepts the files, nor speed: tests/test_mps.py and the matrix's ``mps`` device do that on a Mac.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from attention_helpers import make_qkv
from emulation import backends, metal_emulator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metal"))
import embed  # noqa: E402  (metal/embed.py, the build step that embeds the sources)

pytestmark = pytest.mark.kernel

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# CI sets this: there, a missing clang++ or libtsan is a failure, not a skip.
REQUIRED = os.environ.get("ATTNX_REQUIRE_METAL_EMULATION") == "1"


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"{reason} (ATTNX_REQUIRE_METAL_EMULATION=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def library():
    """The emulation's library (every kernel, the runtime), built if needed."""
    try:
        return metal_emulator.build()
    except metal_emulator.Unavailable as e:
        _unavailable(f"Metal emulation unavailable: {e}")


@pytest.fixture(scope="module")
def plan_check(library):
    """tests/emulation/metal/plan_check.cpp, built against the library: runs one of its checks."""
    exe = metal_emulator.check_program(os.path.join(metal_emulator.SHIM, "plan_check.cpp"))

    def run(check):
        result = subprocess.run([exe, check], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
        return result.stdout

    return run


@pytest.fixture
def metal_emu(library):
    """The emulated MPS backend enabled: attnx's CPU kernels are the Metal glue's, on the emulated kernels."""
    try:
        backends.load("metal-emu")
    except backends.Unavailable as e:
        _unavailable(f"metal-emu cannot be built here: {e}")
    with backends.enabled("metal-emu"):
        yield


# ------------------------------------------------------------------------------------------------------------
# The launch plans and the library: what the glue asks for exists, and is what the kernels declare.


def test_plans_name_instantiated_kernels(plan_check, library, metal_emu):
    # Every planned name is instantiated and every instantiation planned for some call (plan_check.cpp); and
    # the kernel attnx::_attention_kernel names for a call, asked of the glue, is one the library has.
    plan_check("names")
    names = set(metal_emulator.Shim(library).kernel_names())
    for dtype in DTYPES:
        for d in (8, 64, 100, 256):
            for L in (1, 40):
                kernel = torch.ops.attnx._attention_kernel(*make_qkv(1, 1, L, 3, d, d, dtype=dtype))
                match = re.fullmatch(r"metal (\w+) (\w+) bucket (\d+)", kernel)
                assert match, kernel
                kind, dtype_name, bucket = match.groups()
                assert dtype_name == str(dtype).removeprefix("torch.")
                assert f"attention_{kind}_d{bucket}_{dtype_name}" in names, kernel


def test_plan_grids_and_limits(plan_check, metal_emu):
    # B * H on grid.y past 65535, the GEMM and GEMV grids, no kernel above head dim 256 (plan_check.cpp); the
    # glue refuses such a call with a clear error before any launch.
    plan_check("grids")
    for D, Dv in [(264, 8), (8, 300)]:
        with pytest.raises(RuntimeError, match="up to 256"):
            torch.ops.attnx._attention_kernel(*make_qkv(1, 1, 3, 5, D, Dv))


def test_threadgroup_memory_is_what_the_plan_says(plan_check):
    # Both attention kernels at small and large buckets, and the GEMM, as launched.
    plan_check("threadgroup_memory")


def test_embedded_source_is_self_contained():
    # What the MPS build embeds: every .metal file and the project headers they include, each header once,
    # no quoted #include left for Apple's compiler to resolve; and it compiles as one file under the shim.
    source = embed.metal_source()
    assert not re.search(r'^\s*#\s*include\s+"', source, re.MULTILINE)
    for name in ("params.h", "softmax.h", "metal_config.h", "key_range.h", "common.h", "attention.metal",
                 "linear.metal"):
        assert len(re.findall(rf"^// ---- .*\b{re.escape(name)}$", source, re.MULTILINE)) == 1, name
    header = embed.header(source)
    assert header.count('R"attnx_metal(') == 1 and header.rstrip().endswith("}  // namespace attnx::mps")
    cxx = metal_emulator.compiler()
    if cxx is None:
        _unavailable("no clang++")
    result = subprocess.run(
        [cxx, *metal_emulator.FLAGS, "-fsyntax-only", "-I" + metal_emulator.SHIM, "-x", "c++", "-"],
        input=source, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]


# ------------------------------------------------------------------------------------------------------------
# The shim itself: each rule it enforces, broken on purpose (tests/emulation/metal/shim_check.metal).

SHIM_CHECK = """
import sys, torch
from emulation import metal_emulator
shim = metal_emulator.Shim(metal_emulator.build(metal_sources=[sys.argv[1]]))
out = torch.zeros(128)
shim.launch(sys.argv[2], (1, 1, 1), 128, [out])
print(out.tolist())
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernel, message", [
    # Whichever thread checks first names its own site and the other's: both sites appear, in either order.
    ("divergent_simd_sum", r"(?s)(shim_check.metal:\d+.*<the end of the kernel>|<the end of the kernel>.*"
                           r"shim_check.metal:\d+).*reached by every lane of the simdgroup"),
    ("divergent_barrier", r"(?s)threadgroup_barrier at .*(shim_check.metal:\d+.*<the end of the kernel>|"
                          r"<the end of the kernel>.*shim_check.metal:\d+).*every thread of the threadgroup"),
    ("too_much_threadgroup_memory", r"threadgroup memory: 36000 bytes declared, more than the 32768"),
], ids=lambda x: x if x.isidentifier() else "")
def test_shim_reports(library, kernel, message):
    source = os.path.join(metal_emulator.SHIM, "shim_check.metal")
    result = subprocess.run([sys.executable, "-c", SHIM_CHECK, source, kernel], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
    assert result.returncode != 0 and re.search(message, result.stderr), result.stderr[-3000:]


@pytest.mark.slow
def test_shim_poisons_threadgroup_memory(library):
    # Thread 0 runs ahead of thread 1 up to its first barrier: without one, it reads thread 1's element before
    # thread 1 has written it, and threadgroup memory starts as NaN, not as a lucky value.
    source = os.path.join(metal_emulator.SHIM, "shim_check.metal")
    results = {}
    for kernel in ("missing_barrier", "with_barrier"):
        result = subprocess.run([sys.executable, "-c", SHIM_CHECK, source, kernel], capture_output=True,
                                text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout.strip().splitlines()[-1]
        results[kernel] = torch.tensor(eval(printed, {"nan": float("nan")}))
    assert results["with_barrier"].tolist() == [float((t + 1) % 128) for t in range(128)]
    assert results["missing_barrier"].isnan().any()


# ------------------------------------------------------------------------------------------------------------
# Races: the kernels under ThreadSanitizer (tests/emulation/metal/race_check.cpp). The emulated barriers and
# simd exchanges are atomics TSan follows, so a threadgroup-memory access that no barrier orders is reported
# whatever the interleaving.


@pytest.mark.slow
def test_no_data_races_under_thread_sanitizer():
    if not metal_emulator.has_thread_sanitizer():
        _unavailable("clang++ cannot build -fsanitize=thread programs (no clang++ or no libtsan)")
    try:
        # std::threads, not fibers: ThreadSanitizer sees each emulated thread as a thread.
        exe = metal_emulator.build(extra_flags=["-fsanitize=thread", "-g1", "-DATTNX_METAL_EMU_THREADS"],
                                   sources=metal_emulator.RACE_CHECK_SOURCES, shared=False)
    except metal_emulator.Unavailable as e:
        _unavailable(f"Metal emulation unavailable: {e}")
    result = subprocess.run([exe], capture_output=True, text=True, timeout=900)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


@pytest.mark.slow
def test_pipeline_cache_under_concurrent_first_use(tmp_path):
    """mps::pipeline's cache (csrc/mps/pipeline_cache.h, the code metal_library.mm runs) from 16 threads
    making their first calls at once, under ThreadSanitizer: one library build, one pipeline per name, the
    same pipeline for every thread, and a failed build retried
    (tests/emulation/metal/pipeline_cache_check.cpp)."""
    if not metal_emulator.has_thread_sanitizer():
        _unavailable("clang++ cannot build -fsanitize=thread programs (no clang++ or no libtsan)")
    exe = tmp_path / "pipeline_cache_check"
    source = os.path.join(metal_emulator.HERE, "metal", "pipeline_cache_check.cpp")
    cmd = [metal_emulator.compiler(), "-std=c++20", "-O1", "-g1", "-fsanitize=thread", "-pthread",
           "-I" + metal_emulator.CSRC, source, "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-4000:]
