"""Per-call overhead: attnx's ops against torch's at shapes so small that the call is mostly dispatch.

Decoding calls attention once per layer per token, so what a call costs beyond its arithmetic matters. Each
row times attnx and its torch counterpart interleaved on one thread (the ratio is the round-by-round median
with its 95% interval): no_grad and inference_mode (the routers run the kernel ops directly: no Python below
``torch.ops``), grad mode with nothing requiring grad (the Autograd kernel, registered from Python, finds
nothing to record), and a forward plus backward. Torch's counterparts: ``F.linear``, SDPA (with its bool
mask the other way round where attnx takes one), ``nn.MultiheadAttention``.
"""

import contextlib

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_us, paired_ratio, progress, table, time_interleaved

DEVICES = ("cpu",)
MODE_NAMES = {
    torch.no_grad: "no_grad", torch.inference_mode: "inference_mode", contextlib.nullcontext: "grad mode",
}
TITLE = "per-call overhead at tiny shapes (one thread): attnx vs torch"


def _cases():
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 64), torch.randn(64, 64), torch.randn(64)
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 128, 64), torch.randn(1, 8, 128, 64)
    qg, kg, vg = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    E, H = 64, 4
    xs = torch.randn(1, 4, E)
    ours = attnx.nn.MultiheadAttention(E, H, batch_first=True)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    theirs.load_state_dict(ours.state_dict())

    def attention_fwd_bwd():
        attnx.attention(qg, kg, vg)[0].sum().backward()

    def sdpa_fwd_bwd():
        F.scaled_dot_product_attention(qg, kg, vg).sum().backward()

    def mha_fwd_bwd(module):
        def fn():
            module(xs, xs, xs, need_weights=False)[0].sum().backward()
        return fn

    no_grad, inference, grad = torch.no_grad, torch.inference_mode, contextlib.nullcontext
    return [
        # name, mode, attnx, torch
        ("linear (1, 64) x (64, 64)", no_grad, lambda: attnx.linear(x, w, b), lambda: F.linear(x, w, b)),
        ("attention decode (1, 8, 1|128, 64)", no_grad, lambda: attnx.attention(q, k, v),
         lambda: F.scaled_dot_product_attention(q, k, v)),
        ("attention decode (1, 8, 1|128, 64)", inference, lambda: attnx.attention(q, k, v),
         lambda: F.scaled_dot_product_attention(q, k, v)),
        ("attention decode, no input requires grad", grad, lambda: attnx.attention(q, k, v),
         lambda: F.scaled_dot_product_attention(q, k, v)),
        ("MultiheadAttention eval (1, 4, 64), 4 heads", no_grad,
         lambda: ours.eval()(xs, xs, xs, need_weights=False),
         lambda: theirs.eval()(xs, xs, xs, need_weights=False)),
        ("attention forward + backward (1, 2, 8, 16)", grad, attention_fwd_bwd, sdpa_fwd_bwd),
        ("MultiheadAttention train forward + backward (1, 4, 64)", grad, mha_fwd_bwd(ours.train()),
         mha_fwd_bwd(theirs.train())),
    ]


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    reps = 3 if smoke else 11 if quick else 31
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results, rows = {}, []
    try:
        for name, mode, ours, theirs in _cases():
            label = f"{name}, {MODE_NAMES[mode]}"
            progress(label)
            with mode():
                t = time_interleaved({"attnx": ours, "torch": theirs}, device, reps=reps,
                                     min_block_s=0.002 if smoke else 0.02)
            ratio = paired_ratio(t["attnx"], t["torch"])
            results[label] = {"attnx": t["attnx"].to_json(), "torch": t["torch"].to_json(),
                              "attnx/torch": ratio.to_json()}
            rows.append([label, fmt_us(t["attnx"].median), t["attnx"].spread, fmt_us(t["torch"].median),
                         t["torch"].spread, str(ratio)])
    finally:
        torch.set_num_threads(threads)
    text = f"{TITLE}: time per call in us (median of {reps} rounds)\n" + table(
        ["call, mode", "attnx", "±", "torch", "±", "attnx/torch (95% CI)"], rows
    )
    return {"results": results, "text": text}
