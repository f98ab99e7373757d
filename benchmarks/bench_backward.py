"""Attention training step: attnx.attention and its fused backward vs F.scaled_dot_product_attention
(upstream report: flex-attention-backward-math-fallback).

Per shape and mask case, fp32, ``(B, H, L, D)`` inputs that require grad:
- time of forward + backward (``torch.autograd.grad`` of out w.r.t. q, k, v) and of the backward alone (on a
  graph built beforehand, ``retain_graph=True``), attnx and SDPA timed interleaved; on CPU SDPA runs torch's
  flash attention forward and backward;
- peak extra memory of the backward alone, in a fresh process (``benchmarks.memory``), next to the size of
  q, k, v, out and of the gradients dq, dk, dv. The gradients are what a backward must allocate; anything
  (B, H, L, S) would show up as hundreds of MiB.

Masks: none (not in quick mode), or key_padding_mask (bool, the last eighth of batch 1's keys padded) + an
(L, S) float mask. attnx reads both in place; SDPA gets them merged into one additive (B, 1, L, S) float
mask, built before timing (as its convention requires; nn.MultiheadAttention would build it on every call).

On CUDA attnx's backward is the whole-tensor math fallback unless ATTNX_CUDA_FUSED_BACKWARD=1 selects the
fused kernels (opt-in until they have run on a GPU); the table says which ran.
"""

import os

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_ms, progress, table, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu", "cuda")
TITLE = "attention forward + backward vs SDPA"
B, H, D = 2, 8, 64
LENGTHS = (1024, 4096)
SMOKE_LENGTHS = (64,)
MASKS = ("none", "padding+float")
IMPLS = ("attnx", "sdpa")
FACTORY = "benchmarks.bench_backward:backward_case"


def _inputs(L: int, masks: str, device: str, requires_grad: bool = True):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(B, H, L, D, device=device, generator=g).requires_grad_(requires_grad) for _ in range(3)
    )
    grad_out = torch.randn(B, H, L, D, device=device, generator=g)
    if masks == "none":
        return q, k, v, grad_out, {}, {}
    kpm = torch.zeros(B, L, dtype=torch.bool, device=device)
    kpm[1, L - L // 8 :] = True
    mask = torch.randn(L, L, device=device, generator=g)
    # SDPA: one additive mask with the key padding merged in (True = masked out, as nn.MultiheadAttention).
    merged = mask + torch.zeros(B, 1, 1, L, device=device).masked_fill(kpm[:, None, None, :], float("-inf"))
    return q, k, v, grad_out, {"attn_mask": mask, "key_padding_mask": kpm}, {"attn_mask": merged}


def _forward(impl: str, q, k, v, attnx_masks: dict, sdpa_masks: dict):
    if impl == "attnx":
        return attnx.attention(q, k, v, **attnx_masks)[0]
    return F.scaled_dot_product_attention(q, k, v, **sdpa_masks)


def step(impl: str, L: int, masks: str, device: str):
    """Forward + backward of one implementation; returns the gradients."""
    q, k, v, grad_out, am, sm = _inputs(L, masks, device)
    return lambda: torch.autograd.grad(_forward(impl, q, k, v, am, sm), (q, k, v), grad_out)


def backward_case(device: str, impl: str, L: int, masks: str):
    """(fn, warmup) for benchmarks.memory: fn runs the backward alone on a graph built here."""

    def graph(length):
        q, k, v, grad_out, am, sm = _inputs(length, masks, device)
        out = _forward(impl, q, k, v, am, sm)
        return lambda: torch.autograd.grad(out, (q, k, v), grad_out)

    return graph(L), graph(256)


def attnx_backward(device: str) -> str:
    """Which attention_backward attnx runs on `device` (cuda/attention_backward.cpp's choice)."""
    if device == "cuda" and os.environ.get("ATTNX_CUDA_FUSED_BACKWARD") != "1":
        return "the whole-tensor math fallback"
    return "the fused backward"


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    results, texts = {}, []
    for L in SMOKE_LENGTHS if smoke else LENGTHS[:1] if quick else LENGTHS:
        rows, shape_results = [], {}
        tensor_bytes = B * H * L * D * 4
        for masks in MASKS[1:] if quick else MASKS:
            progress(f"B={B} H={H} L=S={L} D={D}, masks: {masks}")
            fns, graphs = {}, {}
            for impl in IMPLS:
                q, k, v, grad_out, am, sm = _inputs(L, masks, device)
                out = _forward(impl, q, k, v, am, sm)
                # The gradients, checked below; the graph stays for timing the backward alone.
                graphs[impl] = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
                fns[(impl, "fwd+bwd")] = step(impl, L, masks, device)
                fns[(impl, "bwd")] = lambda out=out, q=q, k=k, v=v, g=grad_out: torch.autograd.grad(
                    out, (q, k, v), g, retain_graph=True
                )
            for name, a, b in zip("qkv", graphs["attnx"], graphs["sdpa"], strict=True):  # before timing
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"d{n}: {m}")
            del graphs
            timings = time_interleaved(fns, device, reps=5 if quick or L > 2048 else 9, min_block_s=0)
            jobs = [(FACTORY, False, dict(impl=impl, L=L, masks=masks)) for impl in IMPLS]
            memory = dict(zip(IMPLS, peak_extra_bytes_many(jobs, device, workers=2), strict=True))
            case = {}
            for impl in IMPLS:
                t_step, t_bwd = timings[(impl, "fwd+bwd")], timings[(impl, "bwd")]
                ref_step, ref_bwd = timings[("sdpa", "fwd+bwd")], timings[("sdpa", "bwd")]
                rows.append(
                    [
                        f"{impl}, {masks}",
                        fmt_ms(t_step.median),
                        t_step.spread,
                        f"{t_step.median / ref_step.median:.2f}x",
                        fmt_ms(t_bwd.median),
                        t_bwd.spread,
                        f"{t_bwd.median / ref_bwd.median:.2f}x",
                        f"{memory[impl] / 2**20:.1f}",
                        f"{memory[impl] / (3 * tensor_bytes):.2f}x",
                    ]
                )
                case[impl] = {
                    "fwd+bwd": t_step.to_json(),
                    "bwd": t_bwd.to_json(),
                    "bwd_peak_extra_bytes": memory[impl],
                }
            shape_results[masks] = case
        shape_results["tensor_bytes"] = tensor_bytes
        results[f"B{B}_H{H}_L{L}_D{D}"] = shape_results
        texts.append(
            f"attention forward + backward, B={B} H={H} L=S={L} D={D}, {device} fp32, attnx running "
            f"{attnx_backward(device)} (median of "
            f"{len(t_step.samples)} interleaved reps; memory: backward alone, fresh process each). Each of "
            f"q, k, v, out, dq, dk, dv is {mib(tensor_bytes)} MiB: the gradients are "
            f"{mib(3 * tensor_bytes)} MiB, "
            f"q, k, v, out and the gradients {mib(7 * tensor_bytes)} MiB; (B, H, L, S) in fp32 would be "
            f"{mib(B * H * L * L * 4)} MiB.\n"
            + table(
                [
                    "implementation, masks",
                    "fwd+bwd ms",
                    "spread",
                    "vs SDPA",
                    "bwd ms",
                    "spread",
                    "vs SDPA",
                    "bwd peak extra MiB",
                    "vs dq+dk+dv",
                ],
                rows,
            )
        )
    return {"results": results, "text": "\n\n".join(texts)}
