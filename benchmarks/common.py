"""Timing, environment labels and result files shared by the benchmarks.

Machines are noisy, so candidates are timed interleaved (round-robin, the same number of repetitions each) and
compared as ratios of medians taken in the same run; the spread (interquartile range) is reported with each.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


@dataclass
class Timing:
    """Per-call seconds over repetitions."""

    samples: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> float:
        q = statistics.quantiles(self.samples, n=4)
        return q[2] - q[0]

    def to_json(self) -> dict:
        return {"median_s": self.median, "iqr_s": self.iqr, "reps": len(self.samples)}


def time_interleaved(fns: dict, device: str = "cpu", reps: int = 15, min_block_s: float = 0.02) -> dict:
    """Time each callable in ``fns`` round-robin; each sample is the mean of a block of calls.

    The block size is chosen per callable so that one block lasts about ``min_block_s``, which keeps timer
    resolution and per-call noise out of short calls.
    """
    blocks = {}
    for name, fn in fns.items():
        fn()  # warm-up: allocator, lazy init, caches
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        once = max(time.perf_counter() - t0, 1e-7)
        blocks[name] = max(1, int(min_block_s / once))
    timings = {name: Timing() for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            n = blocks[name]
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            synchronize(device)
            timings[name].samples.append((time.perf_counter() - t0) / n)
    return timings


def environment(device: str) -> dict:
    """Labels for a result file: what ran, where, on which commit."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    if device == "cuda":
        name = torch.cuda.get_device_name()
    elif device == "mps":
        name = "Apple " + platform.machine()
    else:
        name = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return {
        "device": device,
        "device_name": name,
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
    }


def write_results(device: str, results: dict) -> str:
    """Write ``benchmarks/results/<device>-<date>.json`` and return its path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    env = environment(device)
    path = os.path.join(RESULTS_DIR, f"{device}-{env['date']}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=2)
        f.write("\n")
    return path


def table(headers: list, rows: list) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"
