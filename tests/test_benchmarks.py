"""The benchmark entry point still runs: its tiniest configuration, and the plot from a result file.

No timing is asserted here: benchmarks measure, tests check that the measuring code works.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level package of the repository, not of the installed attnx
    sys.path.insert(0, ROOT)


def test_smoke_run_writes_labelled_results(tmp_path):
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--only", "b1", "--device", "cpu"]
    result = subprocess.run(
        command + ["--results-dir", str(tmp_path), "--no-plots"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[1/1] cpu b1" in result.stderr  # progress lines
    assert "F.linear layout table" in result.stdout
    (path,) = tmp_path.glob("cpu-*.json")
    data = json.loads(path.read_text())
    env = data["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["commit"] and env["threads"] >= 1
    case = data["cases"]["b1"]
    assert case["options"] == {"quick": False, "smoke": True}
    (shape,) = case["results"]["mha_sweep"].values()
    assert shape["attnx"]["reps"] == len(shape["attnx"]["samples_s"]) > 0


def test_dispatch_counter_counts_forward_and_backward():
    import torch

    from benchmarks.common import count_dispatches

    x = torch.randn(4, requires_grad=True)
    counter = count_dispatches(lambda: (x * 2).sum().backward())
    assert counter.n >= 4  # mul, sum, and their backward ops
    assert "aten.mul" in counter.ops


def test_plot_from_a_result_file(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.bench_scaling import plot

    def timing(ms):
        s = ms / 1e3
        return {"median_s": s, "iqr_s": s / 10, "q1_s": s * 0.95, "q3_s": s * 1.05, "min_s": s, "reps": 3}

    def series(scale):
        return {
            "time": {str(L): timing(scale * L / 256) for L in (256, 512)},
            "peak_extra_bytes": {"256": scale * 2**20, "512": None},
        }

    results = {
        "shape": {"B": 1, "E": 32, "H": 4},
        "lengths": [256, 512],
        "memory_lengths": [256],
        "eval": {"torch fast path": series(2), "attnx": series(1)},
        "train": {"nn.MultiheadAttention": series(3), "attnx": series(1)},
    }
    env = {"device_name": "cpu", "threads": 1, "torch": "x", "commit": "abc", "date": "2026-01-01"}
    path = tmp_path / "cpu-2026-01-01.json"
    path.write_text(json.dumps({"cases": {"scaling": {"environment": env, "results": results}}}))
    message = plot(str(path))
    assert (tmp_path / "cpu-2026-01-01-scaling.png").stat().st_size > 0, message
