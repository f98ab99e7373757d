"""The AVX512-BF16 and AMX-BF16 instructions' scalar definitions (csrc/cpu/dot16.h, csrc/cpu/tiles.h), which
the emulated CPU variants run on: known answers on any machine, and bit for bit against the instructions where
the CPU has them (tests/cpu/dot16_check.cpp, tests/cpu/tiles_check.cpp); and the AVX-512 softmax exps
against double precision (tests/cpu/exp_check.cpp). The kernels built on them are tested
through the emulated variants (test_isa_variants in test_attention.py, test_attention_backward.py and
test_dropout.py) and, on a CPU with AVX512-BF16 or AMX-BF16, natively by the whole suite."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = shutil.which("g++") or shutil.which("clang++")


def check(tmp_path, name, args, cases, skip_reason):
    """Builds and runs tests/cpu/<name>.cpp with ``args``; skips with ``skip_reason`` where the CPU lacks what
    it compares with (exit status 77), else expects ``cases`` cases checked."""
    exe = tmp_path / name
    subprocess.run([CXX, "-O2", "-std=c++20", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "cpu", name + ".cpp"), "-o", str(exe)], check=True)
    result = subprocess.run([str(exe), *args], capture_output=True, text=True)
    if result.returncode == 77:
        pytest.skip(skip_reason)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"checked {cases} cases"), result.stdout


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++)")
def test_dot16_definitions_match_the_instructions(tmp_path):
    check(tmp_path, "dot16_check", ["200000", "1"], 9600000,
          "known answers checked; this CPU has no AVX512-BF16 to compare the definitions with")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++)")
def test_tile_definitions_match_the_instructions(tmp_path):
    """AMX-BF16's tdpbf16ps as csrc/cpu/tiles.h defines it for the emulated_amx variant
    (tests/cpu/tiles_check.cpp): known answers anywhere (the even and odd halves of the pairs summed apart,
    denormals flushed), and bit for bit against the instruction over 2.56 M random and special cases where
    the CPU has AMX."""
    check(tmp_path, "tiles_check", ["10000", "1"], 2560000,
          "known answers checked; this CPU has no AMX-BF16 (or no tile state) to compare them with")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++)")
def test_softmax_exps_are_within_their_bounds(tmp_path):
    """vec.h's AVX-512 exps over every 7th float32 in [ln(FLT_MIN), 0] against double-precision exp
    (tests/cpu/exp_check.cpp): vexp within 20 ulp, vexp_for_bf16 (the bfloat16 pair kernels', rounded to
    bfloat16 next) within 3e-6 relative, and their special values, where the CPU has AVX-512."""
    check(tmp_path, "exp_check", [], 159820536, "this CPU has no AVX-512 (F, DQ) with FMA to run the exps on")
