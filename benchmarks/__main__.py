"""``python -m benchmarks [--quick] [--device cpu|cuda|mps]``: run every benchmark and record the results."""

import argparse

import torch

from . import bench_backward, bench_cuda, bench_linear, bench_mha, bench_mps
from .common import write_results

# name -> module with run(device, quick) and DEVICES, the devices it has cases for.
BENCHMARKS = {
    "linear": bench_linear, "mha": bench_mha, "backward": bench_backward, "cuda": bench_cuda,
    "mps": bench_mps,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append", help="run only these")
    parser.add_argument("--device", action="append", help="devices (default: cpu plus any GPU present)")
    args = parser.parse_args()

    devices = args.device or (
        ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (["mps"] if torch.backends.mps.is_available() else [])
    )
    for device in devices:
        results = {}
        for name in args.only or BENCHMARKS:
            if device not in BENCHMARKS[name].DEVICES:
                continue
            print(f"[{device}] {name} ...", flush=True)
            out = BENCHMARKS[name].run(device=device, quick=args.quick)
            print(out["text"], end="\n\n", flush=True)
            results[name] = out["results"]
        print(f"[{device}] results written to {write_results(device, results)}")


if __name__ == "__main__":
    main()
