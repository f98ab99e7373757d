"""Eval memory and time of nn.MultiheadAttention (upstream report: mha-eval-fastpath-memory).

``nn.MultiheadAttention(256, 4, batch_first=True)`` in eval under no_grad, self-attention, with a
key_padding_mask and an attn_mask (all False, as in the report). Torch's fast path merges the two masks into a
``[B*H, L, S]`` tensor and materialises attention; its slow path (fast path disabled, which is what the
report's train() run takes) materialises ``[B, H, L, S]`` scores too. attnx (``attnx.nn.MultiheadAttention``
with the torch module's state_dict) reads both masks in place. The report's shape (B=32, L=2000) on GPUs; on
CPU it is scaled down in batch (B=8, quick: B=4) so that the fast path's ~1.6 GiB fits any machine.

Reported: peak extra memory of one call (fresh process each; CPU: RSS high-water mark, CUDA:
max_memory_allocated) against the unavoidable memory (the q, k, v projections plus the output), and time.
"""

import torch

import attnx

from .common import Timing, fmt_mib, fmt_ms, progress, ratio, table, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu", "cuda", "mps")
TITLE = "eval memory and time (mha-eval-fastpath-memory)"
EVAL_SHAPE = {
    "cpu": dict(B=8, L=2000, E=256, H=4),
    "cpu-quick": dict(B=4, L=2000, E=256, H=4),
    "cuda": dict(B=32, L=2000, E=256, H=4),
    "mps": dict(B=32, L=2000, E=256, H=4),
}
SMOKE_SHAPE = dict(B=2, L=64, E=32, H=4)
EVAL_IMPLS = ("torch fast path", "torch slow path", "attnx")


def _modules(E: int, H: int, device: str):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
    ours = attnx.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def eval_case(device: str, impl: str, B: int, L: int, E: int, H: int):
    """(fn, warmup) for one implementation; ``impl`` is one of EVAL_IMPLS."""
    ref, ours = _modules(E, H, device)
    module = ours if impl == "attnx" else ref
    fast = impl == "torch fast path"

    def call(x, kpm, mask):
        torch.backends.mha.set_fastpath_enabled(fast)
        return module(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]

    def inputs(length):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(B, length, E, device=device, generator=g)
        kpm = torch.zeros(B, length, dtype=torch.bool, device=device)
        mask = torch.zeros(length, length, dtype=torch.bool, device=device)
        return x, kpm, mask

    big, small = inputs(L), inputs(16)
    return (lambda: call(*big)), (lambda: call(*small))


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    shape = (
        SMOKE_SHAPE if smoke else EVAL_SHAPE.get(f"{device}-quick" if quick else device, EVAL_SHAPE[device])
    )
    B, L, E = shape["B"], shape["L"], shape["E"]
    reps = 3 if smoke else 5 if quick else 11
    fns = {impl: eval_case(device, impl, **shape)[0] for impl in EVAL_IMPLS}
    progress(f"B={B} L=S={L} E={E}: checking outputs")
    with torch.no_grad():
        outs = {impl: fn() for impl, fn in fns.items()}
        for impl in EVAL_IMPLS[1:]:
            torch.testing.assert_close(outs[impl], outs["torch fast path"], atol=1e-4, rtol=1e-4)
        del outs
        progress(f"B={B} L=S={L} E={E}: timing, {reps} interleaved reps")
        timings = time_interleaved(fns, device, reps=reps, min_block_s=0.05 if device != "cpu" else 0)
    torch.backends.mha.set_fastpath_enabled(True)
    progress(f"B={B} L=S={L} E={E}: peak memory, a fresh process per implementation")
    jobs = [("benchmarks.bench_mha:eval_case", False, dict(impl=impl, **shape)) for impl in EVAL_IMPLS]
    memory = dict(zip(EVAL_IMPLS, peak_extra_bytes_many(jobs, device, workers=2), strict=True))
    unavoidable = 4 * B * L * E * 4  # q, k, v projections and the output, fp32
    t_fast = timings["torch fast path"].median
    rows, results = [], {}
    for impl in EVAL_IMPLS:
        t: Timing = timings[impl]
        rows.append(
            [
                impl,
                fmt_mib(memory[impl]),
                ratio(memory[impl], unavoidable),
                ratio(memory[impl], memory["attnx"]),
                fmt_ms(t.median),
                t.spread,
                f"{t.median / t_fast:.2f}x",
            ]
        )
        results[impl] = {
            "peak_extra_bytes": memory[impl],
            "time": t.to_json(),
            "time_over_fast_path": t.median / t_fast,
        }
    text = (
        f"Eval, nn.MultiheadAttention(E={E}, H={shape['H']}, batch_first=True), self-attention, B={B}, "
        f"L=S={L}, "
        f"key_padding_mask + attn_mask (all False), no_grad, {device} fp32.\n"
        f"Time: median of {reps} interleaved reps, spread = IQR/median. Memory: peak extra bytes of one "
        "call, "
        f"fresh process each. Unavoidable = q, k, v and the output = {fmt_mib(unavoidable)} MiB.\n"
        + table(
            [
                "implementation",
                "peak extra MiB",
                "vs unavoidable",
                "vs attnx",
                "time ms",
                "spread",
                "vs fast path",
            ],
            rows,
        )
    )
    return {"results": {"shape": shape, "unavoidable_bytes": unavoidable, **results}, "text": text}
