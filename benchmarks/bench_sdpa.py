"""F.scaled_dot_product_attention on the CPU under the SDPA takeover (attnx.sdpa) vs PyTorch's own kernel.

The same call, ``F.scaled_dot_product_attention`` (in no_grad, or forward + backward), timed interleaved with
the takeover switched on before each attnx block and off before each torch block (untimed), so both sides pay
the same dispatch. Shapes PyTorch's CPU flash kernel takes: decoding (per-call overhead), GQA decoding, an
encoder with a padding mask (as transformers' ``sdpa`` builds it), causal prefill, a ViT, and a diffusion
UNet's self- and cross-attention; float32, bfloat16 and float16. Then a diffusers UNet2DConditionModel forward
(built from a small config, random weights; skipped when diffusers is missing). Outputs are compared first.
Ratio: the round-by-round median of attnx's time over torch's with its 95% interval; target: at most 1.0x.
"""

import torch
import torch.nn.functional as F

import attnx

from .common import paired_ratio, progress, table, target, time_interleaved

DEVICES = ("cpu",)
TITLE = "F.scaled_dot_product_attention under the takeover vs PyTorch's CPU kernel"

# name, (B, H, Hkv, L, S, D), mask ("none", "causal", "padding"), dtypes, with a backward
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = (
    ("decode", (1, 8, 8, 1, 128, 64), "none", (torch.float32,), False),
    ("decode GQA", (4, 32, 8, 1, 1024, 128), "none", ALL_DTYPES, False),
    ("encoder + padding", (8, 12, 12, 256, 256, 64), "padding", ALL_DTYPES, True),
    ("causal prefill", (1, 16, 16, 1024, 1024, 64), "causal", ALL_DTYPES, True),
    ("ViT-B/16", (8, 12, 12, 197, 197, 64), "none", (torch.float32,), True),
    ("UNet self", (2, 8, 8, 1024, 1024, 40), "none", (torch.float32,), False),
    ("UNet cross", (2, 8, 8, 1024, 77, 40), "none", (torch.float32,), False),
)
QUICK_SHAPES = (
    ("decode", (1, 8, 8, 1, 128, 64), "none", (torch.float32,), False),
    ("encoder + padding", (4, 12, 12, 128, 128, 64), "padding", (torch.float32, torch.bfloat16), True),
    ("causal prefill", (1, 8, 8, 512, 512, 64), "causal", (torch.float32,), True),
)
SMOKE_SHAPES = (("tiny", (1, 2, 1, 8, 12, 16), "padding", (torch.float32,), True),)


def make_call(shape, mask, dtype, backward):
    B, H, Hkv, L, S, D = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, D, generator=gen).to(dtype).transpose(1, 2)  # a projection's (B, L, H, D) view
    k, v = (torch.randn(B, S, Hkv, D, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    kwargs = {"enable_gqa": Hkv != H}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "padding":
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        keep[: B // 2, ..., S - S // 4 :] = False  # half the batch padded by a quarter
        kwargs["attn_mask"] = keep
    if backward:
        for t in (q, k, v):
            t.requires_grad_(True)

    def call():
        with torch.set_grad_enabled(backward):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
            if backward:
                torch.autograd.grad(out.sum(), (q, k, v))
        return out

    return call


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _switch(on: bool):
    return attnx.sdpa.enable if on else attnx.sdpa.disable


def unet_case():
    """A diffusers UNet2DConditionModel forward, or None without diffusers."""
    try:
        from diffusers import UNet2DConditionModel
    except ImportError:
        return None
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(64, 128), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=16,
    ).eval()
    x, t, enc = torch.randn(2, 4, 32, 32), torch.tensor([10, 20]), torch.randn(2, 77, 64)

    def call():
        with torch.no_grad():
            return unet(x, t, enc).sample

    return call


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    shapes = SMOKE_SHAPES if smoke else QUICK_SHAPES if quick else SHAPES
    reps = 3 if smoke else 9 if quick else 15
    rows, results = [], {}
    setup = {"attnx": _switch(True), "torch": _switch(False)}
    try:
        cases = [
            (f"{name} {'x'.join(map(str, shape))} {str(dtype).split('.')[1]}" + (" fwd+bwd" if bwd else ""),
             make_call(shape, mask, dtype, bwd), dtype)
            for name, shape, mask, dtypes, bwd in shapes
            for dtype in dtypes
            for bwd in ((False, True) if bwd else (False,))
        ]
        if not smoke:
            unet = unet_case()
            if unet is not None:
                cases.append(("diffusers UNet2DConditionModel forward (2, 4, 32, 32)", unet, torch.float32))
        for label, call, dtype in cases:
            progress(label)
            attnx.sdpa.enable()
            ours = call().detach()
            attnx.sdpa.disable()
            theirs = call().detach()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
            t = time_interleaved({"attnx": call, "torch": call}, device, reps=reps,
                                 min_block_s=0.002 if smoke else 0.05, setup=setup)
            ratio = paired_ratio(t["attnx"], t["torch"])
            results[label] = {"attnx": t["attnx"].to_json(), "torch": t["torch"].to_json(),
                              "attnx/torch": ratio.to_json()}
            rows.append([label, ms(t["attnx"].median), t["attnx"].spread, ms(t["torch"].median),
                         t["torch"].spread, str(ratio), target(ratio.median <= 1.0)])
    finally:
        attnx.sdpa.disable()
    text = (
        f"{TITLE}, {device}: ms per call (median of {reps} interleaved rounds), "
        "attnx/torch = round-by-round median (95% CI); target <= 1.0x\n"
        + table(["case (B x H x Hkv x L x S x D)", "attnx", "±", "torch", "±", "attnx/torch", "target"], rows)
    )
    return {"results": results, "text": text}
