"""What every benchmark case shares: timing, dispatch counting, progress lines, tables, result files.

Machines are noisy, so candidates are timed interleaved (round-robin, the same number of repetitions each, the
order reversed every other round) and compared as ratios of medians taken in the same run; each figure comes
with its spread (the interquartile range as a percentage of the median) and the number of repetitions. Where
two candidates are close, :func:`paired_ratio` compares them round by round instead.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnx

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
RESULTS_FORMAT = 2  # bump when the layout of a result file changes; an older file is then replaced


# -----------------------------------------------------------------------------------------------------------
# Timing


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


@dataclass
class Timing:
    """Per-call seconds, one sample per repetition."""

    samples: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple:
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def iqr(self) -> float:
        q1, q3 = self.quartiles
        return q3 - q1

    @property
    def spread(self) -> str:
        """The interquartile range relative to the median, e.g. ``±4%``."""
        return f"±{100 * self.iqr / self.median:.0f}%"

    def to_json(self) -> dict:
        return {
            "median_s": self.median,
            "iqr_s": self.iqr,
            "q1_s": self.quartiles[0],
            "q3_s": self.quartiles[1],
            "min_s": min(self.samples),
            "reps": len(self.samples),
            "samples_s": self.samples,
        }


def time_interleaved(
    fns: dict, device: str = "cpu", reps: int = 15, min_block_s: float = 0.02, setup: dict | None = None
) -> dict:
    """Time each callable in ``fns`` round-robin, the order reversed every other round; returns
    ``{name: Timing}`` whose samples line up by round.

    Each sample is the mean of a block of calls whose size is chosen per callable so that one block lasts
    about ``min_block_s``, which keeps timer resolution and per-call noise out of short calls
    (``min_block_s=0``: one call per sample, for calls of many milliseconds). Every callable is called once
    first (allocator, lazy initialisation, caches). ``setup[name]``, when given, runs before each of that
    callable's blocks, untimed (to switch a process-wide state such as attnx.sdpa's on or off).
    """
    setup = setup or {}
    blocks = {}
    for name, fn in fns.items():
        setup.get(name, lambda: None)()
        fn()
        synchronize(device)
        if min_block_s <= 0:
            blocks[name] = 1
            continue
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        once = max(time.perf_counter() - t0, 1e-7)
        blocks[name] = max(1, int(min_block_s / once))
    timings = {name: Timing() for name in fns}
    order = list(fns.items())
    for _ in range(reps):
        for name, fn in order:
            n = blocks[name]
            setup.get(name, lambda: None)()
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            synchronize(device)
            timings[name].samples.append((time.perf_counter() - t0) / n)
        order.reverse()  # no candidate always runs first, or always after the same one
    return timings


@dataclass
class Ratio:
    """Time ratios a / b of two candidates, one per round of :func:`time_interleaved` (the two ran within
    the same round, so the load of the machine at that moment divides out)."""

    samples: list

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def ci95(self) -> tuple:
        """A distribution-free 95% confidence interval of the median: the order statistics whose ranks the
        binomial(n, 1/2) count of samples below the median reaches with 2.5% probability either side."""
        ordered, n = sorted(self.samples), len(self.samples)
        k = max(0, int(n / 2 - 1.96 * n**0.5 / 2))
        return ordered[k], ordered[n - 1 - k]

    def __str__(self) -> str:
        lo, hi = self.ci95
        return f"{self.median:.2f}x ({lo:.2f}-{hi:.2f})"

    def to_json(self) -> dict:
        return {"median": self.median, "ci95": list(self.ci95), "rounds": len(self.samples)}


def paired_ratio(a: Timing, b: Timing) -> Ratio:
    """Round-by-round ratios of two timings from the same :func:`time_interleaved` call."""
    return Ratio([x / y for x, y in zip(a.samples, b.samples, strict=True)])


# -----------------------------------------------------------------------------------------------------------
# Dispatch counting (the method of the upstream report flex-attention-backward-math-fallback)


class DispatchCounter(TorchDispatchMode):
    """Counts every ``__torch_dispatch__`` call, i.e. every ATen (or custom) op that reaches the dispatcher
    below autograd, forward and backward alike, and remembers which ops they were."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def to_json(self, top: int = 12) -> dict:
        return {
            "dispatches": self.n,
            "top_ops": dict(self.ops.most_common(top)),
            "distinct_ops": len(self.ops),
        }


def count_dispatches(fn) -> DispatchCounter:
    """Run ``fn`` once under a :class:`DispatchCounter` and return the counter."""
    counter = DispatchCounter()
    with counter:
        fn()
    return counter


# -----------------------------------------------------------------------------------------------------------
# Progress lines (stderr, one line per step, so they read the same in a terminal, a pipe or a CI log)


class _Progress:
    def __init__(self) -> None:
        self.index, self.total, self.case, self.start = 0, 0, "", time.perf_counter()

    def begin(self, index: int, total: int, case: str) -> None:
        self.index, self.total, self.case = index, total, case

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(
            f"[{self.index}/{self.total}] {self.case}: {message} ({elapsed:.0f} s)",
            file=sys.stderr,
            flush=True,
        )


progress = _Progress()


# -----------------------------------------------------------------------------------------------------------
# Environment labels and result files


def _git(*args: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root).stdout.strip()


def commit() -> str:
    """``git rev-parse --short HEAD`` of the benchmarked tree, ``+dirty`` when it has uncommitted changes."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    if device == "mps":
        return f"Apple {platform.machine()} (MPS)"
    return cpu_name()


def environment(device: str, now=None) -> dict:
    """Labels for a result file: what ran, where, on which commit, under which load (``now``: a UTC datetime,
    by default the present)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    env = {
        "device": device,
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "commit": commit(),
        # UTC, the clock of the run's Markdown record too, so that a run's JSON and record share their date
        "date": now.date().isoformat(),
        "time": now.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):
        env["load_average"] = load_average()
    return env


def write_results(device: str, results: dict, options: dict, results_dir: str = RESULTS_DIR, now=None) -> str:
    """Merge this run's cases into ``<results_dir>/<device>-<date>.json`` and return its path.

    A case run again replaces its earlier entry; cases not run keep theirs, so ``--only`` updates one case.
    Every case records the environment and options it ran under; ``now`` dates them (see :func:`environment`).
    """
    os.makedirs(results_dir, exist_ok=True)
    env = environment(device, now)
    path = os.path.join(results_dir, f"{device}-{env['date']}.json")
    data = {"format": RESULTS_FORMAT, "cases": {}}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("format") == RESULTS_FORMAT:
            data = old
    data["environment"] = env
    for name, case in results.items():
        data["cases"][name] = {"environment": env, "options": options, **case}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


# -----------------------------------------------------------------------------------------------------------
# The Markdown record of a run: what a reader needs to judge its tables (where, when, on what, under which
# load), then the tables exactly as the cases printed them


def load_average():
    """The 1, 5 and 15 minute load averages, or None where the system keeps none."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _cores() -> str:
    """Logical CPUs, the physical cores /proc/cpuinfo lists, and how many CPUs this process may use (a
    container or taskset may allow fewer than the machine has)."""
    logical = os.cpu_count()
    text = f"{logical} logical CPUs"
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().split("\n\n")
    except OSError:
        blocks = []
    cores = set()
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            cores.add((fields.get("physical id"), fields["core id"]))
    if cores:
        text += f", {len(cores)} physical cores"
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0))
        if usable != logical:
            text += f", {usable} usable by this process"
    return text


def _nvidia_driver() -> str:
    # torch reports the CUDA version it was built with, not the driver's; nvidia-smi knows the driver (one per
    # machine, so the first line serves whichever GPU torch numbers as current)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    return out.splitlines()[0].strip() if out.strip() else "unknown"


def gpu(device: str):
    """The GPU a run used, with its compute capability, runtime and driver; None on the CPU."""
    if device == "cuda":
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        hip = torch.version.hip
        runtime = f"HIP {hip}" if hip else f"CUDA {torch.version.cuda} (torch's build)"
        return (
            f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor}), {runtime}, "
            f"driver {_nvidia_driver()}"
        )
    if device == "mps":
        return f"{device_name(device)}, macOS {platform.mac_ver()[0]}"
    return None


def machine(device: str) -> dict:
    """What a run's record says about where it ran; taken when the run starts, since cases change the thread
    count while they run."""
    return {
        "cpu": f"{cpu_name()} ({platform.machine()})",
        "cores": _cores(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit(),
        # the build under test: another checkout's attnx can be imported through PYTHONPATH
        "attnx": f"{attnx.__version__} from {os.path.dirname(attnx.__file__)}",
    }


def _fenced(text: str) -> str:
    # a fence longer than any run of backticks in the text, so that no table can close its block early
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}text\n{text}\n{fence}"


def record(device: str, cases: dict, run: dict) -> str:
    """The Markdown record of one device's part of a run.

    ``cases``: ``{name: {"title", "text", "seconds", "load_average_at_start"}}`` in the order they ran;
    ``run``: ``started`` and ``ended`` (UTC datetimes), ``machine`` (:func:`machine`), ``load_start`` and
    ``load_end``, ``command``, ``options`` and ``skipped`` (cases not run, with why). The tables go in as the
    cases printed them: nothing here reformats a figure.
    """
    m, started, ended, options = run["machine"], run["started"], run["ended"], run["options"]
    # in the title, so that tiny smoke shapes or a quick run's fewer repetitions are not read as a full run
    mode = "--smoke" if options.get("smoke") else "--quick" if options.get("quick") else "full"
    head, dirty, _ = m["commit"].partition("+dirty")
    tree = (
        "not a git checkout" if head == "unknown"
        else "uncommitted changes in the tree, outside benchmarks/results" if dirty else "clean tree"
    )
    lines = [
        f"# attnx benchmarks: {device}, {started:%Y-%m-%d %H:%M} UTC, {mode}",
        "",
        "Written by `python -m benchmarks`: the header is what the runner read from the machine, each table",
        "is the text its case printed.",
        "",
        f"- date: {started:%Y-%m-%d %H:%M:%S} to {ended:%Y-%m-%d %H:%M:%S} UTC "
        f"({(ended - started).total_seconds():.0f} s)",
        f"- machine: {m['cpu']}; {m['cores']}; torch threads at the start: {m['threads']}",
        f"- ISA level torch reports: {m['cpu_capability']}",
    ]
    if m["gpu"]:
        lines.append(f"- GPU: {m['gpu']}")
    lines += [
        f"- torch {m['torch']}, Python {m['python']}, {m['platform']}",
        f"- attnx commit: {m['commit']} ({tree}); imported: {m['attnx']}",
        f"- load average (1, 5, 15 min): {run['load_start']} at the start, {run['load_end']} at the end",
        f"- command: `{run['command']}`",
        "- options: " + ", ".join(f"{k}={v!r}" for k, v in options.items()),
    ]
    for name, why in run.get("skipped", {}).items():
        lines.append(f"- not run: {name} ({why})")
    for name, case in cases.items():
        lines += [
            "",
            f"## {name}: {case['title']}",
            "",
            f"{case['seconds']:.0f} s, load average at the start of the case {case['load_average_at_start']}",
            "",
            _fenced(case["text"]),
        ]
    return "\n".join(lines) + "\n"


def write_record(device: str, cases: dict, run: dict, results_dir: str = RESULTS_DIR) -> tuple:
    """Write :func:`record` to ``<results_dir>/<device>-<date>-<commit>.md`` and copy it to
    ``<results_dir>/LATEST-<device>.md``; return both paths.

    A record is never replaced: a second run on the same day and commit gets ``-2``, ``-3``, ... The latest
    record is kept per device, since one run covers the CPU and each GPU present and a CPU-only run elsewhere
    must not hide the GPU's record.
    """
    os.makedirs(results_dir, exist_ok=True)
    text = record(device, cases, run)
    # the date the run ended: the runner dates the JSON file it merged the run into with the same moment
    stem = f"{device}-{run['ended']:%Y-%m-%d}-{run['machine']['commit'].replace('+', '-')}"
    n = 1
    while True:
        path = os.path.join(results_dir, stem + (f"-{n}" if n > 1 else "") + ".md")
        try:
            # "x": fails rather than replace a record that exists
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
            break
        except FileExistsError:
            n += 1
    latest = os.path.join(results_dir, f"LATEST-{device}.md")
    with open(latest + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(latest + ".tmp", latest)
    return path, latest


# -----------------------------------------------------------------------------------------------------------
# Formatting


def table(headers: list, rows: list) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 1 else f"{seconds * 1e3:.0f}"


def fmt_mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def target(met: bool) -> str:
    return "met" if met else "NOT met"
