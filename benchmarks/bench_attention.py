"""attnx.attention against F.scaled_dot_product_attention, forward: GFLOP/s and peak memory.

SDPA has no key padding mask and reads bool masks the other way round, so for masked cases it gets what an
nn.MultiheadAttention user has to build for it: attn_mask and key_padding_mask merged into one additive
(B, 1, L, S) float tensor, built outside the timed region. attnx gets the (L, S) mask and the (B, S) padding
mask as they are. Outputs are compared before timing; the two ops are timed interleaved. FLOPs are 4 * D per
(query, key) pair left unmasked by is_causal (4 * B * H * L * S * D without it): the QK^T and PV GEMMs. Peak
memory is the extra memory of one call in a fresh process, inputs and masks excluded (not in quick mode).
"""

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_mib, progress, table, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu", "cuda")
TITLE = "attention forward vs SDPA (GFLOP/s, memory)"
MASKS = ("none", "mask+padding", "causal")
# (B, H, L, S, D): the acceptance shape, BERT-base-like, long context, short queries over long keys, decoding.
SHAPES = (
    (4, 8, 2048, 2048, 64),
    (8, 12, 512, 512, 64),
    (1, 16, 4096, 4096, 64),
    (16, 8, 128, 1024, 64),
    (16, 8, 1, 2048, 64),
)
QUICK_SHAPES = ((4, 8, 1024, 1024, 64),)
SMOKE_SHAPES = ((1, 2, 32, 48, 16),)
FACTORY = "benchmarks.bench_attention:attention_case"


def make_inputs(B, H, L, S, D, mask, device="cpu", dtype=torch.float32, seed=0):
    """q, k, v ``(B, H, L|S, D)``; attnx's keyword arguments and SDPA's for the same masking."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=dtype, device=device) for n in (L, S, S))
    attnx_kwargs, sdpa_kwargs = {}, {}
    if mask == "causal":
        attnx_kwargs["is_causal"] = sdpa_kwargs["is_causal"] = True
    elif mask == "mask+padding":
        attn_mask = torch.randn(L, S, generator=gen, dtype=dtype, device=device)
        padding = torch.zeros(B, S, dtype=torch.bool, device=device)
        padding[:, S - S // 8 :] = True  # the last eighth of every sequence is padding
        attnx_kwargs.update(attn_mask=attn_mask, key_padding_mask=padding)
        additive = torch.zeros(B, S, dtype=dtype, device=device).masked_fill(padding, float("-inf"))
        sdpa_kwargs["attn_mask"] = attn_mask[None, None] + additive[:, None, None, :]
    return (q, k, v), attnx_kwargs, sdpa_kwargs


def attention_case(device: str, impl: str, shape: list, mask: str):
    """(fn, warmup) for benchmarks.memory."""

    def op(shape):
        (q, k, v), akw, skw = make_inputs(*shape, mask, device=device)
        if impl == "attnx":
            return lambda: attnx.attention(q, k, v, **akw)
        return lambda: F.scaled_dot_product_attention(q, k, v, **skw)

    return op(shape), op((1, 1, 64, 64, shape[4]))


def flop_count(B, H, L, S, D, causal):
    """4 flops per (query, key, channel) pair that a mask leaves: the QK^T and PV GEMMs."""
    pairs = sum(min(row + 1, S) for row in range(L)) if causal else L * S
    return 4 * B * H * pairs * D


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    shapes = SMOKE_SHAPES if smoke else QUICK_SHAPES if quick else SHAPES
    reps = 3 if smoke else 5 if quick else 9
    rows, results = [], []
    for shape in shapes:
        B, H, L, S, D = shape
        for mask in MASKS:
            progress(f"B={B} H={H} L={L} S={S} D={D}, {mask}")
            (q, k, v), akw, skw = make_inputs(*shape, mask, device=device)
            with torch.no_grad():
                out, _ = attnx.attention(q, k, v, **akw)
                torch.testing.assert_close(
                    out, F.scaled_dot_product_attention(q, k, v, **skw), rtol=1e-4, atol=1e-4
                )
                timings = time_interleaved(
                    {
                        "attnx": lambda q=q, k=k, v=v, akw=akw: attnx.attention(q, k, v, **akw),
                        "sdpa": lambda q=q, k=k, v=v, skw=skw: F.scaled_dot_product_attention(q, k, v, **skw),
                    },
                    device,
                    reps=reps,
                    min_block_s=0.05,
                )
            memory = [None, None]
            if not quick:  # a fresh process per figure costs seconds
                jobs = [
                    (FACTORY, False, dict(impl=impl, shape=list(shape), mask=mask))
                    for impl in ("attnx", "sdpa")
                ]
                memory = peak_extra_bytes_many(jobs, device, workers=2)
            flops = flop_count(B, H, L, S, D, mask == "causal")
            t_a, t_s = timings["attnx"], timings["sdpa"]
            rows.append(
                [
                    f"{B},{H},{L},{S},{D}",
                    mask,
                    f"{flops / t_a.median / 1e9:.1f}",
                    t_a.spread,
                    f"{flops / t_s.median / 1e9:.1f}",
                    t_s.spread,
                    f"{t_s.median / t_a.median:.2f}x",
                    fmt_mib(memory[0]),
                    fmt_mib(memory[1]),
                ]
            )
            results.append(
                {
                    "shape": dict(B=B, H=H, L=L, S=S, D=D),
                    "mask": mask,
                    "attnx": t_a.to_json(),
                    "sdpa": t_s.to_json(),
                    "attnx_gflops": flops / t_a.median / 1e9,
                    "sdpa_gflops": flops / t_s.median / 1e9,
                    "speedup": t_s.median / t_a.median,
                    "attnx_peak_extra_bytes": memory[0],
                    "sdpa_peak_extra_bytes": memory[1],
                }
            )
    text = (
        f"attention forward, {device} fp32: GFLOP/s from the median of {reps} interleaved reps (spread = "
        "IQR/median), speedup = SDPA time / attnx time, peak extra MiB of one call (fresh process each)\n"
        + table(
            [
                "B,H,L,S,D",
                "mask",
                "attnx GF/s",
                "spread",
                "SDPA GF/s",
                "spread",
                "speedup",
                "attnx MiB",
                "SDPA MiB",
            ],
            rows,
        )
    )
    return {"results": results, "text": text}
