"""The gradients of attnx.attention (attnx::attention_backward) against autograd through reference.attention.

Accuracy bound (flash-attention style), per gradient: with g64 autograd through the reference on float64
copies of the same inputs and g_same autograd through the reference in the inputs' own dtype,

    max |g - g64| <= K * max |g_same - g64| + atol[dtype]

float64 has g_same = g64, so its bound is atol alone: tight. atol covers what the relative bound cannot:
float32 recomputes the probabilities with an exp accurate to ~20 ulp where the reference's is ~1 ulp;
bfloat16/float16 round the saved out, which enters delta = rowsum(dO * O), where the reference differentiates
its unrounded output. Expanded (stride-0) inputs are compared through the gradient of their un-expanded base.
The leaves, their views and this comparison are attention_helpers.py's (check_backward).
"""

import os
import re
import sys
import textwrap

import pytest
import torch

import attnx
from attention_helpers import (
    ATTN_MASK_KINDS,
    DTYPES,
    EMPTY_SIZES,
    KEY_PADDING_MASK_KINDS,
    check_backward,
    make_attn_mask,
    make_key_padding_mask,
    make_leaves,
    run_python,
    run_under_cpu_capability,
    views,
)
from attnx import reference

# ------------------------------------------------------------------------------------------------------------
# Shapes, dtypes, layouts: leaves (what gradients are compared on) and the (B, H, N, E) views attention reads.

LAYOUTS = ["contiguous", "blhd", "lbhd", "sliced", "expanded_kv", "strided_last"]

# (B, H, L, S, D, Dv)
SHAPES = [
    (2, 3, 37, 53, 24, 24),  # odd sizes, L != S
    (1, 2, 16, 16, 32, 8),  # Dv < D
    (2, 1, 9, 70, 8, 40),  # Dv > D, L < S
    (1, 1, 1, 1, 4, 4),  # single query and key
    (3, 2, 1, 33, 16, 16),  # one query
    (1, 1, 45, 1, 16, 16),  # one key
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_dtypes_layouts(shape, dtype, layout):
    check_backward(make_leaves(*shape, dtype=dtype, layout=layout), layout)


# The backward tiles 128 queries by 128 keys; a head's keys are split into chunks when B*H is small next to
# the thread count, whose dQ contributions are summed in a second pass. These shapes cross the tile boundaries
# with partial tiles, and run with one thread and with all of them, so that both plans (one chunk per head,
# several) are exercised.
BIG_SHAPES = [
    (1, 1, 300, 270, 32, 32),  # one head: chunked keys
    (2, 3, 130, 390, 16, 24),  # six heads
]


@pytest.mark.parametrize("threads", ["one", "all"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BIG_SHAPES, ids=str)
def test_tile_boundaries_and_plans(shape, dtype, is_causal, threads):
    saved = torch.get_num_threads()
    try:
        if threads == "one":
            torch.set_num_threads(1)
        check_backward(make_leaves(*shape, dtype=dtype, layout="blhd"), "blhd", is_causal=is_causal)
    finally:
        torch.set_num_threads(saved)


def test_custom_scale():
    leaves = make_leaves(2, 2, 20, 30, 16, 12, dtype=torch.float64)
    check_backward(leaves, scale=0.37)
    check_backward(leaves, scale=0.0)  # uniform probabilities: dq = dk = 0 exactly
    check_backward(leaves, scale=3.0, is_causal=True)


def test_b1_transposed_layout():
    leaves = make_leaves(1, 4, 12, 12, 8, 8, dtype=torch.float64, layout="lbhd")
    q = views(leaves, "lbhd")[0]
    assert q.stride(0) == 4 * 8  # the size-1 batch dim carries a stride that is not the contiguous one
    check_backward(leaves, "lbhd")


def test_expanded_grad_out():
    # out.sum().backward() hands the backward a grad_out of stride 0 everywhere.
    leaves = make_leaves(2, 2, 20, 30, 16, 16, dtype=torch.float64, layout="blhd")
    ones = torch.ones(1, 1, 1, 1, dtype=torch.float64).expand(2, 2, 20, 16)
    check_backward(leaves, "blhd", grad_out=ones, is_causal=True)
    q, k, v = (t.detach().requires_grad_() for t in leaves)
    attnx.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0].sum().backward()
    q64, k64, v64 = (t.detach().requires_grad_() for t in leaves)
    reference.attention(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2))[0].sum().backward()
    for a, b in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-11)


# ------------------------------------------------------------------------------------------------------------
# Masks (attention_helpers' factories: (B, H, L, S) = (2, 3, 19, 41)), in float64 against the float64
# reference.

ATTN_MASKS = [None, *ATTN_MASK_KINDS]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("attn_mask", ATTN_MASKS, ids=str)
def test_attn_mask(attn_mask, is_causal):
    gen = torch.Generator().manual_seed(1)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    check_backward(make_leaves(2, 3, 19, 41, 16, 16, dtype=torch.float64, layout="blhd"), "blhd",
                   attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padding", [None, *KEY_PADDING_MASK_KINDS], ids=str)
@pytest.mark.parametrize("attn_mask", [None, "bool_ls", "float_bhls", "float_1h1s"], ids=str)
def test_padding_and_attn_mask(attn_mask, padding, is_causal):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    kpm = None if padding is None else make_key_padding_mask(padding, gen)
    check_backward(make_leaves(2, 3, 19, 41, 16, 16, dtype=torch.float64), attn_mask=mask,
                   key_padding_mask=kpm, is_causal=is_causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_masks_low_precision_and_strided(dtype):
    gen = torch.Generator().manual_seed(3)
    leaves = make_leaves(2, 3, 19, 41, 16, 8, dtype=dtype, layout="strided_last")
    check_backward(leaves, "strided_last", attn_mask=make_attn_mask("float_ls", gen).to(dtype),
                   key_padding_mask=make_key_padding_mask("bool", gen), is_causal=True, scale=0.2)


def test_masked_tiles_are_skipped_correctly():
    # Masks that remove whole (128, 128) tile pairs, which the kernel skips, next to pairs they cut in part.
    leaves = make_leaves(2, 2, 300, 400, 16, 16)
    mask = torch.zeros(300, 400, dtype=torch.bool)
    mask[:128, 128:256] = True  # a whole pair for the first query tile, part of one for the second
    mask[:200, 300:] = True
    kpm = torch.zeros(2, 400, dtype=torch.bool)
    kpm[0, :128] = True  # batch 0: the whole first key tile
    kpm[1, 384:] = True  # batch 1: the last, partial key tile
    check_backward(leaves, attn_mask=mask, key_padding_mask=kpm)
    additive = torch.zeros(300, 400).masked_fill(mask, float("-inf"))
    check_backward(leaves, attn_mask=additive, key_padding_mask=kpm, is_causal=True)


# ------------------------------------------------------------------------------------------------------------
# Fully masked rows, empty sizes.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fully_masked_rows(dtype):
    leaves = make_leaves(2, 2, 6, 9, 8, 8, dtype=dtype)
    mask = torch.zeros(6, 9, dtype=torch.bool)
    mask[2] = True  # query 2 sees no key
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1] = True  # batch 1 sees no key at all
    dq, dk, dv = check_backward(leaves, attn_mask=mask, key_padding_mask=kpm)
    assert (dq[:, :, 2] == 0).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dq[0, :, [0, 1, 3, 4, 5]] != 0).any()


@pytest.mark.parametrize("sizes", EMPTY_SIZES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_empty_sizes(sizes, dtype):
    kpm = torch.zeros(sizes[0], sizes[3], dtype=torch.bool)
    dq, dk, dv = check_backward(make_leaves(*sizes, dtype=dtype), key_padding_mask=kpm)
    if sizes[2] == 0:  # no queries: no gradient reaches the keys
        assert (dk == 0).all() and (dv == 0).all()
    if sizes[3] == 0:  # no keys: every row is fully masked
        assert (dq == 0).all()


# ------------------------------------------------------------------------------------------------------------
# gradcheck (float64, finite differences) on small cases.


@pytest.mark.parametrize(
    "case", ["plain", "causal_scale", "bool_and_padding", "float_masks_strided", "expanded_kv"]
)
def test_gradcheck(case):
    gen = torch.Generator().manual_seed(4)
    B, H, L, S, D = 2, 2, 5, 7, 4
    layout, kwargs = "contiguous", {}
    if case == "causal_scale":
        kwargs = {"is_causal": True, "scale": 0.7}
    elif case == "bool_and_padding":
        mask = torch.rand(L, S, generator=gen) < 0.3
        mask[1] = True  # one fully masked row
        kwargs = {"attn_mask": mask, "key_padding_mask": torch.rand(B, S, generator=gen) < 0.2}
    elif case == "float_masks_strided":
        layout = "blhd"
        kwargs = {"attn_mask": torch.randn(B * H, L, S, generator=gen, dtype=torch.float64),
                  "key_padding_mask": torch.randn(B, S, generator=gen), "is_causal": True}
    elif case == "expanded_kv":
        layout = "expanded_kv"
    leaves = [t.requires_grad_() for t in make_leaves(B, H, L, S, D, 3, dtype=torch.float64, layout=layout)]
    assert torch.autograd.gradcheck(lambda *ls: attnx.attention(*views(ls, layout), **kwargs)[0], leaves)


# ------------------------------------------------------------------------------------------------------------
# Autograd behaviour: what is saved, what is not differentiable, errors.


def test_float_masks_requiring_grad():
    # attn_mask gets its gradient (tested in depth in test_attention_features.py); a float key_padding_mask
    # that requires grad is a clear error.
    q, k, v = (t.requires_grad_() for t in make_leaves(1, 2, 4, 5, 8, 8))
    mask = torch.randn(4, 5, requires_grad=True)
    attnx.attention(q, k, v, attn_mask=mask)[0].sum().backward()
    assert mask.grad is not None and mask.grad.shape == mask.shape
    kpm = torch.randn(1, 5, requires_grad=True)
    # Only the mask requires grad.
    out, _ = attnx.attention(q.detach(), k.detach(), v.detach(), key_padding_mask=kpm)
    with pytest.raises(RuntimeError, match=r"no gradient for a float key_padding_mask, which requires grad"):
        out.sum().backward()
    # A mask that does not require grad is fine, float or bool.
    attnx.attention(q, k, v, attn_mask=mask.detach(), key_padding_mask=kpm.detach() > 0)[0].sum().backward()


def test_lse_is_not_differentiable():
    q, k, v = (t.requires_grad_() for t in make_leaves(1, 2, 4, 5, 8, 8))
    out, lse = attnx.attention(q, k, v)
    assert out.requires_grad and not lse.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()


def test_double_backward_is_an_error():
    q, k, v = (t.requires_grad_() for t in make_leaves(1, 2, 4, 5, 8, 8, dtype=torch.float64))
    out, _ = attnx.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="attnx.attention: double backward is not implemented"):
        dq.sum().backward()


def test_only_requested_gradients():
    q, k, v = make_leaves(1, 2, 4, 5, 8, 8)
    k.requires_grad_()
    attnx.attention(q, k, v)[0].sum().backward()
    assert k.grad is not None and q.grad is None and v.grad is None


def test_saves_no_attention_sized_tensor():
    B, H, L, S, D = 2, 2, 64, 96, 8
    q, k, v = (t.requires_grad_() for t in make_leaves(B, H, L, S, D, D))
    mask, kpm = torch.randn(L, S), torch.rand(B, S) < 0.2
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attnx.attention(q, k, v, attn_mask=mask, key_padding_mask=kpm)
    # The inputs, out, lse and the masks as given (an (L, S) mask is an input): nothing (B, H, L, S).
    assert {tuple(t.shape) for t in saved} == {(B, H, L, D), (B, H, S, D), (B, H, L), (L, S), (B, S)}


def _python_functions_run(fn) -> list:
    """The Python functions that run inside fn(), apart from fn and torch.ops' OpOverload.__call__."""
    codes = []

    def profile(frame, event, arg):
        if event == "call":
            codes.append(frame.f_code)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [f"{c.co_filename}:{c.co_name}" for c in codes
            if c is not fn.__code__ and not c.co_filename.endswith(os.path.join("torch", "_ops.py"))]


@pytest.mark.parametrize("op_name", ["attention", "attention_backward"])
def test_no_python_runs_without_grad(op_name):
    # attention routes by grad mode (csrc/common/routes.cpp): without it to attnx::_attention, which has no
    # autograd kernel, so no Python runs below torch.ops (a Python autograd kernel costs as much as the op at
    # decoding shapes); attention_backward has no autograd kernel at all.
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::_attention", "Autograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::attention_backward", "Autograd")
    q, k, v = make_leaves(1, 2, 4, 5, 8, 8)
    op = getattr(torch.ops.attnx, op_name).default
    if op_name == "attention":
        args = (q, k, v)
    else:
        out, lse = attnx.attention(q, k, v)
        args = (torch.randn_like(out), q, k, v, out, lse)
    with torch.no_grad():
        assert _python_functions_run(lambda: op(*args)) == []
    with torch.inference_mode():
        assert _python_functions_run(lambda: op(*args)) == []
    if op_name == "attention":  # in grad mode its autograd (registered from Python) runs, records a backward
        q.requires_grad_()
        assert _python_functions_run(lambda: op(*args)) != []
        assert op(*args)[0].grad_fn.name() == "_AttentionFunctionBackward"


# ------------------------------------------------------------------------------------------------------------
# Layout of the gradients, fake kernel, opcheck, errors.


def _backward_args(B=2, H=3, L=5, S=7, D=8, Dv=4, dtype=torch.float32, layout="blhd", seed=0):
    leaves = make_leaves(B, H, L, S, D, Dv, dtype=dtype, layout=layout, seed=seed)
    q, k, v = views(leaves, layout)
    out, lse = attnx.attention(q, k, v)
    grad_out = torch.randn(B, L, H, 2 * Dv, generator=torch.Generator().manual_seed(9)).to(dtype)
    return grad_out.transpose(1, 2)[..., ::2], q, k, v, out, lse  # a strided grad_out


def test_gradient_layout():
    *grads, grad_mask, grad_sinks = attnx.attention_backward(*_backward_args(2, 3, 5, 7, 8, 4))
    assert [g.shape for g in grads] == [(2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)]
    for g in grads:  # memory order (B, N, H, E), like out
        assert g.transpose(1, 2).is_contiguous()
    assert grad_mask.numel() == 0 and grad_sinks.numel() == 0  # neither asked for


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "sizes", [(2, 3, 5, 7, 8, 4), (1, 1, 1, 1, 1, 1), (2, 0, 3, 4, 8, 8), (1, 2, 3, 4, 8, 0)], ids=str
)
def test_fake_matches_kernel(sizes, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _backward_args(*sizes, dtype=dtype)
    real = attnx.attention_backward(*args)
    with FakeTensorMode() as mode:
        fake = attnx.attention_backward(*[mode.from_tensor(a) for a in args])
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


def _opcheck_cases():
    """(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed): masks, causal, a
    custom scale, float64 and bfloat16, each without and with fused dropout."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = views(make_leaves(2, 2, 5, 7, 8, 4, layout="blhd"), "blhd")
    kpm = torch.rand(2, 7, generator=gen) < 0.3
    mask = torch.randn(5, 7, generator=gen)

    def seed(s, offset=0):
        return torch.tensor([s, offset], dtype=torch.int64)

    return [
        (q, k, v, None, None, False, None, 0.0, None),
        (q, k, v, mask, kpm, True, 0.5, 0.0, None),
        (q.double(), k.double(), v.double(), torch.rand(4, 5, 7, generator=gen) < 0.2, None, False, None, 0.0,
         None),
        (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, kpm.float(), False, None, 0.0, None),
        (q, k, v, None, None, False, None, 0.3, seed(1, 2)),
        (q, k, v, mask, kpm, True, 0.5, 0.6, seed(-5, 2**40)),
        (q.double(), k.double(), v.double(), None, None, False, None, 1.0, seed(3)),
        (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, kpm.float(), False, None, 0.1, seed(4)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_opcheck_attention_with_grad(case):
    pytest.importorskip("expecttest")
    q, k, v, *rest = _opcheck_cases()[case]
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.attnx.attention.default, (q, k, v, *rest))


@pytest.mark.parametrize("case", range(8))
def test_opcheck_attention_backward(case):
    pytest.importorskip("expecttest")
    q, k, v, mask, kpm, is_causal, scale, p, dropout_seed = _opcheck_cases()[case]
    out, lse = attnx.attention(q, k, v, mask, kpm, is_causal, scale, p, dropout_seed)
    args = (torch.randn_like(out), q, k, v, out, lse, mask, kpm, is_causal, scale, p, dropout_seed)
    torch.library.opcheck(torch.ops.attnx.attention_backward.default, args)


def test_compile_backward():
    q, k, v = (t.requires_grad_() for t in make_leaves(2, 2, 5, 7, 8, 8))
    def loss(q, k, v):
        return attnx.attention(q, k, v, is_causal=True)[0].square().sum()

    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)


def _bad_cases():
    grad_out, q, k, v, out, lse = _backward_args(2, 3, 5, 7, 8, 4)
    return {
        "grad_out shape": ((grad_out[..., :3], q, k, v, out, lse),
                           "attnx::attention_backward: expected grad_out of shape (B, H, L, Dv) = "
                           "[2, 3, 5, 4], got [2, 3, 5, 3]"),
        "grad_out dtype": ((grad_out.double(), q, k, v, out, lse),
                           "attnx::attention_backward: expected grad_out of dtype Float, got Double"),
        "out shape": ((grad_out, q, k, v, out[:, :, :4], lse),
                      "attnx::attention_backward: expected out of shape (B, H, L, Dv) = [2, 3, 5, 4], "
                      "got [2, 3, 4, 4]"),
        "lse dtype": ((grad_out, q, k, v, out, lse.half()),
                      "attnx::attention_backward: expected lse of dtype Float, got Half"),
        "lse shape": ((grad_out, q, k, v, out, lse[:, :1]),
                      "attnx::attention_backward: expected lse of shape (B, H, L) = [2, 3, 5], "
                      "got [2, 1, 5]"),
        "key shape": ((grad_out, q, k[:, :, :, :4], v, out, lse),
                      "attnx::attention: expected key of shape (B, Hkv, S, D) = (2, Hkv, S, 8)"),
    }


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs(case, fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, message = _bad_cases()[case]
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                attnx.attention_backward(*args)
    else:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attnx.attention_backward(*args)


# ------------------------------------------------------------------------------------------------------------
# Memory: the backward allocates nothing of size (B, H, L, S).


def test_no_attention_sized_allocation():
    B, H, L, S, D = 2, 4, 256, 256, 16
    attention_bytes = B * H * L * S * 4
    gen = torch.Generator().manual_seed(6)
    mask, kpm = torch.randn(L, S, generator=gen), torch.randn(B, S, generator=gen)
    for impl in (attnx.attention, reference.attention):
        q, k, v = (t.requires_grad_() for t in make_leaves(B, H, L, S, D, D, layout="blhd"))
        out, _ = impl(*views((q, k, v), "blhd"), attn_mask=mask, key_padding_mask=kpm, is_causal=True)
        grad_out = torch.randn_like(out)
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu, profile_memory=True) as p:
            out.backward(grad_out)
        largest = max(e.cpu_memory_usage for e in p.events())
        if impl is reference.attention:  # the control: autograd through the reference does allocate them
            assert largest >= attention_bytes
        else:
            assert largest < attention_bytes / 4, largest


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import torch, attnx
    from benchmarks.memory import _peak_rss_bytes, _reset_peak_rss, _rss_bytes
    B, H, L, S, D = 2, 4, 2048, 2048, 16
    q, k, v = (torch.randn(B, H, n, D) for n in (L, S, S))
    mask = torch.rand(L, S) < 0.1
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[:, -100:] = True
    out, lse = attnx.attention(q, k, v, mask, kpm, is_causal=True)
    go = torch.randn_like(out)
    # Warm up (threads, JIT kernels) on the first 8 queries.
    attnx.attention_backward(go[:, :, :8], q[:, :, :8], k, v, out[:, :, :8], lse[:, :, :8], mask[:8], kpm)
    _reset_peak_rss()
    before = _rss_bytes()
    grads = attnx.attention_backward(go, q, k, v, out, lse, mask, kpm, True)
    print(_peak_rss_bytes() - before)
    """
)


def test_no_quadratic_memory():
    # Peak RSS of a fresh process around one backward: (B, H, L, S) probabilities would be 128 MiB. The call
    # returns 3 MiB of gradients and may add per-thread buffers (3 * L * D floats and tiles, ~1 MiB each).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    grown = int(run_python(_MEMORY_SCRIPT, cwd=root).strip().splitlines()[-1])
    assert grown < 16 * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB during the backward"


# ------------------------------------------------------------------------------------------------------------
# Every ISA variant of the CPU kernel.

_ISA_SCRIPT = """
    from attention_helpers import check_backward, make_leaves
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        leaves = make_leaves(2, 3, 150, 140, 24, 20, dtype=dtype, layout="strided_last")
        check_backward(leaves, "strided_last", attn_mask=torch.randn(150, 140),
                       key_padding_mask=torch.rand(2, 140) < 0.3, is_causal=True)
        check_backward(make_leaves(1, 2, 37, 53, 24, 24, dtype=dtype, layout="blhd"), "blhd")
    """


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_isa_variants(isa):
    run_under_cpu_capability(_ISA_SCRIPT, isa)
