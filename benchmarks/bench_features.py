"""Attention for today's models: decoding with grouped KV heads, a sliding window over a long sequence, and a
learned bias with its gradient, each against what torch offers for it.

- ``decode``: one decoding step, B=8, H=32 query heads over Hkv=8 kv heads, D=128, a 4096-key cache, fp32.
  attnx reads the shared kv head in place; SDPA runs with ``enable_gqa=True``, and after
  ``repeat_interleave`` of the cache (what a model without GQA support does every step). Target: attnx
  <= 0.8x both, extra memory O(B*H) (the output and lse).
- ``window``: L = S = 16384, H=8, D=64, B=1, a causal sliding window of 1024 keys
  (``window_left=1023, window_right=0``). SDPA gets the window as a materialised (L, S) bool mask, built
  before timing. Targets: attnx >= 3x faster than SDPA, and its time per query row within 1.3x of attnx's own
  L = S = 2048 full-attention call per query row (tiles outside the window are skipped, so the cost follows
  the window, not S); memory O(B*H*L).
- ``bias``: a learned (1, H, L, S) float bias that requires grad, L = S = 1024, B=2, H=8, D=64, forward and
  backward (gradients of q, k, v and the bias). SDPA gets the same bias. Targets: time <= SDPA's, peak extra
  memory <= SDPA's (both must store the bias's gradient).

Times are medians of per-round ratios from interleaved runs (95% confidence intervals beside them); memory is
the peak extra of one call in a fresh process (``benchmarks.memory``). Outputs are checked against each other
before timing. On CUDA the decode and window cases run the same comparison (SDPA picks flash, cuDNN or
memory-efficient itself); the bias case's backward has no CUDA kernel and runs on the CPU only.
"""

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_mib, fmt_ms, paired_ratio, progress, table, target, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu", "cuda")
TITLE = "GQA decoding, sliding windows, learned biases"
FACTORY = "benchmarks.bench_features:memory_case"

DECODE = dict(B=8, H=32, Hkv=8, D=128, S=4096)
WINDOW = dict(B=1, H=8, D=64, L=16384, window=1024, full_L=2048)
BIAS = dict(B=2, H=8, D=64, L=1024)
SMOKE = dict(decode=dict(B=2, H=4, Hkv=2, D=16, S=64), window=dict(B=1, H=2, D=16, L=512, window=64,
                                                                    full_L=64),
             bias=dict(B=1, H=2, D=16, L=64))


def _randn(*shape, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ------------------------------------------------------------------------------------------------------------
# Callables (also the factories of benchmarks.memory).


def decode_fns(device: str, B: int, H: int, Hkv: int, D: int, S: int) -> dict:
    q = _randn(B, H, 1, D, device=device, seed=1)
    k, v = _randn(B, Hkv, S, D, device=device, seed=2), _randn(B, Hkv, S, D, device=device, seed=3)
    g = H // Hkv
    return {
        "attnx": lambda: attnx.attention(q, k, v)[0],
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "sdpa_repeat": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        ),
    }


def window_mask(L: int, window: int, device: str) -> torch.Tensor:
    """SDPA's bool mask (True = attend) of a causal sliding window of `window` keys."""
    row = torch.arange(L, device=device).view(L, 1)
    col = torch.arange(L, device=device).view(1, L)
    return (col <= row) & (col > row - window)


def window_fns(device: str, B: int, H: int, D: int, L: int, window: int, full_L: int) -> dict:
    q, k, v = (_randn(B, H, L, D, device=device, seed=s) for s in (1, 2, 3))
    mask = window_mask(L, window, device)
    qf, kf, vf = (t[:, :, :full_L].clone() for t in (q, k, v))
    return {
        "attnx": lambda: attnx.attention(q, k, v, window_left=window - 1, window_right=0)[0],
        "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "attnx_full": lambda: attnx.attention(qf, kf, vf)[0],
    }


def bias_fns(device: str, B: int, H: int, D: int, L: int) -> dict:
    q, k, v = (_randn(B, H, L, D, device=device, seed=s).requires_grad_() for s in (1, 2, 3))
    bias = _randn(1, H, L, L, device=device, seed=4).requires_grad_()
    grad_out = _randn(B, H, L, D, device=device, seed=5)
    inputs = (q, k, v, bias)

    def step(forward):
        return lambda: torch.autograd.grad(forward(), inputs, grad_out)

    return {
        "attnx": step(lambda: attnx.attention(q, k, v, attn_mask=bias)[0]),
        "sdpa": step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)),
    }


CASES = {"decode": decode_fns, "window": window_fns, "bias": bias_fns}


def memory_case(device: str, case: str, impl: str, shape: dict, warm: dict):
    """(fn, warmup) for benchmarks.memory: one call of `impl` in `case` at `shape`, warmed up at `warm`."""
    return CASES[case](device, **shape)[impl], CASES[case](device, **warm)[impl]


# ------------------------------------------------------------------------------------------------------------


def _check(fns: dict, names: tuple, atol: float):
    """The candidates' outputs agree (gradients for the bias case) before any timing."""
    outs = {n: fns[n]() for n in names}
    first = outs[names[0]]
    for n in names[1:]:
        for a, b in zip(first if isinstance(first, tuple) else (first,),
                        outs[n] if isinstance(outs[n], tuple) else (outs[n],), strict=True):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-3, msg=f"{names[0]} and {n} disagree")


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    shapes = SMOKE if smoke else {"decode": DECODE, "window": WINDOW, "bias": BIAS}
    warm = SMOKE
    reps = 3 if smoke else 7 if quick else 15
    results, texts = {}, []

    # Decoding.
    s = shapes["decode"]
    progress(f"decode {s}")
    fns = decode_fns(device, **s)
    _check(fns, ("attnx", "sdpa_gqa", "sdpa_repeat"), atol=1e-4)
    t = time_interleaved(fns, device, reps=reps * 2)
    r_gqa, r_rep = paired_ratio(t["attnx"], t["sdpa_gqa"]), paired_ratio(t["attnx"], t["sdpa_repeat"])
    mem = peak_extra_bytes_many(
        [(FACTORY, False, dict(case="decode", impl=i, shape=s, warm=warm["decode"])) for i in fns], device
    )
    out_bytes = s["B"] * s["H"] * s["D"] * 4 + s["B"] * s["H"] * 4
    met = r_gqa.median <= 0.8 and r_rep.median <= 0.8
    results["decode"] = {
        "shape": s, "timings": {n: x.to_json() for n, x in t.items()},
        "ratio_vs_sdpa_gqa": r_gqa.to_json(), "ratio_vs_sdpa_repeat": r_rep.to_json(),
        "peak_extra_bytes": dict(zip(fns, mem, strict=True)), "output_and_lse_bytes": out_bytes,
        "target_met": met,
    }
    texts.append(f"decode {s} (fp32, one step)\n" + table(
        ["impl", "time (ms)", "attnx / impl (95% CI)", "peak extra MiB"],
        [["attnx", fmt_ms(t["attnx"].median), "", fmt_mib(mem[0])],
         ["sdpa enable_gqa", fmt_ms(t["sdpa_gqa"].median), str(r_gqa), fmt_mib(mem[1])],
         ["sdpa repeat_interleave", fmt_ms(t["sdpa_repeat"].median), str(r_rep), fmt_mib(mem[2])]],
    ) + f"\ntarget attnx <= 0.8x both: {target(met)}; output + lse = {fmt_mib(out_bytes)} MiB")

    # Sliding window.
    s = shapes["window"]
    progress(f"window {s}")
    fns = window_fns(device, **s)
    _check(fns, ("attnx", "sdpa_mask"), atol=1e-4)
    t = time_interleaved(fns, device, reps=max(3, reps // 3), min_block_s=0)
    r_sdpa = paired_ratio(t["sdpa_mask"], t["attnx"])  # speed-up of attnx over SDPA
    per_row = (t["attnx"].median / s["L"]) / (t["attnx_full"].median / s["full_L"])
    mem = peak_extra_bytes_many(
        [(FACTORY, False, dict(case="window", impl=i, shape=s, warm=warm["window"]))
         for i in ("attnx", "sdpa_mask")], device
    )
    met = r_sdpa.median >= 3 and per_row <= 1.3
    results["window"] = {
        "shape": s, "timings": {n: x.to_json() for n, x in t.items()},
        "speedup_vs_sdpa_mask": r_sdpa.to_json(), "time_per_row_vs_full": per_row,
        "peak_extra_bytes": {"attnx": mem[0], "sdpa_mask": mem[1]}, "target_met": met,
    }
    texts.append(f"window {s} (fp32, causal sliding window; SDPA's mask built before timing)\n" + table(
        ["impl", "time (ms)", "peak extra MiB"],
        [["attnx window", fmt_ms(t["attnx"].median), fmt_mib(mem[0])],
         ["sdpa + (L, S) bool mask", fmt_ms(t["sdpa_mask"].median), fmt_mib(mem[1])],
         [f"attnx full L=S={s['full_L']}", fmt_ms(t["attnx_full"].median), ""]],
    ) + f"\nattnx speed-up over SDPA {r_sdpa} (target >= 3x); time per query row vs the full "
        f"L={s['full_L']} call {per_row:.2f}x (target <= 1.3x): {target(met)}")

    # Learned bias with its gradient (the CUDA backward is the ATen fallback: CPU only).
    if device == "cpu":
        s = shapes["bias"]
        progress(f"bias {s}")
        fns = bias_fns(device, **s)
        _check(fns, ("attnx", "sdpa"), atol=1e-3)
        t = time_interleaved(fns, device, reps=reps, min_block_s=0)
        r = paired_ratio(t["attnx"], t["sdpa"])
        mem = peak_extra_bytes_many(
            [(FACTORY, True, dict(case="bias", impl=i, shape=s, warm=warm["bias"]))
             for i in ("attnx", "sdpa")],
            device,
        )
        met = r.median <= 1.0 and mem[0] <= mem[1]
        results["bias"] = {
            "shape": s, "timings": {n: x.to_json() for n, x in t.items()}, "ratio_vs_sdpa": r.to_json(),
            "peak_extra_bytes": {"attnx": mem[0], "sdpa": mem[1]}, "target_met": met,
        }
        texts.append(f"bias {s} (fp32, (1, H, L, S) bias requiring grad, forward + backward)\n" + table(
            ["impl", "time (ms)", "attnx / impl (95% CI)", "peak extra MiB"],
            [["attnx", fmt_ms(t["attnx"].median), "", fmt_mib(mem[0])],
             ["sdpa", fmt_ms(t["sdpa"].median), str(r), fmt_mib(mem[1])]],
        ) + f"\ntarget time <= SDPA's and memory <= SDPA's: {target(met)}")
    return {"results": results, "text": "\n\n".join(texts)}
