"""attention_backward's math fallback (csrc/common/attention_math.cpp), the kernel of backends without a fused
backward (CUDA, MPS). Here it is called on CPU tensors by dispatching to its CompositeExplicitAutograd kernel
directly, and compared with the fused CPU kernel and with autograd through reference.attention in float64."""

import pytest
import torch

import attnx
from attention_helpers import (
    ATTN_MASK_KINDS,
    KEY_PADDING_MASK_KINDS,
    MASKED_SHAPE,
    make_attn_mask,
    make_key_padding_mask,
)
from attnx import reference

pytestmark = pytest.mark.kernel

B, H, L, S = MASKED_SHAPE
D = 16
MATH = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def math_backward(*args):
    return torch.ops.attnx.attention_backward.default.redispatch(MATH, *args)


def _inputs(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if layout == "blhd":  # the layout mha hands over
        q, k, v = (
            torch.randn(B, n, H, D, generator=gen, dtype=torch.float64).transpose(1, 2) for n in (L, S, S)
        )
    else:
        q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for n in (L, S, S))
    return q, k, v


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padding", [None, *KEY_PADDING_MASK_KINDS])
@pytest.mark.parametrize("attn_mask", [None, *ATTN_MASK_KINDS])
def test_math_backward_matches_the_reference_and_the_kernel(attn_mask, padding, is_causal):
    gen = torch.Generator().manual_seed(1)
    am = make_attn_mask(attn_mask, gen) if attn_mask else None
    kpm = make_key_padding_mask(padding, gen) if padding else None
    q, k, v = (t.requires_grad_() for t in _inputs("blhd"))
    out, lse = attnx.attention(q, k, v, am, kpm, is_causal)
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    got = math_backward(grad_out, q, k, v, out, lse, am, kpm, is_causal, None)
    kernel = torch.ops.attnx.attention_backward(grad_out, q, k, v, out, lse, am, kpm, is_causal, None)
    want_out, _ = reference.attention(q, k, v, am, kpm, is_causal)
    want = torch.autograd.grad(want_out, (q, k, v), grad_out)
    assert all(t.numel() == 0 for t in (*got[3:], *kernel[3:]))  # no mask or sink gradient asked for
    for name, g, kern, w in zip("qkv", got[:3], kernel[:3], want, strict=True):
        assert g.isfinite().all(), name
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"grad {n}: {m}")
        assert (g.shape, g.stride()) == (kern.shape, kern.stride()), name  # the kernel's layout


def test_math_backward_custom_scale_and_low_precision():
    q, k, v = (t.float() for t in _inputs("contiguous"))
    out, lse = attnx.attention(q, k, v, scale=0.3)
    grad_out = torch.randn_like(out)
    got = math_backward(grad_out, q, k, v, out, lse, None, None, False, 0.3)
    want = torch.ops.attnx.attention_backward(grad_out, q, k, v, out, lse, None, None, False, 0.3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_math_backward_checks_its_arguments():
    q, k, v = _inputs("contiguous")
    out, lse = attnx.attention(q, k, v)
    with pytest.raises(RuntimeError, match=r"attnx::attention_backward: expected lse of shape \(B, H, L\)"):
        math_backward(out, q, k, v, out, lse[..., :-1], None, None, False, None)


# The attention features of today's models (test_attention_features.py tests the CPU kernel) through the math
# fallback: grouped KV heads, key ranges, soft-capping, sinks and a float attn_mask's gradient.
FEATURES = {
    "gqa causal": dict(heads=(4, 2), kwargs=dict(is_causal=True)),
    "mqa window": dict(heads=(4, 1), kwargs=dict(window_left=3, window_right=1)),
    "key lengths": dict(heads=(2, 2), kwargs=dict(key_lengths=torch.tensor([9, 0]), window_left=-1,
                                                   window_right=0)),
    "softcap bias": dict(heads=(4, 2), kwargs=dict(softcap=2.0), bias=(1, 4, 6, 9)),
    # A bias of the scores' full shape: its gradient is dS itself, before the soft-cap's derivative.
    "softcap full bias": dict(heads=(4, 2), kwargs=dict(softcap=2.0), bias=(2, 4, 6, 9)),
    "sinks bias": dict(heads=(4, 4), kwargs={}, bias=(6, 9), sinks=True),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_math_backward_features(case):
    c = FEATURES[case]
    H_, Hkv = c["heads"]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, H_, 6, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, Hkv, 9, D, generator=gen, dtype=torch.float64) for _ in range(2))
    if "key_lengths" in c["kwargs"]:
        k[1], v[1] = float("nan"), float("nan")  # past batch 1's key length (0): never read
    bias = torch.randn(c["bias"], generator=gen, dtype=torch.float64) if "bias" in c else None
    sinks = torch.randn(H_, generator=gen, dtype=torch.float64) if c.get("sinks") else None
    kw = c["kwargs"]
    out, lse = attnx.attention(q, k, v, attn_mask=bias, sinks=sinks, **kw)
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    args = (grad_out, q, k, v, out, lse, bias, None, kw.get("is_causal", False), None, 0.0, None,
            kw.get("window_left", -1), kw.get("window_right", -1), kw.get("key_lengths"), kw.get("softcap"),
            sinks, None, None, 128, 128, bias is not None)
    got = math_backward(*args)
    kernel = torch.ops.attnx.attention_backward(*args)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    extra = {n: t.detach().clone().requires_grad_() for n, t in (("attn_mask", bias), ("sinks", sinks))
             if t is not None}
    want_out, _ = reference.attention(*leaves, **extra, **kw)
    want = torch.autograd.grad(want_out, [*leaves, *extra.values()], grad_out)
    got_list = [*got[:3], *(g for g, t in zip(got[3:], (bias, sinks), strict=True) if t is not None)]
    kernel_list = [*kernel[:3], *(g for g, t in zip(kernel[3:], (bias, sinks), strict=True) if t is not None)]
    for i, (g, kern, w) in enumerate(zip(got_list, kernel_list, want, strict=True)):
        assert g.isfinite().all(), i
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=lambda m, i=i: f"gradient {i}: {m}")
        assert (g.shape, g.stride()) == (kern.shape, kern.stride()), i
