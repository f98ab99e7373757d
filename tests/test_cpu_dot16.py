"""The AVX512-BF16 instructions' scalar definitions (csrc/cpu/dot16.h), which the emulated CPU variant runs
on: known answers on any machine, and bit for bit against the instructions where the CPU has them
(tests/cpu/dot16_check.cpp). The kernels built on them are tested through the emulated variant
(test_isa_variants in test_attention.py, test_attention_backward.py and test_dropout.py) and, on a CPU with
AVX512-BF16, natively by the whole suite."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++)")
def test_dot16_definitions_match_the_instructions(tmp_path):
    exe = tmp_path / "dot16_check"
    subprocess.run([CXX, "-O2", "-std=c++20", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "cpu", "dot16_check.cpp"), "-o", str(exe)], check=True)
    result = subprocess.run([str(exe), "200000", "1"], capture_output=True, text=True)
    if result.returncode == 77:
        pytest.skip("known answers checked; this CPU has no AVX512-BF16 to compare the definitions with")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("checked 9600000 cases"), result.stdout
