"""``python -m benchmarks [--quick] [--only CASE] [--device D]``: the upstream problems and attnx's answer.

Runs every case on the CPU and on each GPU present, prints a table per case (progress lines go to stderr),
merges the results into ``benchmarks/results/<device>-<date>.json``, writes the run's record
``<device>-<date>-<commit>.md`` (the machine, load and command, then the tables as printed) and its copy
``LATEST-<device>.md``, and draws the scaling plots (``<device>-<date>-scaling.png``, when matplotlib is
installed). ``--quick`` takes fewer shapes and repetitions (a couple of minutes on a small CPU); ``--smoke``
takes tiny shapes, to check that a case runs, and writes nothing unless given ``--results-dir``.
"""

import argparse
import datetime
import os
import shlex
import sys
import time

import torch

from . import (
    bench_attention,
    bench_b1,
    bench_backward,
    bench_batching,
    bench_cpu16,
    bench_cuda,
    bench_features,
    bench_flex,
    bench_mha,
    bench_models,
    bench_overhead,
    bench_scaling,
    bench_sdpa,
    bench_train,
    bench_varlen,
)
from .common import RESULTS_DIR, load_average, machine, progress, write_record, write_results

# name -> module with TITLE, DEVICES (the devices it has cases for) and run(device, quick, smoke) returning
# {"results": <JSON-able>, "text": <tables>}. The first four are the upstream problems, in the report's order.
BENCHMARKS = {
    "eval": bench_mha,
    "b1": bench_b1,
    "train": bench_train,
    "scaling": bench_scaling,
    "attention": bench_attention,
    "backward": bench_backward,
    "cuda": bench_cuda,
    "features": bench_features,
    "models": bench_models,
    "overhead": bench_overhead,
    "sdpa": bench_sdpa,
    "varlen": bench_varlen,
    "batching": bench_batching,
    "flex": bench_flex,
    "cpu16": bench_cpu16,
}


def default_devices() -> list:
    return (
        ["cpu"]
        + (["cuda"] if torch.cuda.is_available() else [])
        + (["mps"] if torch.backends.mps.is_available() else [])
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks that the cases run")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append", help="run only these cases")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "mps"),
        action="append",
        help="devices (default: cpu plus any GPU present)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    parser.add_argument(
        "--results-dir",
        help=f"where results and plots go (default: {os.path.relpath(RESULTS_DIR)}; a --smoke run writes "
        "none unless given one)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)

    options = {"quick": args.quick, "smoke": args.smoke}
    devices = args.device or default_devices()
    missing = [d for d in devices if d not in default_devices()]
    if missing:
        print(f"no {', '.join(missing)} device here", file=sys.stderr)
        return 2
    names = args.only or list(BENCHMARKS)
    plan = [(device, name) for device in devices for name in names if device in BENCHMARKS[name].DEVICES]
    if not plan:
        print(f"nothing to run: {', '.join(names)} has no case for {', '.join(devices)}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    for device in devices:
        run = {
            "started": datetime.datetime.now(datetime.timezone.utc),
            "machine": machine(device),
            "load_start": load_average(),
            "command": shlex.join(["python", "-m", "benchmarks", *argv]),
            "options": vars(args),
        }
        results = {}
        for name in (n for d, n in plan if d == device):
            module = BENCHMARKS[name]
            progress.begin(plan.index((device, name)) + 1, len(plan), f"{device} {name}")
            progress(f"{module.TITLE}")
            t0 = time.perf_counter()
            load = load_average()
            out = module.run(device=device, quick=args.quick, smoke=args.smoke)
            results[name] = {
                "results": out["results"],
                "text": out["text"],
                "seconds": time.perf_counter() - t0,
                "load_average_at_start": load,
            }
            print(f"== [{device}] {name}: {module.TITLE}\n{out['text']}\n", flush=True)
        run["ended"], run["load_end"] = datetime.datetime.now(datetime.timezone.utc), load_average()
        if not results:
            continue
        if args.smoke and not args.results_dir:
            print(f"[{device}] smoke run: no result file written", flush=True)
            continue
        results_dir = args.results_dir or RESULTS_DIR
        path = write_results(device, results, options, results_dir, now=run["ended"])
        print(f"[{device}] results written to {path}", flush=True)
        # the record holds the very strings printed above, so its tables are the run's own output
        cases = {name: {"title": BENCHMARKS[name].TITLE, **case} for name, case in results.items()}
        record, latest = write_record(device, cases, run, results_dir)
        print(f"[{device}] record written to {record} (copied to {latest})", flush=True)
        if "scaling" in results and not args.no_plots:
            print(f"[{device}] {bench_scaling.plot(path)}", flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
