"""attnx::attention_backward's CUDA kernels compiled for the CPU, run on std::threads, against the reference.

The source is csrc/cuda/attention_backward_kernel.cu itself, built into the emulation library with the forward
kernels (tests/emulation/, see test_cuda_emulation.py) and launched through the real launcher with the real
plan. Each case runs the forward on the CPU kernel, then the emulated backward, and compares its gradients
with autograd through reference.attention (float64 and the inputs' dtype, the bound of attention_helpers) and,
where the reference's gradient is not finite or the comparison should be exact, with the CPU fused backward.
It cannot show GPU-only behaviour: tests/test_cuda.py does that on a GPU.
"""

import pytest
import torch

import attnx
from attention_helpers import (
    GRAD_ATOL,
    QKV_LAYOUTS,
    assert_grad_bounded,
    make_gqa,
    make_qkv,
    make_sinks,
    seed_of,
    upcast,
)
from attnx import reference
from emulation import emulator

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
WINDOWS = [(-1, 0), (3, 0), (2, 2), (0, -1)]


@pytest.fixture(scope="module")
def emu():
    return emulator.load()


def _grad_out(q, v, seed=7):
    B, H, L, _ = q.shape
    gen = torch.Generator().manual_seed(seed)
    # (B, L, H, Dv) memory order, as a multi-head caller's gradient arrives
    return torch.randn(B, L, H, v.shape[3], generator=gen).to(q.dtype).transpose(1, 2)


def reference_grads(grad_out, q, k, v, grad_attn_mask=False, **kwargs):
    """(dq, dk, dv, dmask) by autograd through reference.attention; dmask None unless asked for."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    kwargs = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if grad_attn_mask:
        mask = mask.detach().requires_grad_()
        kwargs["attn_mask"] = mask
        leaves.append(mask)
    out, _ = reference.attention(*leaves[:3], **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return (*grads[:3], grads[3] if grad_attn_mask else None)


def check(emu, q, k, v, grad_attn_mask=False, **kwargs):
    """The emulated backward's gradients against the reference's (the forward on the CPU kernel); returns
    them."""
    out, lse = attnx.attention(q, k, v, **kwargs)
    grad_out = _grad_out(q, v)
    grads = emu.attention_backward(grad_out, q, k, v, out, lse, grad_attn_mask=grad_attn_mask, **kwargs)
    g64 = reference_grads(upcast(grad_out), upcast(q), upcast(k), upcast(v), grad_attn_mask,
                          **{n: upcast(a) for n, a in kwargs.items()})
    g_same = reference_grads(grad_out, q, k, v, grad_attn_mask, **kwargs)
    for name, g, r64, rs, like in zip(("q", "k", "v", "attn_mask"), grads, g64, g_same,
                                      (q, k, v, kwargs.get("attn_mask")), strict=True):
        if r64 is None:
            assert g is None
            continue
        assert g.dtype == like.dtype and g.shape == like.shape
        # (the mask's gradient sums dS over up to B * H broadcast copies: a wider atol)
        atol = GRAD_ATOL[q.dtype] * (10 if name == "attn_mask" else 1)
        assert_grad_bounded(g, r64, rs, atol, f"grad {name}")
    return grads


def check_against_cpu(emu, q, k, v, grad_attn_mask=False, **kwargs):
    """The emulated backward against the CPU fused backward on the same forward (cases whose reference
    gradients are not finite, and exact comparisons); returns the emulated gradients."""
    out, lse = attnx.attention(q, k, v, **kwargs)
    grad_out = _grad_out(q, v)
    emu_grads = emu.attention_backward(grad_out, q, k, v, out, lse, grad_attn_mask=grad_attn_mask, **kwargs)
    cpu = attnx.attention_backward(grad_out, q, k, v, out, lse, grad_attn_mask=grad_attn_mask, **kwargs)
    atol = 1e-12 if q.dtype == torch.float64 else 1e-5 if q.dtype == torch.float32 else 1e-2
    for name, g, c in zip(("q", "k", "v"), emu_grads[:3], cpu[:3], strict=True):
        torch.testing.assert_close(g, c, atol=atol, rtol=atol, equal_nan=True, msg=f"grad {name}")
    if grad_attn_mask:
        torch.testing.assert_close(emu_grads[3], cpu[3], atol=atol, rtol=atol, msg="grad attn_mask")
    return emu_grads


# ------------------------------------------------------------------------------------------------------------
# Dtypes, layouts, head-dim buckets (and so the three tile sizes), tile boundaries.

@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_layouts(emu, dtype, layout):
    check(emu, *make_qkv(2, 3, 7, 11, 16, 8, dtype=dtype, layout=layout))


@pytest.mark.parametrize(("D", "Dv"), [(8, 8), (40, 24), (64, 64), (100, 72), (130, 200), (256, 256)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_head_dim_buckets(emu, dtype, D, Dv):
    # float32 tiles 32 up to bucket 128 and 16 at 256; float64 32 up to 64, 16 at 128 and 8 at 256.
    check(emu, *make_qkv(1, 2, 20, 19, D, Dv, dtype=dtype))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_many_tiles(emu, dtype, is_causal):
    # Three query tiles and two key tiles of 32, each pair with a partial last one; L > S and L < S.
    check(emu, *make_qkv(1, 2, 70, 45, 8, 8, dtype=dtype), is_causal=is_causal)
    check(emu, *make_qkv(1, 1, 33, 80, 8, 8, dtype=dtype), is_causal=is_causal)


# ------------------------------------------------------------------------------------------------------------
# Masks and attn_mask's gradient in every broadcast pattern.

MASK_SHAPES = {
    "ls": lambda B, H, L, S: (L, S),
    "bhls_3d": lambda B, H, L, S: (B * H, L, S),
    "b1ls": lambda B, H, L, S: (B, 1, L, S),
    "1h1s": lambda B, H, L, S: (1, H, 1, S),
    "bhl1": lambda B, H, L, S: (B, H, L, 1),
    "full": lambda B, H, L, S: (B, H, L, S),
}


@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float_mask_and_its_gradient(emu, dtype, shape):
    B, H, L, S = 2, 3, 40, 37
    gen = torch.Generator().manual_seed(3)
    mask = torch.randn(*MASK_SHAPES[shape](B, H, L, S), generator=gen).to(dtype)
    q, k, v = make_qkv(B, H, L, S, 8, 8, dtype=dtype)
    grads = check(emu, q, k, v, attn_mask=mask, grad_attn_mask=True)
    assert grads[3].abs().sum() > 0
    check(emu, q, k, v, attn_mask=mask, grad_attn_mask=True, is_causal=True)


MASK_DTYPES = [torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_dtypes_with_key_padding(emu, dtype, mask_dtype):
    B, H, L, S = 2, 2, 9, 13
    gen = torch.Generator().manual_seed(4)
    if mask_dtype == torch.bool:
        mask = torch.rand(L, S, generator=gen) < 0.3
        kpm = torch.rand(B, S, generator=gen) < 0.3
        kpm[:, 0] = False  # every row sees a key (the reference's gradient is finite)
        mask[:, 0] = False
    else:
        mask = torch.randn(L, S, generator=gen).to(mask_dtype)
        kpm = torch.randn(B, S, generator=gen)
    q, k, v = make_qkv(B, H, L, S, 16, 16, dtype=dtype, layout="blhd")
    check(emu, q, k, v, attn_mask=mask, key_padding_mask=kpm)


def test_fully_masked_rows_get_zero_gradients(emu):
    # Query 2 sees no key, batch 1 none at all: their dQ is 0 and they add nothing to dK and dV; a masked key
    # gets no gradient. As the CPU kernel, exactly.
    q, k, v = make_qkv(2, 2, 6, 9, 8, 8, dtype=torch.float64)
    mask = torch.zeros(6, 9, dtype=torch.bool)
    mask[2] = True
    mask[:, 4] = True
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1] = True
    dq, dk, dv, _ = check_against_cpu(emu, q, k, v, attn_mask=mask, key_padding_mask=kpm)
    assert (dq[:, :, 2] == 0).all() and (dq[1] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[:, :, 4] == 0).all() and (dv[:, :, 4] == 0).all()


# ------------------------------------------------------------------------------------------------------------
# Grouped KV heads, key ranges, soft-capping, sinks, dropout.

@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 3), (3, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_kv_heads(emu, dtype, heads):
    # dK and dV of a kv head are sums over its group's query heads, formed in one block.
    H, Hkv = heads
    check(emu, *make_gqa(2, H, Hkv, 20, 45, 16, 16, dtype=dtype, layout="blhd"), is_causal=True)


def test_grouped_kv_heads_expanded(emu):
    q, k, v = make_gqa(2, 4, 2, 9, 13, 16, 16, dtype=torch.float64, layout="expanded_kv")
    assert k.stride(1) == 0
    check(emu, q, k, v)


def _key_lengths(values, kind):
    if kind == "int32":
        return torch.tensor(values, dtype=torch.int32)
    return torch.tensor([x for v in values for x in (v, -7)], dtype=torch.int64)[::2]  # strided


@pytest.mark.parametrize("lengths", ["int32", "int64"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_windows_and_key_lengths(emu, window, lengths):
    # Batch 0 sees every key, batch 1 none, batch 2 fewer keys than queries (its first rows see nothing).
    L, S = 40, 45
    q, k, v = make_gqa(3, 2, 2, L, S, 16, 16, dtype=torch.float64, layout="blhd")
    kwargs = {"window_left": window[0], "window_right": window[1],
              "key_lengths": _key_lengths([S, 0, L * 2 // 3], lengths)}
    dq, dk, dv, _ = check_against_cpu(emu, q, k, v, **kwargs)
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[2, :, L * 2 // 3:] == 0).all()  # keys past key_lengths get no gradient


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_windows_against_the_reference(emu, dtype, window):
    q, k, v = make_gqa(2, 2, 1, 40, 45, 16, 16, dtype=dtype, layout="blhd")
    check(emu, q, k, v, window_left=window[0], window_right=window[1], is_causal=window[1] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_and_sinks(emu, dtype):
    q, k, v = make_gqa(2, 4, 2, 20, 25, 16, 16, dtype=dtype)
    check(emu, q, k, v, softcap=2.0, scale=1.5)
    check(emu, q, k, v, sinks=make_sinks(4, dtype))
    check(emu, q, k, v, softcap=3.0, sinks=make_sinks(4, dtype), is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout(emu, dtype):
    # The keep mask is regenerated from the forward's Philox draws: the same as the CPU kernel's and the
    # reference's.
    q, k, v = make_gqa(2, 4, 2, 20, 45, 16, 16, dtype=dtype)
    check(emu, q, k, v, dropout_p=0.3, dropout_seed=seed_of(11, 5))
    check(emu, q, k, v, dropout_p=0.3, dropout_seed=seed_of(11, 5), is_causal=True, softcap=3.0,
          sinks=make_sinks(4, dtype))


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_features_together(emu, dtype, mask):
    # Grouped heads, a window, key lengths, soft-capping, sinks, both masks (attn_mask as
    # nn.MultiheadAttention passes it) on strided inputs, and the mask's gradient; float64 against the CPU
    # kernel too.
    gen = torch.Generator().manual_seed(5)
    B, H, L, S = 2, 4, 20, 45
    q, k, v = make_gqa(B, H, 2, L, S, 24, 16, dtype=dtype, layout="lbhd")
    if mask == "bool":
        attn_mask = torch.rand(B * H, L, S, generator=gen) < 0.2
        kpm = torch.rand(B, S, generator=gen) < 0.2
        attn_mask[..., 40], kpm[:, 40] = False, False  # a key every row sees (inside the window)
    else:
        attn_mask = torch.randn(B * H, L, S, generator=gen).to(dtype)
        kpm = torch.randn(B, S, generator=gen)
    kwargs = {"attn_mask": attn_mask, "key_padding_mask": kpm, "window_left": 30, "window_right": 2,
              "key_lengths": _key_lengths([S, S - 3], "int64"), "softcap": 4.0,
              "sinks": make_sinks(H, dtype), "scale": 0.4}
    check(emu, q, k, v, grad_attn_mask=mask == "float", **kwargs)
    if dtype == torch.float64:
        check_against_cpu(emu, q, k, v, grad_attn_mask=mask == "float", is_causal=True, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Determinism, NaN, empty sizes, what the launcher refuses.

def test_deterministic(emu):
    # No atomics: two runs are equal bit for bit, the mask's gradient (summed over B and H) included.
    q, k, v = make_gqa(2, 4, 2, 40, 37, 16, 16, dtype=torch.float32)
    mask = torch.randn(40, 37)
    out, lse = attnx.attention(q, k, v, attn_mask=mask)
    grad_out = _grad_out(q, v)
    first = emu.attention_backward(grad_out, q, k, v, out, lse, attn_mask=mask, grad_attn_mask=True)
    second = emu.attention_backward(grad_out, q, k, v, out, lse, attn_mask=mask, grad_attn_mask=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_nan_stays_in_its_row(emu):
    q, k, v = make_qkv(1, 1, 5, 7, 8, 8, dtype=torch.float64)
    q[0, 0, 3, 0] = float("nan")
    out, lse = attnx.attention(q, k, v)
    dq, dk, dv, _ = emu.attention_backward(_grad_out(q, v), q, k, v, out, lse)
    assert torch.isnan(dq[0, 0, 3]).all()
    assert torch.isfinite(dq[0, 0, :3]).all() and torch.isfinite(dq[0, 0, 4:]).all()
    assert torch.isnan(dk).any()  # query 3's NaN scores reach every key


@pytest.mark.parametrize("sizes", [(0, 2, 3, 4), (2, 0, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0)], ids=str)
def test_empty_sizes(emu, sizes):
    B, H, L, S = sizes
    q, k, v = make_qkv(B, H, L, S, 8, 8)
    out, lse = attnx.attention(q, k, v)
    dq, dk, dv, _ = emu.attention_backward(_grad_out(q, v), q, k, v, out, lse)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()  # every element written


def test_refuses_what_it_does_not_cover(emu):
    q, k, v = make_qkv(1, 2, 3, 5, 264, 8)
    out, lse = attnx.attention(q, k, v)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        emu.attention_backward(_grad_out(q, v), q, k, v, out, lse)

