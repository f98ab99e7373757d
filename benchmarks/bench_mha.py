"""nn.MultiheadAttention forward: torch vs attnx on the cases of two seed reports.

(a) mha-eval-fastpath-memory: ``nn.MultiheadAttention(256, 4, batch_first=True)`` in eval under no_grad, with a
    key_padding_mask and an attn_mask (all False). Torch's fast path merges the two masks into a
    ``[B*H, L, S]`` tensor and materialises attention; its slow path (fast path disabled) does not merge.
    Reported: peak extra memory (fresh process per case) against the unavoidable memory (the q, k, v
    projections plus the output), and time.
(b) mps-mha-b1-transposed-linear: its B=1 shape sweep, ``nn.MultiheadAttention`` vs the report's hand-written
    SDPA composition vs attnx. The report's 9x is an MPS effect; on CPU this checks that attnx's single
    dispatch is no slower than the composition.
"""

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_us, table, time_interleaved
from .memory import peak_extra_bytes

DEVICES = ("cpu",)  # bench_cuda runs case (a) on CUDA at the report's own shape
EVAL_SHAPE = {"cpu": dict(B=8, L=2000, E=256, H=4), "cuda": dict(B=32, L=2000, E=256, H=4)}
EVAL_IMPLS = ("torch fast path", "torch slow path", "attnx")
B1_SHAPES = [  # (B, Lq, Lkv, E, H, self-attention)
    (1, 32, 256, 512, 8, False),
    (1, 64, 512, 512, 8, False),
    (1, 128, 1024, 512, 8, False),
    (1, 64, 64, 768, 12, True),
    (4, 32, 256, 512, 8, False),
]


def _modules(E: int, H: int, device: str):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
    ours = attnx.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def eval_case(device: str, impl: str, B: int, L: int, E: int, H: int):
    """(fn, warmup) for case (a); ``impl`` is one of EVAL_IMPLS."""
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


def run_eval(device: str, quick: bool) -> tuple:
    shape = EVAL_SHAPE[device]
    B, L, E = shape["B"], shape["L"], shape["E"]
    fns = {impl: eval_case(device, impl, **shape)[0] for impl in EVAL_IMPLS}
    with torch.no_grad():
        outs = {impl: fn() for impl, fn in fns.items()}
        for impl in EVAL_IMPLS[1:]:
            torch.testing.assert_close(outs[impl], outs["torch fast path"], atol=1e-4, rtol=1e-4)
        del outs
        timings = time_interleaved(fns, device, reps=3 if quick else 7, min_block_s=0)
    torch.backends.mha.set_fastpath_enabled(True)
    memory = {impl: peak_extra_bytes("benchmarks.bench_mha:eval_case", device, impl=impl, **shape)
              for impl in EVAL_IMPLS}
    unavoidable = 4 * B * L * E * 4  # q, k, v projections and the output, fp32
    t_fast = timings["torch fast path"].median
    rows, results = [], {}
    for impl in EVAL_IMPLS:
        t = timings[impl]
        rows.append([impl, f"{memory[impl] / 2**20:.1f}", f"{memory[impl] / unavoidable:.2f}x",
                     f"{t.median * 1e3:.1f}", f"{t.median / t_fast:.2f}x", f"±{100 * t.iqr / t.median:.0f}%"])
        results[impl] = {"peak_extra_bytes": memory[impl], "time": t.to_json()}
    results["unavoidable_bytes"] = unavoidable
    text = (
        f"(a) eval, nn.MultiheadAttention(E={E}, H={shape['H']}, batch_first=True), B={B}, L=S={L}, "
        f"key_padding_mask + attn_mask, no_grad, {device} fp32 (time: median of {len(t.samples)}; "
        f"memory: fresh process each; unavoidable = q, k, v and output = {unavoidable / 2**20:.1f} MiB)\n"
        + table(["implementation", "peak extra MiB", "vs unavoidable", "time ms", "vs fast path", "IQR"], rows)
    )
    return results, text


def run_b1(device: str, quick: bool) -> tuple:
    rows, results = [], {}
    for B, Lq, Lkv, E, H, self_attn in B1_SHAPES[:2] if quick else B1_SHAPES:
        ref, ours = _modules(E, H, device)
        hd = E // H
        q = torch.randn(B, Lq, E, device=device)
        mem = q if self_attn else torch.randn(B, Lkv, E, device=device)
        Wq, Wk, Wv = ref.in_proj_weight.detach().chunk(3)
        bq, bk, bv = ref.in_proj_bias.detach().chunk(3)
        Wo, bo = ref.out_proj.weight.detach(), ref.out_proj.bias.detach()

        def via_sdpa(q=q, mem=mem, Lq=Lq, Lkv=Lkv):  # the report's composition, verbatim
            Q = F.linear(q, Wq, bq).view(B, Lq, H, hd).transpose(1, 2)
            K = F.linear(mem, Wk, bk).view(B, Lkv, H, hd).transpose(1, 2)
            V = F.linear(mem, Wv, bv).view(B, Lkv, H, hd).transpose(1, 2)
            out = F.scaled_dot_product_attention(Q, K, V).transpose(1, 2).contiguous().view(B, Lq, E)
            return F.linear(out, Wo, bo)

        fns = {
            "nn.MultiheadAttention": lambda ref=ref, q=q, mem=mem: ref(q, mem, mem, need_weights=False)[0],
            "SDPA composition": via_sdpa,
            "attnx": lambda ours=ours, q=q, mem=mem: ours(q, mem, mem, need_weights=False)[0],
        }
        with torch.no_grad():
            want = fns["SDPA composition"]()
            for name, fn in fns.items():
                torch.testing.assert_close(fn(), want, atol=1e-4, rtol=1e-4)
            timings = time_interleaved(fns, device, reps=9 if quick else 21)
        t_sdpa = timings["SDPA composition"].median
        label = f"B={B} Lq={Lq} Lkv={Lkv} E={E} H={H}" + (" self" if self_attn else "")
        t_mha, t_attnx = timings["nn.MultiheadAttention"], timings["attnx"]
        rows.append([label, fmt_us(t_mha.median), fmt_us(t_sdpa), fmt_us(t_attnx.median),
                     f"{t_mha.median / t_sdpa:.2f}x", f"{t_attnx.median / t_sdpa:.2f}x",
                     f"±{100 * t_attnx.iqr / t_attnx.median:.0f}%"])
        results[label] = {name: t.to_json() for name, t in timings.items()}
    text = (
        f"(b) B=1 sweep of the MPS report, eval, no_grad, {device} fp32 (median of interleaved reps)\n"
        + table(["shape", "nn.MHA us", "SDPA comp. us", "attnx us", "nn.MHA/SDPA", "attnx/SDPA", "IQR"], rows)
    )
    return results, text


def run(device: str = "cpu", quick: bool = False) -> dict:
    eval_results, eval_text = run_eval(device, quick)
    b1_results, b1_text = run_b1(device, quick)
    return {"results": {"eval_memory": eval_results, "b1_sweep": b1_results}, "text": eval_text + "\n\n" + b1_text}
