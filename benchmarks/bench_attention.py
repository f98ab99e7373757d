"""attnx.attention against F.scaled_dot_product_attention on CPU: GFLOP/s and peak memory.

    python benchmarks/bench_attention.py                      # the default shapes, table on stdout
    python benchmarks/bench_attention.py --json out.json      # also write labelled results
    python benchmarks/bench_attention.py --shape 4,8,2048,2048,64 --mask none,mask+padding

SDPA has no key padding mask and reads bool masks the other way round, so for masked cases it gets what an
nn.MultiheadAttention user has to build for it: attn_mask and key_padding_mask merged into one additive
(B, 1, L, S) float tensor, built outside the timed region. attnx gets the (L, S) mask and the (B, S) padding
mask as they are. Outputs are compared before timing. Runs alternate between the two ops, so that a noisy
machine slows both; the best of `--repeat` runs is reported. FLOPs are 4 * D per (query, key) pair left
unmasked by is_causal (4 * B * H * L * S * D without it): the QK^T and PV GEMMs. Peak memory (--memory) is
the growth of a fresh process's peak RSS during its first full-size call, inputs excluded (Linux only).
"""

import argparse
import json
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import attnx

MASKS = ("none", "mask+padding", "causal")
# (B, H, L, S, D): the acceptance shape, BERT-base-like, long context, short queries over long keys.
DEFAULT_SHAPES = (
    (4, 8, 2048, 2048, 64),
    (8, 12, 512, 512, 64),
    (1, 16, 4096, 4096, 64),
    (16, 8, 128, 1024, 64),
)


def make_inputs(B, H, L, S, D, mask, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=dtype) for n in (L, S, S))
    attnx_kwargs, sdpa_kwargs = {}, {}
    if mask == "causal":
        attnx_kwargs["is_causal"] = sdpa_kwargs["is_causal"] = True
    elif mask == "mask+padding":
        attn_mask = torch.randn(L, S, generator=gen, dtype=dtype)
        padding = torch.zeros(B, S, dtype=torch.bool)
        padding[:, S - S // 8 :] = True  # the last eighth of every sequence is padding
        attnx_kwargs.update(attn_mask=attn_mask, key_padding_mask=padding)
        additive = torch.zeros(B, S, dtype=dtype).masked_fill(padding, float("-inf"))
        sdpa_kwargs["attn_mask"] = attn_mask[None, None] + additive[:, None, None, :]
    return (q, k, v), attnx_kwargs, sdpa_kwargs


def best_times(fns, repeat):
    """The best wall time of each function, running them alternately `repeat` times after one warm-up."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


_PEAK_SCRIPT = """
import sys, torch, attnx
sys.path.insert(0, {here!r})
from bench_attention import make_inputs
import torch.nn.functional as F

def op(shape):
    (q, k, v), akw, skw = make_inputs(*shape, {mask!r})
    if {which!r} == "attnx":
        return lambda: attnx.attention(q, k, v, **akw)
    return lambda: F.scaled_dot_product_attention(q, k, v, **skw)

def status(field):  # bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

op((1, 1, 64, 64, {shape[4]}))()  # warm up (libraries, threads, JIT kernels) on a tiny problem
call = op({shape!r})  # inputs and masks exist before the measurement
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
before = status("VmRSS")
call()
print(status("VmHWM") - before)
"""


def peak_growth(shape, mask, which):
    """Peak-RSS growth in bytes of the first full-size call, in a fresh process: the memory the op itself
    needs (its outputs and temporaries), not its inputs."""
    import os

    script = _PEAK_SCRIPT.format(here=os.path.dirname(os.path.abspath(__file__)), shape=shape, mask=mask,
                                 which=which)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


def flop_count(B, H, L, S, D, causal):
    """4 flops per (query, key, channel) pair that a mask leaves: the QK^T and PV GEMMs."""
    pairs = sum(min(row + 1, S) for row in range(L)) if causal else L * S
    return 4 * B * H * pairs * D


def run_case(shape, mask, repeat, memory):
    B, H, L, S, D = shape
    (q, k, v), akw, skw = make_inputs(B, H, L, S, D, mask)
    out, _ = attnx.attention(q, k, v, **akw)
    expected = F.scaled_dot_product_attention(q, k, v, **skw)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    t_attnx, t_sdpa = best_times(
        [lambda: attnx.attention(q, k, v, **akw), lambda: F.scaled_dot_product_attention(q, k, v, **skw)],
        repeat,
    )
    flops = flop_count(B, H, L, S, D, mask == "causal")
    row = {
        "shape": {"B": B, "H": H, "L": L, "S": S, "D": D},
        "mask": mask,
        "attnx_gflops": flops / t_attnx / 1e9,
        "sdpa_gflops": flops / t_sdpa / 1e9,
        "speedup": t_sdpa / t_attnx,
    }
    if memory:
        row["attnx_peak_mib"] = peak_growth(shape, mask, "attnx") / 2**20
        row["sdpa_peak_mib"] = peak_growth(shape, mask, "sdpa") / 2**20
    return row


def environment():
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True).stdout
    except OSError:
        commit = ""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "device": f"cpu: {cpu}",
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "attnx_commit": commit.strip() or None,
        "dtype": "float32",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", help="B,H,L,S,D (repeatable)")
    parser.add_argument("--mask", default=",".join(MASKS), help=f"comma-separated subset of {MASKS}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="also measure peak RSS growth (fresh process)")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else DEFAULT_SHAPES
    env = environment()
    print(f"{env['device']}, {env['threads']} threads, {env['cpu_capability']}, torch {env['torch']}")
    header = f"{'B,H,L,S,D':>22} {'mask':>13} {'attnx GF/s':>11} {'SDPA GF/s':>10} {'speedup':>8}"
    print(header + ("  peak MiB attnx / SDPA" if args.memory else ""))
    rows = []
    for shape in shapes:
        for mask in args.mask.split(","):
            row = run_case(shape, mask, args.repeat, args.memory)
            rows.append(row)
            line = (f"{','.join(map(str, shape)):>22} {mask:>13} {row['attnx_gflops']:>11.1f} "
                    f"{row['sdpa_gflops']:>10.1f} {row['speedup']:>7.2f}x")
            if args.memory:
                line += f"  {row['attnx_peak_mib']:8.1f} / {row['sdpa_peak_mib']:.1f}"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
