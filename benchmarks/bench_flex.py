"""FlexAttention's masks on the CPU: PyTorch's FlexAttention against attnx's takeover (``attnx.flex``).

The third upstream report: FlexAttention outside inductor (eager, ``aot_eager``) runs a dense forward and a
dense backward (``sdpa_dense`` / ``sdpa_dense_backward``: ``(B, H, L, S)`` scores, ~85 dispatches a
backward). On the CPU PyTorch's public function refuses a backward altogether, so the training rows time its
dense path through its operator (``torch.ops.higher_order.flex_attention``, the same code ``aot_eager`` runs).

- ``documents``: 8 documents packed in S keys (bf16, D = 128, a ``BlockMask`` of 128 x 128 blocks): PyTorch's
  eager forward, its inductor-compiled forward (``torch.compile``; its CPU kernel has no backward), its dense
  training step, and the takeover's forward and training step; peak extra memory of the training steps
  (fresh process each); the dispatches of the takeover's backward. Targets: takeover step <= 0.2x the dense
  step, takeover forward <= 1.0x the compiled forward, peak extra memory <= 1/20 of the dense step's.
- ``sliding``: a causal window of 1024 keys at S = 16384 (bf16, D = 128): the takeover's forward against
  ``attnx.attention(window_left=1023, window_right=0)``, the same work given as a rule. Target: <= 1.2x.

Outputs are compared before timing. Times are medians of per-round ratios from interleaved runs.
"""

import warnings

import torch

import attnx

from .common import count_dispatches, fmt_mib, fmt_ms, paired_ratio, progress, table, target, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu",)
TITLE = "FlexAttention masks (BlockMask) on the CPU: PyTorch's paths vs the attnx.flex takeover"

DOCUMENTS = 8
MEMORY_PRELOAD = ("torch.nn.attention.flex_attention",)


def _flex():
    from torch.nn.attention import flex_attention as flex

    return flex


def documents_mask(B: int, S: int):
    """FlexAttention's documents mask: 8 documents of random lengths in each batch's S keys."""
    gen = torch.Generator().manual_seed(0)
    cuts = torch.stack([torch.randperm(S - 1, generator=gen)[:DOCUMENTS - 1].sort().values + 1
                        for _ in range(B)])
    ids = (torch.arange(S).view(1, S) >= cuts.unsqueeze(-1)).sum(1)

    def mask(b, h, q, kv):
        return ids[b, q] == ids[b, kv]

    return mask


def sliding_mask(window: int):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return mask


def _inputs(B: int, H: int, S: int, D: int, dtype, grad: bool):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(B, H, S, D, generator=gen).to(dtype).requires_grad_(grad) for _ in range(3)]


def _dense_step(q, k, v, bm):
    """PyTorch's dense FlexAttention forward and backward (its operator, as aot_eager runs it)."""
    flex = _flex()
    hop = torch.ops.higher_order.flex_attention
    options = flex._apply_kernel_options(q, k, v, False, None, None)
    options["OUTPUT_LOGSUMEXP"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hop(q, k, v, flex._identity, bm.as_tuple(), q.shape[-1] ** -0.5, options)[0]
    return out


def training_case(impl: str = "attnx", device: str = "cpu", B: int = 1, H: int = 2, S: int = 8192,
                  D: int = 128) -> tuple:
    """A training step (forward and backward) of the documents mask: ``(fn, warmup)`` for
    benchmarks.memory."""
    flex = _flex()
    q, k, v = _inputs(B, H, S, D, torch.bfloat16, grad=True)
    bm = flex.create_block_mask(documents_mask(B, S), B, None, S, S, device=device)
    grad = torch.ones(B, H, S, D, dtype=torch.bfloat16)
    attnx.flex.block_sparse(bm)  # the conversion, once per BlockMask (layers share it)

    def step():
        if impl == "attnx":
            attnx.flex.flex_attention(q, k, v, block_mask=bm).backward(grad)
        else:
            _dense_step(q, k, v, bm).backward(grad)

    return step, step


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    flex = _flex()
    B, H, D = 1, 2, 128
    S = 256 if smoke else 4096 if quick else 8192
    reps = 3 if smoke else 3 if quick else 5
    progress(f"flex documents B={B} H={H} S={S} D={D} bf16")
    q, k, v = _inputs(B, H, S, D, torch.bfloat16, grad=False)
    mask = documents_mask(B, S)
    bm = flex.create_block_mask(mask, B, None, S, S, device=device)
    attnx.flex.block_sparse(bm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(flex.flex_attention)
        want = compiled(q, k, v, block_mask=bm)  # compiles here, outside the timing
        eager = flex.flex_attention(q, k, v, block_mask=bm)
    got = attnx.flex.flex_attention(q, k, v, block_mask=bm)
    for name, ref in (("compiled", want), ("eager", eager)):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2,
                                   msg=f"attnx.flex and PyTorch's {name} FlexAttention disagree")
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    grad = torch.ones_like(got)

    def eager_forward():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex.flex_attention(q, k, v, block_mask=bm)

    def dense_step():
        _dense_step(qg, kg, vg, bm).backward(grad)

    def attnx_step():
        attnx.flex.flex_attention(qg, kg, vg, block_mask=bm).backward(grad)

    fns = {
        "eager_forward": eager_forward,
        "compiled_forward": lambda: compiled(q, k, v, block_mask=bm),
        "attnx_forward": lambda: attnx.flex.flex_attention(q, k, v, block_mask=bm),
        "dense_step": dense_step,
        "attnx_step": attnx_step,
    }
    with torch.no_grad():
        t_fwd = time_interleaved({n: fns[n] for n in ("eager_forward", "compiled_forward", "attnx_forward")},
                                 device, reps=reps, min_block_s=0)
    t_step = time_interleaved({n: fns[n] for n in ("dense_step", "attnx_step")}, device, reps=reps,
                              min_block_s=0)
    t = {**t_fwd, **t_step}
    r_eager = paired_ratio(t["attnx_forward"], t["eager_forward"])
    r_compiled = paired_ratio(t["attnx_forward"], t["compiled_forward"])
    r_step = paired_ratio(t["attnx_step"], t["dense_step"])

    def backward_dispatches(step_fn):
        out = step_fn()
        return count_dispatches(lambda: out.backward(grad)).n

    # (A TorchDispatchMode does not see into PyTorch's dense backward, an operator of its own: the report
    # counted 83-87 dispatches there.)
    dispatches = {"attnx": backward_dispatches(lambda: attnx.flex.flex_attention(qg, kg, vg, block_mask=bm))}
    kwargs = {"B": B, "H": H, "S": S, "D": D}
    memory = peak_extra_bytes_many([("benchmarks.bench_flex:training_case", True, {**kwargs, "impl": impl})
                                    for impl in ("dense", "attnx")], device)
    memory = dict(zip(("dense", "attnx"), memory, strict=True))
    met = {
        "step": r_step.median <= 0.2,
        "forward_vs_compiled": r_compiled.median <= 1.0,
        "memory": memory["attnx"] <= memory["dense"] / 20,
    }
    documents = {
        "shape": {"B": B, "H": H, "S": S, "D": D, "documents": DOCUMENTS, "dtype": "bfloat16"},
        "timings": {n: x.to_json() for n, x in t.items()},
        "attnx_vs_eager_forward": r_eager.to_json(), "attnx_vs_compiled_forward": r_compiled.to_json(),
        "attnx_vs_dense_step": r_step.to_json(), "backward_dispatches": dispatches,
        "peak_extra_bytes": memory, "target_met": met,
    }
    visited = int((attnx.flex.block_sparse(bm)["block_map"] != -1).sum())
    text = (
        f"documents mask, {DOCUMENTS} documents in S={S} (bf16, B={B}, H={H}, D={D}, 128 x 128 blocks, "
        f"{visited} of {(S // 128) ** 2} blocks visited)\n"
        + table(
            ["call", "time (ms)", "attnx / this (95% CI)", "backward dispatches", "peak extra MiB"],
            [["PyTorch eager flex_attention, forward", fmt_ms(t["eager_forward"].median), str(r_eager), "",
              ""],
             ["PyTorch torch.compile flex_attention, forward", fmt_ms(t["compiled_forward"].median),
              str(r_compiled), "", ""],
             ["attnx.flex, forward", fmt_ms(t["attnx_forward"].median), "", "", ""],
             ["PyTorch dense flex_attention, forward + backward", fmt_ms(t["dense_step"].median), str(r_step),
              "", fmt_mib(memory["dense"])],
             ["attnx.flex, forward + backward", fmt_ms(t["attnx_step"].median), "", str(dispatches["attnx"]),
              fmt_mib(memory["attnx"])]],
        )
        + f"\ntargets: step <= 0.2x the dense step: {target(met['step'])}; forward <= 1.0x the compiled "
        f"forward: {target(met['forward_vs_compiled'])}; memory <= 1/20 of the dense step's: "
        f"{target(met['memory'])}"
    )

    # A sliding window as a BlockMask against the same window as attnx's rule.
    S = 512 if smoke else 8192 if quick else 16384
    W = 64 if smoke else 1024
    progress(f"flex sliding window {W} B={B} H={H} S={S} D={D} bf16")
    q, k, v = _inputs(B, H, S, D, torch.bfloat16, grad=False)
    bm = flex.create_block_mask(sliding_mask(W), None, None, S, S, device=device)
    attnx.flex.block_sparse(bm)
    fns = {
        "block_mask": lambda: attnx.flex.flex_attention(q, k, v, block_mask=bm),
        "window": lambda: attnx.attention(q, k, v, window_left=W - 1, window_right=0)[0],
    }
    torch.testing.assert_close(fns["block_mask"]().float(), fns["window"]().float(), atol=1e-2, rtol=1e-2)
    with torch.no_grad():
        t = time_interleaved(fns, device, reps=reps, min_block_s=0)
    r = paired_ratio(t["block_mask"], t["window"])
    sliding_met = r.median <= 1.2
    sliding = {
        "shape": {"B": B, "H": H, "S": S, "D": D, "window": W, "dtype": "bfloat16"},
        "timings": {n: x.to_json() for n, x in t.items()}, "block_mask_vs_window": r.to_json(),
        "target_met": sliding_met,
    }
    text += (
        f"\n\nsliding window of {W} keys, S={S} (bf16, B={B}, H={H}, D={D}), forward\n"
        + table(
            ["call", "time (ms)", "block mask / window rule (95% CI)"],
            [["attnx.flex with the BlockMask", fmt_ms(t["block_mask"].median), str(r)],
             [f"attnx.attention(window_left={W - 1}, window_right=0)", fmt_ms(t["window"].median), ""]],
        )
        + f"\ntarget <= 1.2x: {target(sliding_met)}"
    )
    return {"results": {"documents": documents, "sliding": sliding}, "text": text}
