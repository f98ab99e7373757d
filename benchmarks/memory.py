"""Peak extra memory of one call, measured in a fresh process so nothing earlier in the run can hide it.

CPU: the high-water mark of the resident set after the call minus the resident set just before it, once a
small warm-up call has initialised the libraries (thread pools, BLAS buffers). On Linux the high-water mark
(VmHWM) is reset right before the call (``/proc/self/clear_refs``): ``ru_maxrss`` would not do, since it
survives exec and so starts at the RSS of the process that started this one. Large tensors are mmap-backed
and returned to the system when freed, so the difference is the call's peak.
CUDA: ``torch.cuda.max_memory_allocated`` after resetting it, minus what was allocated before the call.

Usage from a benchmark: ``peak_extra_bytes("benchmarks.bench_mha:eval_case", impl="attnx", ...)`` runs
``python -m benchmarks.memory`` with the factory's name and keyword arguments; the factory returns
``(fn, warmup_fn)``.
"""

import importlib
import json
import os
import resource
import subprocess
import sys

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


def measure(factory: str, device: str, kwargs: dict) -> dict:
    module, name = factory.split(":")
    fn, warmup = getattr(importlib.import_module(module), name)(device=device, **kwargs)
    with torch.no_grad():
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


def peak_extra_bytes(factory: str, device: str = "cpu", **kwargs) -> int:
    """Run ``factory`` in a fresh interpreter and return the peak extra bytes of one call."""
    if device == "mps":
        raise NotImplementedError("peak memory on MPS is not measured yet")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", factory, device, json.dumps(kwargs)],
        capture_output=True, text=True, check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_extra_bytes"]


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
