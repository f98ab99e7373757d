"""Seeded fuzzing of ``attnx.attention`` and its backward against ``attnx.reference``: random shapes (empty
dims included), grouped KV heads, strided layouts, every mask form, causal attention, windows, key lengths,
soft-capping, sinks and scales, each configuration a pure function of its case number (the test id), so a
failure reproduces with ``-k 'case-N'``."""

import random

import pytest
import torch

import attnx
from attnx import reference

FORWARD_CASES = 300
BACKWARD_CASES = 100


def _tensor(rng, g, shape, dtype, requires_grad=False):
    t = torch.randn(*shape, generator=g, dtype=dtype)
    if rng.random() < 0.3:  # (B, N, H, E) in memory, as a model's projections lay it out
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.requires_grad_(requires_grad)


def _config(case, dtype, grad):
    """(query, key, value, keyword arguments) of one case; L and S may be 0 in the forward cases."""
    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    B, Hkv = rng.randint(1, 3), rng.randint(1, 3)
    H = Hkv * rng.randint(1, 3)
    low = 1 if grad else 0
    L, S = rng.randint(low, 40), rng.randint(low, 70)
    D, Dv = rng.choice([1, 3, 8, 16, 33, 64]), rng.choice([1, 8, 16, 40])
    q = _tensor(rng, g, (B, H, L, D), dtype, grad)
    k = _tensor(rng, g, (B, Hkv, S, D), dtype, grad)
    v = _tensor(rng, g, (B, Hkv, S, Dv), dtype, grad)
    kw = {}
    if rng.random() < 0.4:
        kw["key_padding_mask"] = torch.rand(B, S, generator=g) < 0.3
    if rng.random() < 0.3:
        kind = rng.choice(["bool 2-D", "float (1, H, L, S)", "bool (B, 1, 1, S)"])
        if kind == "bool 2-D":
            kw["attn_mask"] = torch.rand(L, S, generator=g) < 0.2
        elif kind == "float (1, H, L, S)":
            kw["attn_mask"] = torch.randn(1, H, L, S, generator=g, dtype=dtype).requires_grad_(grad)
        else:
            kw["attn_mask"] = torch.rand(B, 1, 1, S, generator=g) < 0.3
    choice = rng.random()
    if choice < 0.2:
        kw["is_causal"] = True
    elif choice < 0.5:
        kw["window_left"], kw["window_right"] = rng.choice([-1, 0, 2, 7]), rng.choice([-1, 0, 3])
    if rng.random() < 0.3:
        kw["key_lengths"] = torch.randint(0, S + 1, (B,), generator=g)
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([0.5, 5.0])
    if rng.random() < 0.2:
        kw["sinks"] = torch.randn(H, generator=g, dtype=dtype).requires_grad_(grad)
    if rng.random() < 0.2:
        kw["scale"] = rng.choice([0.01, 1.0, 3.0])
    return q, k, v, kw


def _in_float64(kw):
    return {n: t.detach().double() if torch.is_tensor(t) and t.is_floating_point() else t
            for n, t in kw.items()}


@pytest.mark.parametrize("case", [pytest.param(c, id=f"case-{c}") for c in range(FORWARD_CASES)])
def test_forward_matches_the_reference(case):
    dtype = torch.float64 if case % 2 else torch.float32
    q, k, v, kw = _config(case, dtype, grad=False)
    out, lse = attnx.attention(q, k, v, **kw)
    expected_out, expected_lse = reference.attention(q.double(), k.double(), v.double(), **_in_float64(kw))
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", [pytest.param(c, id=f"case-{c}") for c in range(BACKWARD_CASES)])
def test_backward_matches_the_reference(case):
    q, k, v, kw = _config(10_000 + case, torch.float64, grad=True)
    learned = (kw.get("attn_mask"), kw.get("sinks"))
    inputs = [q, k, v] + [t for t in learned if t is not None and t.requires_grad]
    grad_out = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(case),
                           dtype=torch.float64)
    actual = torch.autograd.grad(attnx.attention(q, k, v, **kw)[0], inputs, grad_out)
    expected = torch.autograd.grad(reference.attention(q, k, v, **kw)[0], inputs, grad_out)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-9)
