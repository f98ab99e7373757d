"""Training: dispatch counts, time and memory of one MHA layer's forward + backward
(upstream report: flex-attention-backward-math-fallback).

(a) The report's dispatch counts, with its counter (a ``TorchDispatchMode`` counting every
    ``__torch_dispatch__`` call) and its shapes (B=2, H=4, S=128, D=16): torch's dense math fallback
    ``sdpa_dense_backward`` (114 in the report) and SDPA forward + ``.sum().backward()`` (13), with attnx's
    ``attention`` forward + ``.sum().backward()`` beside them.
(b) One MHA layer, self-attention (batch_first, no masks, no dropout), forward + ``.backward(grad_out)``:
    ``nn.MultiheadAttention`` in train mode vs the hand-written SDPA composition of the B=1 report vs
    ``attnx.nn.MultiheadAttention`` in train mode, whatever path attnx takes for it. Dispatches counted as in
    (a) at the report's shape (E = H * D = 64, L = 128), with the most frequent ops; target: attnx in at most
    6 dispatches (its two ops and autograd's detach of each of the 4 parameter gradients), 7 where the input
    requires grad too (one more leaf, one more detach).
(c) The same layer at B=2, E=512, H=8, L in {1024, 4096}: forward + backward time (interleaved), peak extra
    memory of forward + backward and of the backward alone (fresh process each). Target: attnx's backward
    peak extra memory at S=4096 at most 1.25x the size of q, k, v, out (each B*L*E) and dq, dk, dv.
"""

import torch
import torch.nn.functional as F

import attnx

from .bench_b1 import sdpa_composition
from .common import count_dispatches, fmt_mib, fmt_ms, progress, ratio, table, target, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu", "cuda", "mps")
TITLE = "training: dispatches, time, memory (flex-attention-backward-math-fallback)"
IMPLS = ("nn.MultiheadAttention", "SDPA composition", "attnx")
SEED_SHAPE = (2, 4, 128, 16)  # (B, H, S, D), the report's
LAYER = dict(B=2, E=512, H=8)
LENGTHS = (1024, 4096)
SMOKE_LAYER, SMOKE_LENGTHS = dict(B=2, E=32, H=4), (64,)
MAX_DISPATCHES = 6  # mha_forward, mha_backward, a detach per parameter gradient; +1 for an input with grad
MAX_BWD_MEMORY = 1.25  # x the size of q, k, v, out, dq, dk, dv
FACTORY = "benchmarks.bench_train:layer_case"


# -----------------------------------------------------------------------------------------------------------
# (a) the report's counts


def _seed_counts() -> dict:
    """The report's repro on the CPU (its counts are hardware-independent), plus attnx.attention."""
    B, H, S, D = SEED_SHAPE
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    counts = {}
    try:
        from torch._higher_order_ops.flex_attention import sdpa_dense_backward

        lse = torch.zeros(B, H, S)
        go = torch.randn_like(out)
        block_mask = (
            torch.ones(1, 1, 1, dtype=torch.int32),
            torch.ones(1, 1, 1, 1, dtype=torch.int32),
            torch.ones(1, 1, 1, dtype=torch.int32),
            torch.ones(1, 1, 1, 1, dtype=torch.int32),
            None,
            None,
            None,
            None,
            S,
            S,
            lambda b, h, q, kv: q >= 0,
        )
        opts = dict(PRESCALE_QK=False, ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False, WRITE_DQ=True,
                    OUTPUT_LOGSUMEXP=False, OUTPUT_MAX=False)
        counts["flex dense backward (math fallback)"] = count_dispatches(
            lambda: sdpa_dense_backward(
                q,
                k,
                v,
                out,
                lse,
                go,
                None,
                lambda s, b, h, m, n: s,
                None,
                block_mask,
                1.0 / D**0.5,
                opts,
                (),
                (),
            )
        ).to_json()
    except Exception as e:  # noqa: BLE001 (a private torch API: any change of it only loses this row)
        counts["flex dense backward (math fallback)"] = {
            "dispatches": None,
            "error": f"{type(e).__name__}: {e}",
        }

    def fwd_bwd(fn):
        q2, k2, v2 = (t.clone().requires_grad_(True) for t in (q, k, v))
        return count_dispatches(lambda: fn(q2, k2, v2).sum().backward()).to_json()

    counts["SDPA fwd+bwd"] = fwd_bwd(F.scaled_dot_product_attention)
    counts["attnx.attention fwd+bwd"] = fwd_bwd(lambda q, k, v: attnx.attention(q, k, v)[0])
    return counts


# -----------------------------------------------------------------------------------------------------------
# (b), (c): one MHA layer


def make_layer(impl: str, device: str, B: int, L: int, E: int, H: int):
    """A train-mode layer and its input: ``(forward, x, grad_out, module)``; forward() returns the output."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, device=device).train()
    module = ref
    if impl == "attnx":
        module = attnx.nn.MultiheadAttention(E, H, batch_first=True, device=device).train()
        module.load_state_dict(ref.state_dict())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(B, L, E, device=device, generator=g).requires_grad_(True)
    grad_out = torch.randn(B, L, E, device=device, generator=g)
    if impl == "SDPA composition":
        forward = sdpa_composition(ref, x, x, train=True)
    else:

        def forward():
            return module(x, x, x, need_weights=False)[0]

    return forward, x, grad_out, module


def _zero_grads(x, module) -> None:
    x.grad = None
    module.zero_grad(set_to_none=True)


def layer_case(device: str, impl: str, B: int, L: int, E: int, H: int, phase: str):
    """(fn, warmup) for benchmarks.memory: ``phase`` "step" = forward + backward, "backward" = the backward
    alone, of a graph built here (and its inputs, which exist before the call)."""

    def make(length):
        forward, x, grad_out, module = make_layer(impl, device, B, length, E, H)
        if phase == "step":
            return lambda: forward().backward(grad_out)
        out = forward()
        return lambda: out.backward(grad_out)

    return make(L), make(16)


def _check_layers(device: str, B: int, L: int, E: int, H: int) -> dict:
    """Outputs, input and parameter gradients of each implementation against torch's module, before timing."""
    got = {}
    for impl in IMPLS:
        forward, x, grad_out, module = make_layer(impl, device, B, L, E, H)
        out = forward()
        out.backward(grad_out)
        got[impl] = [out.detach(), x.grad] + [p.grad for p in module.parameters()]
    for impl in IMPLS[1:]:
        for i, (a, b) in enumerate(zip(got[impl], got[IMPLS[0]], strict=True)):
            torch.testing.assert_close(
                a, b, atol=2e-4, rtol=1e-3, msg=lambda m, i=i, n=impl: f"{n}, tensor {i}: {m}"
            )
    return {impl: (got[impl][0] - got[IMPLS[0]][0]).abs().max().item() for impl in IMPLS}


def _layer_counts(device: str) -> dict:
    B, H, S, D = SEED_SHAPE
    counts = {}
    for impl in IMPLS:
        forward, x, grad_out, module = make_layer(impl, device, B, S, H * D, H)
        forward().backward(grad_out)  # warm-up: lazy initialisation stays out of the count
        _zero_grads(x, module)  # counted as a training step after zero_grad(set_to_none=True)
        counts[impl] = count_dispatches(lambda f=forward, g=grad_out: f().backward(g)).to_json()
    return counts


def _seq_first_counts(device: str) -> dict:
    """(b) as the layer sits in most models: sequence-first (no batch_first transposes around the op) and fed
    by data that needs no gradient, so what is counted is the layer's own work plus autograd's one detach per
    parameter gradient it accumulates."""
    B, H, S, D = SEED_SHAPE
    counts = {}
    for impl, cls in (("nn.MultiheadAttention", torch.nn.MultiheadAttention),
                      ("attnx", attnx.nn.MultiheadAttention)):
        torch.manual_seed(0)
        module = cls(H * D, H, device=device).train()
        x = torch.randn(S, B, H * D, device=device)
        grad_out = torch.randn(S, B, H * D, device=device)

        def step(module=module, x=x, grad_out=grad_out):
            module(x, x, x, need_weights=False)[0].backward(grad_out)

        step()
        module.zero_grad(set_to_none=True)
        counts[impl] = count_dispatches(step).to_json()
    return counts


def _step_fn(device: str, impl: str, B: int, L: int, E: int, H: int):
    forward, x, grad_out, module = make_layer(impl, device, B, L, E, H)

    def step():
        _zero_grads(x, module)
        forward().backward(grad_out)

    return step


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    layer = SMOKE_LAYER if smoke else LAYER
    lengths = SMOKE_LENGTHS if smoke else LENGTHS[:1] if quick else LENGTHS
    B, E, H = layer["B"], layer["E"], layer["H"]

    progress("dispatch counts: the report's repro and the MHA layer")
    seed = _seed_counts()
    _check_layers(device, B, 64, E, H)
    layer_counts = _layer_counts(device)
    seq_first_counts = _seq_first_counts(device)

    texts = []
    rows = [
        [name, c["dispatches"] if c["dispatches"] is not None else "n/a (" + c["error"][:60] + ")"]
        for name, c in seed.items()
    ]
    texts.append(
        f"(a) the report's dispatch counts (TorchDispatchMode counting every __torch_dispatch__ call), "
        f"B={SEED_SHAPE[0]} H={SEED_SHAPE[1]} S={SEED_SHAPE[2]} D={SEED_SHAPE[3]}, cpu "
        "(the report: 114 and 13)\n" + table(["what", "dispatches"], rows)
    )
    rows = []
    for impl in IMPLS:
        c = layer_counts[impl]
        top = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in list(c["top_ops"].items())[:5])
        limit = MAX_DISPATCHES + 1  # the input requires grad here: autograd detaches its gradient too
        goal = target(c["dispatches"] <= limit) if impl == "attnx" else ""
        rows.append([impl, c["dispatches"], f"<= {limit}: {goal}" if goal else "", top])
    for impl, c in seq_first_counts.items():
        top = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in list(c["top_ops"].items())[:5])
        goal = target(c["dispatches"] <= MAX_DISPATCHES) if impl == "attnx" else ""
        rows.append([f"{impl}, seq-first, input without grad", c["dispatches"],
                     f"<= {MAX_DISPATCHES}: {goal}" if goal else "", top])
    texts.append(
        f"(b) one MHA layer, train mode, forward + .backward(grad_out), self-attention, "
        f"B={SEED_SHAPE[0]} L={SEED_SHAPE[2]} E={SEED_SHAPE[1] * SEED_SHAPE[3]} H={SEED_SHAPE[1]}, {device}: "
        f"dispatches (the counter of (a)) and the most frequent ops. The first rows: batch_first modules "
        f"and an input that requires grad (each leaf's gradient costs autograd one detach; attnx hands "
        f"batch_first inputs to its op as they are, torch's module transposes them); the last two: the layer "
        f"as most models hold it\n"
        + table(["implementation", "dispatches", "target", "top ops"], rows)
    )

    per_length, rows, mem_rows = {}, [], []
    reps = 3 if smoke else 5 if quick else 7
    for L in lengths:
        n = reps if L <= 2048 else 3  # one step takes seconds there
        progress(f"B={B} L={L} E={E} H={H}: checking gradients, then timing forward + backward ({n} reps)")
        diffs = _check_layers(device, B, L, E, H)
        fns = {impl: _step_fn(device, impl, B, L, E, H) for impl in IMPLS}
        timings = time_interleaved(fns, device, reps=n, min_block_s=0)
        del fns
        progress(f"B={B} L={L} E={E} H={H}: peak memory, a fresh process per implementation and phase")
        phases = ("backward",) if quick else ("step", "backward")  # quick: the figure with a target only
        jobs = [
            (FACTORY, True, dict(impl=impl, B=B, L=L, E=E, H=H, phase=phase))
            for impl in IMPLS
            for phase in phases
        ]
        small = (
            B * H * L * L * 4 <= 2**28
        )  # attention-sized temporaries below 256 MiB: two processes at a time
        peaks = iter(peak_extra_bytes_many(jobs, device, workers=2 if small else 1))
        memory = {impl: {"step": None, **{phase: next(peaks) for phase in phases}} for impl in IMPLS}
        tensor_bytes = B * L * E * 4
        budget = 7 * tensor_bytes  # q, k, v, out, dq, dk, dv
        t_ref = timings[IMPLS[0]].median
        case = {"tensor_bytes": tensor_bytes, "max_abs_diff_vs_torch": diffs}
        for impl in IMPLS:
            t, m = timings[impl], memory[impl]
            rows.append([f"L={L}, {impl}", fmt_ms(t.median), t.spread, f"{t.median / t_ref:.2f}x"])
            goal = ""
            if impl == "attnx" and m["backward"] is not None and L == 4096:
                goal = target(m["backward"] <= MAX_BWD_MEMORY * budget)
            mem_rows.append(
                [
                    f"L={L}, {impl}",
                    fmt_mib(m["step"]),
                    fmt_mib(m["backward"]),
                    ratio(m["backward"], budget),
                    goal,
                ]
            )
            case[impl] = {
                "fwd+bwd": t.to_json(),
                "step_peak_extra_bytes": m["step"],
                "bwd_peak_extra_bytes": m["backward"],
                "time_over_torch": t.median / t_ref,
            }
        per_length[f"L{L}"] = case
    texts.append(
        f"(c) one MHA layer, train mode, forward + backward, B={B} E={E} H={H}, {device} fp32: time (median "
        f"of {reps} interleaved reps, 3 above L=2048; spread = IQR/median; ratio to nn.MultiheadAttention)\n"
        + table(["L, implementation", "fwd+bwd ms", "spread", "vs nn.MHA"], rows)
    )
    texts.append(
        f"(c) peak extra memory (fresh process each) of forward + backward and of the backward alone; q, k, "
        "v, "
        f"out, dq, dk, dv are B*L*E*4 bytes each ({fmt_mib(7 * B * lengths[0] * E * 4)} MiB together at "
        f"L={lengths[0]}); target: attnx's backward at L=4096 <= {MAX_BWD_MEMORY}x of them\n"
        + table(
            ["L, implementation", "fwd+bwd peak MiB", "bwd peak MiB", "bwd vs q,k,v,out,grads", "target"],
            mem_rows,
        )
    )
    results = {
        "seed_counts": seed,
        "layer_counts": layer_counts,
        "seq_first_layer_counts": seq_first_counts,
        "layer": per_length,
        "targets": {
            "max_dispatches": MAX_DISPATCHES,
            "max_dispatches_input_grad": MAX_DISPATCHES + 1,
            "max_bwd_memory_vs_qkv_out_grads": MAX_BWD_MEMORY,
        },
    }
    return {"results": results, "text": "\n\n".join(texts)}
