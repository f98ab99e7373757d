"""The attention features of today's models, forward and backward, against reference.attention on the CPU:
grouped KV heads (GQA / MQA), key ranges (bottom-right windows, per-batch key lengths, decoding and chunked
prefill), soft-capping, attention sinks, and the gradient of a float attn_mask (a learned bias).

Bounds as in test_attention.py (forward) and test_attention_backward.py (gradients), through
attention_helpers.py: the kernel may be at most K times as far from the float64 reference as the reference in
the inputs' dtype is, plus a small atol.
"""

import re

import pytest
import torch

import attnx
from attention_helpers import (
    DTYPES,
    GRAD_ATOL,
    QKV_LAYOUTS,
    assert_grad_bounded,
    check_forward,
    make_in_layout,
    upcast,
)
from attnx import reference


def make_gqa(B, H, Hkv, L, S, D, Dv, dtype=torch.float32, layout="contiguous", seed=0):
    """query (B, H, L, D) and key/value with Hkv heads, in `layout` (one of QKV_LAYOUTS), all three from one
    generator (attention_helpers.make_gqa draws key and value from a second one)."""
    gen = torch.Generator().manual_seed(seed)
    q = make_in_layout((B, H, L, D), layout, dtype, gen, which="q")
    k = make_in_layout((B, Hkv, S, D), layout, dtype, gen, which="k")
    v = make_in_layout((B, Hkv, S, Dv), layout, dtype, gen, which="v")
    return q, k, v


def check_grads(q, k, v, grad_names=("q", "k", "v"), **kwargs):
    """Gradients of attnx.attention w.r.t. q, k, v and any of attn_mask / sinks named in grad_names, against
    autograd through the reference; returns them."""
    named = {"q": q, "k": k, "v": v, **{n: kwargs[n] for n in ("attn_mask", "sinks") if n in kwargs}}
    leaves = {n: t for n, t in named.items() if n in grad_names}
    B, H, L, _ = q.shape
    grad_out = torch.randn(B, H, L, v.shape[3], generator=torch.Generator().manual_seed(7)).to(q.dtype)

    def grads(fn, cast):
        ls = {n: cast(t).detach().requires_grad_() for n, t in leaves.items()}
        args = {n: ls.get(n, cast(t)) for n, t in named.items()}
        rest = {n: cast(a) for n, a in kwargs.items() if n not in args}
        out, _ = fn(args["q"], args["k"], args["v"], **{n: args[n] for n in args if n not in "qkv"}, **rest)
        return torch.autograd.grad(out, list(ls.values()), cast(grad_out).to(out.dtype))

    got = grads(attnx.attention, lambda t: t)
    g64 = grads(reference.attention, upcast)
    g_same = grads(reference.attention, lambda t: t)
    for name, g, r64, rs in zip(leaves, got, g64, g_same, strict=True):
        assert g.shape == leaves[name].shape and g.dtype == leaves[name].dtype, name
        assert_grad_bounded(g, r64, rs, GRAD_ATOL[q.dtype] * (4 if name in ("attn_mask", "sinks") else 1),
                            f"grad {name}")
    return got


# ------------------------------------------------------------------------------------------------------------
# Grouped KV heads.

GROUPS = [(4, 1), (4, 2), (6, 3), (4, 4)]


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GROUPS, ids=str)
def test_gqa_forward(heads, dtype, layout):
    H, Hkv = heads
    check_forward(*make_gqa(2, H, Hkv, 37, 53, 24, 16, dtype=dtype, layout=layout))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GROUPS, ids=str)
def test_gqa_backward(heads, dtype):
    H, Hkv = heads
    # S = 300: three backward key tiles of 128, the last partial; L = 130: two query tiles.
    check_grads(*make_gqa(2, H, Hkv, 130, 300, 16, 24, dtype=dtype), is_causal=True)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_gqa_backward_plans(threads, intra_op_threads):
    # One kv head and few threads: keys are split into chunks whose dQ slots are summed afterwards.
    intra_op_threads(threads)
    check_grads(*make_gqa(1, 4, 1, 70, 600, 8, 8, dtype=torch.float64))


def test_gqa_backward_strided():
    q, k, v = make_gqa(2, 4, 2, 20, 30, 8, 8, dtype=torch.float64, layout="blhd")
    check_grads(q, k, v, window_left=5, window_right=1)


def test_gqa_reads_no_copy():
    # The kv head is indexed, never repeated: a stride-0 key over the group's heads is what a repeat would
    # give, and the result is the same as reading Hkv heads.
    q, k, v = make_gqa(2, 4, 1, 9, 11, 8, 8)
    out_shared, _ = attnx.attention(q, k, v)
    out_expanded, _ = attnx.attention(q, k.expand(2, 4, 11, 8), v.expand(2, 4, 11, 8))
    torch.testing.assert_close(out_shared, out_expanded, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------
# Key ranges: bottom-right windows and key lengths (decoding, chunked prefill, static caches).

WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 2), (0, -1), (0, 0), (40, 7)]
# (L, S): square; chunked prefill; decoding; more queries than keys; tile boundaries of the forward (512
# keys, 128 queries) and the backward (128 x 128).
RANGE_SHAPES = [(23, 23), (9, 40), (1, 33), (30, 12), (200, 1100)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("shape", RANGE_SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_windows(shape, window, is_causal):
    L, S = shape
    q, k, v = make_gqa(2, 2, 1, L, S, 16, 8, dtype=torch.float64)
    kwargs = dict(window_left=window[0], window_right=window[1], is_causal=is_causal)
    check_forward(q, k, v, **kwargs)
    if L * S < 10000:
        check_grads(q, k, v, **kwargs)


@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (1, 3)], ids=str)
@pytest.mark.parametrize("shape", [(1, 600), (5, 40), (40, 40)], ids=str)
def test_key_lengths(shape, window, lengths_dtype):
    L, S = shape
    q, k, v = make_gqa(3, 4, 2, L, S, 16, 16, dtype=torch.float64)
    lengths = torch.tensor([S, 0, S // 3 + 1], dtype=lengths_dtype)  # full, empty, partial
    kwargs = dict(key_lengths=lengths, window_left=window[0], window_right=window[1])
    _, lse = check_forward(q, k, v, **kwargs)
    assert torch.isposinf(lse[1]).all()  # no valid key: out 0, lse +inf
    check_grads(q, k, v, **kwargs)


def test_unfilled_cache_slots_are_never_read():
    # A static KV cache past its filled length holds anything: NaN there must not reach out or any gradient.
    q, k, v = make_gqa(2, 4, 2, 3, 700, 16, 16, dtype=torch.float32)
    lengths = torch.tensor([513, 5])
    for t in (k, v):
        t[0, :, 513:] = float("nan")
        t[1, :, 5:] = float("inf")
    out, lse = check_forward(q, k, v, key_lengths=lengths, window_left=-1, window_right=0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    grads = check_grads(q, k, v, key_lengths=lengths, window_left=-1, window_right=0)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", QKV_LAYOUTS)
def test_decoding_step(dtype, layout):
    # One query per sequence against a cache: the bottom-right causal window puts it at the last valid key.
    q, k, v = make_gqa(4, 8, 2, 1, 77, 32, 32, dtype=dtype, layout=layout)
    check_forward(q, k, v, key_lengths=torch.tensor([77, 1, 40, 64]), window_left=-1, window_right=0)
    check_forward(q, k, v, window_left=15, window_right=0)  # a sliding window while decoding


def test_window_with_masks_and_rows_that_see_nothing():
    q, k, v = make_gqa(2, 4, 2, 12, 30, 8, 8, dtype=torch.float64)
    kpm = torch.zeros(2, 30, dtype=torch.bool)
    kpm[1, 20:] = True  # batch 1's window rows near the end see only padded keys
    mask = torch.randn(12, 30, dtype=torch.float64)
    _, lse = check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm, window_left=2, window_right=0)
    assert torch.isposinf(lse[1, :, -1]).all()
    check_grads(q, k, v, attn_mask=mask, key_padding_mask=kpm, window_left=2, window_right=0)


def test_window_cost_follows_the_window():
    # Tiles outside the window are skipped: NaN keys far outside every row's window do not reach the output,
    # which would happen if their tiles were read (a NaN score poisons its row's maximum).
    q, k, v = make_gqa(1, 2, 2, 2048, 2048, 16, 16)
    k[:, :, :512] = float("nan")  # only the first 512 keys, which no row of the last 1024 queries sees
    out, _ = attnx.attention(q, k, v, window_left=255, window_right=0)
    assert torch.isfinite(out[:, :, 1024:]).all()


# ------------------------------------------------------------------------------------------------------------
# Soft-capping and sinks.


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [0.5, 7.3, 50.0])
def test_softcap(softcap, dtype):
    q, k, v = make_gqa(2, 4, 2, 37, 53, 16, 16, dtype=dtype)
    q = q * 4  # scores beyond the cap, where tanh bends
    mask = torch.randn(37, 53).to(dtype)
    check_forward(q, k, v, softcap=softcap, attn_mask=mask)
    check_grads(q, k, v, softcap=softcap, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16])
def test_sinks(dtype, sinks_dtype):
    q, k, v = make_gqa(2, 4, 2, 20, 45, 16, 16, dtype=dtype)
    sinks = (torch.randn(4) * 3).to(sinks_dtype)
    kpm = torch.zeros(2, 45, dtype=torch.bool)
    kpm[1] = True  # batch 1 sees no key: out 0 and lse +inf, sink or not
    _, lse = check_forward(q, k, v, sinks=sinks, key_padding_mask=kpm)
    assert torch.isposinf(lse[1]).all() and torch.isfinite(lse[0]).all()
    check_grads(q, k, v, grad_names=("q", "k", "v", "sinks"), sinks=sinks, key_padding_mask=kpm)


def test_sink_takes_mass():
    # A huge sink takes (almost) all the probability: out tends to 0 and lse to the sink.
    q, k, v = make_gqa(1, 2, 2, 3, 5, 4, 4, dtype=torch.float64)
    out, lse = attnx.attention(q, k, v, sinks=torch.tensor([60.0, 60.0], dtype=torch.float64))
    assert out.abs().max() < 1e-20
    torch.testing.assert_close(lse, torch.full_like(lse, 60.0))


def test_everything_together():
    q, k, v = make_gqa(3, 6, 2, 40, 150, 16, 8, dtype=torch.float64, layout="blhd")
    kwargs = dict(
        attn_mask=torch.randn(1, 6, 40, 150, dtype=torch.float64),
        key_padding_mask=torch.rand(3, 150) < 0.2,
        key_lengths=torch.tensor([150, 90, 41]),
        window_left=30, window_right=2, softcap=5.0, sinks=torch.randn(6, dtype=torch.float64),
    )
    check_forward(q, k, v, **kwargs)
    check_grads(q, k, v, grad_names=("q", "k", "v", "attn_mask", "sinks"), **kwargs)


# ------------------------------------------------------------------------------------------------------------
# The gradient of a float attn_mask (learned biases).

# (shape of the bias, B, H): every way it can broadcast over (B, H, L, S).
BIAS_SHAPES = [
    ((37, 53), 2, 4),  # (L, S): summed over B and H
    ((8, 37, 53), 2, 4),  # nn.MultiheadAttention's (B*H, L, S)
    ((1, 4, 37, 53), 2, 4),  # T5 / Swin: per head, shared by the batch
    ((2, 1, 37, 53), 2, 4),
    ((2, 4, 37, 53), 2, 4),
    ((1, 4, 1, 53), 2, 4),  # per head and key (ALiBi-like slopes times positions)
    ((2, 1, 37, 1), 2, 4),  # per query: summed over keys
    ((1, 1, 1, 1), 2, 4),
]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=str)
def test_mask_gradient(bias_shape):
    shape, B, H = bias_shape
    q, k, v = make_gqa(B, H, 2, 37, 53, 8, 8, dtype=torch.float64)
    bias = torch.randn(shape, dtype=torch.float64)
    grads = check_grads(q, k, v, grad_names=("q", "k", "v", "attn_mask"), attn_mask=bias, is_causal=True)
    assert grads[3].shape == bias.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 3])
def test_mask_gradient_dtypes_and_plans(dtype, threads, intra_op_threads):
    intra_op_threads(threads)
    # Keys across several backward tiles, so that items split them (or a slot covers every batch and head).
    q, k, v = make_gqa(2, 2, 2, 50, 400, 8, 8, dtype=dtype)
    for shape in [(1, 2, 50, 400), (50, 400), (2, 2, 50, 1)]:
        bias = torch.randn(shape).to(dtype)
        check_grads(q, k, v, grad_names=("q", "k", "v", "attn_mask"), attn_mask=bias, window_left=100,
                    window_right=-1)


def test_mask_gradient_of_an_expanded_mask():
    # An expanded (stride-0, full-size) mask gets one gradient element per element: autograd's expand
    # backward then sums them into the base.
    q, k, v = make_gqa(2, 2, 2, 6, 7, 4, 4, dtype=torch.float64)
    base = torch.randn(1, 1, 6, 7, dtype=torch.float64, requires_grad=True)
    out, _ = attnx.attention(q, k, v, attn_mask=base.expand(2, 2, 6, 7))
    out.sum().backward()
    base_ref = base.detach().clone().requires_grad_()
    reference.attention(q, k, v, attn_mask=base_ref.expand(2, 2, 6, 7))[0].sum().backward()
    torch.testing.assert_close(base.grad, base_ref.grad)


def test_mask_gradient_uses_no_attention_sized_buffer():
    # A (1, H, L, S) bias: the backward allocates its gradient (H*L*S) but nothing of (B, H, L, S) = 8x that.
    B, H, L, S = 8, 2, 64, 96
    q, k, v = make_gqa(B, H, H, L, S, 8, 8)
    bias = torch.randn(1, H, L, S)
    out, lse = attnx.attention(q, k, v, attn_mask=bias)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        attnx.attention_backward(torch.ones_like(out), q, k, v, out, lse, attn_mask=bias, grad_attn_mask=True)
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(sizes) < B * H * L * S * 4 // 2


def test_key_padding_mask_requiring_grad_is_an_error():
    q, k, v = (t.requires_grad_() for t in make_gqa(1, 2, 2, 3, 4, 4, 4))
    kpm = torch.zeros(1, 4, requires_grad=True)
    out, _ = attnx.attention(q, k, v, key_padding_mask=kpm)
    with pytest.raises(RuntimeError, match=re.escape("no gradient for a float key_padding_mask")):
        out.sum().backward()


# ------------------------------------------------------------------------------------------------------------
# gradcheck (float64, finite differences), fakes and opcheck.

GRADCHECK_CASES = {
    "gqa window": dict(heads=(4, 2), kwargs=dict(window_left=2, window_right=1)),
    "mqa causal lengths": dict(heads=(2, 1), kwargs=dict(is_causal=True, key_lengths=torch.tensor([7, 3]))),
    "softcap bias": dict(heads=(2, 2), kwargs=dict(softcap=1.5), bias=(2, 5, 7)),
    "sinks bias": dict(heads=(2, 1), kwargs={}, bias=(5, 7), sinks=True),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck(case):
    c = GRADCHECK_CASES[case]
    H, Hkv = c["heads"]
    q, k, v = (t.requires_grad_() for t in make_gqa(2, H, Hkv, 5, 7, 3, 3, dtype=torch.float64))
    extra = []
    if "bias" in c:
        shape = c["bias"]
        shape = (2 * H, *shape[1:]) if len(shape) == 3 else shape
        extra.append(("attn_mask", torch.randn(shape, dtype=torch.float64, requires_grad=True)))
    if c.get("sinks"):
        extra.append(("sinks", torch.randn(H, dtype=torch.float64, requires_grad=True)))
    names = [n for n, _ in extra]

    def fn(q, k, v, *ts):
        return attnx.attention(q, k, v, **c["kwargs"], **dict(zip(names, ts, strict=True)))[0]

    assert torch.autograd.gradcheck(fn, (q, k, v, *(t for _, t in extra)))


def _opcheck_cases():
    q, k, v = make_gqa(2, 4, 2, 5, 7, 8, 4)
    return {
        "gqa": (q, k, v, None, None, False, None, 0.0, None, -1, -1, None, None, None),
        "window lengths": (q, k, v, None, None, False, None, 0.0, None, 3, 0, torch.tensor([7, 2]), None,
                           None),
        "softcap sinks": (q, k, v, torch.randn(5, 7), None, True, 0.3, 0.0, None, -1, -1, None, 2.0,
                          torch.randn(4)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    args = _opcheck_cases()[case]
    torch.library.opcheck(torch.ops.attnx.attention.default, args)
    q, k, v = args[:3]
    out, lse = torch.ops.attnx.attention.default(*args)
    bwd = (torch.randn_like(out), q, k, v, out, lse, *args[3:], args[3] is not None)
    torch.library.opcheck(torch.ops.attnx.attention_backward.default, bwd)


def test_fake_shapes_with_gqa():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_gqa(2, 4, 2, 5, 7, 8, 4)
    real = attnx.attention_backward(torch.ones(2, 4, 5, 4), q, k, v, *attnx.attention(q, k, v))
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse = attnx.attention(q, k, v)
        fake = attnx.attention_backward(torch.ones(2, 4, 5, 4), q, k, v, out, lse)
    for r, f in zip(real, fake, strict=True):
        assert r.shape == f.shape and r.stride() == f.stride()


# ------------------------------------------------------------------------------------------------------------
# Bad input: torch-style errors, never a crash or a silent wrong answer.


def _bad_cases():
    q, k, v = make_gqa(2, 6, 4, 5, 7, 8, 4)
    k3, v3 = k[:, :3], v[:, :3]
    return {
        "heads not dividing": ((q, k, v), {},
                               "expected the number of key/value heads (Hkv = 4) to divide the number of "
                               "query heads (H = 6)"),
        "window below -1": ((q, k3, v3), {"window_left": -2},
                            "expected window_left and window_right >= -1 (-1 = unbounded), got (-2, -1)"),
        "key_lengths dtype": ((q, k3, v3), {"key_lengths": torch.tensor([1.0, 2.0])},
                              "expected key_lengths of dtype int32 or int64, got Float"),
        "key_lengths shape": ((q, k3, v3), {"key_lengths": torch.tensor([1, 2, 3])},
                              "expected key_lengths of shape (B,) = (2,), got [3]"),
        "key_lengths device": ((q, k3, v3), {"key_lengths": torch.tensor([1, 2], device="meta")},
                               "expected key_lengths on query's device cpu, got meta"),
        "key_lengths range": ((q, k3, v3), {"key_lengths": torch.tensor([1, 8])},
                              "expected key_lengths in [0, S] = [0, 7], got key_lengths[1] = 8"),
        "key_lengths negative": ((q, k3, v3), {"key_lengths": torch.tensor([-1, 2], dtype=torch.int32)},
                                 "got key_lengths[0] = -1"),
        "softcap zero": ((q, k3, v3), {"softcap": 0.0}, "expected softcap to be a finite number > 0"),
        "softcap inf": ((q, k3, v3), {"softcap": float("inf")}, "expected softcap to be a finite number > 0"),
        "softcap nan": ((q, k3, v3), {"softcap": float("nan")}, "expected softcap to be a finite number > 0"),
        "sinks shape": ((q, k3, v3), {"sinks": torch.zeros(3)},
                        "expected sinks of shape (H,) = (6,), got [3]"),
        "sinks dtype": ((q, k3, v3), {"sinks": torch.zeros(6, dtype=torch.int64)},
                        "expected sinks of a floating dtype"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake"])
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs(case, fake):
    args, kwargs, message = _bad_cases()[case]
    if fake and "range" in case or fake and "negative" in case:
        pytest.skip("key_lengths' values are data: a fake tensor has none to check")
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                attnx.attention(*args, **kwargs)
    else:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attnx.attention(*args, **kwargs)
