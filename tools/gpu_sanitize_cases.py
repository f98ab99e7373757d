"""Launches for compute-sanitizer (memcheck, racecheck, synccheck), run by tools/gpu_check.py.

A small set that still reaches every code path of the CUDA backend: both forward kernels (float16, bfloat16
and float32, vector and element tile staging, partial tiles, dropout, the tensor cores' mask pre-pass and
the tiles it classifies), every feature (both masks, causal,
grouped KV heads, windows, key_lengths, soft-capping, sinks) and the head-dim > 256 composite; and the fused
backward (ATTNX_CUDA_FUSED_BACKWARD=1, set here before attnx reads it): the SIMT kernels' every tile size, the
tensor-core kernels' three instantiations and 64- and 32-row tiles, float32's 3xTF32 ones, their mask tile
classes, every feature, dropout and a float mask's gradient. Each launch is synchronised and printed with the
kernel it takes, as the library names it (attnx::_attention_kernel); the run fails if the cases no longer
reach every kernel.

    python tools/gpu_sanitize_cases.py          # from the repository root, attnx importable
"""

import os
import sys

import torch

os.environ["ATTNX_CUDA_FUSED_BACKWARD"] = "1"  # read once, at attnx's first CUDA backward
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

import attnx  # noqa: E402
from attention_helpers import every_feature, make_gqa, make_qkv  # noqa: E402
from layouts import to_device  # noqa: E402

DEV = "cuda"
H16, BF, F32 = torch.float16, torch.bfloat16, torch.float32
GEN = torch.Generator().manual_seed(0)
# The kernels the cases must reach, by the first words of their names.
KERNELS = ("cuda mma", "cuda simt", "cuda composite", "cuda fused mma", "cuda fused simt")


def bool_mask(*shape, p=0.2):
    return to_device(torch.rand(*shape, generator=GEN) < p, DEV)


def qkv(*shape, dtype=H16, layout="contiguous"):
    return to_device(make_qkv(*shape, dtype=dtype, layout=layout), DEV)


def gqa(*shape, dtype=H16, layout="contiguous"):
    return to_device(make_gqa(*shape, dtype=dtype, layout=layout), DEV)


def features(B, H, S):
    """attention_helpers.every_feature on the GPU."""
    return to_device(every_feature(B, H, S), DEV)


def cases():
    yield "fp16 D=64 partial tiles, causal", qkv(2, 3, 37, 53, 64, 64), {"is_causal": True}
    yield "fp16 D=32 strided (element staging), fp16 (B*H, L, S) mask", qkv(
        2, 2, 70, 90, 32, 32, layout="strided_last"), {
        "attn_mask": to_device(torch.randn(4, 70, 90, generator=GEN).half(), DEV)}
    yield "bf16 D=128 GQA, both masks, every feature", gqa(2, 6, 2, 100, 150, 128, 128, dtype=BF,
                                                               layout="blhd"), {
        "attn_mask": bool_mask(100, 150), "key_padding_mask": bool_mask(2, 150), **features(2, 6, 150)}
    yield "fp32 D=64 GQA, both masks, causal, every feature", gqa(2, 4, 2, 45, 70, 64, 48, dtype=F32,
                                                                      layout="lbhd"), {
        "attn_mask": bool_mask(45, 70), "key_padding_mask": bool_mask(2, 70), "is_causal": True,
        **features(2, 4, 70)}
    yield "fp32 D=20 strided (element staging), float mask", qkv(2, 2, 70, 90, 20, 20, dtype=F32,
                                                                     layout="strided_last"), {
        "attn_mask": to_device(torch.randn(70, 90, generator=GEN), DEV)}
    yield "fp32 D=96 GQA, both masks, every feature", gqa(2, 4, 2, 45, 70, 96, 80, dtype=F32), {
        "attn_mask": bool_mask(45, 70), "key_padding_mask": bool_mask(2, 70), **features(2, 4, 70)}
    yield "fp32 D=128 (sm_90: Q staged in shared memory)", qkv(2, 3, 70, 90, 128, 128, dtype=F32), {}
    yield "fp32 D=256", qkv(1, 1, 20, 30, 256, 256, dtype=F32), {"is_causal": True}
    yield "fp16 dropout, every feature", gqa(2, 4, 2, 37, 53, 24, 24), {
        "dropout_p": 0.3, "dropout_seed": torch.tensor([17, 3]), **features(2, 4, 53)}
    yield "fp32 D=288 GQA, both masks, causal, every feature", gqa(2, 4, 2, 37, 50, 288, 48,
                                                                             dtype=F32, layout="blhd"), {
        "attn_mask": bool_mask(37, 50), "key_padding_mask": bool_mask(2, 50), "is_causal": True,
        **features(2, 4, 50)}
    # the tensor cores' tile classes: a causal bool mask and right padding (tiles skipped, run unmasked and
    # read from the packed mask), then with a window that starts the tiles past key 0
    causal = torch.ones(130, 200, dtype=torch.bool).triu_(71)
    padding = torch.zeros(2, 200, dtype=torch.bool)
    padding[1, 150:] = True
    masks = {"attn_mask": to_device(causal, DEV), "key_padding_mask": to_device(padding, DEV)}
    yield "fp16 D=64 causal bool mask + padding: tile classes", qkv(2, 2, 130, 200, 64, 64), masks
    yield "bf16 D=128 the same, windowed", qkv(2, 2, 130, 200, 128, 128, dtype=BF), {
        **masks, "window_left": 90, "window_right": 10}
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1] = True  # batch 1 sees no key
    yield "fp16 fully masked rows", qkv(2, 2, 6, 9, 8, 8), {"key_padding_mask": to_device(kpm, DEV)}
    yield "empty (S=0)", qkv(2, 2, 3, 0, 8, 8), {}


def backward_cases():
    """(label, (q, k, v), kwargs) for the fused backward; a float attn_mask is learned (has a gradient)."""
    F64 = torch.float64
    yield "backward fp16 D=64 GQA, both masks, every feature, learned mask", gqa(
        2, 4, 2, 45, 70, 64, 48, layout="blhd"), {
        "attn_mask": to_device(torch.randn(45, 70, generator=GEN).half(), DEV),
        "key_padding_mask": bool_mask(2, 70), **features(2, 4, 70)}
    yield "backward fp32 D=256 causal (16-row tiles)", qkv(1, 2, 40, 50, 256, 256, dtype=F32), {
        "is_causal": True}
    yield "backward fp64 D=200 dropout (8-row tiles)", qkv(1, 2, 20, 30, 200, 200, dtype=F64), {
        "dropout_p": 0.2, "dropout_seed": torch.tensor([5, 6])}
    yield "backward bf16 D=32 learned (1, H, 1, S) mask", qkv(2, 3, 40, 33, 32, 32, dtype=BF), {
        "attn_mask": to_device(torch.randn(1, 3, 1, 33, generator=GEN).bfloat16(), DEV)}
    yield "backward fp16 D=128 causal, several tiles (plain, 32-row tiles)", qkv(2, 2, 130, 150, 128, 128), {
        "is_causal": True}
    # float32 on tensor cores (3xTF32): the plain instantiation, 16-byte rows and strided ones
    yield "backward fp32 D=64 GQA, causal, sinks (3xTF32, 32-row tiles)", gqa(2, 4, 2, 70, 100, 64, 64,
                                                                            dtype=F32, layout="blhd"), {
        "is_causal": True, "sinks": to_device(torch.linspace(-1.0, 1.0, 4), DEV)}
    yield "backward fp32 D=20 strided (3xTF32, element staging)", qkv(2, 2, 70, 90, 20, 20, dtype=F32,
                                                                          layout="strided_last"), {}
    yield "backward bf16 D=64 GQA, dropout, window (general)", gqa(2, 4, 2, 100, 140, 64, 64, dtype=BF), {
        "dropout_p": 0.2, "dropout_seed": torch.tensor([7, 8]), "window_left": 50, "window_right": 10}
    # the tensor-core backward's tile classes: a causal bool mask and right padding (the bits instantiation:
    # tiles skipped, run unmasked and read from the packed bits, in both passes; S a multiple of 4, so that
    # dropout's Philox blocks are shared by 4 scores), then a float mask over the same tiles (general)
    causal = torch.ones(130, 200, dtype=torch.bool).triu_(71)
    padding = torch.zeros(2, 200, dtype=torch.bool)
    padding[1, 150:] = True
    kpm = to_device(padding, DEV)
    yield "backward fp16 D=64 causal bool mask + padding, dropout: tile classes (bits)", qkv(
        2, 2, 130, 200, 64, 64), {"attn_mask": to_device(causal, DEV), "key_padding_mask": kpm,
                                  "dropout_p": 0.2, "dropout_seed": torch.tensor([9, 10])}
    additive = to_device(torch.zeros(130, 200).masked_fill(causal, float("-inf")).half(), DEV)
    yield "backward fp16 D=128 float causal mask + padding: tile classes (general, 32-row tiles)", qkv(
        2, 2, 130, 200, 128, 128), {"attn_mask": additive, "key_padding_mask": kpm}


def main():
    failed, reached = 0, set()
    for label, (q, k, v), kwargs in [*cases(), *backward_cases()]:
        try:
            backward = label.startswith("backward")
            kernel = torch.ops.attnx._attention_kernel(q, k, v, backward=backward, **kwargs)
            reached |= {prefix for prefix in KERNELS if kernel.startswith(prefix)}
            if backward:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                mask = kwargs.get("attn_mask")
                if mask is not None and mask.is_floating_point():
                    kwargs = {**kwargs, "attn_mask": mask.detach().requires_grad_()}
                out, _ = attnx.attention(*leaves, **kwargs)
                out.sum().backward()
            else:
                with torch.no_grad():
                    out, _ = attnx.attention(q, k, v, **kwargs)
            torch.cuda.synchronize()
            print(f"ok    {label} ({kernel}): out {tuple(out.shape)}", flush=True)
        except RuntimeError as e:  # reported and counted; the next cases still run
            failed += 1
            print(f"FAIL  {label}: {str(e).splitlines()[0][:300]}", flush=True)
    missed = [prefix for prefix in KERNELS if prefix not in reached]
    if missed:
        failed += 1
        print(f"FAIL  no case reaches {', '.join(missed)}", flush=True)
    print(f"{failed} of the launches failed" if failed else "all launches done", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
