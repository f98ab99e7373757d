"""Packed sequences of different lengths: attnx.varlen_attention against the same batch padded.

One batch of causal self-attention sequences with skewed lengths (one long, many short), H=8, D=64, fp32:

- ``varlen``: attnx.varlen_attention on the packed ``(T, H, D)`` tensors (cu_seqlens).
- ``attnx padded``: attnx.attention on the batch padded to the longest sequence, ``(N, H, L_max, D)``, with
  ``key_lengths`` (keys past a sequence's length are skipped, its padded query rows are not).
- ``sdpa padded``: F.scaled_dot_product_attention on the same padded batch with ``is_causal`` (each valid row
  sees only valid keys; the padded rows are computed and thrown away).

- ``attnx longest``: attnx.attention on the longest sequence alone, ``(1, H, L_max, D)``: the yardstick.

The packed call's work is Σ L_b² / 2 (causal); the longest sequence's alone L_max² / 2. The target: a varlen
time within 1.5x of the longest sequence's time times Σ L_b² / L_max² (cost ∝ Σ Lq·Lk, nothing spent on
padding or across sequences). SDPA's padded work is N · L_max² / 2; attnx's padded call skips keys past each
length but computes every padded query row. Outputs are checked against each other on the valid rows before
timing. Times are medians of per-round ratios from interleaved runs.
"""

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_ms, paired_ratio, progress, table, target, time_interleaved

DEVICES = ("cpu",)
TITLE = "Packed sequences (varlen) vs the same batch padded"

LENGTHS = [2048, 512, 256, 256, 128, 64, 32, 16]
SMOKE_LENGTHS = [64, 16, 8, 1]
H, D = 8, 64


def varlen_fns(lengths: list, device: str = "cpu") -> tuple[dict, callable]:
    """The three candidates, and a function that checks they agree on the valid rows."""
    gen = torch.Generator().manual_seed(0)
    N, L, T = len(lengths), max(lengths), sum(lengths)
    q, k, v = (torch.randn(T, H, D, generator=gen).to(device) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    padded = [torch.zeros(N, H, L, D, device=device) for _ in range(3)]
    for b, n in enumerate(lengths):
        s = slice(cu[b].item(), cu[b + 1].item())
        for dst, src in zip(padded, (q, k, v), strict=True):
            dst[b, :, :n] = src[s].transpose(0, 1)
    pq, pk, pv = padded
    key_lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    fns = {
        "varlen": lambda: attnx.varlen_attention(q, k, v, cu, cu, L, L, is_causal=True)[0],
        "attnx_padded": lambda: attnx.attention(pq, pk, pv, is_causal=True, key_lengths=key_lengths)[0],
        "sdpa_padded": lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True),
    }
    longest = lengths.index(L)
    lq, lk, lv = (t[longest:longest + 1, :, :L] for t in padded)
    fns["attnx_longest"] = lambda: attnx.attention(lq, lk, lv, is_causal=True)[0]

    def check():
        packed = fns["varlen"]()
        for name in ("attnx_padded", "sdpa_padded"):
            out = fns[name]()
            for b, n in enumerate(lengths):
                torch.testing.assert_close(out[b, :, :n].transpose(0, 1), packed[cu[b]:cu[b + 1]], atol=1e-4,
                                           rtol=1e-3, msg=f"varlen and {name} disagree on sequence {b}")

    return fns, check


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    lengths = SMOKE_LENGTHS if smoke else LENGTHS
    reps = 3 if smoke else 7 if quick else 15
    progress(f"varlen lengths={lengths} H={H} D={D}")
    fns, check = varlen_fns(lengths, device)
    check()
    t = time_interleaved(fns, device, reps=reps, min_block_s=0 if not smoke else 0.02)
    r_attnx = paired_ratio(t["varlen"], t["attnx_padded"])
    r_sdpa = paired_ratio(t["varlen"], t["sdpa_padded"])
    r_long = paired_ratio(t["varlen"], t["attnx_longest"])
    L = max(lengths)
    work = sum(n * (n + 1) for n in lengths) / (L * (L + 1))  # packed / longest alone
    met = r_long.median <= 1.5 * work
    results = {
        "lengths": lengths, "H": H, "D": D, "timings": {n: x.to_json() for n, x in t.items()},
        "ratio_vs_attnx_padded": r_attnx.to_json(), "ratio_vs_sdpa_padded": r_sdpa.to_json(),
        "ratio_vs_attnx_longest": r_long.to_json(), "work_vs_longest": work, "target_met": met,
    }
    text = f"varlen lengths={lengths} (fp32, causal, H={H}, D={D})\n" + table(
        ["impl", "time (ms)", "varlen / impl (95% CI)"],
        [["attnx.varlen_attention (packed)", fmt_ms(t["varlen"].median), ""],
         ["attnx.attention (padded, key_lengths)", fmt_ms(t["attnx_padded"].median), str(r_attnx)],
         ["sdpa (padded, is_causal)", fmt_ms(t["sdpa_padded"].median), str(r_sdpa)],
         [f"attnx.attention (longest alone, L={L})", fmt_ms(t["attnx_longest"].median), str(r_long)]],
    ) + (f"\nwork of the packed batch / the longest sequence's = sum L_b^2 / L_max^2 = {work:.2f}; target "
         f"varlen / longest <= 1.5 x that: {target(met)}")
    return {"results": {"varlen": results}, "text": text}
