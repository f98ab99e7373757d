"""``python -m benchmarks [--quick] [--only CASE] [--device D]``: the seed problems and attnx's answer.

Runs every case on the CPU and on each GPU present, prints a table per case (progress lines go to stderr),
merges the results into ``benchmarks/results/<device>-<date>.json`` and draws the scaling plots
(``<device>-<date>-scaling.png``, when matplotlib is installed). ``--quick`` takes fewer shapes and
repetitions (a couple of minutes on a small CPU); ``--smoke`` takes tiny shapes, to check that a case runs.
"""

import argparse
import inspect
import os
import sys
import time

import torch

from . import (
    bench_attention,
    bench_b1,
    bench_backward,
    bench_cuda,
    bench_features,
    bench_mha,
    bench_models,
    bench_overhead,
    bench_scaling,
    bench_train,
)
from .common import RESULTS_DIR, progress, write_results

# name -> module with TITLE, DEVICES (the devices it has cases for) and run(device, quick[, smoke]) returning
# {"results": <JSON-able>, "text": <tables>}. The first four are the seed problems, in the report's order.
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
        results = {}
        for name in (n for d, n in plan if d == device):
            module = BENCHMARKS[name]
            progress.begin(plan.index((device, name)) + 1, len(plan), f"{device} {name}")
            kwargs = {"device": device, "quick": args.quick}
            if args.smoke:
                if "smoke" not in inspect.signature(module.run).parameters:
                    progress("no smoke shapes, skipped")
                    continue
                kwargs["smoke"] = True
            progress(f"{module.TITLE}")
            t0 = time.perf_counter()
            load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
            out = module.run(**kwargs)
            results[name] = {
                "results": out["results"],
                "text": out["text"],
                "seconds": time.perf_counter() - t0,
                "load_average_at_start": load,
            }
            print(f"== [{device}] {name}: {module.TITLE}\n{out['text']}\n", flush=True)
        if not results:
            continue
        if args.smoke and not args.results_dir:
            print(f"[{device}] smoke run: no result file written", flush=True)
            continue
        path = write_results(device, results, options, args.results_dir or RESULTS_DIR)
        print(f"[{device}] results written to {path}", flush=True)
        if "scaling" in results and not args.no_plots:
            print(f"[{device}] {bench_scaling.plot(path)}", flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
