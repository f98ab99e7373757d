"""What only the CUDA emulation can check: the kernels' launch plans and the launchers' refusals, and data
races under ThreadSanitizer.

The kernels are csrc/cuda/*.cu compiled by g++ against tests/emulation/cuda_shim.h (one std::thread per CUDA
thread, __syncthreads as a barrier, warp shuffles through exchange slots). Their values, on every feature, are
checked through attnx's own ops on the ``cuda-emu`` and ``cuda-emu-sm75`` devices of the test matrix
(tests/emulation/backends.py, the ``device`` fixture); here, C++ programs drive the launchers directly: with
parameters the glue never sends (tests/emulation/launch_check.cpp), and under ThreadSanitizer
(tests/emulation/race_check.cpp).
"""

import os
import subprocess

import pytest

from emulation import emulator

pytestmark = pytest.mark.kernel


def _run(exe, timeout, env=None):
    return subprocess.run([exe], capture_output=True, text=True, timeout=timeout, env=env)


def test_launch_plans_and_refusals():
    """launch_check.cpp: shared memory within the 163 KiB an sm80 block may opt into for every dtype and
    head-dim bucket of both kernels; B * H past grid.y's 65535 on a 1-D grid; the launchers refuse
    (cudaErrorInvalidValue) kv_heads that do not divide heads, key_lengths or sinks without a pointer, windows
    below -1, and head dims above 256 (the glue runs the composite there, which the matrix tests on
    cuda-emu)."""
    try:
        exe = emulator.check_program(os.path.join(emulator.HERE, "launch_check.cpp"))
    except emulator.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    result = _run(exe, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout + result.stderr[-4000:])


# Both kernels and the backward under ThreadSanitizer. The emulated barriers and warp exchanges are atomics
# TSan follows, so a shared-memory access that no __syncthreads/__syncwarp orders is reported whatever the
# interleaving.


@pytest.mark.slow
def test_no_data_races_under_thread_sanitizer():
    if not emulator.has_thread_sanitizer():
        pytest.skip("the C++ compiler cannot build -fsanitize=thread programs (no libtsan)")
    try:
        exe = emulator.build(extra_flags=["-fsanitize=thread", "-g1"], sources=emulator.RACE_CHECK_SOURCES,
                             shared=False)
    except emulator.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    # Without a preloaded AddressSanitizer runtime (`make sanitize` preloads one), which TSan cannot share a
    # process with.
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    result = _run(exe, timeout=900, env=env)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
