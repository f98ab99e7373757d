"""Before/after figures for PR.md: the eval case of pytorch#166166 on CPU, installed torch vs patch.diff.

    PYTHONPATH=upstream python upstream/mha-eval-fastpath/bench.py [--batch 8] [--seq 2000] [--repeats 5]

Peak memory: one call in a fresh process per (module, path, masks); the resident set's high-water mark
(VmHWM, reset through /proc/self/clear_refs right before the call) minus the resident set before it, after a
small warm-up call (as benchmarks/memory.py in this repository). Time: the median of ``--repeats`` calls in
one process, the three paths interleaved, so that ratios are taken under the same load. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import harness  # noqa: E402

PATHS = ("fast path, torch 2.14.1", "fast path, patched", "slow path")


def build(module: str, path: str, B: int, L: int, masks: str, patched_dir: str):
    """``(fn, warmup)`` for one module / path / masks, as in the report: E=256, H=4, fp32, no_grad."""
    torch.manual_seed(0)
    if path == "fast path, patched":
        files = harness.apply(HERE / "patch.diff", pathlib.Path(patched_dir))
        activation = harness.load(files["torch/nn/modules/activation.py"], "torch.nn.modules.activation")
        with harness.swapped_in(torch__nn__modules__activation=activation):
            transformer = harness.load(files["torch/nn/modules/transformer.py"],
                                       "torch.nn.modules.transformer")
    else:
        activation, transformer = torch.nn.modules.activation, torch.nn.modules.transformer
    if module == "MultiheadAttention":
        m = activation.MultiheadAttention(256, 4, batch_first=True).eval()

        def call(x, attn, kpm):
            return m(x, x, x, attn_mask=attn, key_padding_mask=kpm, need_weights=False)[0]
    else:
        m = transformer.TransformerEncoderLayer(256, 4, 1024, batch_first=True).eval()

        def call(x, attn, kpm):
            return m(x, src_mask=attn, src_key_padding_mask=kpm)

    def inputs(b, n):
        x = torch.randn(b, n, 256)
        kpm = torch.zeros(b, n, dtype=torch.bool) if "kpm" in masks else None
        attn = torch.zeros(n, n, dtype=torch.bool) if "attn" in masks else None
        return x, attn, kpm

    def run(args):
        torch.backends.mha.set_fastpath_enabled(path != "slow path")
        with torch.no_grad():
            return call(*args)

    big, small = inputs(B, L), inputs(2, 16)
    return (lambda: run(big)), (lambda: run(small))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as d:
        fn, warmup = build(spec["module"], spec["path"], spec["B"], spec["L"], spec["masks"], d)
        warmup()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        before = _rss()
        fn()
        print(json.dumps({"peak_extra_bytes": _peak() - before}))


def peak_extra(spec: dict) -> int:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_bytes"]


def times(module: str, B: int, L: int, masks: str, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        fns = {p: build(module, p, B, L, masks, d) for p in PATHS}
        outs = {p: fn() for p, (fn, _) in fns.items()}
        for p in PATHS[1:]:  # check outputs before timing
            torch.testing.assert_close(outs[p], outs[PATHS[0]], atol=1e-4, rtol=1e-4)
        del outs
        samples: dict = {p: [] for p in PATHS}
        for _ in range(repeats):
            for p, (fn, _) in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[p].append(time.perf_counter() - t0)
    return {p: statistics.median(s) for p, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--masks", default="attn+kpm,kpm")
    ap.add_argument("--modules", default="MultiheadAttention,TransformerEncoderLayer")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not harness.is_pinned():
        sys.exit(harness.skip_reason())
    B, L = args.batch, args.seq
    unit = B * 4 * L * L * 4
    print(f"torch {torch.__version__}, {args.threads} threads, B={B} L=S={L} E=256 H=4 fp32, "
          f"need_weights=False; one fp32 (B, H, L, S) tensor = {unit / 2**20:.0f} MiB")
    for module in args.modules.split(","):
        for masks in args.masks.split(","):
            row = {"module": module, "masks": masks, "B": B, "L": L, "threads": args.threads}
            peaks = {p: peak_extra({**row, "path": p}) for p in PATHS}
            secs = {} if args.no_time else times(module, B, L, masks, args.repeats, args.threads)
            for p in PATHS:
                t = f", {secs[p] * 1e3:8.1f} ms" if secs else ""
                print(f"{module:24s} {masks:9s} {p:24s} peak extra {peaks[p] / 2**20:8.1f} MiB "
                      f"({peaks[p] / unit:4.2f} units){t}")
            print(json.dumps({**row, "peak_extra_bytes": peaks, "median_s": secs}))


if __name__ == "__main__":
    main()
