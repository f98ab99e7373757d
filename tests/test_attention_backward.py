"""The gradients of attnx.attention (attnx::attention_backward) on every device, against autograd through
reference.attention.

Accuracy bound (flash-attention style), per gradient: with g64 autograd through the reference on float64
copies of the same inputs and g_same autograd through the reference in the inputs' own dtype,

    max |g - g64| <= K * max |g_same - g64| + atol[dtype]

float64 has g_same = g64, so its bound is atol alone: tight. atol covers what the relative bound cannot:
float32 recomputes the probabilities with an exp accurate to ~20 ulp where the reference's is ~1 ulp;
bfloat16/float16 round the saved out, which enters delta = rowsum(dO * O), where the reference differentiates
its unrounded output. A learned attn_mask's and the sinks' gradients sum dS over up to B * H broadcast copies
(over every key for the sinks): 4 * atol. Expanded (stride-0) inputs are compared through the gradient of
their un-expanded base. The reference runs on the CPU whatever the device.

A feature test takes conftest's ``device`` and runs on each backend's backward: the CPU's fused kernel, CUDA's
fused kernels (the emulated sm_90 device runs them; a GPU runs them under ATTNX_CUDA_FUSED_BACKWARD=1, which
test_fused_backward_on_a_gpu sets for this file's GPU tests) and the whole-tensor math (MPS, the Metal
emulation, CUDA above head dim 256 or without that variable). The tests without ``device`` are about the CPU
kernel itself: its thread plans and 128-wide tiles, its ISA variants, its memory, what runs in Python.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import attnx
import mha_helpers
from attention_helpers import (
    ATTN_MASK_KINDS,
    CPU_VARIANTS,
    DTYPES,
    EMPTY_SIZES,
    GRAD_ATOL,
    KEY_PADDING_MASK_KINDS,
    assert_grad_bounded,
    check_backward,
    fully_masked_rows_case,
    kernel_or_skip,
    key_tile_skipping_cases,
    make_attn_mask,
    make_feature_masks,
    make_gqa,
    make_key_padding_mask,
    make_leaves,
    make_qkv,
    make_sinks,
    run_python,
    run_under_cpu_capability,
    seed_of,
    tile_classes_case,
    tile_classes_mask,
    upcast,
    views,
)
from attnx import reference
from conftest import DEVICES
from layouts import to_device

pytestmark = pytest.mark.kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------------------------
# The comparison on a device.


def on(device, kwargs):
    """attention's keyword arguments on ``device`` (with their layouts); dropout_seed stays a CPU tensor."""
    return {n: a if n == "dropout_seed" else to_device(a, device) for n, a in kwargs.items()}


def grad_out_for(q, v, seed=7):
    """A (B, H, L, Dv) gradient in (B, L, H, Dv) memory order, as a multi-head caller's arrives."""
    B, H, L, _ = q.shape
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, H, v.shape[3], generator=gen).to(q.dtype).transpose(1, 2)


def _grads(fn, leaves, layout, grad_out, kwargs, learn):
    leaves = [t.detach().requires_grad_() for t in leaves]
    kwargs = {n: a.detach().requires_grad_() if n in learn else a for n, a in kwargs.items()}
    out, _ = fn(*views(leaves, layout), **kwargs)
    return torch.autograd.grad(out, [*leaves, *(kwargs[n] for n in learn)], grad_out.to(out.dtype))


def check_grads(device, leaves, layout="contiguous", grad_out=None, learn=(), **kwargs):
    """Gradients of attnx.attention on ``device`` w.r.t. ``leaves`` (CPU tensors: make_leaves's, or query,
    key and value themselves with layout "contiguous", moved with their layout) and the options named in
    ``learn`` ("attn_mask", "sinks"), against autograd through the reference on the CPU. Skips where the
    device takes no such call; returns (the backward's kernel, the gradients on the CPU)."""
    dtype = leaves[0].dtype
    kernel = kernel_or_skip(device, *views(to_device(leaves, device), layout), backward=True,
                            **on(device, kwargs))
    if grad_out is None:
        q, _, v = views(leaves, layout)
        grad_out = grad_out_for(q, v)
    got = _grads(attnx.attention, to_device(leaves, device), layout, to_device(grad_out, device),
                 on(device, kwargs), learn)
    g64 = _grads(reference.attention, [upcast(t) for t in leaves], layout, upcast(grad_out),
                 {n: upcast(a) for n, a in kwargs.items()}, learn)
    g_same = _grads(reference.attention, leaves, layout, grad_out, kwargs, learn)
    names = [*"qkv", *learn]
    likes = [*leaves, *(kwargs[n] for n in learn)]
    for name, g, r64, rs, like in zip(names, got, g64, g_same, likes, strict=True):
        assert (g.dtype, g.shape, g.device.type) == (like.dtype, like.shape, torch.device(device).type), name
        atol = GRAD_ATOL[dtype] * (4 if name in learn else 1)
        assert_grad_bounded(g.cpu(), r64, rs, atol, f"{kernel}: grad {name}")
    return kernel, [g.cpu() for g in got]


# ------------------------------------------------------------------------------------------------------------
# Dtypes, layouts, shapes, head-dim buckets, tile boundaries.

LAYOUTS = ["contiguous", "blhd", "lbhd", "sliced", "expanded_kv", "strided_last", "packed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_layouts(device, dtype, layout):
    if layout == "packed":  # slices of packed (B, N, 3, H, E) in-projection outputs: storage offsets
        check_grads(device, make_qkv(2, 3, 19, 23, 16, 8, dtype=dtype, layout="packed"))
        return
    check_grads(device, make_leaves(2, 3, 19, 23, 16, 8, dtype=dtype, layout=layout), layout)


# (B, H, L, S, D, Dv)
SHAPES = [
    (2, 3, 37, 53, 24, 24),  # odd sizes, L != S
    (1, 2, 16, 16, 32, 8),  # Dv < D
    (2, 1, 9, 70, 8, 40),  # Dv > D, L < S
    (1, 1, 1, 1, 4, 4),  # single query and key
    (3, 2, 1, 33, 16, 16),  # one query
    (1, 1, 45, 1, 16, 16),  # one key
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(device, shape, dtype):
    check_grads(device, make_leaves(*shape, dtype=dtype, layout="blhd"), "blhd")


@pytest.mark.parametrize(("D", "Dv"), [(8, 8), (40, 24), (64, 64), (100, 72), (130, 200), (256, 256)],
                         ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_buckets(device, dtype, D, Dv):
    # Each bucket is its own instantiation of the kernels, with its own tile sizes (CUDA's fused backward:
    # 32 query rows and keys, 16 or 8 at the largest head dims and widest dtypes).
    check_grads(device, make_qkv(1, 2, 20, 19, D, Dv, dtype=dtype, layout="blhd"))


@pytest.mark.parametrize(("D", "is_causal"), [(8, False), (8, True), (200, True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_tile_boundaries(device, dtype, D, is_causal):
    # Several query and key tiles (32, or 16 and 8 at D = 200), each with a partial last one; L > S and L < S.
    check_grads(device, make_qkv(1, 2, 70, 45, D, 8, dtype=dtype), is_causal=is_causal)
    check_grads(device, make_qkv(1, 1, 33, 80, D, D, dtype=dtype), is_causal=is_causal)


# The CPU kernel tiles 128 queries by 128 keys; a head's keys are split into chunks when B*H is small next to
# the thread count, whose dQ contributions are summed in a second pass. These shapes cross the tile boundaries
# with partial tiles, and run with one thread and with all of them, so that both plans (one chunk per head,
# several) are exercised. CPU only: the shapes the CPU's tiles need are too big for the emulated kernels.
BIG_SHAPES = [
    (1, 1, 300, 270, 32, 32),  # one head: chunked keys
    (2, 3, 130, 390, 16, 24),  # six heads
]


@pytest.mark.parametrize("threads", ["one", "all"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BIG_SHAPES, ids=str)
def test_cpu_tile_boundaries_and_plans(shape, dtype, is_causal, threads, intra_op_threads):
    if threads == "one":
        intra_op_threads(1)
    check_backward(make_leaves(*shape, dtype=dtype, layout="blhd"), "blhd", is_causal=is_causal)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_custom_scale(device, dtype):
    leaves = make_leaves(1, 2, 20, 30, 16, 12, dtype=dtype)
    check_grads(device, leaves, scale=0.37)
    _, (dq, dk, _) = check_grads(device, leaves, scale=0.0)  # uniform probabilities: dq = dk = 0
    assert (dq == 0).all() and (dk == 0).all()
    check_grads(device, leaves, scale=3.0, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_b1_transposed_layout(device, dtype):
    leaves = make_leaves(1, 4, 12, 12, 8, 8, dtype=dtype, layout="lbhd")
    q = views(leaves, "lbhd")[0]
    assert q.stride(0) == 4 * 8  # the size-1 batch dim carries a stride that is not the contiguous one
    check_grads(device, leaves, "lbhd")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_expanded_grad_out(device, dtype):
    # out.sum().backward() hands the backward a grad_out of stride 0 everywhere.
    leaves = make_leaves(2, 2, 20, 30, 16, 16, dtype=dtype, layout="blhd")
    ones = torch.ones(1, 1, 1, 1, dtype=dtype).expand(2, 2, 20, 16)
    _, expected = check_grads(device, leaves, "blhd", grad_out=ones, is_causal=True)
    # The same through autograd's own stride-0 gradient: the same gradients.
    leaves = [t.detach().requires_grad_() for t in to_device(leaves, device)]
    attnx.attention(*views(leaves, "blhd"), is_causal=True)[0].sum().backward()
    for leaf, e in zip(leaves, expected, strict=True):
        assert torch.equal(leaf.grad.cpu(), e)


# ------------------------------------------------------------------------------------------------------------
# Masks (attention_helpers' factories: (B, H, L, S) = (2, 3, 19, 41)), every kind and dtype, with padding.


# Every kind, causal or not in turn (and no mask both ways).
ATTN_MASK_CASES = [(None, False), (None, True),
                   *((kind, i % 2 == 0) for i, kind in enumerate(ATTN_MASK_KINDS))]


@pytest.mark.parametrize(("attn_mask", "is_causal"), ATTN_MASK_CASES, ids=str)
def test_attn_mask(device, attn_mask, is_causal):
    gen = torch.Generator().manual_seed(1)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    check_grads(device, make_leaves(2, 3, 19, 41, 16, 16, layout="blhd"), "blhd", attn_mask=mask,
                is_causal=is_causal)


# (attn_mask kind, key_padding_mask kind): every padding kind, each beside another attn_mask.
PADDING_CASES = [(None, "bool"), ("bool_ls", "float"), ("float_bhls", "float_neginf"),
                 ("float_1h1s", "bool_transposed"), ("bool_ls", "float16_expanded"), ("float_bhls", None)]
assert {p for _, p in PADDING_CASES} >= set(KEY_PADDING_MASK_KINDS)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("attn_mask", "padding"), PADDING_CASES, ids=str)
def test_padding_and_attn_mask(device, attn_mask, padding, is_causal):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    kpm = None if padding is None else make_key_padding_mask(padding, gen)
    check_grads(device, make_leaves(2, 3, 19, 41, 16, 16, dtype=torch.float64), attn_mask=mask,
                key_padding_mask=kpm, is_causal=is_causal)


MASK_DTYPES = [torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_dtypes_with_key_padding(device, dtype, mask_dtype):
    B, H, L, S = 2, 2, 9, 13
    gen = torch.Generator().manual_seed(4)
    if mask_dtype == torch.bool:
        mask = torch.rand(L, S, generator=gen) < 0.3
        kpm = torch.rand(B, S, generator=gen) < 0.3
        mask[:, 0], kpm[:, 0] = False, False  # every row sees a key
    else:
        mask = torch.randn(L, S, generator=gen).to(mask_dtype)
        kpm = torch.randn(B, S, generator=gen)
    check_grads(device, make_qkv(B, H, L, S, 16, 16, dtype=dtype, layout="blhd"), attn_mask=mask,
                key_padding_mask=kpm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_masks_low_precision_and_strided(device, dtype):
    gen = torch.Generator().manual_seed(3)
    leaves = make_leaves(2, 3, 19, 41, 16, 8, dtype=dtype, layout="strided_last")
    check_grads(device, leaves, "strided_last", attn_mask=make_attn_mask("float_ls", gen).to(dtype),
                key_padding_mask=make_key_padding_mask("bool", gen), is_causal=True, scale=0.2)


def test_masked_tiles_are_skipped_correctly(device):
    # Masks that remove whole 32-key tiles (which a kernel may skip) next to tiles they cut in part.
    (q, k, v), cases = key_tile_skipping_cases()
    for kwargs in cases:
        check_grads(device, (q, k, v), **kwargs)


def test_cpu_masked_tiles_are_skipped_correctly():
    # The same at the CPU kernel's (128, 128) tile pairs. CPU only: too big for the emulated kernels.
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


# attn_mask's gradient in each broadcast pattern: summed over the dims it broadcasts over.
MASK_SHAPES = {
    "ls": lambda B, H, L, S: (L, S),
    "bhls_3d": lambda B, H, L, S: (B * H, L, S),
    "b1ls": lambda B, H, L, S: (B, 1, L, S),
    "1h1s": lambda B, H, L, S: (1, H, 1, S),
    "bhl1": lambda B, H, L, S: (B, H, L, 1),
    "full": lambda B, H, L, S: (B, H, L, S),
}


@pytest.mark.parametrize(("shape", "dtype"), [(shape, dtypes[i % 2]) for i, shape in enumerate(MASK_SHAPES)
                                               for dtypes in ((torch.float32, torch.float64),
                                                              (torch.bfloat16, torch.float16))], ids=str)
def test_float_mask_gradient(device, dtype, shape):
    B, H, L, S = 2, 3, 40, 37
    gen = torch.Generator().manual_seed(3)
    mask = torch.randn(*MASK_SHAPES[shape](B, H, L, S), generator=gen).to(dtype)
    qkv = make_qkv(B, H, L, S, 8, 8, dtype=dtype)
    _, grads = check_grads(device, qkv, learn=("attn_mask",), attn_mask=mask)
    assert grads[3].abs().sum() > 0
    check_grads(device, qkv, learn=("attn_mask",), attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("shape", ["ls", "1h1s", "bhl1", "full"])
def test_float_mask_gradient_across_tiles(device, shape):
    # The gradient summed over several query and key tiles of the tensor-core kernels (64 x 64), partial
    # last ones, along L, S, B and H as the mask broadcasts; soft-capped scores (the mask's gradient is dS,
    # the scores' dS times the cap's derivative).
    B, H, L, S = 2, 2, 130, 70
    gen = torch.Generator().manual_seed(4)
    mask = torch.randn(*MASK_SHAPES[shape](B, H, L, S), generator=gen).half()
    check_grads(device, make_qkv(B, H, L, S, 16, 16, dtype=torch.float16), learn=("attn_mask",),
                attn_mask=mask, window_left=90, window_right=10, softcap=2.0)


def test_float_masks_requiring_grad(device):
    # A float attn_mask that requires grad gets its gradient; a float key_padding_mask that does is a clear
    # error; masks that do not, float or bool, are fine.
    q, k, v = (t.requires_grad_() for t in to_device(make_leaves(1, 2, 4, 5, 8, 8), device))
    kernel_or_skip(device, q, k, v, backward=True)
    mask = to_device(torch.randn(4, 5), device).requires_grad_()
    attnx.attention(q, k, v, attn_mask=mask)[0].sum().backward()
    assert mask.grad is not None and mask.grad.shape == mask.shape
    kpm = to_device(torch.randn(1, 5), device).requires_grad_()
    out, _ = attnx.attention(q.detach(), k.detach(), v.detach(), key_padding_mask=kpm)  # only kpm does
    with pytest.raises(RuntimeError, match=r"no gradient for a float key_padding_mask, which requires grad"):
        out.sum().backward()
    attnx.attention(q, k, v, attn_mask=mask.detach(), key_padding_mask=kpm.detach() > 0)[0].sum().backward()


# ------------------------------------------------------------------------------------------------------------
# Fully masked rows, NaN, empty sizes, head dims above the kernels'.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fully_masked_rows_get_zero_gradients(device, dtype):
    # Query 2 sees no key, batch 1 none at all: their dQ is 0 and they add nothing to dK and dV; a key that
    # every query has masked (key 4) gets no gradient.
    (q, k, v), kwargs = fully_masked_rows_case(dtype=dtype)
    kwargs["attn_mask"][:, 4] = True
    _, (dq, dk, dv) = check_grads(device, (q, k, v), **kwargs)
    assert (dq[:, :, 2] == 0).all() and (dq[1] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[:, :, 4] == 0).all() and (dv[:, :, 4] == 0).all()
    assert (dq[0, :, [0, 1, 3, 4, 5]] != 0).any()


def test_nan_stays_in_its_row(device):
    q, k, v = to_device(make_qkv(1, 1, 5, 7, 8, 8), device)
    q[0, 0, 3, 0] = float("nan")
    kernel_or_skip(device, q, k, v, backward=True)
    out, lse = attnx.attention(q, k, v)
    dq, dk, _, _, _ = attnx.attention_backward(to_device(grad_out_for(q, v), device), q, k, v, out, lse)
    dq, dk = dq.cpu(), dk.cpu()
    assert torch.isnan(dq[0, 0, 3]).all()
    assert torch.isfinite(dq[0, 0, :3]).all() and torch.isfinite(dq[0, 0, 4:]).all()
    assert torch.isnan(dk).any()  # query 3's NaN scores reach every key


@pytest.mark.parametrize("sizes", EMPTY_SIZES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_empty_sizes(device, sizes, dtype):
    kpm = torch.zeros(sizes[0], sizes[3], dtype=torch.bool)
    leaves = make_leaves(*sizes, dtype=dtype)
    kernel_or_skip(device, *to_device(leaves, device), backward=True)
    _, (dq, dk, dv) = check_grads(device, leaves, key_padding_mask=kpm)
    if sizes[2] == 0:  # no queries: no gradient reaches the keys (every element written)
        assert (dk == 0).all() and (dv == 0).all()
    if sizes[3] == 0:  # no keys: every row is fully masked
        assert (dq == 0).all()


@pytest.mark.parametrize("dims", [(264, 8), (64, 320), (288, 288)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_head_dims_above_the_fused_kernels(device, dtype, dims):
    # CUDA's fused kernels cover head dims up to 256: above, its backward is the whole-tensor math.
    D, Dv = dims
    kernel, _ = check_grads(device, make_qkv(1, 2, 9, 13, D, Dv, dtype=dtype, layout="blhd"), is_causal=True)
    if device.cuda_like:
        assert kernel == "math"


# ------------------------------------------------------------------------------------------------------------
# Grouped KV heads, key ranges, soft-capping, sinks, dropout, all of them together.


@pytest.mark.parametrize(("heads", "dtype"), [((4, 1), torch.float32), ((4, 2), torch.float64),
                                              ((6, 3), torch.bfloat16), ((4, 2), torch.float16),
                                              ((3, 3), torch.float32)], ids=str)
def test_grouped_kv_heads(device, heads, dtype):
    # dK and dV of a kv head are its group's query heads' contributions, summed by the backward: it returns
    # them per kv head (no copy of the keys per query head, no (B, H, S, D) gradient to reduce).
    H, Hkv = heads
    q, k, v = make_gqa(2, H, Hkv, 20, 45, 16, 16, dtype=dtype, layout="blhd")
    _, (_, dk, dv) = check_grads(device, (q, k, v), is_causal=True)
    assert dk.shape == k.shape and dv.shape == v.shape


def test_grouped_kv_heads_expanded(device):
    # Grouped kv heads that are one head expanded through stride 0, and kv expanded to every query head: read
    # in place, their gradients summed into the base by autograd.
    q, k, v = make_gqa(2, 4, 2, 9, 13, 16, 16, layout="expanded_kv")
    assert k.stride(1) == 0
    check_grads(device, (q, k, v))
    check_grads(device, make_leaves(2, 4, 9, 13, 16, 16, layout="expanded_kv"), "expanded_kv")


def _key_lengths(values, dtype):
    if dtype == torch.int32:
        return torch.tensor(values, dtype=torch.int32)
    return torch.tensor([x for v in values for x in (v, -7)], dtype=torch.int64)[::2]  # strided


WINDOWS = [(-1, 0), (3, 0), (2, 2), (0, -1)]


@pytest.mark.parametrize(("dtype", "lengths"), [(torch.float64, torch.int32), (torch.float32, torch.int64),
                                                 (torch.float16, None)], ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_windows_and_key_lengths(device, window, dtype, lengths):
    # Batch 0 sees every key, batch 1 none, batch 2 fewer keys than queries (its first rows see nothing).
    L, S = 40, 45
    q, k, v = make_gqa(3, 2, 2, L, S, 16, 16, dtype=dtype, layout="blhd")
    kwargs = {"window_left": window[0], "window_right": window[1], "is_causal": window == (-1, 0)}
    if lengths is not None:
        kwargs["key_lengths"] = _key_lengths([S, 0, L * 2 // 3], lengths)
    _, (dq, dk, dv) = check_grads(device, (q, k, v), **kwargs)
    if lengths is not None:
        assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
        assert (dk[2, :, L * 2 // 3:] == 0).all()  # keys past key_lengths get no gradient


@pytest.mark.parametrize("window", [(-1, 0), (40, 0), (10, 70), (70, -1)], ids=str)
def test_key_ranges_across_64_row_tiles(device, window):
    # The tensor-core kernels' 64 x 64 tiles (CUDA's fused backward in float16 and bfloat16): three query
    # and three key tiles, partial last ones; tiles that all 16 rows of a warp see whole (no per-score test)
    # beside tiles that a window's edge or the key lengths cut, from either side.
    L, S = 150, 140
    q, k, v = make_gqa(2, 2, 1, L, S, 16, 16, dtype=torch.float16)
    kwargs = {"window_left": window[0], "window_right": window[1], "is_causal": window == (-1, 0),
              "key_lengths": _key_lengths([S, 100], torch.int64)}
    check_grads(device, (q, k, v), **kwargs)


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("case", ["bool", "float", "per_batch", "per_head", "strided", "broadcast_rows",
                                  "window", "padding_causal", "softcap_sinks"])
def test_attn_mask_tile_classes(device, case, head_dim):
    # The forward's tile-class cases: tiles of 16 query rows x 64 keys that the masks remove whole (the
    # tensor-core backward skips them in both passes), keep whole (no mask read) or in part (a bool mask's
    # packed bits, a float mask's terms), with a float mask's gradient; at head dim 128 the query pass's key
    # tiles and the key pass's query tiles are 32 rows, half a class tile.
    options = tile_classes_case(case)
    learn = ("attn_mask",) if options["attn_mask"].is_floating_point() else ()
    if "sinks" in options:
        learn += ("sinks",)
    check_grads(device, make_qkv(2, 2, 70, 200, head_dim, head_dim, dtype=torch.float16), learn=learn,
                **options)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
def test_empty_tiles_are_not_read(device, mask_dtype):
    # Keys and values in tiles that the masks remove for every row (keys 64-127 by attn_mask, and batch 1's
    # 128-191 by key_padding_mask) are never read by the tensor-core backward: NaN there changes no gradient
    # bit (their keys' dK and dV are 0).
    q, k, v = make_qkv(2, 2, 70, 200, 32, 32, dtype=torch.float16)
    removed = tile_classes_mask()
    removed[:, 64:128] = True
    mask = removed if mask_dtype == torch.bool else torch.zeros(70, 200).masked_fill(removed, float("-inf"))
    kpm = torch.zeros(2, 200, dtype=torch.bool)
    kpm[1, 128:192] = True
    kpm[0, 7] = True
    options = {"attn_mask": mask, "key_padding_mask": kpm}
    kernel, grads = check_grads(device, (q, k, v), **options)
    if not kernel.startswith("cuda fused mma"):
        pytest.skip(f"{kernel}: this checks the tensor-core backward's tile classes")
    k_nan, v_nan = k.clone(), v.clone()
    for key in (k_nan, v_nan):
        key[:, :, 64:128] = float("nan")
        key[1, :, 128:192] = float("nan")
    nan_grads = _grads(attnx.attention, to_device((q, k_nan, v_nan), device), "contiguous",
                       to_device(grad_out_for(q, v), device), on(device, options), ())
    for name, g, g_nan in zip("qkv", grads, nan_grads, strict=True):
        assert torch.equal(g, g_nan.cpu()), f"{kernel}: grad {name} read a removed tile"


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_tiles_that_padding_removes_whole(device, kind):
    # key_padding_mask removes a whole 64-key tile of batch 0 (the tensor-core key pass skips that block: its
    # dK and dV are 0) and the keys from 100 on of batch 1 (tiles cut in part, one removed whole past S's
    # last tile start), alone and with an attn_mask and soft-capping.
    B, H, L, S = 2, 2, 70, 150
    q, k, v = make_qkv(B, H, L, S, 16, 16, dtype=torch.float16)
    removed = torch.zeros(B, S, dtype=torch.bool)
    removed[0, 64:128] = True
    removed[1, 100:] = True
    kpm = removed if kind == "bool" else torch.zeros(B, S).masked_fill(removed, float("-inf"))
    _, (_, dk, dv) = check_grads(device, (q, k, v), key_padding_mask=kpm)
    assert (dk[0, :, 64:128] == 0).all() and (dv[0, :, 64:128] == 0).all()
    check_grads(device, (q, k, v), key_padding_mask=kpm, attn_mask=torch.randn(L, S).half(), softcap=3.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_and_sinks(device, dtype):
    # The soft-cap's derivative (1 - tanh^2) in dS, and the sinks' gradient (-sum over the row of P dP).
    q, k, v = make_gqa(2, 4, 2, 20, 25, 16, 16, dtype=dtype)
    check_grads(device, (q, k, v), softcap=2.0, scale=1.5)
    check_grads(device, (q, k, v), learn=("sinks",), softcap=3.0, sinks=make_sinks(4, dtype), is_causal=True)


@pytest.mark.parametrize("S", [45, 96])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout(device, dtype, S):
    # The keep mask is regenerated from the forward's Philox draws (never stored): the reference draws the
    # same. On devices that run dropout's forward. S = 96, a multiple of 4: each Philox block's 4 draws are
    # one row's 4 keys, which the tensor-core backward's lanes share (a block drawn once for 4 scores).
    q, k, v = make_gqa(2, 4, 2, 20, S, 16, 16, dtype=dtype)
    check_grads(device, (q, k, v), dropout_p=0.3, dropout_seed=seed_of(11, 5))
    mask = torch.randn(2, 1, 20, S, generator=torch.Generator().manual_seed(6)).to(dtype)
    check_grads(device, (q, k, v), learn=("attn_mask", "sinks"), dropout_p=0.3, dropout_seed=seed_of(11, 5),
                is_causal=True, softcap=3.0, sinks=make_sinks(4, dtype), attn_mask=mask)


@pytest.mark.wheel
@pytest.mark.sanitize
@pytest.mark.parametrize(("mask", "head_dim"), [("bool", 24), ("float", 24), ("float", 264)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_features_together(device, dtype, mask, head_dim):
    # Grouped heads, a window, key lengths, soft-capping, learned sinks, both masks (attn_mask as
    # nn.MultiheadAttention passes it, its gradient when float; with is_causal then) on strided inputs; above
    # head dim 256 too.
    gen = torch.Generator().manual_seed(5)
    B, H, L, S = 2, 4, 20, 45
    attn_mask, kpm = make_feature_masks(mask, B, H, L, S, dtype, gen)
    if mask == "bool":
        attn_mask[..., 40], kpm[:, 40] = False, False  # a key every row sees (inside the window)
    kwargs = {"attn_mask": attn_mask, "key_padding_mask": kpm, "window_left": 30, "window_right": 2,
              "key_lengths": _key_lengths([S, S - 3], torch.int64), "softcap": 4.0,
              "sinks": make_sinks(H, dtype), "scale": 0.4}
    learn = ("attn_mask", "sinks") if mask == "float" else ("sinks",)
    qkv = make_gqa(B, H, 2, L, S, head_dim, 16, dtype=dtype, layout="lbhd")
    check_grads(device, qkv, learn=learn, is_causal=mask == "float", **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Determinism, gradcheck.


def test_deterministic(device):
    # No atomics: two runs are equal bit for bit, the mask's and the sinks' gradients (summed over B and H)
    # included.
    q, k, v = to_device(make_gqa(2, 4, 2, 40, 37, 16, 16), device)
    kwargs = on(device, {"attn_mask": torch.randn(40, 37), "sinks": make_sinks(4, torch.float32),
                         "key_padding_mask": torch.rand(2, 37) < 0.2})
    kernel_or_skip(device, q, k, v, **kwargs, backward=True)
    out, lse = attnx.attention(q, k, v, **kwargs)
    grad_out = to_device(grad_out_for(q, v), device)
    first = attnx.attention_backward(grad_out, q, k, v, out, lse, **kwargs, grad_attn_mask=True)
    second = attnx.attention_backward(grad_out, q, k, v, out, lse, **kwargs, grad_attn_mask=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _gradcheck_case(case, device):
    """(leaves, layout, fn's keyword arguments, learned options) of test_gradcheck's case."""
    gen = torch.Generator().manual_seed(4)
    B, H, L, S, D = 2, 2, 5, 7, 4
    layout, kwargs, learn = "contiguous", {}, {}
    leaves = None
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
    elif case.startswith("every_feature"):
        # Grouped heads, a learned float mask and sinks, padding, causal, a window, key lengths, soft-capping.
        head_dim = 264 if case.endswith("264") else 8
        leaves = [torch.randn(*shape, generator=gen, dtype=torch.float64)
                  for shape in ((1, 4, 6, head_dim), (1, 2, 9, head_dim), (1, 2, 9, 5))]
        kwargs = {"key_padding_mask": torch.tensor([[False] * 8 + [True]]), "is_causal": True,
                  "window_left": 4, "window_right": 1, "key_lengths": torch.tensor([8]), "softcap": 3.0}
        learn = {"attn_mask": torch.randn(6, 9, generator=gen, dtype=torch.float64),
                 "sinks": torch.randn(4, generator=gen, dtype=torch.float64)}
    if leaves is None:
        leaves = make_leaves(B, H, L, S, D, 3, dtype=torch.float64, layout=layout)
    return to_device(leaves, device), layout, on(device, kwargs), to_device(learn, device)


# every_feature's finite differences take ~1000 forwards: seconds on the CPU.
GRADCHECK_CASES = ["plain", "causal_scale", "bool_and_padding", "float_masks_strided", "expanded_kv",
                   pytest.param("every_feature", marks=pytest.mark.slow), "every_feature_264"]


@pytest.mark.parametrize("case", GRADCHECK_CASES)
def test_gradcheck(device, case):
    leaves, layout, kwargs, learn = _gradcheck_case(case, device)
    kernel_or_skip(device, *views(leaves, layout), **kwargs, **learn, backward=True)
    inputs = [t.requires_grad_() for t in (*leaves, *learn.values())]

    def fn(*ts):
        learned = dict(zip(learn, ts[3:], strict=True))
        return attnx.attention(*views(ts[:3], layout), **kwargs, **learned)[0]

    # Finite differences take two forwards per input element: the emulated kernels and head dim 264 check a
    # random projection of the Jacobian instead (fast mode), a few calls.
    fast = device.emulated or case.endswith("264")
    assert torch.autograd.gradcheck(fn, inputs, atol=1e-6, rtol=1e-4, fast_mode=fast)


# ------------------------------------------------------------------------------------------------------------
# Autograd: what is differentiable, what is computed, the gradients' layout, double backward.


def test_lse_is_not_differentiable(device):
    q, k, v = (t.requires_grad_() for t in to_device(make_leaves(1, 2, 4, 5, 8, 8), device))
    kernel_or_skip(device, q, k, v, backward=True)
    out, lse = attnx.attention(q, k, v)
    assert out.requires_grad and not lse.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()


def test_double_backward_is_an_error(device):
    q, k, v = (t.requires_grad_() for t in to_device(make_leaves(1, 2, 4, 5, 8, 8), device))
    kernel_or_skip(device, q, k, v, backward=True)
    out, _ = attnx.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="attnx.attention: double backward is not implemented"):
        dq.sum().backward()


def test_only_requested_gradients(device):
    q, k, v = to_device(make_leaves(1, 2, 4, 5, 8, 8), device)
    kernel_or_skip(device, q, k, v, backward=True)
    k.requires_grad_()
    attnx.attention(q, k, v)[0].sum().backward()
    assert k.grad is not None and q.grad is None and v.grad is None
    # A learned mask alone: its gradient only.
    mask = to_device(torch.randn(4, 5), device).requires_grad_()
    attnx.attention(q, k.detach(), v, attn_mask=mask)[0].sum().backward()
    assert mask.grad is not None and mask.grad.abs().sum() > 0


def _backward_args(device, B=2, H=3, L=5, S=7, D=8, Dv=4, dtype=torch.float32, layout="blhd", seed=0,
                   forward=True):
    """(grad_out, q, k, v, out, lse) on ``device`` for attention_backward, grad_out strided (without
    ``forward``: out and lse None); skips where the device takes no such call."""
    q, k, v = views(to_device(make_leaves(B, H, L, S, D, Dv, dtype=dtype, layout=layout, seed=seed), device),
                    layout)
    kernel_or_skip(device, q, k, v, backward=True)
    out, lse = attnx.attention(q, k, v) if forward else (None, None)
    grad_out = torch.randn(B, L, H, 2 * Dv, generator=torch.Generator().manual_seed(9)).to(dtype)
    return to_device(grad_out, device).transpose(1, 2)[..., ::2], q, k, v, out, lse


def test_gradient_layout(device):
    *grads, grad_mask, grad_sinks = attnx.attention_backward(*_backward_args(device, 2, 3, 5, 7, 8, 4))
    assert [g.shape for g in grads] == [(2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)]
    for g in grads:  # memory order (B, N, H, E), like out
        assert g.transpose(1, 2).is_contiguous() and g.device.type == torch.device(device).type
    assert grad_mask.numel() == 0 and grad_sinks.numel() == 0  # neither asked for


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "sizes", [(2, 3, 5, 7, 8, 4), (1, 1, 1, 1, 1, 1), (2, 0, 3, 4, 8, 8), (1, 2, 3, 4, 8, 0)], ids=str
)
def test_fake_matches_kernel(device, sizes, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _backward_args(device, *sizes, dtype=dtype)
    kernel_or_skip(device, *args[1:4], backward=True)
    real = attnx.attention_backward(*args)
    with FakeTensorMode() as mode:
        fake = attnx.attention_backward(*[mode.from_tensor(a) for a in args])
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype, f.device) == (r.shape, r.stride(), r.dtype, r.device)


def _opcheck_cases():
    """(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed) on the CPU: masks,
    causal, a custom scale, float64 and bfloat16, each without and with fused dropout."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = views(make_leaves(2, 2, 5, 7, 8, 4, layout="blhd"), "blhd")
    kpm = torch.rand(2, 7, generator=gen) < 0.3
    mask = torch.randn(5, 7, generator=gen)
    return [
        (q, k, v, None, None, False, None, 0.0, None),
        (q, k, v, mask, kpm, True, 0.5, 0.0, None),
        (q.double(), k.double(), v.double(), torch.rand(4, 5, 7, generator=gen) < 0.2, None, False, None, 0.0,
         None),
        (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, kpm.float(), False, None, 0.0, None),
        (q, k, v, None, None, False, None, 0.3, seed_of(1, 2)),
        (q, k, v, mask, kpm, True, 0.5, 0.6, seed_of(-5, 2**40)),
        (q.double(), k.double(), v.double(), None, None, False, None, 1.0, seed_of(3)),
        (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, kpm.float(), False, None, 0.1, seed_of(4)),
    ]


def _opcheck_args(device, case):
    q, k, v, mask, kpm, is_causal, scale, p, dropout_seed = _opcheck_cases()[case]
    q, k, v, mask, kpm = to_device((q, k, v, mask, kpm), device)
    rest = (mask, kpm, is_causal, scale, p, dropout_seed)
    kernel_or_skip(device, q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal, scale=scale,
                    dropout_p=p, dropout_seed=dropout_seed, backward=True)
    return q, k, v, rest


@pytest.mark.parametrize("case", [1, 5])  # masks, causal, a custom scale, without and with dropout
def test_opcheck_attention_with_grad(device, case):
    pytest.importorskip("expecttest")
    q, k, v, rest = _opcheck_args(device, case)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.attnx.attention.default, (q, k, v, *rest))


@pytest.mark.parametrize("case", range(8))
def test_opcheck_attention_backward(device, case):
    pytest.importorskip("expecttest")
    q, k, v, rest = _opcheck_args(device, case)
    out, lse = attnx.attention(q, k, v, *rest)
    torch.library.opcheck(torch.ops.attnx.attention_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, *rest))


@pytest.mark.slow
def test_compile_backward(device):
    q, k, v = (t.requires_grad_() for t in to_device(make_leaves(2, 2, 5, 7, 8, 8), device))
    kernel_or_skip(device, q, k, v, is_causal=True, backward=True)

    def loss(q, k, v):
        return attnx.attention(q, k, v, is_causal=True)[0].square().sum()

    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_module_training_step(device, dtype):
    # nn.MultiheadAttention's training step reaches the device's attention backward through mha's backward:
    # the parameters' gradients as torch.nn.MultiheadAttention's on the CPU.
    module = attnx.nn.MultiheadAttention(64, 4, batch_first=True, dtype=dtype)
    torch_module = torch.nn.MultiheadAttention(64, 4, batch_first=True, dtype=dtype)
    torch_module.load_state_dict(module.state_dict())
    x = torch.randn(2, 50, 64, dtype=dtype)
    q = x.unflatten(-1, (4, 16)).transpose(1, 2)
    kernel_or_skip(device, *to_device((q, q, q), device), backward=True)
    module.to(device)(*(to_device(x, device),) * 3, need_weights=False)[0].sum().backward()
    torch_module(x, x, x, need_weights=False)[0].sum().backward()
    for (name, p), p_torch in zip(module.named_parameters(), torch_module.parameters(), strict=True):
        mha_helpers.assert_close(p.grad.cpu(), p_torch.grad, dtype, name)


def _bad_cases(device):
    # The arguments are checked before any kernel runs: out and lse of the right shapes, without a forward.
    grad_out, q, k, v = _backward_args(device, 2, 3, 5, 7, 8, 4, forward=False)[:4]
    out, lse = torch.zeros_like(grad_out), grad_out.new_zeros(2, 3, 5)
    return {
        "grad_out shape": ((grad_out[..., :3], q, k, v, out, lse),
                           "attnx::attention_backward: expected grad_out of shape (B, H, L, Dv) = "
                           "[2, 3, 5, 4], got [2, 3, 5, 3]"),
        "grad_out dtype": ((grad_out.to(torch.float16), q, k, v, out, lse),
                           "attnx::attention_backward: expected grad_out of dtype Float, got Half"),
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


BAD_CASES = ["grad_out shape", "grad_out dtype", "out shape", "lse dtype", "lse shape", "key shape"]


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs(device, case, fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, message = _bad_cases(device)[case]
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                attnx.attention_backward(*args)
    else:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attnx.attention_backward(*args)


# ------------------------------------------------------------------------------------------------------------
# CUDA's fused kernels on a GPU: CUDA's backward is the whole-tensor math unless ATTNX_CUDA_FUSED_BACKWARD=1,
# which the library reads once per process. A fresh pytest runs this file's GPU tests with it set, so that the
# fused kernels pass everything the emulated ones do, on the hardware.

CUDA = [p for p in DEVICES if p.id == "cuda"]


@pytest.mark.slow
@pytest.mark.parametrize("device", CUDA, indirect=True)
def test_fused_backward_on_a_gpu(device):
    if os.environ.get("ATTNX_CUDA_FUSED_BACKWARD") == "1":
        pytest.skip("this process runs the fused kernels already")
    env = {**os.environ, "ATTNX_CUDA_FUSED_BACKWARD": "1"}
    kernel = run_python(textwrap.dedent(
        """
        import torch, attnx
        q = torch.randn(1, 2, 5, 64, device="cuda")
        print(torch.ops.attnx._attention_kernel(q, q, q, backward=True))
        """), env=env).strip()
    assert kernel.startswith("cuda fused"), kernel
    result = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-m", "cuda", "-q", "-p",
         "no:cacheprovider"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------------------
# The CPU kernel: no Python per call, nothing of size (B, H, L, S) saved or allocated, every ISA variant.


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_no_attention_sized_allocation(device, dtype):
    # Nothing of size (B, H, L, S) is allocated: a fused backward's workspace is O(B H L) (delta). Watched by
    # torch's profiler on the CPU allocator: the CPU's kernel and the emulated devices' (CUDA's tensor-core
    # and SIMT kernels); autograd through the reference is the control that it sees such an allocation.
    if device != "cpu":
        pytest.skip("the profiler watches the CPU allocator here: the CPU and the emulated devices")
    B, H, L, S, D = 1, 2, 256, 256, 16
    attention_bytes = B * H * L * S * dtype.itemsize
    gen = torch.Generator().manual_seed(6)
    mask, kpm = torch.randn(L, S, generator=gen), torch.randn(B, S, generator=gen)
    kwargs = {"attn_mask": mask, "key_padding_mask": kpm, "is_causal": True}
    leaves = make_leaves(B, H, L, S, D, D, dtype=dtype, layout="blhd")
    kernel = kernel_or_skip(device, *views(leaves, "blhd"), backward=True, **kwargs)
    if kernel == "math":
        pytest.skip("the whole-tensor backward materialises the probabilities by design")
    for impl in (attnx.attention, reference.attention):
        q, k, v = (t.detach().requires_grad_() for t in leaves)
        out, _ = impl(*views((q, k, v), "blhd"), **kwargs)
        grad_out = torch.randn_like(out)
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu, profile_memory=True) as p:
            out.backward(grad_out)
        largest = max(e.cpu_memory_usage for e in p.events())
        if impl is reference.attention:  # the control: autograd through the reference does allocate them
            assert largest >= attention_bytes
        else:
            assert largest < attention_bytes / 4, (kernel, largest)


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


@pytest.mark.slow
def test_no_quadratic_memory():
    # Peak RSS of a fresh process around one backward: (B, H, L, S) probabilities would be 128 MiB. The call
    # returns 3 MiB of gradients and may add per-thread buffers (3 * L * D floats and tiles, ~1 MiB each).
    grown = int(run_python(_MEMORY_SCRIPT, cwd=ROOT).strip().splitlines()[-1])
    assert grown < 16 * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB during the backward"


_ISA_SCRIPT = """
    from attention_helpers import check_backward, make_leaves
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        leaves = make_leaves(2, 3, 150, 140, 24, 20, dtype=dtype, layout="strided_last")
        check_backward(leaves, "strided_last", attn_mask=torch.randn(150, 140),
                       key_padding_mask=torch.rand(2, 140) < 0.3, is_causal=True)
        check_backward(make_leaves(1, 2, 37, 53, 24, 24, dtype=dtype, layout="blhd"), "blhd")
    """


@pytest.mark.slow
@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_isa_variants(variant):
    run_under_cpu_capability(_ISA_SCRIPT, variant)
