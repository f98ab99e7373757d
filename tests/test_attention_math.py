"""attention_backward's math fallback (csrc/common/attention_math.cpp), the kernel of backends without a fused
backward (CUDA, MPS). Here it is called on CPU tensors by dispatching to its CompositeExplicitAutograd kernel
directly, and compared with the fused CPU kernel and with autograd through reference.attention in float64."""

import pytest
import torch

import attnx
from attnx import reference
from test_attention import ATTN_MASKS, PADDINGS, B, H, L, S, _mask, _padding

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
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("attn_mask", ATTN_MASKS)
def test_math_backward_matches_the_reference_and_the_kernel(attn_mask, padding, is_causal):
    gen = torch.Generator().manual_seed(1)
    am = _mask(attn_mask, gen) if attn_mask else None
    kpm = _padding(padding, gen) if padding else None
    q, k, v = (t.requires_grad_() for t in _inputs("blhd"))
    out, lse = attnx.attention(q, k, v, am, kpm, is_causal)
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    got = math_backward(grad_out, q, k, v, out, lse, am, kpm, is_causal, None)
    kernel = torch.ops.attnx.attention_backward(grad_out, q, k, v, out, lse, am, kpm, is_causal, None)
    want_out, _ = reference.attention(q, k, v, am, kpm, is_causal)
    want = torch.autograd.grad(want_out, (q, k, v), grad_out)
    for name, g, kern, w in zip("qkv", got, kernel, want, strict=True):
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
