"""attnx on CUDA: attention throughput against every SDPA backend.

TFLOP/s = 4 * B * H * L * S * D / time: ``attnx.attention`` against ``F.scaled_dot_product_attention`` under
each ``sdpa_kernel`` backend, fp16/bf16, L = S in {1024, 4096}, D in {64, 128}, without masks, with
is_causal, with a key_padding_mask + a random (L, S) attn_mask (every tile partly masked), with a
key_padding_mask + a causal (L, S) bool attn_mask (the masks transformers' models pass: whole tiles removed or
kept, which attnx's tensor cores skip or run unmasked), with a float (L, S) bias (every tile read), and with
dropout (p = 0.1); fp32 at D = 64 (the float32 tensor-core
kernel's range: 3xTF32, as SDPA's efficient backend, whose fp32 is 3xTF32 whatever ``allow_tf32`` says) and
D = 128 (the same kernel with Q staged in shared memory on sm_90, the SIMT kernel on devices with less shared
memory).
SDPA takes masks in its own convention: one boolean mask, True = keep, merged here *before* timing into
(B, 1, L, S); attnx takes the two masks as they are. Backends that reject a case (flash attention with a
mask, flash and cuDNN in fp32) show "n/a". With dropout the implementations draw different masks (attnx's
Philox stream is its own, the same on every backend), so their outputs are checked to be finite, not equal.
Each row names the kernel attnx ran, as the CUDA library names
it for that call (``torch.ops.attnx._attention_kernel``; ``ATTNX_CUDA_MMA=0`` selects the SIMT kernel). Where
that is torch's own flash kernel (unmasked float16/bfloat16: attnx routes those calls to it until its own
kernel measures as fast), "attnx own" times attnx's kernel on the same call. The upstream eval memory case
runs on CUDA in the ``eval`` case (bench_mha).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnx

from .common import progress, table, time_interleaved

DEVICES = ("cuda",)
TITLE = "CUDA attention throughput vs every SDPA backend"
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
THROUGHPUT_B, THROUGHPUT_H = 4, 16
# --smoke: one short length at the smallest head dim, in float16 (the tensor-core kernel) and float32 (its
# 3xTF32 variant), with and without masks: every path runs, in seconds.
SMOKE_LENGTHS, SMOKE_DIMS, SMOKE_DTYPES = [128], [64], [torch.float16, torch.float32]


# The implementations timed, as the table's columns: attnx (what a call runs), attnx's own kernel where attnx
# sends the call to torch's flash kernel ("-" elsewhere), each SDPA backend ("n/a" where it rejects the case).
COLUMNS = ("attnx", "attnx own", *(f"sdpa {n}" for n in SDPA_BACKENDS))

# The cases of each (dtype, L, D): no masks, is_causal, both masks (a random attn_mask, a causal one), a float
# (L, S) bias (ALiBi's shape: every tile read), dropout.
KINDS = ("plain", "causal", "masks", "causal_masks", "bias", "dropout")
DROPOUT_P = 0.1


def throughput_inputs(L: int, D: int, dtype: torch.dtype, kind: str):
    """q, k, v (B, H, L, D); attnx's masks (True = masked out, or a float bias) and SDPA's mask (the bool
    masks merged, True = keep; the bias as it is), for a case of KINDS."""
    B, H = THROUGHPUT_B, THROUGHPUT_H
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    if kind == "bias":
        pos = torch.arange(L, device="cuda", dtype=torch.float32)
        bias = (-0.05 * (pos[:, None] - pos[None, :]).abs()).to(dtype)  # (L, S), a distance penalty
        return q, k, v, bias, None, bias
    if kind not in ("masks", "causal_masks"):
        return q, k, v, None, None, None
    kpm = torch.zeros(B, L, dtype=torch.bool, device="cuda")
    kpm[:, L - L // 8 :] = True  # right padding: the last 1/8 of the keys
    if kind == "masks":
        attn_mask = torch.rand(L, L, device="cuda", generator=g) < 0.1
        attn_mask.fill_diagonal_(False)  # no fully masked row
    else:
        attn_mask = torch.ones(L, L, dtype=torch.bool, device="cuda").triu_(1)  # above the diagonal
    keep = ~(attn_mask[None, None] | kpm[:, None, None, :])  # (B, 1, L, S)
    return q, k, v, attn_mask, kpm, keep


def throughput_case(L: int, D: int, dtype: torch.dtype, kind: str, reps: int) -> tuple[str, dict]:
    """The kernel attnx runs, and {implementation: {"time", "tflops"} or None where the backend rejects the
    case}, for one case of KINDS."""
    q, k, v, attn_mask, kpm, keep = throughput_inputs(L, D, dtype, kind)
    p = DROPOUT_P if kind == "dropout" else 0.0
    causal = kind == "causal"
    flops = 4 * THROUGHPUT_B * THROUGHPUT_H * L * L * D  # the full L x S, causal too
    fns = {"attnx": lambda: attnx.attention(q, k, v, attn_mask, kpm, is_causal=causal, dropout_p=p)[0]}
    seed = torch.zeros(2, dtype=torch.int64) if p else None  # naming the kernel draws nothing

    def name_kernel():
        return torch.ops.attnx._attention_kernel(q, k, v, attn_mask=attn_mask, key_padding_mask=kpm,
                                                 is_causal=causal, dropout_p=p, dropout_seed=seed)

    kernel = name_kernel()
    if kernel.startswith("torch flash"):
        # attnx sends this call to torch's flash kernel; its own kernel is timed beside it (the route turned
        # off for each call: a host-side switch, hidden behind the GPU's work), which is the figure that
        # decides when attnx's kernel takes such calls back.
        def own():
            torch.ops.attnx._cuda_torch_flash(False)
            try:
                return attnx.attention(q, k, v, is_causal=causal)[0]
            finally:
                torch.ops.attnx._cuda_torch_flash(True)

        torch.ops.attnx._cuda_torch_flash(False)
        kernel += f" (own: {name_kernel().removeprefix('cuda ')})"
        torch.ops.attnx._cuda_torch_flash(True)
        fns["attnx own"] = own
    for name, backend in SDPA_BACKENDS.items():

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p, is_causal=causal)

        fns[f"sdpa {name}"] = sdpa
    tol = {torch.bfloat16: 3e-2, torch.float16: 1e-2}.get(dtype, 1e-4)
    with torch.no_grad():
        want = fns["sdpa math"]().float() if p == 0 else None
        supported = {}
        for name, fn in fns.items():  # check outputs before timing
            try:
                got = fn().float()
            except RuntimeError:  # the backend does not take this case
                continue
            if want is None:
                assert got.isfinite().all(), f"{name}: non-finite output with dropout"
            else:
                torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
            supported[name] = fn
        del want
        timings = time_interleaved(supported, "cuda", reps=reps, min_block_s=0.05)
    return kernel, {
        name: {"time": timings[name].to_json(), "tflops": flops / timings[name].median / 1e12}
        if name in timings
        else None
        for name in fns
    }


def run_throughput(quick: bool, smoke: bool) -> tuple:
    rows, results, kernels = [], {}, {}
    lengths = SMOKE_LENGTHS if smoke else [1024] if quick else [1024, 4096]
    dims = SMOKE_DIMS if smoke else [64] if quick else [64, 128]
    dtypes = [torch.float16, torch.float32] if quick else [torch.float16, torch.bfloat16, torch.float32]
    dtypes = SMOKE_DTYPES if smoke else dtypes
    reps = 3 if smoke else 5 if quick else 15
    for dtype in dtypes:
        for L in lengths:
            for D in dims:
                for kind in KINDS:
                    name = str(dtype).removeprefix("torch.")
                    label = f"{name} L=S={L} D={D}" + ("" if kind == "plain" else f" {kind}")
                    progress(label)
                    kernel, case = throughput_case(L, D, dtype, kind, reps)
                    torch.cuda.empty_cache()
                    results[label], kernels[label] = case, kernel
                    cells = [f"{case[n]['tflops']:.1f}" if case.get(n) else "-" if n not in case else "n/a"
                             for n in COLUMNS]
                    rows.append([label, *cells, kernel.removeprefix("cuda ")])
    text = (
        f"(b) attention forward TFLOP/s (4*B*H*L*S*D / time, the full L x S even where a mask removes "
        f"half), B={THROUGHPUT_B}, H={THROUGHPUT_H}; causal = is_causal; masks = key_padding_mask (last 1/8 "
        f"of keys) + 10% random (L, S) attn_mask; causal_masks = the same key_padding_mask + a causal (L, S) "
        f"bool attn_mask; SDPA gets them merged beforehand into one (B, 1, L, S) keep-mask; bias = a float "
        f"(L, S) attn_mask (-0.05 |l - s|), given to SDPA as it is; dropout = dropout_p "
        f"{DROPOUT_P}; the kernel attnx ran, as the CUDA library names it\n"
        + table(["case", *COLUMNS, "attnx kernel"], rows)
    )
    return results, kernels, text


def run(device: str = "cuda", quick: bool = False, smoke: bool = False) -> dict:
    if device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("bench_cuda needs a CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::_attention", "CUDA"):
        raise RuntimeError("this build of attnx has no CUDA kernels (see python -m attnx.info)")
    results, kernels, text = run_throughput(quick, smoke)
    return {
        "results": {"attention_throughput": results, "attnx_kernels": kernels},
        "text": text,
    }
