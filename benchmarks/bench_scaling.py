"""Scaling: time and peak memory of one MHA layer against sequence length, torch vs attnx.

Self-attention, batch_first, a key_padding_mask with the last eighth of the keys padded (a padded batch, the
common case that sends torch's eval fast path to a merged mask and a materialised attention matrix), fp32,
L = S in powers of two from 256 to 8192 (quick: fewer points, memory at fewer still).
- eval (no_grad): nn.MultiheadAttention with its fast path (torch's default in eval), with the fast path
  disabled (its slow path), the hand-written SDPA composition (the mask as a broadcast (B, 1, 1, S)
  keep-mask), and attnx.nn.MultiheadAttention;
- train: forward + .backward(grad_out) of nn.MultiheadAttention, of the SDPA composition and of
  attnx.nn.MultiheadAttention, all in train mode.
Outputs (and in train the input gradient) are checked against torch before timing. Memory is the peak extra
of one call in a fresh process per point. ``plot(result_file)`` draws the curves (matplotlib, Agg).
"""

import json
import os

import torch

import attnx

from .bench_b1 import sdpa_composition
from .common import fmt_mib, fmt_ms, progress, table, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu", "cuda", "mps")
TITLE = "scaling with sequence length (time, peak memory)"
EVAL_IMPLS = ("torch fast path", "torch slow path", "SDPA composition", "attnx")
TRAIN_IMPLS = ("nn.MultiheadAttention", "SDPA composition", "attnx")
# One (B, H, L, S) fp32 tensor at L = 8192 is B*H*256 MiB: 1 GiB on the CPU, where torch's materialising paths
# hold a few of them.
SHAPE = {"cpu": dict(B=1, E=256, H=4), "cuda": dict(B=4, E=512, H=8), "mps": dict(B=1, E=256, H=4)}
LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS, QUICK_MEMORY_LENGTHS = (256, 1024, 2048), (2048,)
SMOKE_SHAPE, SMOKE_LENGTHS = dict(B=1, E=32, H=4), (32, 64)
FACTORY = "benchmarks.bench_scaling:scaling_case"


def make(device: str, impl: str, mode: str, B: int, L: int, E: int, H: int):
    """A callable running one eval forward or one train forward + backward of ``impl``, and its output getter.

    Returns ``(call, result)``: ``call()`` runs it, ``result()`` runs it and returns what to check (the output
    in eval; the output and the input gradient in train).
    """
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, device=device).train(mode == "train")
    module = ref
    if impl == "attnx":
        module = attnx.nn.MultiheadAttention(E, H, batch_first=True, device=device).train(mode == "train")
        module.load_state_dict(ref.state_dict())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(B, L, E, device=device, generator=g).requires_grad_(mode == "train")
    kpm = torch.zeros(B, L, dtype=torch.bool, device=device)
    kpm[:, L - L // 8 :] = True
    if impl == "SDPA composition":
        forward = sdpa_composition(ref, x, x, train=mode == "train", key_padding_mask=kpm)
    else:
        fast = impl == "torch fast path"

        def forward():
            torch.backends.mha.set_fastpath_enabled(fast)
            return module(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    if mode == "eval":
        return forward, forward
    grad_out = torch.randn(B, L, E, device=device, generator=g)

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        out = forward()
        out.backward(grad_out)
        return out

    def result():
        out = step().detach()
        return torch.cat([out.flatten(), x.grad.flatten()])

    return step, result


def scaling_case(device: str, impl: str, mode: str, B: int, L: int, E: int, H: int):
    """(fn, warmup) for benchmarks.memory."""
    return make(device, impl, mode, B, L, E, H)[0], make(device, impl, mode, B, 64, E, H)[0]


def _point(device: str, mode: str, shape: dict, L: int, reps: int) -> dict:
    impls = EVAL_IMPLS if mode == "eval" else TRAIN_IMPLS
    made = {impl: make(device, impl, mode, L=L, **shape) for impl in impls}
    with torch.set_grad_enabled(mode == "train"):
        want = made[impls[0]][1]()
        for impl in impls[1:]:
            got = made[impl][1]()
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3, msg=lambda m, n=impl: f"{n}: {m}")
        del want, got
        timings = time_interleaved({impl: m[0] for impl, m in made.items()}, device, reps=reps, min_block_s=0)
    torch.backends.mha.set_fastpath_enabled(True)
    return timings


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    shape = SMOKE_SHAPE if smoke else SHAPE[device]
    lengths = SMOKE_LENGTHS if smoke else QUICK_LENGTHS if quick else LENGTHS
    memory_lengths = SMOKE_LENGTHS[-1:] if smoke else QUICK_MEMORY_LENGTHS if quick else LENGTHS
    reps = 3 if smoke or quick else 5
    B, E, H = shape["B"], shape["E"], shape["H"]
    results = {"shape": shape, "lengths": list(lengths), "memory_lengths": list(memory_lengths)}
    texts = []
    for mode, impls in (("eval", EVAL_IMPLS), ("train", TRAIN_IMPLS)):
        series = {impl: {"time": {}, "peak_extra_bytes": {}} for impl in impls}
        for L in lengths:
            # Fewer repetitions where one call takes seconds: the spread is still reported.
            n = reps if L <= 2048 else 3
            progress(f"{mode} L={L}: checking outputs, timing ({n} interleaved reps)")
            for impl, t in _point(device, mode, shape, L, n).items():
                series[impl]["time"][str(L)] = t.to_json()
        for L in memory_lengths:
            progress(f"{mode} L={L}: peak memory, a fresh process per implementation")
            jobs = [
                (FACTORY, mode == "train", dict(impl=impl, mode=mode, B=B, L=L, E=E, H=H)) for impl in impls
            ]
            workers = 2 if B * H * L * L * 4 <= 2**28 else 1
            for impl, peak in zip(impls, peak_extra_bytes_many(jobs, device, workers), strict=True):
                series[impl]["peak_extra_bytes"][str(L)] = peak
        results[mode] = series

        rows = []
        for L in sorted(set(lengths) | set(memory_lengths)):
            row = [str(L)]
            t_attnx = series["attnx"]["time"].get(str(L))
            for impl in impls:
                t = series[impl]["time"].get(str(L))
                row.append(f"{fmt_ms(t['median_s'])} ±{100 * t['iqr_s'] / t['median_s']:.0f}%" if t else "-")
            for impl in impls[:-1]:
                t = series[impl]["time"].get(str(L))
                row.append(f"{t_attnx['median_s'] / t['median_s']:.2f}x" if t and t_attnx else "-")
            for impl in impls:
                m = series[impl]["peak_extra_bytes"].get(str(L), "-")
                row.append(m if m == "-" else fmt_mib(m))
            rows.append(row)
        short = {
            "torch fast path": "fast",
            "torch slow path": "slow",
            "SDPA composition": "SDPA",
            "nn.MultiheadAttention": "nn.MHA",
            "attnx": "attnx",
        }
        headers = (
            ["L"]
            + [f"{short[i]} ms" for i in impls]
            + [f"attnx/{short[i]}" for i in impls[:-1]]
            + [f"{short[i]} MiB" for i in impls]
        )
        what = "forward, no_grad" if mode == "eval" else "forward + backward"
        texts.append(
            f"{mode}: one MHA layer, {what}, B={B} E={E} H={H}, key_padding_mask (last 1/8), {device} fp32. "
            f"Time: median ± IQR/median of {reps} interleaved reps (3 above L=2048); attnx/X = time ratio. "
            "MiB: peak extra memory of one call, fresh process each. "
            + (
                "fast/slow = nn.MultiheadAttention with / without its fast path.\n"
                if mode == "eval"
                else "nn.MHA = nn.MultiheadAttention.\n"
            )
            + table(headers, rows)
        )
    return {"results": results, "text": "\n\n".join(texts)}


def plot(result_file: str) -> str:
    """Draw ``<device>-<date>-scaling.png`` beside ``result_file`` (its scaling case); returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed: no plots (pip install matplotlib, or make bench)"
    with open(result_file) as f:
        data = json.load(f)
    case = data["cases"]["scaling"]
    res, env = case["results"], case["environment"]
    shape = res["shape"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    styles = {
        "attnx": dict(color="C3", linewidth=2.5, marker="o"),
        "torch fast path": dict(color="C0", marker="s"),
        "torch slow path": dict(color="C1", marker="^"),
        "nn.MultiheadAttention": dict(color="C1", marker="^"),
        "SDPA composition": dict(color="C2", marker="v", linestyle="--"),
    }
    for row, mode in enumerate(("eval", "train")):
        for col, key in enumerate(("time", "peak_extra_bytes")):
            ax = axes[row][col]
            for impl, series in res[mode].items():
                points = sorted((int(L), v) for L, v in series[key].items() if v is not None)
                if not points:
                    continue
                xs = [L for L, _ in points]
                if key == "time":
                    ys = [v["median_s"] * 1e3 for _, v in points]
                    lo = [v["q1_s"] * 1e3 for _, v in points]
                    hi = [v["q3_s"] * 1e3 for _, v in points]
                    ax.plot(xs, ys, label=impl, **styles.get(impl, {}))
                    ax.fill_between(xs, lo, hi, alpha=0.2, color=styles.get(impl, {}).get("color"))
                else:
                    ax.plot(xs, [v / 2**20 for _, v in points], label=impl, **styles.get(impl, {}))
            if key == "peak_extra_bytes" and res["memory_lengths"]:
                xs = sorted(res["memory_lengths"])
                ax.plot(
                    xs,
                    [shape["B"] * shape["H"] * L * L * 4 / 2**20 for L in xs],
                    color="gray",
                    linestyle=":",
                    label="one (B, H, L, L) fp32 tensor",
                )
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L = S")
            what = "forward (eval, no_grad)" if mode == "eval" else "forward + backward (train)"
            ax.set_ylabel("time per call, ms" if key == "time" else "peak extra memory, MiB")
            ax.set_title(
                f"{what}: {'time (median, IQR band)' if key == 'time' else 'peak extra memory'}", fontsize=10
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(
        f"One MHA layer, B={shape['B']} E={shape['E']} H={shape['H']}, key_padding_mask, fp32 - "
        f"{env['device_name']}, "
        f"{env['threads']} threads, torch {env['torch']}, attnx {env['commit']}, {env['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    png = os.path.splitext(result_file)[0] + "-scaling.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"plot written to {png}"
