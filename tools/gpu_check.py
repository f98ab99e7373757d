"""`make gpu-check`: build attnx for the visible GPU and check its CUDA backend, within a time budget.

Run from the repository root with the Python whose CUDA torch is to be used (the Makefile's GPU_CHECK_PY,
default python3); it needs nvcc, ninja, setuptools and pytest, and uses cuobjdump and compute-sanitizer when
found (no network). Steps, each capped (seconds) and together held to the budget (BUDGET, default 450 s):

    env          card, driver, CUDA, torch, nvcc, commit                                           cap  30
    build        setup.py build_ext --inplace for the visible GPU's arch only, MAX_JOBS=16         cap 240
    binary       registers, stack, local memory, shared memory and LDL/STL counts per kernel
                 (cuobjdump on the built _C_cuda); FAIL if a kernel the default dispatch picks spills cap  60
    tests        pytest -m cuda: the device matrix's cuda params and tests/test_cuda.py            cap 200
    memcheck     compute-sanitizer memcheck (torch's caching allocator off) on
                 tools/gpu_sanitize_cases.py: both kernels, every feature, the composite          cap 150
    racecheck    the same cases under racecheck                                                    cap 100
    synccheck    the same cases under synccheck                                                    cap  60
    bench        python -m benchmarks --device cuda --only cuda --only eval --quick                cap 150
    backward     the same with ATTNX_CUDA_FUSED_BACKWARD=1 --only backward --only train: the fused
                 backward (opt-in until it has run on a GPU) against SDPA's and nn.MHA's            cap 150
    runtime      the kernels compiled at run time (ATTNX_CUDA_RUNTIME_COMPILE=1, tools/gpu_runtime.py):
                 the first call's compile, a disk-cache hit and a warm call beside the prebuilt
                 library's, then pytest -m cuda through them                                       cap 200

The tests and the three sanitizers run side by side (the sanitizers one after another); the benchmarks run
last, alone on the GPU. A step that fails or times out does not stop the later ones; one the budget can no
longer fit is SKIPPED. The summary (benchmarks/results/gpu-check-<date>-<card>.md and .json) is printed last
and copied, with the benchmark records and every log, to $OUT when that is set. Logs: build/gpu-check/.
The exit status is 0 when every step is ok.

    python tools/gpu_check.py --dry-run    # the plan, and a summary of made-up results (no GPU needed)
    python tools/gpu_check.py --only binary --results-dir /tmp/x   # the binary report of the current build

This is a Python driver rather than a shell script so that its parsers (cuobjdump, pytest's JUnit XML,
the sanitizers' summaries, the benchmark JSON) and its summary writer are plain functions that
tests/test_gpu_check.py checks without a GPU. Standard library only; torch is imported by the steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DEFAULT_BUDGET = 450
RESERVE = 10  # seconds kept back for the summary
MIN_STEP = 15  # a step the budget leaves less time than this is skipped
SUMMARY_FORMAT = 1


@dataclasses.dataclass
class Step:
    name: str
    cap: int
    what: str


STEPS = [
    Step("env", 30, "card, driver, CUDA, torch, nvcc, commit"),
    Step("build", 240, "setup.py build_ext --inplace, TORCH_CUDA_ARCH_LIST = the visible GPU's, MAX_JOBS=16"),
    Step("binary", 60, "cuobjdump on _C_cuda: registers, stack, local and shared memory, LDL/STL per kernel"),
    Step("tests", 200, "pytest -m cuda: the device matrix's cuda params and tests/test_cuda.py"),
    Step("memcheck", 150, "compute-sanitizer memcheck (no caching allocator) on tools/gpu_sanitize_cases.py"),
    Step("racecheck", 100, "compute-sanitizer racecheck on tools/gpu_sanitize_cases.py"),
    Step("synccheck", 60, "compute-sanitizer synccheck on tools/gpu_sanitize_cases.py"),
    Step("bench", 150, "python -m benchmarks --device cuda --only cuda --only eval --quick"),
    Step("backward", 150, "ATTNX_CUDA_FUSED_BACKWARD=1 python -m benchmarks --device cuda --only backward "
                          "--only train --quick"),
    Step("runtime", 200, "ATTNX_CUDA_RUNTIME_COMPILE=1: first-call compile, cache hit, warm call; pytest -m "
                         "cuda (tools/gpu_runtime.py)"),
    Step("family", 200, "the forward's tile shapes x fp16/bf16/fp32 x D 64/128 x L 1024/4096, checked and "
                        "timed beside SDPA's backends (tools/gpu_family.py)"),
]
STEP_NAMES = [s.name for s in STEPS]
CAPS = {s.name: s.cap for s in STEPS}
SANITIZERS = ("memcheck", "racecheck", "synccheck")


@dataclasses.dataclass
class Result:
    """One step's outcome: status is ok, FAIL, TIMEOUT or SKIPPED."""

    name: str
    status: str
    seconds: float = 0.0
    cap: int = 0
    detail: str = ""
    log: str = ""


# ------------------------------------------------------------------------------------------------------------
# Running a step: a subprocess in its own process group, killed with its children when its limit passes.


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def limit(self, cap: int) -> int:
        """The seconds a step may take now: its cap, or what the budget has left (0: skip it)."""
        left = int(self.seconds - self.elapsed() - RESERVE)
        limit = min(cap, left)
        return limit if limit >= MIN_STEP else 0


def run_command(cmd, log_path, limit, env=None, cwd=ROOT):
    """Runs cmd with stdout and stderr in log_path; returns (returncode or None on timeout, seconds)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = None
    return rc, time.monotonic() - t0


def outcome(name, rc, seconds, limit, log, detail=""):
    if rc is None:
        return Result(name, "TIMEOUT", seconds, limit, f"killed after {limit} s" + (f"; {detail}" if detail
                                                                                    else ""), log)
    if rc != 0:
        return Result(name, "FAIL", seconds, limit, f"exit {rc}" + (f"; {detail}" if detail else ""), log)
    return Result(name, "ok", seconds, limit, detail, log)


# ------------------------------------------------------------------------------------------------------------
# Parsers (no GPU needed; tests/test_gpu_check.py checks them on samples).

# attention_forward_{simt,mma} and the fused backwards' attention_backward_{keys,queries} (SIMT) and
# attention_backward_mma_{keys,queries} (kinds "simt", "mma", "backward_keys", ...); the SIMT backward's
# delta pre-pass has no bucket or shared memory.
_KERNEL = re.compile(r"attention_(?:forward_(simt|mma)|(backward_keys|backward_queries|backward_mma_keys"
                     r"|backward_mma_queries))"
                     r"I(13__nv_bfloat16|6__half|f|d)Li(\d+)E(?:Li(\d+)E)?")
_DTYPES = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32", "d": "fp64"}


def kernel_label(mangled: str):
    """(kind, dtype, head-dim bucket, rows per warp or None) of an attnx kernel's mangled name, or None."""
    m = _KERNEL.search(mangled)
    if not m:
        return None
    # the SIMT kernel's third template argument; the mma kernel's is its instantiation (MmaVariant)
    rows_per_warp = int(m.group(5)) if m.group(5) and m.group(1) == "simt" else None
    return m.group(1) or m.group(2), _DTYPES[m.group(3)], int(m.group(4)), rows_per_warp


# The kernels attnx::_attention_kernel names (attnx.info's attention_kernel) -> kernel_label's kinds.
_NAMED = re.compile(r"cuda (simt|mma|fused simt|fused mma) (fp16|bf16|fp32|fp64) bucket (\d+)"
                    r"(?: bits| general| capped)?")
_NAMED_KINDS = {"simt": ("simt",), "mma": ("mma",), "fused simt": ("backward_keys", "backward_queries"),
                "fused mma": ("backward_mma_keys", "backward_mma_queries")}

# Run on the GPU (the env step's Python): the kernel attention and its backward take, for every dtype at each
# head-dim bucket, as the CUDA library names them (attnx::_attention_kernel): the default dispatch of this
# process (no ATTNX_CUDA_MMA=0, no ATTNX_CUDA_FUSED_BACKWARD=1 unless the caller set them), asked once more
# with torch's flash kernel off: the unmasked calls it takes reach attnx's own kernels as soon as they carry
# a mask, so those are on the default path too.
ASK_DEFAULT_KERNELS = (
    "import json, torch; from attnx import info; names = lambda: ["
    "info.attention_kernel('cuda', d, h, backward=b) for d in info.CUDA_DTYPES "
    "for h in (32, 64, 128, 256) for b in (False, True)]; first = names(); "
    "torch.ops.attnx._cuda_torch_flash(False); print(json.dumps(first + names()))"
)


def default_kernels(names) -> set:
    """(kind, dtype, head-dim bucket) of each CUDA kernel in ``names`` (attnx::_attention_kernel's answers,
    e.g. "cuda mma fp16 bucket 64"; the fused backward is its two kernels); other answers (the composite, the
    whole-tensor math) name no kernel of the library."""
    out = set()
    for name in names:
        m = _NAMED.fullmatch(name)
        if m:
            out |= {(kind, m.group(2), int(m.group(3))) for kind in _NAMED_KINDS[m.group(1)]}
    return out


_ARCH = re.compile(r"\s*arch = (sm_\d+\w*)")


def _by_arch(text: str):
    """(arch, line) for each line of cuobjdump's output below an `arch = sm_XY` header."""
    arch = None
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            arch = m.group(1)
        elif arch:
            yield arch, line


def parse_resource_usage(text: str) -> dict:
    """`cuobjdump --dump-resource-usage` output -> {(arch, mangled): {registers, stack, local, shared}}."""
    out, function = {}, None
    for arch, line in _by_arch(text):
        m = re.match(r"\s*Function (\S+?):?\s*$", line) or re.match(r"\s*Function (\S+?):\s+REG:", line)
        if m:
            function = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and function:
            out[(arch, function)] = {"registers": int(m.group(1)), "stack": int(m.group(2)),
                                     "shared": int(m.group(3)), "local": int(m.group(4))}
            function = None
    return out


_LOCAL_ACCESS = re.compile(r"\s(LDL|STL)(\.\S+)?\s")


def count_local_accesses(sass: str) -> dict:
    """`cuobjdump -sass` output -> {(arch, mangled): number of LDL + STL instructions}."""
    counts, function = {}, None
    for arch, line in _by_arch(sass):
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            function = (arch, m.group(1))
            counts.setdefault(function, 0)
        elif function and _LOCAL_ACCESS.search(line):
            counts[function] += 1
    return counts


def kernel_report(resources: dict, local_accesses: dict, arch: str | None = None, default=None) -> list:
    """One row per attnx attention kernel (of arch, if given), sorted; a kernel spills when its SASS has
    local-memory accesses (LDL/STL) or its resource usage a LOCAL size. ``default``: the (kind, dtype,
    bucket) the default dispatch takes (default_kernels), or None where that is unknown (every kernel then
    counts as on the default path)."""
    rows = []
    for (a, name), usage in resources.items():
        label = kernel_label(name)
        if label is None or (arch and a != arch):
            continue
        kind, dtype, head_dim, rows_per_warp = label
        ldl_stl = local_accesses.get((a, name), 0)
        rows.append({"arch": a, "kernel": kind, "dtype": dtype, "head_dim": head_dim,
                     "rows_per_warp": rows_per_warp, **usage, "ldl_stl": ldl_stl,
                     "spills": ldl_stl > 0 or usage["local"] > 0,
                     "default_path": default is None or (kind, dtype, head_dim) in default})
    return sorted(rows, key=lambda r: (r["arch"], r["kernel"], r["dtype"], r["head_dim"]))


def spill_verdict(rows: list) -> tuple[bool, list]:
    """(ok, lines): a FAIL line for each default-path kernel that spills, a note for the others."""
    lines = []
    for r in rows:
        if r["spills"]:
            what = (f"{r['arch']} {r['kernel']} {r['dtype']} D<={r['head_dim']}: {r['ldl_stl']} LDL/STL, "
                    f"stack {r['stack']} B, local {r['local']} B")
            lines.append(("FAIL: spills, default path: " if r["default_path"] else
                          "note: spills, off the default path: ") + what)
    return not any(r["spills"] and r["default_path"] for r in rows), lines


def parse_junit(path: str) -> dict:
    """pytest's JUnit XML -> {passed, failed, errors, skipped}."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def parse_sanitizer(text: str) -> dict:
    """compute-sanitizer's log -> {errors, hazards (racecheck), finished}; errors None without a summary."""
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)
    return {"errors": int(errors[-1]) if errors else None, "hazards": int(hazards[-1]) if hazards else None,
            "finished": "all launches done" in text}


def benchmark_ratios(results: dict) -> dict:
    """A benchmarks/results/cuda-<date>.json -> the ratios that say how attnx stands: per throughput case,
    attnx's TFLOP/s over the fastest SDPA backend's; for eval, attnx's time over torch's fast path and its
    peak extra memory over the unavoidable."""
    cases = results.get("cases", {})
    out = {}
    cuda = cases.get("cuda", {}).get("results", {})
    throughput, kernels = cuda.get("attention_throughput", {}), cuda.get("attnx_kernels", {})
    for label, row in throughput.items():
        attnx = (row.get("attnx") or {}).get("tflops")
        own = (row.get("attnx own") or {}).get("tflops")  # attnx's kernel, where torch's flash ran the call
        sdpa = {n: c["tflops"] for n, c in row.items() if n.startswith("sdpa") and c and c.get("tflops")}
        best = max(sdpa, key=sdpa.get) if sdpa else None
        out[f"cuda {label}"] = {"attnx_kernel": kernels.get(label), "attnx_tflops": _round(attnx),
                                "best_sdpa": best, "best_sdpa_tflops": _round(sdpa.get(best)),
                                "ratio": _round(attnx / sdpa[best]) if attnx and best else None}
        if own:
            out[f"cuda {label}"].update(attnx_own_tflops=_round(own),
                                        own_ratio=_round(own / sdpa[best]) if best else None)
    ev = cases.get("eval", {}).get("results", {})
    if "attnx" in ev:
        unavoidable = ev.get("unavoidable_bytes")
        peak = ev["attnx"].get("peak_extra_bytes")
        out["eval attnx"] = {"time_over_fast_path": _round(ev["attnx"].get("time_over_fast_path")),
                             "peak_over_unavoidable": _round(peak / unavoidable) if peak and unavoidable
                             else None}
    return out


def parse_runtime(log: str) -> dict:
    """tools/gpu_runtime.py's `runtime-route: {json}` line, or {} where it printed none."""
    lines = [line for line in log.splitlines() if line.startswith("runtime-route: ")]
    return json.loads(lines[-1][len("runtime-route: "):]) if lines else {}


def runtime_detail(found: dict) -> str:
    """The runtime step's one line: the first call's compile, the disk-cache hit, the warm call against the
    prebuilt library's, the tests."""
    if not found:
        return "no runtime-route line"
    parts = []
    for key, label in (("compile", "first call (compile)"), ("disk_cache", "first call (disk cache)")):
        r = found.get(key, {})
        parts.append(f"{label} {r['first_s']:.2f} s" if "first_s" in r else f"{label}: {r.get('error')}")
    warm, prebuilt = found.get("disk_cache", {}).get("warm_us"), found.get("prebuilt", {}).get("warm_us")
    if warm is not None and prebuilt is not None:
        parts.append(f"warm call {warm:.0f} us (prebuilt {prebuilt:.0f} us)")
    tests = found.get("tests")
    parts.append(", ".join(f"{v} {k}" for k, v in tests.items()) if tests else "no JUnit XML")
    return "; ".join(parts)


def benchmark_files(log: str) -> list:
    """The result files a `python -m benchmarks` run says it wrote."""
    return re.findall(r"\] (?:results|record) written to (\S+)", log)


def _round(x, digits=3):
    return None if x is None else round(float(x), digits)


# ------------------------------------------------------------------------------------------------------------
# The summary.


def card_slug(card: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3" (for the summary's file name)."""
    words = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    return re.sub(r"^nvidia-", "", words) or "unknown"


def overall(results: list) -> str:
    return "ok" if results and all(r.status == "ok" for r in results) else "FAIL"


def summary_json(info: dict, results: list, extra: dict) -> dict:
    return {"format": SUMMARY_FORMAT, **info, "verdict": overall(results),
            "steps": [dataclasses.asdict(r) for r in results], **extra}


def summary_markdown(summary: dict) -> str:
    """The summary as Markdown: header, one line per step, then each step's numbers."""
    s = summary
    lines = [f"# gpu-check {s.get('date', '?')}: {s.get('card', '?')} — {s['verdict']}", "",
             f"- card: {s.get('card')} (sm {s.get('capability')}), driver {s.get('driver')}, "
             f"CUDA {s.get('cuda')} (torch's), nvcc {s.get('nvcc')}",
             f"- torch {s.get('torch')}, commit {s.get('commit')}",
             f"- budget {s.get('budget_s')} s, total {s.get('total_s')} s; command: `{s.get('command')}`",
             "", "| step | status | seconds | cap | detail |", "|---|---|---|---|---|"]
    for r in s["steps"]:
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {r['cap']} | {detail} |")
    tests = s.get("tests")
    if tests:
        lines += ["", "Tests: " + ", ".join(f"{v} {k}" for k, v in tests.items())]
    san = s.get("sanitizers")
    if san:
        lines += ["", "Sanitizers: " + "; ".join(
            f"{tool}: {v['errors'] if v['errors'] is not None else '?'} errors"
            + (f", {v['hazards']} hazards" if v.get("hazards") is not None else "")
            for tool, v in san.items())]
    kernels = s.get("kernels")
    if kernels:
        lines += ["", "| arch | kernel | dtype | D | registers | stack B | local B | static shared B "
                      "| LDL/STL | default path |", "|---|---|---|---|---|---|---|---|---|---|"]
        for k in kernels:
            lines.append(f"| {k['arch']} | {k['kernel']} | {k['dtype']} | {k['head_dim']} | {k['registers']} "
                         f"| {k['stack']} | {k['local']} | {k['shared']} | {k['ldl_stl']} "
                         f"| {'yes' if k['default_path'] else 'no'} |")
        lines += [""] + ([f"- {x}" for x in s.get("spill_lines", [])] or ["- no kernel spills"])
    bench = s.get("benchmarks")
    if bench:
        lines += ["", "| benchmark | numbers |", "|---|---|"]
        for case, row in bench.items():
            lines.append(f"| {case} | " + ", ".join(f"{k} {v}" for k, v in row.items()) + " |")
    return "\n".join(lines) + "\n"


def write_summary(summary: dict, results_dir: str, out_dir: str | None) -> list:
    """Writes gpu-check-<date>-<card>.md and .json to results_dir (and out_dir); returns their paths."""
    os.makedirs(results_dir, exist_ok=True)
    stem = os.path.join(results_dir, f"gpu-check-{summary.get('date', 'undated')}-"
                                     f"{card_slug(summary.get('card') or 'unknown')}")
    paths = [stem + ".md", stem + ".json"]
    with open(paths[0], "w") as f:
        f.write(summary_markdown(summary))
    with open(paths[1], "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        for p in paths:
            shutil.copy(p, out_dir)
    return paths


# ------------------------------------------------------------------------------------------------------------
# The steps.


class Check:
    def __init__(self, args):
        self.args = args
        self.budget = Budget(args.budget)
        self.work = os.path.abspath(args.work)
        os.makedirs(self.work, exist_ok=True)
        self.results: list = []
        self.lock = threading.Lock()
        self.info: dict = {}
        self.extra: dict = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        paths = [os.path.join(ROOT, "python")] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ
                                                  else [])
        self.env["PYTHONPATH"] = os.pathsep.join(paths)
        self.env.pop("CUDA_LAUNCH_BLOCKING", None)  # it would serialise the stream tests' race away

    def wanted(self, name):
        return (not self.args.only or name in self.args.only) and name not in (self.args.skip or [])

    def record(self, result: Result):
        with self.lock:
            self.results.append(result)
        print(f"[{self.budget.elapsed():5.0f} s] {result.name:10s} {result.status:8s} {result.seconds:5.0f} s"
              f"  {result.detail}", flush=True)

    def step(self, name, cmd, env=None, detail=lambda log: ""):
        """Runs cmd as step `name` under its cap and the budget; records and returns its Result."""
        if not self.wanted(name):
            return None
        limit = self.budget.limit(CAPS[name])
        if not limit:
            result = Result(name, "SKIPPED", 0.0, 0, "the budget is spent")
        else:
            log = os.path.join(self.work, f"{name}.log")
            rc, seconds = run_command(cmd, log, limit, env=env or self.env)
            with open(log, errors="replace") as f:
                text = f.read()
            result = outcome(name, rc, seconds, limit, log, detail(text))
        self.record(result)
        return result

    def tool(self, name):
        return find_tool(name)

    # env ------------------------------------------------------------------------------------------------
    def env_step(self):
        probe = ("import json, torch; p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() "
                 "else None; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
                 "'card': p.name if p else None, 'capability': f'{p.major}.{p.minor}' if p else None}))")
        t0 = time.monotonic()
        info = {"torch": None, "cuda": None, "card": None, "capability": None}
        problems = []
        try:
            out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=CAPS["env"],
                                 env=self.env, cwd=ROOT)
            info.update(json.loads(out.stdout.strip().splitlines()[-1]))
        except (subprocess.SubprocessError, ValueError, IndexError, OSError) as e:
            problems.append(f"torch probe failed: {e}")
        info["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        nvcc = _first_line(["nvcc", "--version"], last=True)
        info["nvcc"] = nvcc.split(",")[-1].strip() if nvcc else None
        info["commit"] = os.environ.get("GPU_CHECK_COMMIT") or _first_line(
            ["git", "-C", ROOT, "describe", "--always", "--dirty", "--abbrev=12"]) or "unknown"
        self.info.update(info)
        if not info["card"]:
            problems.append("torch sees no CUDA device")
        for name in ("nvcc", "cuobjdump", "compute-sanitizer"):
            if not self.tool(name):
                problems.append(f"no {name}")
        status = "FAIL" if not info["card"] else "ok"
        self.record(Result("env", status, time.monotonic() - t0, CAPS["env"],
                           "; ".join([f"{info['card']} sm {info['capability']}"] + problems)))

    # build ----------------------------------------------------------------------------------------------
    def build_step(self):
        arch = self.info.get("capability")
        if not arch:
            if self.wanted("build"):
                self.record(Result("build", "SKIPPED", 0, CAPS["build"], "no CUDA device"))
            return
        for stale in glob.glob(os.path.join(ROOT, "python", "attnx", "_C*.so")):
            os.remove(stale)
        env = dict(self.env, TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=os.environ.get("MAX_JOBS", "16"),
                   ATTNX_WITH_CUDA="1")
        check = ("import attnx; from attnx import _loader; b = _loader.loaded_backends(); "
                 "assert 'CUDA' in b, f'the CUDA library did not load: {b}'; print('loaded', b)")
        cmd = ["bash", "-c", f'"{PY}" setup.py build_ext --inplace && "{PY}" -c "{check}"']
        self.step("build", cmd, env=env,
                  detail=lambda log: (re.findall(r"attnx: building[^\n]*", log) or [""])[0][:200])

    # binary ---------------------------------------------------------------------------------------------
    def binary_step(self):
        if not self.wanted("binary"):
            return
        t0 = time.monotonic()
        log = os.path.join(self.work, "binary.log")
        libs = glob.glob(os.path.join(ROOT, "python", "attnx", "_C_cuda*.so"))
        cuobjdump = self.tool("cuobjdump")
        if not libs or not cuobjdump:
            self.record(Result("binary", "FAIL", 0, CAPS["binary"],
                               "no python/attnx/_C_cuda*.so" if not libs else "no cuobjdump", log))
            return
        limit = self.budget.limit(CAPS["binary"]) or MIN_STEP
        arch = self.info.get("capability")
        arch = f"sm_{arch.replace('.', '')}" if arch else None
        # The kernels the default dispatch takes on this GPU, as the library names them.
        asked = subprocess.run([PY, "-c", ASK_DEFAULT_KERNELS], capture_output=True, text=True, cwd=ROOT,
                               env=self.env, timeout=limit)
        default = default_kernels(json.loads(asked.stdout)) if asked.returncode == 0 else None
        try:
            rows, usage = binary_report(libs[0], cuobjdump, arch, limit, default)
        except subprocess.TimeoutExpired:
            self.record(Result("binary", "TIMEOUT", time.monotonic() - t0, limit, "cuobjdump", log))
            return
        except subprocess.CalledProcessError as e:
            self.record(Result("binary", "FAIL", time.monotonic() - t0, limit,
                               f"cuobjdump exit {e.returncode}: {(e.stderr or '').strip()[:200]}", log))
            return
        ok, lines = spill_verdict(rows)
        if default is None:
            lines.append("note: the default kernels could not be asked (every spill fails): "
                         + asked.stderr.strip()[-300:])
        symbols = _nm_checks(libs[0])
        with open(log, "w") as f:
            f.write(f"{libs[0]}\n{cuobjdump}\n\n{usage}\n\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.write("\n".join(lines + symbols["lines"]) + "\n")
        self.extra["kernels"] = rows
        self.extra["spill_lines"] = lines
        problems = [x for x in lines if x.startswith("FAIL")] + symbols["problems"]
        if not rows:
            problems.append(f"no attention kernel for {arch or 'any arch'} in the library")
        status = "ok" if ok and rows and not symbols["problems"] else "FAIL"
        detail = f"{len(rows)} kernels, {sum(r['spills'] for r in rows)} spill" + (
            "; " + "; ".join(problems) if problems else "")
        self.record(Result("binary", status, time.monotonic() - t0, limit, detail, log))

    # tests ----------------------------------------------------------------------------------------------
    def tests_step(self):
        xml = os.path.join(self.work, "pytest.xml")
        extra = []
        if subprocess.run([PY, "-c", "import pytest_timeout"], capture_output=True).returncode == 0:
            extra = ["--timeout=120"]
        cmd = [PY, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra,
               "-m", "cuda"]

        def detail(log):
            if not os.path.exists(xml):
                return "no JUnit XML"
            counts = parse_junit(xml)
            self.extra["tests"] = counts
            return ", ".join(f"{v} {k}" for k, v in counts.items())

        result = self.step("tests", cmd, detail=detail)
        if result and result.status == "ok" and self.extra.get("tests", {}).get("passed", 0) == 0:
            result.status, result.detail = "FAIL", result.detail + "; nothing passed (all skipped?)"

    # sanitizers -----------------------------------------------------------------------------------------
    def sanitizer_steps(self):
        sanitizer = self.tool("compute-sanitizer")
        cases = os.path.join(ROOT, "tools", "gpu_sanitize_cases.py")
        self.extra.setdefault("sanitizers", {})
        for name in SANITIZERS:
            if not self.wanted(name):
                continue
            if not sanitizer:
                self.record(Result(name, "SKIPPED", 0, CAPS[name], "no compute-sanitizer"))
                continue
            env = dict(self.env, PYTORCH_NO_CUDA_MEMORY_CACHING="1") if name == "memcheck" else self.env
            cmd = [sanitizer, "--tool", name, "--error-exitcode", "97", "--print-limit", "20", PY, cases]

            def detail(log, name=name):
                found = parse_sanitizer(log)
                self.extra["sanitizers"][name] = found
                text = f"{found['errors'] if found['errors'] is not None else '?'} errors"
                if found["hazards"] is not None:
                    text += f", {found['hazards']} hazards"
                return text + ("" if found["finished"] else "; the cases did not all run")

            self.step(name, cmd, env=env, detail=detail)

    # bench ----------------------------------------------------------------------------------------------
    def benchmarks_command(self, *only):
        """python -m benchmarks on the GPU, quick, for the benchmarks `only` names."""
        return [PY, "-m", "benchmarks", "--device", "cuda", *(a for name in only for a in ("--only", name)),
                "--quick", "--no-plots", "--results-dir", self.args.results_dir]

    def bench_step(self):
        cmd = self.benchmarks_command("cuda", "eval")

        def detail(log):
            written = benchmark_files(log)
            self.extra["bench_files"] = written
            for path in written:
                if path.endswith(".json") and os.path.exists(path):
                    with open(path) as f:
                        self.extra["benchmarks"] = benchmark_ratios(json.load(f))
            ratios = [v["ratio"] for k, v in self.extra.get("benchmarks", {}).items() if v.get("ratio")]
            return f"attnx / best SDPA TFLOP/s: {min(ratios)} .. {max(ratios)}" if ratios else ""

        self.step("bench", cmd, detail=detail)

    # the fused backward's benchmarks (opt-in until it has run on a GPU) -------------------------------------
    def backward_step(self):
        cmd = self.benchmarks_command("backward", "train")

        def detail(log):
            written = benchmark_files(log)
            self.extra["backward_bench_files"] = written
            return f"{len(written)} result files"

        self.step("backward", cmd, env=dict(self.env, ATTNX_CUDA_FUSED_BACKWARD="1"), detail=detail)

    # the kernels compiled at run time --------------------------------------------------------------------
    def runtime_step(self):
        xml = os.path.join(self.work, "runtime.xml")
        cmd = [PY, os.path.join(ROOT, "tools", "gpu_runtime.py"), "--cache",
               os.path.join(self.work, "rtc-cache"), "--junit", xml]

        def detail(log):
            found = parse_runtime(log)
            self.extra["runtime"] = found
            return runtime_detail(found)

        self.step("runtime", cmd, detail=detail)

    # the forward's tile-shape family --------------------------------------------------------------------
    def family_step(self):
        cmd = [PY, os.path.join(ROOT, "tools", "gpu_family.py"), "--results-dir", self.args.results_dir]

        def detail(log):
            lines = [line for line in log.splitlines() if line.startswith("family-sweep: ")]
            if not lines:
                return "no family-sweep line"
            best = json.loads(lines[-1][len("family-sweep: "):])
            self.extra["family"] = best
            return "; ".join(f"{k}: {v['shape']} {v['tflops']} TFLOP/s" for k, v in best.items()
                             if "shape" in v)

        self.step("family", cmd, env=dict(self.env, ATTNX_CUDA_RUNTIME_COMPILE="1"), detail=detail)

    # the whole run --------------------------------------------------------------------------------------
    def run(self) -> int:
        self.env_step()
        if self.wanted("build"):
            self.build_step()
        self.binary_step()
        if self.info.get("card"):
            side = threading.Thread(target=self.sanitizer_steps)
            side.start()
            if self.wanted("tests"):
                self.tests_step()
            side.join()
            if self.wanted("bench"):
                self.bench_step()
            if self.wanted("backward"):
                self.backward_step()
            if self.wanted("runtime"):
                self.runtime_step()
            if self.wanted("family"):
                self.family_step()
        else:
            for name in ["tests", *SANITIZERS, "bench", "backward", "runtime", "family"]:
                if self.wanted(name):
                    self.record(Result(name, "SKIPPED", 0, CAPS[name], "no CUDA device"))
        return self.finish()

    def finish(self) -> int:
        order = {n: i for i, n in enumerate(STEP_NAMES)}
        self.results.sort(key=lambda r: order[r.name])
        self.info.update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                         budget_s=self.args.budget, total_s=round(self.budget.elapsed()),
                         command=" ".join(["python", "tools/gpu_check.py", *sys.argv[1:]]))
        summary = summary_json(self.info, self.results, self.extra)
        paths = write_summary(summary, self.args.results_dir, self.args.out)
        if self.args.out:
            for path in self.extra.get("bench_files", []) + self.extra.get("backward_bench_files", []):
                if os.path.exists(path):
                    shutil.copy(path, self.args.out)
            with tarfile.open(os.path.join(self.args.out, "gpu-check-logs.tar.gz"), "w:gz") as tar:
                for log in sorted(glob.glob(os.path.join(self.work, "*.log")) +
                                  glob.glob(os.path.join(self.work, "*.xml"))):
                    tar.add(log, arcname=os.path.basename(log))
        for r in self.results:
            if r.status != "ok" and r.log and os.path.exists(r.log):
                with open(r.log, errors="replace") as f:
                    tail = f.read().splitlines()[-25:]
                print(f"---- tail of {os.path.relpath(r.log, ROOT)}\n" + "\n".join(tail))
        print("\n" + summary_markdown(summary))
        print("written: " + ", ".join(os.path.relpath(p, ROOT) for p in paths)
              + (f" (and copied to {self.args.out})" if self.args.out else ""))
        return 0 if summary["verdict"] == "ok" else 1


def _first_line(cmd, last=False):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out[-1] if last else out[0]).strip() if out else None


def find_tool(name):
    """A CUDA tool (cuobjdump, compute-sanitizer) on PATH, under $CUDA_HOME, in the usual toolkit folders or,
    for cuobjdump, the one triton ships beside this Python's torch; None when there is none."""
    found = shutil.which(name)
    if found:
        return found
    home = [os.path.join(os.environ[v], "bin", name) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for pattern in (*home, f"/usr/local/cuda*/bin/{name}", f"/opt/nvidia/*/{name}",
                    f"/opt/nvidia/*/*/{name}"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    if name == "cuobjdump":  # triton ships one
        hits = glob.glob(os.path.join(os.path.dirname(PY), "..", "lib", "python3*", "site-packages",
                                      "triton", "backends", "nvidia", "bin", "cuobjdump"))
        if hits:
            return hits[0]
    return None


def binary_report(lib, cuobjdump, arch=None, timeout=None, default=None):
    """(kernel_report rows, the resource-usage text) of a built _C_cuda library, from cuobjdump's resource
    usage and SASS: the kernels of `arch` (e.g. "sm_90"), or of every arch in the library when None;
    ``default`` as kernel_report's. Also tests/test_cuda_binary.py's spill check. Raises
    subprocess.TimeoutExpired."""
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", lib], capture_output=True, text=True,
                           timeout=timeout, check=True).stdout
    resources = parse_resource_usage(usage)
    # Local memory is a kernel's stack frame (spill slots, local arrays): where no kernel has one, no LDL or
    # STL can reach any, and the SASS (some 180 MB of it, half a minute of cuobjdump) is not read.
    local_accesses = {}
    if any(r["stack"] or r["local"] for r in resources.values()):
        sass = subprocess.run([cuobjdump, "-sass", lib], capture_output=True, text=True, timeout=timeout,
                              check=True).stdout
        local_accesses = count_local_accesses(sass)
    return kernel_report(resources, local_accesses, arch, default), usage


def _nm_checks(lib):
    """The library takes the current stream from torch's C shim and libstdc++ from the system
    (csrc/cuda/README.md): a `T` for _M_insert<long> means a statically linked copy."""
    lines, problems = [], []
    try:
        undefined = subprocess.run(["nm", "-D", "--undefined-only", lib], capture_output=True, text=True,
                                   timeout=30).stdout
        defined = subprocess.run(["nm", "-C", lib], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"lines": [f"nm unavailable: {e}"], "problems": []}
    if "aoti_torch_get_current_cuda_stream" not in undefined:
        problems.append("the stream getter aoti_torch_get_current_cuda_stream is not imported")
    if re.search(r" [TW] .*_M_insert<long>", defined):
        problems.append("libstdc++'s _M_insert<long> is linked in statically (see csrc/cuda/README.md)")
    lines.append("nm: stream getter imported, libstdc++ not linked in" if not problems else "nm: problems")
    return {"lines": lines, "problems": problems}


# ------------------------------------------------------------------------------------------------------------
# The dry run: the plan, and the summary writer on made-up results.


def fake_results() -> tuple[dict, list, dict]:
    info = {"card": "NVIDIA H100 80GB HBM3 (dry run)", "capability": "9.0", "driver": "000.00",
            "cuda": "13.0", "nvcc": "V13.0.00", "torch": "0.0.0+dry", "commit": "dry-run",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "budget_s": 450,
            "total_s": 0, "command": "python tools/gpu_check.py --dry-run"}
    results = [Result("env", "ok", 1, 30, "made up"), Result("build", "ok", 95, 240, "made up"),
               Result("binary", "FAIL", 6, 60, "made up: a default-path kernel spills"),
               Result("tests", "ok", 70, 200, "420 passed, 0 failed, 0 errors, 0 skipped"),
               Result("memcheck", "ok", 80, 150, "0 errors"),
               Result("racecheck", "TIMEOUT", 100, 100, "killed after 100 s"),
               Result("synccheck", "SKIPPED", 0, 0, "the budget is spent"),
               Result("bench", "ok", 90, 150, "made up")]
    rows = [{"arch": "sm_90", "kernel": "mma", "dtype": "fp16", "head_dim": 64, "rows_per_warp": None,
             "registers": 182, "stack": 0, "shared": 1024, "local": 0, "ldl_stl": 0, "spills": False,
             "default_path": True},
            {"arch": "sm_90", "kernel": "simt", "dtype": "fp32", "head_dim": 128, "rows_per_warp": 4,
             "registers": 128, "stack": 24, "shared": 1024, "local": 0, "ldl_stl": 10, "spills": True,
             "default_path": True}]
    extra = {"tests": {"passed": 420, "failed": 0, "errors": 0, "skipped": 0},
             "sanitizers": {"memcheck": {"errors": 0, "hazards": None, "finished": True},
                            "racecheck": {"errors": None, "hazards": None, "finished": False}},
             "kernels": rows, "spill_lines": spill_verdict(rows)[1],
             "benchmarks": {"cuda float16 L=S=1024 D=64": {"attnx_tflops": 68.8, "best_sdpa": "sdpa cudnn",
                                                           "best_sdpa_tflops": 264.7, "ratio": 0.26}}}
    return info, results, extra


def dry_run(args) -> int:
    print(f"gpu-check plan (budget {args.budget} s, {RESERVE} s kept for the summary; python {PY}):")
    for s in STEPS:
        mark = " " if (not args.only or s.name in args.only) and s.name not in (args.skip or []) else "-"
        print(f" {mark} {s.name:10s} cap {s.cap:3d} s  {s.what}")
    print("   tests run beside memcheck -> racecheck -> synccheck; bench runs last, alone")
    print(f"   logs: {os.path.relpath(os.path.abspath(args.work), ROOT)}/; summary: "
          f"{os.path.relpath(os.path.abspath(args.results_dir), ROOT)}/gpu-check-<date>-<card>.md and .json"
          + (f", copied to {args.out}" if args.out else ""))
    info, results, extra = fake_results()
    info["budget_s"] = args.budget
    summary = summary_json(info, results, extra)
    paths = write_summary(summary, args.results_dir, args.out)
    print("\n" + summary_markdown(summary))
    print("dry run: made-up results written to " + ", ".join(paths))
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                        help="print the plan and write a summary of made-up results "
                        "(also GPU_CHECK_DRY_RUN=1)")
    parser.add_argument("--budget", type=int, default=int(os.environ.get("BUDGET", DEFAULT_BUDGET)),
                        help=f"seconds for the whole run (env BUDGET; default {DEFAULT_BUDGET})")
    parser.add_argument("--only", action="append", choices=STEP_NAMES, help="run only these steps")
    parser.add_argument("--skip", action="append", choices=STEP_NAMES, help="leave these steps out")
    parser.add_argument("--results-dir", default=None,
                        help="where the summary and benchmark records go (default benchmarks/results; "
                        "a dry run: build/gpu-check/dry-run)")
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "gpu-check"), help="logs")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="a folder to copy the summary, benchmark records and logs to (default $OUT)")
    args = parser.parse_args(argv)
    if args.results_dir is None:
        args.results_dir = (os.path.join(args.work, "dry-run") if args.dry_run
                            else os.path.join(ROOT, "benchmarks", "results"))
    args.results_dir = os.path.abspath(args.results_dir)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    if args.dry_run:
        return dry_run(args)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
