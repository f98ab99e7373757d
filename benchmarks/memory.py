"""Peak extra memory of one call, measured in a fresh process so nothing earlier in the run can hide it.

CPU: the high-water mark of the resident set after the call minus the resident set just before it, once a
small warm-up call has initialised the libraries (thread pools, BLAS buffers). On Linux the high-water mark
(VmHWM) is reset right before the call (``/proc/self/clear_refs``): ``ru_maxrss`` would not do, since it
survives exec and so starts at the RSS of the process that started this one. Large tensors are mmap-backed
and returned to the system when freed, so the difference is the call's peak. That holds only with a fixed
mmap threshold: glibc raises its threshold whenever an mmap-backed block is freed (up to 32 MiB), after which
blocks below it come from the heap, whose freed memory the process keeps, and the figure then depends on the
order of earlier allocations (measured: 24 to 278 MiB for the same call). :func:`measure` fixes it at 128 KiB
(glibc's default start), as ``MALLOC_MMAP_THRESHOLD_`` would.
CUDA: ``torch.cuda.max_memory_allocated`` after resetting it, minus what was allocated before the call.

MPS: not measured (torch has no peak counter for it); reported as ``None``.

Usage from a benchmark: ``peak_extra_bytes("benchmarks.bench_mha:eval_case", impl="attnx", ...)`` runs
``python -m benchmarks.memory`` with the factory's name and keyword arguments; the factory returns
``(fn, warmup_fn)``, both called under ``torch.no_grad()`` unless ``grad=True`` (a training step).
``peak_extra_bytes_many`` measures several jobs, a few at a time: memory is per process, so running them side
by side changes no figure, only the wall time. On Linux one interpreter imports torch, attnx and the jobs'
modules (and those a module names in ``MEMORY_PRELOAD``, e.g. transformers) and forks a process per job, each
measured as a fresh one is: it starts from that interpreter's state, which ran no op, instead of paying
seconds of imports per job. The interpreter must not have touched the GPU or torch's thread pool, which
forked processes could not use: it only imports.
"""

import ctypes
import importlib
import json
import os
import resource
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    if sys.platform.startswith("linux"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS


def _peak_rss_bytes() -> int:
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def _fix_mmap_threshold() -> None:
    """glibc: every block of 128 KiB or more mmap-backed, returned to the system when freed (see above)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return
        M_MMAP_THRESHOLD = -3
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def measure(factory: str, device: str, kwargs: dict, grad: bool = False) -> dict:
    _fix_mmap_threshold()
    module, name = factory.split(":")
    fn, warmup = getattr(importlib.import_module(module), name)(device=device, **kwargs)
    with torch.set_grad_enabled(grad):
        warmup()
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return {"peak_extra_bytes": torch.cuda.max_memory_allocated() - before}
        _reset_peak_rss()
        before = _rss_bytes()
        fn()
        return {"peak_extra_bytes": _peak_rss_bytes() - before}


def _command(factory: str, device: str, kwargs: dict, grad: bool) -> list:
    return [sys.executable, "-m", "benchmarks.memory", factory, device, json.dumps(kwargs), str(int(grad))]


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(command: list) -> int:
    out = subprocess.run(command, capture_output=True, text=True, cwd=_ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:])} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_bytes"]


def peak_extra_bytes(factory: str, device: str = "cpu", grad: bool = False, **kwargs):
    """Run ``factory`` in a fresh interpreter and return the peak extra bytes of one call (None on MPS)."""
    if device == "mps":
        return None
    return _run(_command(factory, device, kwargs, grad))


def peak_extra_bytes_many(jobs: list, device: str = "cpu", workers: int = 1) -> list:
    """``peak_extra_bytes`` for each ``(factory, grad, kwargs)`` in ``jobs``, ``workers`` processes at a time.

    Only memory is measured here, so processes may share the machine; keep ``workers`` at 1 where one job
    alone takes a large part of the machine's memory. On CUDA they always run one at a time.
    """
    if device == "mps":
        return [None] * len(jobs)
    workers = 1 if device == "cuda" else max(1, workers)
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-m", "benchmarks.memory", "--forks", device, str(workers)]
        out = subprocess.run(command, input=json.dumps(jobs), capture_output=True, text=True, cwd=_ROOT)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(command[2:])} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    commands = [_command(factory, device, kwargs, grad) for factory, grad, kwargs in jobs]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_run, commands))


def _forks(device: str, workers: int, jobs: list) -> list:
    """``python -m benchmarks.memory --forks``: imports what the jobs need, then measures each in a forked
    process, ``workers`` at a time; the peaks in the jobs' order."""
    for module in sorted({factory.split(":")[0] for factory, _, _ in jobs}):
        for name in getattr(importlib.import_module(module), "MEMORY_PRELOAD", ()):
            try:
                importlib.import_module(name)
            except ImportError:  # optional: a job that needs it says so itself
                pass
    peaks, running = [None] * len(jobs), {}

    def reap():
        pid, status = os.wait()
        index, read = running.pop(pid)
        with os.fdopen(read) as f:
            text = f.read()
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"job {jobs[index]} failed (exit {os.waitstatus_to_exitcode(status)})")
        peaks[index] = json.loads(text)["peak_extra_bytes"]

    for index, (factory, grad, kwargs) in enumerate(jobs):
        while len(running) >= workers:
            reap()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the measured process: its result through the pipe, its exit code says whether it ran
            os.close(read)
            code = 1
            try:
                os.write(write, json.dumps(measure(factory, device, kwargs, grad)).encode())
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        running[pid] = index, read
    while running:
        reap()
    return peaks


if __name__ == "__main__":
    if sys.argv[1] == "--forks":
        print(json.dumps(_forks(sys.argv[2], int(sys.argv[3]), json.load(sys.stdin))))
    else:
        print(json.dumps(measure(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), grad=sys.argv[4] == "1")))
