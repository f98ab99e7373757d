"""16-bit attention on the CPU against the machine's 16-bit rate: attnx.attention in bfloat16 and float16
beside torch's own matmul of the same dtype (the machine's 16-bit GEMM rate, measured in the same run) and
PyTorch's CPU kernel (F.scaled_dot_product_attention: its flash kernel), for the forward (unmasked, and with
an (L, S) mask plus key padding, which SDPA gets merged into one (B, 1, L, S) bias built before timing), the
forward + backward, and one decoding step with grouped KV heads.

GFLOP/s count the GEMMs: 4 * D per (query, key) pair forward, 3.5 times that forward + backward (the
backward's five products); the matmul's 2 * n^3, n = 2048, or smaller where torch has no fast GEMM for the
dtype (float16 on a CPU without AVX512-FP16 or AMX-FP16, whose 2048^3 matmul takes a minute): the largest
power of two from 256 whose product takes under 0.2 s. ``of matmul`` = attnx's rate / the matmul's;
``vs PyTorch`` = PyTorch's time / attnx's (above 1: attnx is faster). The variant attnx runs
(``torch.ops.attnx._cpu_capability``, e.g. ``avx512_bf16``: bfloat16 products on vdpbf16ps) is in the
title; ATTNX_CPU_CAPABILITY=avx512 runs the same case on the float32 products, for a before/after on one
machine. Outputs are checked against PyTorch's before anything is timed.
"""

import torch
import torch.nn.functional as F

import attnx

from .common import progress, table, time_interleaved

DEVICES = ("cpu",)
TITLE = "16-bit CPU attention vs the machine's 16-bit matmul rate and PyTorch's kernel"
DTYPES = (torch.bfloat16, torch.float16)
# (case, B, H, Hkv, L, S, D): the acceptance shape, its masked and training forms, a longer head
# dim, and a decoding step of a LLaMA-shaped model (32 query heads over 8 kv heads, a 4096-key cache).
CASES = (
    ("forward", 4, 8, 8, 2048, 2048, 64),
    ("forward, mask+padding", 4, 8, 8, 2048, 2048, 64),
    ("forward", 4, 8, 8, 2048, 2048, 128),
    ("forward+backward", 2, 8, 8, 1024, 1024, 64),
    ("decoding, GQA", 8, 32, 8, 1, 4096, 128),
)
QUICK = (CASES[0], CASES[1], CASES[3], CASES[4])
SMOKE = (("forward", 1, 2, 2, 64, 64, 16), ("forward, mask+padding", 1, 2, 2, 64, 64, 16),
         ("forward+backward", 1, 2, 2, 32, 32, 16), ("decoding, GQA", 1, 4, 2, 1, 64, 16))
MATMUL_N = 2048


def _matmul_size(dtype, largest):
    """The largest n <= largest (a power of two from 256) whose n^3 matmul of dtype takes under 0.2 s."""
    import time

    n = min(256, largest)
    while n < largest:
        a = torch.randn(2 * n, 2 * n).to(dtype)
        a[:64, :64] @ a[:64, :64]  # the dtype's first matmul starts the GEMM library: not the size's cost
        start = time.perf_counter()
        a @ a
        if time.perf_counter() - start > 0.2:
            break
        n *= 2
    return n


def _inputs(case, B, H, Hkv, L, S, D, dtype, grad):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)

    q, k, v = randn(B, H, L, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D)
    akw, skw = {}, {"enable_gqa": True} if Hkv != H else {}
    if case.endswith("mask+padding"):
        attn_mask = torch.randn(L, S, generator=gen).to(dtype)
        padding = torch.zeros(B, S, dtype=torch.bool)
        padding[:, S - S // 8:] = True
        akw.update(attn_mask=attn_mask, key_padding_mask=padding)
        bias = torch.zeros(B, S, dtype=dtype).masked_fill(padding, float("-inf"))
        skw["attn_mask"] = attn_mask[None, None] + bias[:, None, None, :]
    return (q, k, v), akw, skw


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    cases = SMOKE if smoke else QUICK if quick else CASES
    reps = 3 if smoke else 5 if quick else 7
    variant = torch.ops.attnx._cpu_capability()
    rows, results = [], []
    for dtype in DTYPES:
        n = _matmul_size(dtype, 64 if smoke else MATMUL_N)
        a, b = (torch.randn(n, n).to(dtype) for _ in range(2))
        for case, B, H, Hkv, L, S, D in cases:
            progress(f"{case}, {dtype}, B={B} H={H} Hkv={Hkv} L={L} S={S} D={D}")
            train = case == "forward+backward"
            (q, k, v), akw, skw = _inputs(case, B, H, Hkv, L, S, D, dtype, train)
            grad = torch.randn(B, H, L, D).to(dtype)

            def attnx_step(q=q, k=k, v=v, akw=akw, train=train, grad=grad):
                out, _ = attnx.attention(q, k, v, **akw)
                if train:
                    torch.autograd.grad(out, (q, k, v), grad)
                return out

            def torch_step(q=q, k=k, v=v, skw=skw, train=train, grad=grad):
                out = F.scaled_dot_product_attention(q, k, v, **skw)
                if train:
                    torch.autograd.grad(out, (q, k, v), grad)
                return out

            with torch.set_grad_enabled(train):
                torch.testing.assert_close(attnx_step().float(), torch_step().float(), rtol=2e-2, atol=2e-2)
                timings = time_interleaved(
                    {"attnx": attnx_step, "pytorch": torch_step, "matmul": lambda a=a, b=b: a @ b},
                    device, reps=reps, min_block_s=0.05)
            flops = 4 * B * H * L * S * D * (3.5 if train else 1)
            t_a, t_p, t_m = (timings[name].median for name in ("attnx", "pytorch", "matmul"))
            rate_a, rate_p, rate_m = flops / t_a / 1e9, flops / t_p / 1e9, 2 * n**3 / t_m / 1e9
            rows.append([str(dtype).removeprefix("torch."), case, f"{B},{H},{Hkv},{L},{S},{D}",
                         f"{rate_a:.0f}", timings["attnx"].spread, f"{rate_m:.0f} (n={n})",
                         f"{rate_a / rate_m:.2f}", f"{rate_p:.0f}", f"{t_p / t_a:.2f}x"])
            results.append({"dtype": str(dtype), "case": case,
                            "shape": dict(B=B, H=H, Hkv=Hkv, L=L, S=S, D=D), "variant": variant,
                            "attnx": timings["attnx"].to_json(), "pytorch": timings["pytorch"].to_json(),
                            "matmul": timings["matmul"].to_json(), "matmul_n": n, "attnx_gflops": rate_a,
                            "pytorch_gflops": rate_p, "matmul_gflops": rate_m, "of_matmul": rate_a / rate_m,
                            "vs_pytorch": t_p / t_a})
    text = (
        f"16-bit attention on the CPU, attnx variant {variant}: GFLOP/s from the median of {reps} "
        "interleaved reps (spread = IQR/median), beside torch's n^3 matmul of the same dtype and PyTorch's "
        "kernel\n"
        + table(["dtype", "case", "B,H,Hkv,L,S,D", "attnx GF/s", "spread", "matmul GF/s", "of matmul",
                 "PyTorch GF/s", "vs PyTorch"], rows)
    )
    return {"results": results, "text": text}
