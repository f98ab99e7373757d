"""Shared helpers of the attention tests: query/key/value inputs in the layouts attnx.attention reads without
copying, the mask factories, and the bounded comparisons with reference.attention, forward and gradients.

Used by test_attention.py, test_attention_backward.py, test_attention_features.py, test_attention_math.py,
test_dropout.py, test_large.py and the backend tiers (test_cuda.py, test_cuda_emulation.py,
test_metal_emulation.py, test_mps.py), and by the scripts their subprocess tests run.

The accuracy bound (flash-attention style), forward and gradients alike: with ref64 the reference on float64
copies of the same inputs and ref_same the reference in the inputs' own dtype,

    max |kernel - ref64| <= K_BOUND * max |ref_same - ref64| + atol[dtype]

(test_attention.py and test_attention_backward.py say what the atols below cover).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attnx
from attnx import reference

TESTS = os.path.dirname(os.path.abspath(__file__))

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
K_BOUND = 4
ATOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-3, torch.float16: 2e-3}  # out
LSE_ATOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-5, torch.float16: 1e-5}
GRAD_ATOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 4e-3, torch.float16: 2e-3}


# ------------------------------------------------------------------------------------------------------------
# Inputs: (B, H, N, E) tensors in every layout the op must take without copying.

QKV_LAYOUTS = ["contiguous", "blhd", "lbhd", "packed", "expanded_kv", "strided_last"]

# Sizes (B, H, L, S, D, Dv) with one of them 0.
EMPTY_SIZES = [(0, 2, 3, 4, 8, 8), (2, 0, 3, 4, 8, 8), (2, 2, 0, 4, 8, 8), (2, 2, 3, 0, 8, 8),
               (2, 2, 3, 4, 0, 8), (2, 2, 3, 4, 8, 0)]


def make_in_layout(shape, layout, dtype, gen, *, which):
    """A (B, H, N, E) tensor of N(0, 1) values in `layout` (one of QKV_LAYOUTS) for query, key or value
    (`which`: "q", "k" or "v"); values are drawn in float32 from `gen`, then cast."""
    B, H, N, E = shape

    def randn(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    if layout == "contiguous":
        return randn(B, H, N, E)
    if layout == "blhd":  # nn.MultiheadAttention(batch_first=True) after its in-projection
        return randn(B, N, H, E).transpose(1, 2)
    if layout == "lbhd":  # sequence-first; at B == 1 the batch stride is left arbitrary
        return randn(N, B, H, E).permute(1, 2, 0, 3)
    if layout == "packed":  # one slice of a packed (B, N, 3, H, E) in-projection output: storage offset
        slot = {"q": 0, "k": 1, "v": 2}[which]
        return randn(B, N, 3, H, E)[:, :, slot].transpose(1, 2)
    if layout == "expanded_kv":  # keys and values shared by all heads through stride 0 (GQA-like)
        return randn(B, H, N, E) if which == "q" else randn(B, 1, N, E).expand(B, H, N, E)
    if layout == "strided_last":  # last-dim stride 2
        return randn(B, H, N, 2 * E)[..., ::2]
    raise ValueError(layout)


def make_qkv(B, H, L, S, D, Dv, dtype=torch.float32, layout="contiguous", seed=0):
    """query (B, H, L, D), key (B, H, S, D) and value (B, H, S, Dv) in `layout`, from one generator."""
    gen = torch.Generator().manual_seed(seed)
    q = make_in_layout((B, H, L, D), layout, dtype, gen, which="q")
    k = make_in_layout((B, H, S, D), layout, dtype, gen, which="k")
    v = make_in_layout((B, H, S, Dv), layout, dtype, gen, which="v")
    return q, k, v


def make_gqa(B, H, Hkv, L, S, D, Dv, dtype=torch.float32, layout="contiguous"):
    """query (B, H, L, D) of make_qkv's seed 0 and key, value (B, Hkv, S, D|Dv) of its seed 1, all in `layout`
    (with "expanded_kv" the Hkv kv heads are one head expanded through stride 0)."""
    q = make_qkv(B, H, L, S, D, Dv, dtype=dtype, layout=layout)[0]
    _, k, v = make_qkv(B, Hkv, L, S, D, Dv, dtype=dtype, layout=layout, seed=1)
    return q, k, v


def make_sinks(H, dtype, device="cpu"):
    """(H,) sink logits around the scores' range, -1 .. 2: float64 for float64 inputs, float32 otherwise."""
    return torch.linspace(-1.0, 2.0, H, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                          device=device)


def every_feature(B, H, S):
    """attnx.attention's key-range options and extras all at once, for B batches (up to 2), H query heads and
    S keys: a window around the diagonal, key lengths (S, then S // 2; int32), soft-capping and sinks."""
    return {"window_left": 20, "window_right": 3,
            "key_lengths": torch.tensor([S, S // 2][:B], dtype=torch.int32), "softcap": 5.0,
            "sinks": torch.linspace(-1.0, 2.0, H)}


def seed_of(seed, offset=0):
    """A dropout_seed argument: the CPU int64 tensor (seed, offset)."""
    return torch.tensor([seed, offset], dtype=torch.int64)


# Gradients are compared on leaves; `views(leaves, layout)` are the (B, H, N, E) query, key and value read.


def make_leaves(B, H, L, S, D, Dv, dtype=torch.float32, layout="contiguous", seed=0):
    """Leaf tensors for layout; `views(leaves)` turns them into the (B, H, N, E) query, key and value."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    if layout == "contiguous":
        return [randn(B, H, L, D), randn(B, H, S, D), randn(B, H, S, Dv)]
    if layout == "blhd":  # nn.MultiheadAttention(batch_first=True) after its in-projection
        return [randn(B, L, H, D), randn(B, S, H, D), randn(B, S, H, Dv)]
    if layout == "lbhd":  # sequence-first; at B == 1 the batch stride is the transposed B=1 layout's
        return [randn(L, B, H, D), randn(S, B, H, D), randn(S, B, H, Dv)]
    if layout == "sliced":  # a window of a larger buffer: storage offset, row stride > row
        return [randn(B, H, L + 3, D + 5), randn(B, H, S + 2, D + 1), randn(B, H, S + 1, Dv + 7)]
    if layout == "expanded_kv":  # keys and values shared by all heads through stride 0
        return [randn(B, H, L, D), randn(B, 1, S, D), randn(B, 1, S, Dv)]
    if layout == "strided_last":  # last-dim stride 2
        return [randn(B, H, L, 2 * D), randn(B, H, S, 2 * D), randn(B, H, S, 2 * Dv)]
    raise ValueError(layout)


def views(leaves, layout):
    q, k, v = leaves
    if layout == "contiguous":
        return q, k, v
    if layout == "blhd":
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if layout == "lbhd":
        return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    if layout == "sliced":
        L, D = q.shape[2] - 3, q.shape[3] - 5
        S, Dv = k.shape[2] - 2, v.shape[3] - 7
        return q[:, :, 2 : 2 + L, 1 : 1 + D], k[:, :, 1 : 1 + S, :D], v[:, :, :S, 3 : 3 + Dv]
    if layout == "expanded_kv":
        B, H = q.shape[:2]
        return q, k.expand(B, H, *k.shape[2:]), v.expand(B, H, *v.shape[2:])
    if layout == "strided_last":
        return q[..., ::2], k[..., ::2], v[..., ::2]
    raise ValueError(layout)


# ------------------------------------------------------------------------------------------------------------
# Masks, for the (B, H, L, S) of MASKED_SHAPE; some are non-contiguous or broadcast views.

MASKED_SHAPE = (2, 3, 19, 41)
ATTN_MASK_KINDS = [
    "bool_ls", "float_ls", "float64_ls", "bf16_ls", "neginf_ls", "bool_bhls", "float_bhls", "bool_b1ls",
    "float_1h1s", "float_bh1s", "bool_4d_full", "float_ls_transposed", "bool_ls_sliced", "float_ls_expanded",
    "float_bhls_sliced",
]
KEY_PADDING_MASK_KINDS = ["bool", "float", "float_neginf", "bool_transposed", "float16_expanded"]


def make_attn_mask(kind, gen):
    """An attn_mask of ATTN_MASK_KINDS `kind` for (B, H, L, S) = MASKED_SHAPE."""
    B, H, L, S = MASKED_SHAPE

    def rand(*size):
        return torch.rand(*size, generator=gen)

    def randn(*size):
        return torch.randn(*size, generator=gen)

    masks = {
        "bool_ls": lambda: rand(L, S) < 0.3,
        "float_ls": lambda: randn(L, S),
        "float64_ls": lambda: randn(L, S).double(),
        "bf16_ls": lambda: randn(L, S).bfloat16(),
        "neginf_ls": lambda: randn(L, S).masked_fill(rand(L, S) < 0.3, float("-inf")),
        "bool_bhls": lambda: rand(B * H, L, S) < 0.3,
        "float_bhls": lambda: randn(B * H, L, S),
        "bool_b1ls": lambda: rand(B, 1, L, S) < 0.3,
        "float_1h1s": lambda: randn(1, H, 1, S),
        "float_bh1s": lambda: randn(B, H, 1, S),
        "bool_4d_full": lambda: rand(B, H, L, S) < 0.3,
        "float_ls_transposed": lambda: randn(S, L).t(),  # key stride != 1
        "bool_ls_sliced": lambda: (rand(L, 2 * S) < 0.3)[:, ::2],
        "float_ls_expanded": lambda: randn(1, S).expand(L, S),  # stride 0 over queries
        "float_bhls_sliced": lambda: randn(B * H, L + 5, S)[:, 5:],  # storage offset
    }
    return masks[kind]()


def make_key_padding_mask(kind, gen):
    """A key_padding_mask of KEY_PADDING_MASK_KINDS `kind` for (B, S) of MASKED_SHAPE."""
    B, _, _, S = MASKED_SHAPE
    if kind == "bool":
        return torch.rand(B, S, generator=gen) < 0.3
    if kind == "float":
        return torch.randn(B, S, generator=gen)
    if kind == "float_neginf":
        return torch.zeros(B, S).masked_fill(torch.rand(B, S, generator=gen) < 0.3, float("-inf"))
    if kind == "bool_transposed":
        return (torch.rand(S, B, generator=gen) < 0.3).t()
    if kind == "float16_expanded":
        return torch.randn(B, 1, generator=gen).half().expand(B, S)
    raise ValueError(kind)


def make_feature_masks(kind, B, H, L, S, dtype, gen):
    """(attn_mask of nn.MultiheadAttention's (B*H, L, S) form, key_padding_mask (B, S)), about 1 in 5
    masked: both bool for `kind` "bool"; for "float", random biases in `dtype` and a float32 padding mask
    with -inf."""
    if kind == "bool":
        attn_mask = torch.rand(B * H, L, S, generator=gen) < 0.2
        kpm = torch.rand(B, S, generator=gen) < 0.2
    else:
        attn_mask = torch.randn(B * H, L, S, generator=gen).to(dtype)
        kpm = torch.randn(B, S, generator=gen).masked_fill(torch.rand(B, S, generator=gen) < 0.2, -torch.inf)
    return attn_mask, kpm


# ------------------------------------------------------------------------------------------------------------
# Cases that every implementation runs (the CPU kernel, the emulated CUDA and Metal kernels, a GPU): inputs
# and keyword arguments, and what they must give.


def fully_masked_rows_case(L=6, dtype=torch.float32):
    """(q, k, v) of (B, H, L, S) = (2, 2, L, 9) and masks under which query 2 sees no key and batch 1 none
    at all."""
    q, k, v = make_qkv(2, 2, L, 9, 8, 8, dtype=dtype)
    mask = torch.zeros(L, 9, dtype=torch.bool)
    mask[2] = True  # query 2 sees no key
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1] = True  # batch 1 sees no key at all
    return (q, k, v), {"attn_mask": mask, "key_padding_mask": kpm}


def assert_fully_masked_rows(out, lse):
    """fully_masked_rows_case's rows that see no key have out 0 and lse +inf."""
    assert (out[:, :, 2] == 0).all() and torch.isposinf(lse[:, :, 2]).all()
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


def nan_rows_case(L=5):
    """(q, k, v) of (B, H, L, S) = (1, 2, L, 6) and an attn_mask that put NaN in two kinds of rows: every
    score of row (h=1, l=2), through the query, and one score of row l=4 of every head, through the mask."""
    q, k, v = make_qkv(1, 2, L, 6, 4, 4)
    q[0, 1, 2, 0] = float("nan")
    mask = torch.zeros(L, 6)
    mask[4, 3] = float("nan")
    return (q, k, v), {"attn_mask": mask}


def assert_nan_rows(out, lse):
    """NaN propagates to out and lse in nan_rows_case's two NaN rows, and to no other row of head 0."""
    assert out[0, 1, 2].isnan().all() and lse[0, 1, 2].isnan()
    assert out[0, :, 4].isnan().all() and lse[0, :, 4].isnan().all()
    assert not out[0, 0, :4].isnan().any()


def tile_classes_mask():
    """(L, S) = (70, 200) bool mask (True: removed) whose tiles of 16 query rows x 64 keys (the tensor-core
    kernel's classes) are of every class: FULL (nothing removed), EMPTY (all removed) and PARTIAL, for some
    warps of a block only, for a whole block (rows 64-69: keys 0-127, skipped), and in the last, partial key
    tile."""
    removed = torch.zeros(70, 200, dtype=torch.bool)
    removed[0:16, 64:128] = True  # FULL, EMPTY, PARTIAL (key 150 below)
    removed[5, 150] = True
    removed[16:32, 0:64] = True  # EMPTY, FULL, FULL
    removed[32:48, 64:] = True  # PARTIAL (key 10), EMPTY, EMPTY
    removed[40, 10] = True
    removed[48:64] = True  # rows that see no key
    removed[64:, :128] = True  # EMPTY for the whole second block; FULL, then PARTIAL in the last tile
    removed[66, 195] = True
    return removed


def tile_classes_case(case):
    """Options of the tile-class tests (test_attention.py, test_attention_backward.py) for (B, H, L, S) = (2,
    2, 70, 200)."""
    removed = tile_classes_mask()
    additive = torch.zeros(70, 200).masked_fill(removed, float("-inf"))
    # Finite nonzero terms: a PARTIAL float tile for them alone (a FULL one as a bool mask), tiles with no 0
    # at all, for one warp's rows and for a whole block's, and terms next to -inf.
    additive[20, 100] = 0.75
    additive[16:32, 128:] = -0.5
    additive[64:, 128:192] = -0.25
    additive[3, 130:140] = 0.75
    other = torch.zeros(70, 200, dtype=torch.bool)
    other[:, 64:128] = True  # EMPTY for every row
    kpm = torch.zeros(2, 200, dtype=torch.bool)
    kpm[1, 130:] = True
    if case == "bool":
        return {"attn_mask": removed}
    if case == "float":
        return {"attn_mask": additive}
    if case == "per_batch":  # (B, H, L, S) with stride 0 over H: a slice per batch
        return {"attn_mask": torch.stack([removed, other]).unsqueeze(1).expand(2, 2, 70, 200)}
    if case == "per_head":  # every (b, h) a slice of its own
        slices = [additive, additive.flip(1), additive.flip(0), additive.roll(64, 1)]
        return {"attn_mask": torch.stack(slices).view(2, 2, 70, 200)}
    if case == "strided":  # a bool mask whose keys are not contiguous (packed through its strides)
        return {"attn_mask": removed.t().contiguous().t(), "key_padding_mask": kpm}
    if case == "broadcast_rows":  # (B, 1, 1, S): classified on one row, the same for every query tile
        rows = torch.zeros(2, 1, 1, 200, dtype=torch.bool)
        rows[0, ..., 150:] = True
        rows[1, ..., :64] = True
        return {"attn_mask": rows}
    if case == "window":  # tiles that start past key 0 and not on a multiple of 64 (shifted class bits)
        return {"attn_mask": removed, "window_left": 20, "window_right": 40}
    if case == "padding_causal":
        return {"attn_mask": additive, "key_padding_mask": kpm, "is_causal": True}
    if case == "softcap_sinks":
        return {"attn_mask": removed, "softcap": 3.0, "sinks": make_sinks(2, torch.float32)}
    raise ValueError(case)


def key_tile_skipping_cases():
    """(q, k, v) of (B, H, L, S) = (2, 2, 20, 70) and two sets of masks for kernels with 32-key tiles: in
    batch 0, key_padding_mask removes the whole first tile (which the kernel skips) and part of the third; in
    batch 1, the whole last, partial tile; attn_mask removes a whole tile for some rows only (not skipped),
    as a bool mask, then as a float one with -inf under is_causal."""
    q, k, v = make_qkv(2, 2, 20, 70, 16, 16)
    kpm = torch.zeros(2, 70, dtype=torch.bool)
    kpm[0, :32] = True
    kpm[0, 66:] = True
    kpm[1, 64:] = True
    mask = torch.zeros(20, 70, dtype=torch.bool)
    mask[:10, 32:64] = True
    additive = torch.zeros(20, 70).masked_fill(mask, float("-inf"))
    return (q, k, v), [{"attn_mask": mask, "key_padding_mask": kpm},
                       {"attn_mask": additive, "key_padding_mask": kpm, "is_causal": True}]


# ------------------------------------------------------------------------------------------------------------
# The comparisons.


def upcast(x):
    """x in float64 if it is a floating tensor; anything else as it is."""
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def assert_bounded(actual, ref64, ref_same, atol, what):
    """The forward bound; infinite and NaN entries must match exactly, position by position."""
    actual, ref64, ref_same = actual.double(), ref64.double(), ref_same.double()
    assert actual.shape == ref64.shape
    for pred, name in ((torch.isnan, "NaN"), (torch.isposinf, "+inf"), (torch.isneginf, "-inf")):
        mismatch = pred(actual) != pred(ref64)
        assert not mismatch.any(), f"{what}: {name} at different positions ({int(mismatch.sum())} entries)"
    finite = torch.isfinite(ref64)
    if not finite.any():
        return
    err = (actual - ref64)[finite].abs().max().item()
    ref_err = (ref_same - ref64)[finite].abs().max().item()
    bound = K_BOUND * ref_err + atol
    assert err <= bound, f"{what}: max error {err:.3e} > {K_BOUND} * {ref_err:.3e} + {atol:.0e}"


def assert_matches_reference(out, lse, q, k, v, **kwargs):
    """(out, lse) of some implementation of attention(q, k, v, **kwargs) against the reference, in float64
    and in the inputs' dtype (the bound above); returns (out, lse)."""
    ref64_out, ref64_lse = reference.attention(
        upcast(q), upcast(k), upcast(v), **{n: upcast(a) for n, a in kwargs.items()}
    )
    ref_out, ref_lse = reference.attention(q, k, v, **kwargs)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert_bounded(out, ref64_out, ref_out, ATOL[q.dtype], "out")
    assert_bounded(lse, ref64_lse, ref_lse, LSE_ATOL[q.dtype], "lse")
    return out, lse


def check_forward(q, k, v, **kwargs):
    """Runs attnx.attention and compares out and lse with the reference; returns (out, lse)."""
    return assert_matches_reference(*attnx.attention(q, k, v, **kwargs), q, k, v, **kwargs)


def assert_grad_bounded(actual, ref64, ref_same, atol, what):
    """The bound for a gradient, which must be finite wherever the reference's is."""
    actual, ref64, ref_same = actual.double(), ref64.double(), ref_same.double()
    assert actual.shape == ref64.shape
    assert torch.isfinite(ref64).all(), f"{what}: the reference gradient is not finite"
    assert torch.isfinite(actual).all(), f"{what}: {int((~torch.isfinite(actual)).sum())} non-finite entries"
    if actual.numel() == 0:
        return
    err = (actual - ref64).abs().max().item()
    ref_err = (ref_same - ref64).abs().max().item()
    bound = K_BOUND * ref_err + atol
    assert err <= bound, f"{what}: max error {err:.3e} > {K_BOUND} * {ref_err:.3e} + {atol:.0e}"


def _grads(fn, leaves, layout, grad_out, kwargs):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out, _ = fn(*views(leaves, layout), **kwargs)
    return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def check_backward(leaves, layout="contiguous", grad_out=None, **kwargs):
    """Gradients of attnx.attention w.r.t. the leaves (of make_leaves) against the reference's; returns
    them."""
    dtype = leaves[0].dtype
    if grad_out is None:
        q, _, v = views(leaves, layout)
        B, H, L, _ = q.shape
        grad_out = torch.randn(B, H, L, v.shape[3], generator=torch.Generator().manual_seed(7)).to(dtype)
    _, grads = _grads(attnx.attention, leaves, layout, grad_out, kwargs)
    _, g64 = _grads(reference.attention, [upcast(t) for t in leaves], layout, upcast(grad_out),
                    {n: upcast(a) for n, a in kwargs.items()})
    _, g_same = _grads(reference.attention, leaves, layout, grad_out, kwargs)
    for name, g, r64, rs, leaf in zip("qkv", grads, g64, g_same, leaves, strict=True):
        assert g.dtype == dtype and g.shape == leaf.shape
        assert_grad_bounded(g, r64, rs, GRAD_ATOL[dtype], f"grad {name}")
    return grads


def assert_unseen_rows_empty(out, lse, S, **kwargs):
    """Rows that see no key by the key range alone (reference.key_range_mask of attention's keyword
    arguments `kwargs`, over S keys) have out 0 and lse +inf; returns how many rows that is."""
    B, H, L, _ = out.shape
    seen = reference.key_range_mask(B, L, S, kwargs.get("is_causal", False), kwargs.get("window_left", -1),
                                    kwargs.get("window_right", -1), kwargs.get("key_lengths"))
    empty = ~seen.any(dim=-1).expand(B, H, L)
    assert (out.cpu()[empty] == 0).all() and torch.isposinf(lse.cpu()[empty]).all()
    return int(empty.sum())


def attention_opcheck_cases():
    """attnx::attention's arguments (q, k, v, attn_mask, key_padding_mask, is_causal, scale) for opcheck:
    masks, causal, a custom scale, float64 and bfloat16."""
    q, k, v = make_qkv(2, 2, 5, 7, 8, 4, layout="blhd")
    gen = torch.Generator().manual_seed(5)
    kpm = torch.rand(2, 7, generator=gen) < 0.3
    mask = torch.randn(5, 7, generator=gen)
    return [
        (q, k, v, None, None, False, None),
        (q, k, v, mask, kpm, True, 0.5),
        (q.double(), k.double(), v.double(), (torch.rand(4, 5, 7, generator=gen) < 0.2), None, False, None),
        (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, kpm.float(), False, None),
    ]


# ------------------------------------------------------------------------------------------------------------
# Devices: the kernel a call takes on the device under test (conftest.py's ``device``), asked of its backend.


def kernel_or_skip(device, q, k, v, backward=False, **kwargs):
    """The kernel attnx.attention (``backward``: its backward) runs for this call on ``device``, as its
    backend names it (attnx::_attention_kernel). The test is skipped, saying why, where the backend refuses
    the call (a backward needs its forward: Metal's whole-tensor backward takes float64, its forward does
    not), and where another emulated device runs the same kernel: ``cuda-emu`` (sm_90) leaves the SIMT
    kernels (forward and backward) to ``cuda-emu-sm75``, which runs them for every call, and
    ``cuda-emu-sm75`` leaves the composite and the whole-tensor backward, which do not depend on the device,
    to ``cuda-emu``."""
    try:
        forward = torch.ops.attnx._attention_kernel(q, k, v, **kwargs)
        kernel = torch.ops.attnx._attention_kernel(q, k, v, backward=True, **kwargs) if backward else forward
    except RuntimeError as e:
        pytest.skip(f"{device.backend} does not take this call: {str(e).splitlines()[0]}")
    if device.backend == "cuda-emu" and kernel.startswith(("cuda simt", "cuda fused simt")):
        pytest.skip(f"{kernel}: cuda-emu-sm75 runs it")
    if device.backend == "cuda-emu-sm75" and kernel in ("cuda composite", "math"):
        pytest.skip(f"{kernel}: cuda-emu runs the same")
    return kernel


# ------------------------------------------------------------------------------------------------------------
# Fresh processes: for what one process fixes once (the CPU kernels' ISA, peak memory).


def run_python(script, **kwargs):
    """Runs `script` in a fresh interpreter (with subprocess.run's `env`, `cwd`, ...); asserts that it exits
    with 0 and returns what it printed."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stderr
    return result.stdout


# The CPU kernels' variants that a process can be asked for (ATTNX_CPU_CAPABILITY), by the name
# torch.ops.attnx._cpu_capability gives them. The widest the CPU has (AMX-BF16, or AVX512-BF16) is the
# process's own, which every other test runs.
CPU_VARIANTS = ["default", "avx2", "avx512", "avx512_bf16", "emulated_bf16", "emulated_amx"]


def run_under_cpu_capability(script, variant):
    """Runs `script` in a fresh interpreter whose CPU kernels are `variant`'s (ATTNX_CPU_CAPABILITY), with
    torch imported and tests/ on its path; skips the variant this process runs (every other test runs it) and
    a native one the CPU lacks."""
    own = torch.ops.attnx._cpu_capability()
    if variant == own:
        pytest.skip(f"{variant} is this process's own variant, which every other test runs")
    level = torch.backends.cpu.get_cpu_capability()
    if variant == "avx2" and level not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    if variant == "avx512" and (level != "AVX512" or own not in ("avx512", "avx512_bf16", "amx_bf16")):
        pytest.skip("this CPU (or this build) has no AVX-512 variant")
    has_bf16 = False
    if sys.platform.startswith("linux"):
        with open("/proc/cpuinfo") as f:
            has_bf16 = "avx512_bf16" in f.read()
    if variant == "avx512_bf16" and (level != "AVX512" or not has_bf16 or own not in ("avx512", "amx_bf16")):
        pytest.skip("this CPU (or this build) has no AVX512-BF16 variant")
    preamble = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {TESTS!r})
        import attnx
        assert torch.ops.attnx._cpu_capability() == {variant!r}, torch.ops.attnx._cpu_capability()
        """
    )
    run_python(preamble + textwrap.dedent(script), env=dict(os.environ, ATTNX_CPU_CAPABILITY=variant))
