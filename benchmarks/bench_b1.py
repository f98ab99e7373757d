"""The B=1 stride case (upstream report: mps-mha-b1-transposed-linear).

(a) The report's shape sweep, eval, no_grad: ``nn.MultiheadAttention(batch_first=True)`` vs the report's
    hand-written SDPA composition (verbatim) vs ``attnx.nn.MultiheadAttention`` (one fused dispatch). The
    report's 9x is an MPS effect (its CPU row shows ~1x); on CPU this checks that attnx is no slower than the
    composition. The candidates are within a few percent of each other there, closer than a busy machine's
    drift over a run, so they are compared call by call: one call of each per round, and the ratio of the
    two calls of a round, whose median over the rounds is given with its 95% confidence interval.
(b) The report's ``F.linear`` layout table: the same logical (L, B, E) input of an in-projection in the
    layouts attention code hands to linear, ``F.linear`` vs ``attnx.linear``. At B=1 ``x.transpose(0, 1)`` is
    a stride-only view that ``is_contiguous()`` calls contiguous (strides (E, B*E, 1)); attnx runs the same
    single GEMM on it as on a freshly allocated input, so its "vs contiguous" column should stay at ~1.0.
"""

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_us, paired_ratio, progress, table, target, time_interleaved

DEVICES = ("cpu", "cuda", "mps")
TITLE = "B=1 stride case (mps-mha-b1-transposed-linear)"
B1_SHAPES = [  # (B, Lq, Lkv, E, H, self-attention): the report's sweep
    (1, 32, 256, 512, 8, False),
    (1, 64, 512, 512, 8, False),
    (1, 128, 1024, 512, 8, False),
    (1, 64, 64, 768, 12, False),
    (1, 64, 64, 768, 12, True),
    (4, 32, 256, 512, 8, False),
]
LINEAR_SHAPES = [(1, 32, 512), (1, 1024, 512), (8, 256, 512)]  # (B, L, E): the report's, a long B=1, a batch
SMOKE_B1, SMOKE_LINEAR = [(1, 8, 16, 32, 4, False)], [(1, 8, 32)]


def sdpa_composition(ref: torch.nn.MultiheadAttention, q, mem, train: bool = False, key_padding_mask=None):
    """The report's hand-written composition with ``ref``'s parameters: q ``(B, Lq, E)``, mem ``(B, Lkv, E)``.

    Verbatim for eval (weights sliced once, beforehand). With ``train`` the slices are taken in every call,
    as a module's forward must for its gradients to reach the parameters. A ``key_padding_mask`` ``(B, Lkv)``
    (True = padded) goes to SDPA as the broadcast keep-mask ``(B, 1, 1, Lkv)`` it expects, built per call.
    """
    (B, Lq, D), Lkv, H = q.shape, mem.shape[1], ref.num_heads
    hd = D // H

    def weights():
        Wq, Wk, Wv = ref.in_proj_weight.chunk(3)
        bq, bk, bv = ref.in_proj_bias.chunk(3)
        return Wq, Wk, Wv, bq, bk, bv, ref.out_proj.weight, ref.out_proj.bias

    with torch.no_grad():
        fixed = weights()

    def via_sdpa():
        Wq, Wk, Wv, bq, bk, bv, Wo, bo = weights() if train else fixed
        Q = F.linear(q, Wq, bq).view(B, Lq, H, hd).transpose(1, 2)
        K = F.linear(mem, Wk, bk).view(B, Lkv, H, hd).transpose(1, 2)
        V = F.linear(mem, Wv, bv).view(B, Lkv, H, hd).transpose(1, 2)
        keep = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
        out = (
            F.scaled_dot_product_attention(Q, K, V, attn_mask=keep)
            .transpose(1, 2)
            .contiguous()
            .view(B, Lq, D)
        )
        return F.linear(out, Wo, bo)

    return via_sdpa


def _sweep(device: str, shapes: list, reps: int) -> tuple:
    rows, results = [], {}
    for B, Lq, Lkv, E, H, self_attn in shapes:
        label = f"B={B} Lq={Lq} Lkv={Lkv} E={E} H={H}" + (" self" if self_attn else " cross")
        progress(f"MHA sweep: {label}")
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
        ours = attnx.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
        ours.load_state_dict(ref.state_dict())
        q = torch.randn(B, Lq, E, device=device)
        mem = q if self_attn else torch.randn(B, Lkv, E, device=device)
        fns = {
            "nn.MultiheadAttention": lambda ref=ref, q=q, mem=mem: ref(q, mem, mem, need_weights=False)[0],
            "SDPA composition": sdpa_composition(ref, q, mem),
            "attnx": lambda ours=ours, q=q, mem=mem: ours(q, mem, mem, need_weights=False)[0],
            # The op alone, as the module calls it (batch_first inputs read in place): the module's Python
            # layer (argument checks, torch's error semantics) is the difference between the two.
            "attnx.mha": lambda ours=ours, q=q, mem=mem: attnx.mha(
                q, mem, mem, ours.num_heads, ours.in_proj_weight, ours.in_proj_bias, None, None, None,
                None, None, False, ours.out_proj.weight, ours.out_proj.bias, None, None, False, None, None,
                False, True, batch_first=True,
            )[0],
        }
        with torch.no_grad():
            want = fns["SDPA composition"]()
            diffs = {name: (fn() - want).abs().max().item() for name, fn in fns.items()}
            for name, fn in fns.items():
                torch.testing.assert_close(
                    fn(), want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
                )
            timings = time_interleaved(fns, device, reps=reps, min_block_s=0)
        t_sdpa = timings["SDPA composition"]
        t_mha, t_attnx = timings["nn.MultiheadAttention"], timings["attnx"]
        ratios = {
            name: paired_ratio(timings[name], t_sdpa)
            for name in ("nn.MultiheadAttention", "attnx", "attnx.mha")
        }
        rows.append(
            [
                label,
                fmt_us(t_mha.median),
                fmt_us(t_sdpa.median),
                fmt_us(t_attnx.median),
                str(ratios["nn.MultiheadAttention"]),
                str(ratios["attnx"]),
                str(ratios["attnx.mha"]),
                f"{diffs['nn.MultiheadAttention']:.0e}",
                f"{diffs['attnx']:.0e}",
            ]
        )
        results[label] = {
            **{name: t.to_json() for name, t in timings.items()},
            "max_abs_diff_vs_sdpa": diffs,
            "mha_over_sdpa": ratios["nn.MultiheadAttention"].to_json(),
            "attnx_over_sdpa": ratios["attnx"].to_json(),
            "attnx_mha_op_over_sdpa": ratios["attnx.mha"].to_json(),
        }
    met = all(r["attnx_mha_op_over_sdpa"]["median"] <= 1.0 for r in results.values())
    text = (
        f"(a) the report's shape sweep, eval, no_grad, {device} fp32: time per call in us (median of {reps} "
        f"rounds, one call of each per round) and time over the SDPA composition's (median of the {reps} "
        f"rounds' ratios, with its 95% confidence interval); max|diff| against the SDPA composition. "
        f"attnx = the module attnx.nn.MultiheadAttention; attnx.mha = the op it calls, alone\n"
        + table(
            [
                "shape",
                "nn.MHA us",
                "SDPA comp. us",
                "attnx us",
                "nn.MHA/SDPA",
                "attnx/SDPA",
                "attnx.mha/SDPA",
                "nn.MHA diff",
                "attnx diff",
            ],
            rows,
        )
        + f"\ntarget: attnx.mha no slower than the SDPA composition (median ratio <= 1.00) at every shape: "
        f"{target(met)}"
    )
    return results, text


def layouts(B: int, L: int, E: int, device: str) -> dict:
    """The same logical (L, B, E) input of an in-projection, as attention code hands it to linear."""
    x = torch.randn(B, L, E, device=device)
    packed = torch.randn(B, L, 3 * E, device=device)
    cases = {
        # Freshly allocated: at B=1, x.transpose(0, 1).contiguous() is a no-op that keeps the (E, B*E, 1)
        # strides.
        "contiguous (L, B, E)": torch.randn(L, B, E, device=device),
        "batch_first view x.transpose(0, 1)": x.transpose(0, 1),
        "x.transpose(0, 1).reshape(L, B, E)": x.transpose(0, 1).reshape(L, B, E),
        "slice of packed qkv (offset, row stride 3E)": packed[..., E : 2 * E].transpose(0, 1),
        "gapped rows (every other sequence block)": torch.randn(2 * L, B, E, device=device)[::2],
    }
    if B > 1:
        cases["expanded over batch (stride 0)"] = x[:1].expand(B, L, E).transpose(0, 1)
    return cases


def _linear(device: str, shapes: list, reps: int) -> tuple:
    results, texts = {}, []
    for B, L, E in shapes:
        progress(f"F.linear layouts: B={B} L={L} E={E}")
        w, b = torch.randn(E, E, device=device), torch.randn(E, device=device)
        cases = layouts(B, L, E, device)
        fns = {}
        for name, x in cases.items():
            torch.testing.assert_close(attnx.linear(x, w, b), F.linear(x, w, b))  # check before timing
            fns[("torch", name)] = lambda x=x: F.linear(x, w, b)  # noqa: B023 (w, b: this shape's, used here)
            fns[("attnx", name)] = lambda x=x: attnx.linear(x, w, b)  # noqa: B023
        timings = time_interleaved(fns, device, reps=reps)
        t_torch_base = timings[("torch", "contiguous (L, B, E)")].median
        t_attnx_base = timings[("attnx", "contiguous (L, B, E)")].median
        rows, shape_results = [], {}
        for name, x in cases.items():
            t_torch, t_attnx = timings[("torch", name)], timings[("attnx", name)]
            rows.append(
                [
                    name,
                    str(tuple(x.stride())),
                    fmt_us(t_torch.median),
                    t_torch.spread,
                    f"{t_torch.median / t_torch_base:.2f}",
                    fmt_us(t_attnx.median),
                    t_attnx.spread,
                    f"{t_attnx.median / t_attnx_base:.2f}",
                    f"{t_attnx.median / t_torch.median:.2f}x",
                ]
            )
            shape_results[name] = {
                "strides": list(x.stride()),
                "torch": t_torch.to_json(),
                "attnx": t_attnx.to_json(),
                "attnx_over_torch": t_attnx.median / t_torch.median,
                "torch_over_contiguous": t_torch.median / t_torch_base,
                "attnx_over_contiguous": t_attnx.median / t_attnx_base,
            }
        results[f"B{B}_L{L}_E{E}"] = shape_results
        texts.append(
            f"(b) F.linear layout table, (L, B, E) = ({L}, {B}, {E}) -> E, {device} fp32, time per call in "
            f'us (median of {reps} interleaved reps; "vs contig." = time / the same op\'s time on the '
            "contiguous input)\n"
            + table(
                [
                    "layout",
                    "strides",
                    "F.linear us",
                    "spread",
                    "vs contig.",
                    "attnx us",
                    "spread",
                    "vs contig.",
                    "attnx/torch",
                ],
                rows,
            )
        )
    return results, "\n\n".join(texts)


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    reps = 3 if smoke else 9 if quick else 21
    sweep_reps = 3 if smoke else 31 if quick else 101  # single calls of 2-15 ms each: rounds are short
    b1_shapes = SMOKE_B1 if smoke else B1_SHAPES[:2] if quick else B1_SHAPES
    linear_shapes = SMOKE_LINEAR if smoke else LINEAR_SHAPES[:1] if quick else LINEAR_SHAPES
    sweep_results, sweep_text = _sweep(device, b1_shapes, sweep_reps)
    linear_results, linear_text = _linear(device, linear_shapes, reps)
    return {
        "results": {"mha_sweep": sweep_results, "linear_layouts": linear_results},
        "text": sweep_text + "\n\n" + linear_text,
    }
