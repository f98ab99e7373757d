"""attnx.linear vs F.linear on the layouts attention produces (seed report: mps-mha-b1-transposed-linear).

For each shape, every layout is timed interleaved with the others. Columns: time per call of F.linear and
attnx.linear, their ratio, and attnx's time relative to its own time on the contiguous layout (the B=1
transposed layout must stay within 5% of it: the same single GEMM runs).
"""

import torch
import torch.nn.functional as F

import attnx

from .common import fmt_us, table, time_interleaved

DEVICES = ("cpu", "cuda", "mps")
SHAPES = [  # (B, L, E): the seed report's B=1 decoder query, a long B=1 sequence, a batch
    (1, 32, 512),
    (1, 1024, 512),
    (8, 256, 512),
]


def layouts(B: int, L: int, E: int, device: str) -> dict:
    """The same logical (L, B, E) input of an in-projection, as attention code hands it to linear."""
    x = torch.randn(B, L, E, device=device)
    packed = torch.randn(B, L, 3 * E, device=device)
    cases = {
        # Freshly allocated: at B=1, x.transpose(0, 1).contiguous() is a no-op that keeps the (E, B*E, 1) strides.
        "contiguous (L, B, E)": torch.randn(L, B, E, device=device),
        "batch_first view x.transpose(0, 1)": x.transpose(0, 1),
        "slice of packed qkv (offset, row stride 3E)": packed[..., E : 2 * E].transpose(0, 1),
        "gapped rows (every other sequence block)": torch.randn(2 * L, B, E, device=device)[::2],
    }
    if B > 1:
        cases["expanded over batch (stride 0)"] = x[:1].expand(B, L, E).transpose(0, 1)
    return cases


def run(device: str = "cpu", quick: bool = False) -> dict:
    results, texts = {}, []
    for B, L, E in SHAPES[:2] if quick else SHAPES:
        w, b = torch.randn(E, E, device=device), torch.randn(E, device=device)
        cases = layouts(B, L, E, device)
        fns = {}
        for name, x in cases.items():
            torch.testing.assert_close(attnx.linear(x, w, b), F.linear(x, w, b))  # check before timing
            fns[("torch", name)] = lambda x=x: F.linear(x, w, b)
            fns[("attnx", name)] = lambda x=x: attnx.linear(x, w, b)
        timings = time_interleaved(fns, device, reps=9 if quick else 21)
        base = timings[("attnx", "contiguous (L, B, E)")].median
        rows, shape_results = [], {}
        for name, x in cases.items():
            t_torch, t_attnx = timings[("torch", name)], timings[("attnx", name)]
            rows.append([
                name, str(tuple(x.stride())), fmt_us(t_torch.median), fmt_us(t_attnx.median),
                f"{t_attnx.median / t_torch.median:.2f}x", f"{t_attnx.median / base:.3f}",
                f"±{100 * t_attnx.iqr / t_attnx.median:.0f}%",
            ])
            shape_results[name] = {
                "strides": list(x.stride()), "torch": t_torch.to_json(), "attnx": t_attnx.to_json(),
                "attnx_over_torch": t_attnx.median / t_torch.median, "attnx_over_contiguous": t_attnx.median / base,
            }
        results[f"B{B}_L{L}_E{E}"] = shape_results
        texts.append(
            f"linear, B={B} L={L} E={E} -> E, {device}, fp32 (median of {len(t_attnx.samples)} interleaved reps)\n"
            + table(["layout", "strides", "F.linear us", "attnx us", "attnx/torch", "vs contiguous", "IQR"], rows)
        )
    return {"results": results, "text": "\n\n".join(texts)}
