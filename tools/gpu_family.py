"""`make gpu-check`'s family step: the tensor-core forward's tile shapes timed on a GPU, beside SDPA.

The unmasked forward's shapes (cuda/attention_plan.h, MmaShape: query rows a warp x keys a tile, warps a
block, pipeline stages) other than each dtype and head dim's default run on the kernels compiled at run time,
so this runs with ATTNX_CUDA_RUNTIME_COMPILE=1 (set here before attnx is imported) and torch's flash route
off (attnx::_cuda_torch_flash), each shape chosen by attnx::_cuda_mma_shape. For every dtype (fp16, bf16,
fp32), head dim (64, 128), length (L = S = 1024, 4096), without a mask and causal: each shape's output
checked against SDPA's memory-efficient kernel, its median time over a few calls, and the same for SDPA's
flash, cuDNN and memory-efficient backends where they take the call. The first call of a shape compiles it
(not timed). Masked calls take the default shape (their tile classes are its tiles): `make gpu-check`'s
bench step times them.

Writes the table (markdown and JSON) into RESULTS and prints one line `family-sweep: {json}` (the best shape
per dtype and head dim, against the default and the best SDPA backend) that tools/gpu_check.py reads. The
table is what sets each (dtype, head dim)'s default shape (mma_default_shape). Where Nsight Compute's `ncu`
is found (PATH, or the toolkit's bin), it also profiles one call of the default kernel (prebuilt, float16,
B=1, H=16, L=S=4096, D=64: the shape of the earlier record, ncu-2026-11-26-h100-d866bd9.txt) into
RESULTS/ncu-<date>-<card>.txt: issue slots, IPC, occupancy, warp stalls and executed instructions, which
tools/sass.py's static count per tile is checked against.

    python tools/gpu_family.py --results-dir benchmarks/results
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys

os.environ.setdefault("ATTNX_CUDA_RUNTIME_COMPILE", "1")

import torch  # noqa: E402

import attnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass  # noqa: E402  (a script beside this one)

SHAPES = [f"{rows}x{keys} w{warps} s{stages}" for rows in (16, 32) for keys in (64, 128) for warps in (4, 8)
          for stages in (2, 3)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PROBLEMS = [(4, 16, 1024), (1, 16, 4096)]  # (B, H, L = S)


def valid(shape: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the family has `shape` for the dtype and head dim (sass.mma_shape_valid)."""
    rows, keys, warps, stages = (int(x) for x in re.match(r"(\d+)x(\d+) w(\d) s(\d)$", shape).groups())
    code = rows // 16 * 1000 + warps * 100 + keys // 64 * 10 + stages
    return sass.mma_shape_valid(4 if dtype == torch.float32 else 2, head_dim, code)


def median_ms(fn, calls=10) -> float:
    fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def sdpa_ms(q, k, v, causal) -> dict:
    """SDPA's backends' times where they take the call."""
    from torch.nn.attention import SDPBackend

    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            out[name] = median_ms(lambda backend=backend: sdpa(q, k, v, causal, backend))
        except RuntimeError:
            pass
    return out


# One call of the default forward kernel, the second of two (the first warms up), for ncu.
PROFILED = """
import torch, attnx
q = torch.randn(1, 16, 4096, 64, device="cuda", dtype=torch.float16)
for _ in range(2):
    attnx.attention(q, q, q)
torch.cuda.synchronize()
"""


def ncu_profile(path: str) -> str:
    """Profiles PROFILED's second attention_forward_mma launch with ncu into `path`; a line saying what
    happened."""
    toolkit = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ncu")
    ncu = shutil.which("ncu") or (toolkit if os.path.exists(toolkit) else None)
    if ncu is None:
        return "ncu: not found"
    env = dict(os.environ, ATTNX_CUDA_RUNTIME_COMPILE="0", ATTNX_CUDA_TORCH_FLASH="0")
    cmd = [ncu, "--kernel-name", "regex:attention_forward_mma", "--launch-skip", "1", "--launch-count", "1",
           "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis", "--section", "Occupancy",
           "--section", "SchedulerStats", "--section", "WarpStateStats", "--section", "InstructionStats",
           sys.executable, "-c", PROFILED]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "ncu: timed out"
    with open(path, "w") as f:
        f.write(out.stdout + out.stderr)
    return f"ncu: rc {out.returncode}, {path}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    torch.ops.attnx._cuda_torch_flash(False)
    rows, best = [], {}
    for dname, dtype in DTYPES.items():
        for head_dim in (64, 128):
            for (B, H, L), causal in ((problem, c) for problem in PROBLEMS for c in (False, True)):
                from torch.nn.attention import SDPBackend

                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(B, H, L, head_dim, device="cuda", dtype=dtype, generator=gen)
                           for _ in range(3))
                flops = 4 * B * H * L * L * head_dim // (2 if causal else 1)
                sdpa_times = sdpa_ms(q, k, v, causal)
                expected = sdpa(q, k, v, causal, SDPBackend.EFFICIENT_ATTENTION).float()
                for shape in ["", *SHAPES]:
                    if shape and not valid(shape, dtype, head_dim):
                        continue
                    torch.ops.attnx._cuda_mma_shape(shape)
                    kernel = torch.ops.attnx._attention_kernel(q, k, v, is_causal=causal)
                    out = attnx.attention(q, k, v, is_causal=causal)[0]
                    error = (out.float() - expected).abs().max().item()
                    ms = median_ms(lambda q=q, k=k, v=v, c=causal: attnx.attention(q, k, v, is_causal=c))
                    row = {"dtype": dname, "head_dim": head_dim, "B": B, "H": H, "L": L, "causal": causal,
                           "shape": shape or "default", "kernel": kernel, "ms": round(ms, 4),
                           "tflops": round(flops / ms / 1e9, 1), "max_abs_error": error,
                           "sdpa_ms": {n: round(t, 4) for n, t in sdpa_times.items()}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    key = f"{dname} D={head_dim} L={L}" + (" causal" if causal else "")
                    if key not in best or ms < best[key]["ms"]:
                        best[key] = {"shape": row["shape"], "ms": row["ms"], "tflops": row["tflops"],
                                     "best_sdpa_ms": min(sdpa_times.values()) if sdpa_times else None}
                    if not shape:
                        best[key + " default"] = {"ms": row["ms"]}
    torch.ops.attnx._cuda_mma_shape("")
    card = torch.cuda.get_device_name().lower().replace(" ", "-")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    os.makedirs(args.results_dir, exist_ok=True)
    stem = os.path.join(args.results_dir, f"family-{date}-{card}")
    with open(stem + ".json", "w") as f:
        json.dump({"card": torch.cuda.get_device_name(), "date": date, "rows": rows, "best": best}, f,
                  indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# The tensor-core forward's tile shapes on {torch.cuda.get_device_name()} ({date})\n\n"
                "`python tools/gpu_family.py`: no mask, median ms; TFLOP/s = 4 B H L S D / time (halved "
                "under is_causal).\n\n"
                "| dtype | D | B x H x L | causal | shape | kernel | ms | TFLOP/s | max abs error "
                "| SDPA ms |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            times = ", ".join(f"{n} {t}" for n, t in r["sdpa_ms"].items())
            f.write(f"| {r['dtype']} | {r['head_dim']} | {r['B']} x {r['H']} x {r['L']} | {r['causal']} | "
                    f"{r['shape']} | {r['kernel']} | {r['ms']} | {r['tflops']} | {r['max_abs_error']:.2e} | "
                    f"{times} |\n")
    print(ncu_profile(os.path.join(args.results_dir, f"ncu-{date}-{card}.txt")), flush=True)
    print("family-sweep: " + json.dumps(best), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
