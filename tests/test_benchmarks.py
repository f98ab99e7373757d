"""The benchmark entry point still runs: its tiniest configuration with the result file and Markdown record it
writes, and the plot from a result file.

No timing is asserted here: benchmarks measure, tests check that the measuring code works.
"""

import datetime
import json
import os
import subprocess
import sys

import pytest

import attnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level package of the repository, not of the installed attnx
    sys.path.insert(0, ROOT)


def _smoke(case, results_dir):
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--only", case, "--device", "cpu"]
    result = subprocess.run(
        command + ["--results-dir", str(results_dir), "--no-plots"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_smoke_run_writes_labelled_results(tmp_path):
    from benchmarks.common import RESULTS_DIR, cpu_name

    # the repository's own results change only when someone runs the benchmarks for real
    before = sorted(os.listdir(RESULTS_DIR))
    result = _smoke("b1", tmp_path)
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

    # The run's Markdown record: the machine, commit, torch and load, then the table as the case printed it
    # (the same string as stdout's and the JSON's, not a reformatted copy), and LATEST-cpu.md a copy of it.
    (record,) = tmp_path.glob("cpu-*.md")
    assert record.name == f"{path.stem}-{env['commit'].replace('+', '-')}.md"
    text = record.read_text(encoding="utf-8")
    assert text == (tmp_path / "LATEST-cpu.md").read_text(encoding="utf-8")
    assert f"- attnx commit: {env['commit']} (" in text and f"imported: {attnx.__version__} from " in text
    assert f"- torch {env['torch']}," in text
    assert f"- machine: {cpu_name()} (" in text
    assert f"- ISA level torch reports: {env['cpu_capability']}" in text
    assert "- load average (1, 5, 15 min): [" in text and "] at the end" in text
    assert "- command: `python -m benchmarks --smoke --only b1 --device cpu --results-dir " in text
    assert "\n## b1: " in text
    assert case["text"] in text and case["text"] in result.stdout

    # A second run the same day at the same commit adds a record beside the first and replaces LATEST.
    first = record.read_text(encoding="utf-8")
    _smoke("overhead", tmp_path)
    records = sorted(tmp_path.glob("cpu-*.md"))
    assert len(records) == 2 and record.read_text(encoding="utf-8") == first
    (second,) = (r for r in records if r != record)
    assert second.name == f"{record.stem}-2.md"
    latest = (tmp_path / "LATEST-cpu.md").read_text(encoding="utf-8")
    assert latest == second.read_text(encoding="utf-8") != first
    assert "\n## overhead: " in latest and "\n## b1: " not in latest
    assert json.loads(path.read_text(encoding="utf-8"))["cases"]["overhead"]["text"] in latest
    assert sorted(os.listdir(RESULTS_DIR)) == before


def test_record_fences_hold_any_table():
    from benchmarks.common import machine, record

    # a case's text that holds a Markdown fence still lands inside one code block, unchanged
    text = "a table\n```\nwith a fence\n````"
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    run = {
        "started": now, "ended": now, "machine": machine("cpu"), "load_start": None, "load_end": None,
        "command": "python -m benchmarks", "options": {}, "skipped": {"models": "no smoke shapes"},
    }
    cases = {"x": {"title": "t", "text": text, "seconds": 1.0, "load_average_at_start": None}}
    out = record("cpu", cases, run)
    assert f"\n`````text\n{text}\n`````\n" in out
    assert "- not run: models (no smoke shapes)" in out


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


def test_paired_ratio_pairs_rounds_and_brackets_the_median():
    from benchmarks.common import Timing, paired_ratio

    # Round i: b took 1 + i ms and a 0.9x as long, but for one outlier round: ratios taken round by round
    # divide the drift (1 to 100 ms) out, and the outlier moves neither the median nor the interval.
    b = Timing([(1 + i) * 1e-3 for i in range(100)])
    a = Timing([0.9 * t for t in b.samples[:-1]] + [b.samples[-1] * 5])
    ratio = paired_ratio(a, b)
    assert len(ratio.samples) == 100
    assert ratio.median == pytest.approx(0.9)
    lo, hi = ratio.ci95
    assert lo == pytest.approx(0.9) and hi == pytest.approx(0.9)
    assert str(ratio) == "0.90x (0.90-0.90)"
    # Distinct ratios: the interval is order statistics 40 and 59 (0-based) of 100, n/2 -+ 1.96 sqrt(n)/2.
    spread = paired_ratio(Timing([0.5 + i / 100 for i in range(100)]), Timing([1.0] * 100))
    assert spread.ci95 == (pytest.approx(0.5 + 40 / 100), pytest.approx(0.5 + 59 / 100))
    assert spread.to_json()["rounds"] == 100
    with pytest.raises(ValueError):  # timings from different runs do not pair
        paired_ratio(Timing([1.0, 2.0]), Timing([1.0]))


def test_models_case_smoke_run(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed: the models case is skipped")
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--only", "models", "--device", "cpu"]
    result = subprocess.run(
        command + ["--results-dir", str(tmp_path), "--no-plots"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prefill: LlamaForCausalLM" in result.stdout and "encoder: BertModel" in result.stdout
    (path,) = tmp_path.glob("cpu-*.json")
    case = json.loads(path.read_text())["cases"]["models"]["results"]
    assert case["threads"] >= 1 and case["transformers"]
    for name in ("prefill", "encoder"):
        assert set(case[name]["timings"]) == {"attnx", "sdpa", "eager"}
        assert all(n >= 0 for n in case[name]["peak_extra_bytes"].values())
    decode = case["decode"]
    assert {"B=1", "target_met"} <= set(decode) and decode["B=1"]["tokens_per_s"]["attnx"] > 0


def test_sdpa_case_smoke_run(tmp_path):
    """The SDPA takeover case runs, compares outputs, leaves the takeover off and prints a ratio per row."""
    result = _smoke("sdpa", tmp_path)
    assert result.returncode == 0, result.stderr
    case = json.loads(next(tmp_path.glob("cpu-*.json")).read_text(encoding="utf-8"))["cases"]["sdpa"]
    assert set(case["results"]) == {"tiny 1x2x1x8x12x16 float32", "tiny 1x2x1x8x12x16 float32 fwd+bwd"}
    assert all("attnx/torch" in row for row in case["results"].values())
