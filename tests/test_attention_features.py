"""The attention features of today's models on every device (conftest.py's ``device``: the CPU, a GPU, the
emulated CUDA and Metal backends), forward and backward, against reference.attention: grouped KV heads
(GQA / MQA), key ranges (bottom-right windows, per-batch key lengths, decoding and chunked prefill, rows that
see no key), soft-capping, attention sinks, all of them together, head dims above the kernels' 256, and the
gradient of a float attn_mask (a learned bias).

Each test asks the device which kernel its call takes (attention_helpers.kernel_or_skip) and is skipped
where the backend refuses the call or another emulated device runs the same kernel. Inputs are built on the
CPU and moved to the device with their exact layout (layouts.to_device); the reference runs on CPU copies.
Bounds as in test_attention.py (forward) and test_attention_backward.py (gradients): the kernel may be at
most K times as far from the float64 reference as the reference in the inputs' dtype is, plus a small atol.

Shapes are small enough for the emulators (each emulated CUDA block is 128 threads) while crossing their
boundaries: the SIMT kernel's 16-row blocks and 32-key tiles, the mma kernel's 64-row blocks and 64-key
tiles, Metal's vector kernel (a few query rows) and tiled kernel. The CPU kernel's own tiles (128 query rows,
512 keys forward, 128 x 128 backward) and thread plans are far larger: the tests at the end of the file that
reach them run on the CPU only.
"""

import math
import re

import pytest
import torch

import attnx
from attention_helpers import (
    DTYPES,
    GRAD_ATOL,
    QKV_LAYOUTS,
    assert_grad_bounded,
    assert_matches_reference,
    assert_unseen_rows_empty,
    check_forward,
    kernel_or_skip,
    make_feature_masks,
    make_gqa,
    make_sinks,
    upcast,
)
from attnx import reference
from layouts import to_device

pytestmark = pytest.mark.kernel


def to_cpu(x):
    """x (or the tensors of a dict) on the CPU; anything else as it is."""
    if isinstance(x, dict):
        return {n: to_cpu(a) for n, a in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def on(device, x):
    """layouts.to_device, skipping where the device cannot hold a float64 tensor (MPS)."""
    tensors = list(x.values()) if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else [x]
    if device == "mps" and any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tensors):
        pytest.skip("MPS tensors cannot be float64")
    return to_device(x, device)


def check(q, k, v, **kwargs):
    """attnx.attention on the inputs' device against the reference on CPU copies (check_forward's bound);
    returns (out, lse) on the CPU."""
    out, lse = attnx.attention(q, k, v, **kwargs)
    return assert_matches_reference(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), **to_cpu(kwargs))


def check_grads(q, k, v, grad_names=("q", "k", "v"), **kwargs):
    """Gradients of attnx.attention w.r.t. q, k, v and any of attn_mask / sinks named in grad_names, against
    autograd through the reference on CPU copies; returns them (on the CPU)."""
    named = {"q": q, "k": k, "v": v, **{n: kwargs[n] for n in ("attn_mask", "sinks") if n in kwargs}}
    leaves = {n: t for n, t in named.items() if n in grad_names}
    B, H, L, _ = q.shape
    grad_out = torch.randn(B, H, L, v.shape[3], generator=torch.Generator().manual_seed(7)).to(q.dtype)

    def grads(fn, cast):
        ls = {n: cast(t).detach().requires_grad_() for n, t in leaves.items()}
        args = {n: ls.get(n, cast(t)) for n, t in named.items()}
        rest = {n: cast(a) for n, a in kwargs.items() if n not in args}
        out, _ = fn(args["q"], args["k"], args["v"], **{n: args[n] for n in args if n not in "qkv"}, **rest)
        return torch.autograd.grad(out, list(ls.values()), cast(grad_out).to(out.device, out.dtype))

    got = [g.cpu() for g in grads(attnx.attention, lambda t: t)]
    g64 = grads(reference.attention, lambda t: upcast(to_cpu(t)))
    g_same = grads(reference.attention, to_cpu)
    for name, g, r64, rs in zip(leaves, got, g64, g_same, strict=True):
        assert g.shape == leaves[name].shape and g.dtype == leaves[name].dtype, name
        assert_grad_bounded(g, r64, rs, GRAD_ATOL[q.dtype] * (4 if name in ("attn_mask", "sinks") else 1),
                            f"grad {name}")
    return got


def key_lengths(values, kind, device):
    """values as a (B,) key_lengths tensor on device: "int32", or "int64" read through a stride of 2 (a column
    of a (B, 2) tensor)."""
    if kind == "int32":
        return on(device, torch.tensor(values, dtype=torch.int32))
    lengths = on(device, torch.tensor([[n, -7] for n in values], dtype=torch.int64))[:, 0]
    assert lengths.stride(0) == 2
    return lengths


# ------------------------------------------------------------------------------------------------------------
# Grouped KV heads.

HEADS = [(4, 1), (4, 2), (6, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 1), (6, 3)], ids=str)
def test_grouped_kv_heads(device, heads, dtype):
    # L = 37, S = 70: partial query blocks and key tiles of every kernel. (Batches: the layouts test.)
    H, Hkv = heads
    q, k, v = on(device, make_gqa(1, H, Hkv, 37, 70, 24, 24, dtype=dtype, layout="blhd"))
    kpm = on(device, torch.rand(1, 70, generator=torch.Generator().manual_seed(1)) < 0.3)
    kernel_or_skip(device, q, k, v)
    check(q, k, v)
    check(q, k, v, is_causal=True, key_padding_mask=kpm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [2, 8, 16])
def test_grouped_kv_heads_decoding(device, group, dtype):
    # One query row of `group` heads a kv head: on the CPU a few 16-bit heads score the key rows in place,
    # more share a transposed tile. An odd head dim (a bfloat16 pair's zero half), keys in strided rows,
    # padding.
    q, k, v = on(device, make_gqa(2, 2 * group, 2, 1, 301, 23, 24, dtype=dtype, layout="blhd"))
    kpm = on(device, torch.rand(2, 301, generator=torch.Generator().manual_seed(1)) < 0.3)
    kernel_or_skip(device, q, k, v)
    check(q, k, v, key_padding_mask=kpm)
    # An even head dim and row stride: bfloat16 key rows are pairs in memory, read as such.
    check(*on(device, make_gqa(2, 2 * group, 2, 1, 301, 24, 24, dtype=dtype, layout="blhd")))


@pytest.mark.parametrize("layout", [*QKV_LAYOUTS, "lbhd_b1"])
def test_grouped_kv_heads_layouts(device, layout):
    # "expanded_kv": the kv heads are one stored head (stride 0); "lbhd_b1": the B=1 transpose, a size-1 batch
    # dim with a non-contiguous stride, on query and on the shared kv heads.
    B, layout = (1, "lbhd") if layout == "lbhd_b1" else (2, layout)
    q, k, v = on(device, make_gqa(B, 4, 2, 20, 45, 16, 16, layout=layout))
    if layout == "expanded_kv":
        assert k.stride(1) == 0 and v.stride(1) == 0
    if B == 1:
        assert q.stride(0) == 4 * 16 and k.stride(0) == 2 * 16
    kernel_or_skip(device, q, k, v, is_causal=True)
    check(q, k, v, is_causal=True)


def test_grouped_kv_heads_are_indexed(device):
    # A kv head is read by every query head of its group: one stored head (Hkv = 1) gives exactly what the
    # same head expanded over the H query heads through stride 0 gives.
    q, k, v = on(device, make_gqa(2, 4, 1, 9, 11, 8, 8))
    kernel_or_skip(device, q, k, v)
    out_shared, lse_shared = attnx.attention(q, k, v)
    out_expanded, lse_expanded = attnx.attention(q, k.expand(2, 4, 11, 8), v.expand(2, 4, 11, 8))
    torch.testing.assert_close(out_shared, out_expanded, rtol=0, atol=0)
    torch.testing.assert_close(lse_shared, lse_expanded, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------
# Key ranges: bottom-right windows and key lengths (decoding, chunked prefill, static caches).

WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 2), (0, -1), (0, 0), (20, 3)]
# (L, S): square; chunked prefill; decoding; more queries than keys.
RANGE_SHAPES = [(23, 23), (9, 40), (1, 33), (30, 12)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", RANGE_SHAPES, ids=str)
def test_windows(device, shape, is_causal):
    # is_causal keeps its top-left diagonal on top of the bottom-right window.
    L, S = shape
    q, k, v = on(device, make_gqa(1, 2, 1, L, S, 16, 8))
    kernel_or_skip(device, q, k, v, is_causal=is_causal, window_left=3, window_right=0)
    for window_left, window_right in WINDOWS:
        kwargs = {"window_left": window_left, "window_right": window_right, "is_causal": is_causal}
        out, lse = check(q, k, v, **kwargs)
        assert_unseen_rows_empty(out, lse, S, **kwargs)


@pytest.mark.parametrize("lengths", ["int32", "int64"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_windows_and_key_lengths(device, window, lengths):
    # Batch 0 sees every key, batch 1 none, batch 2 fewer keys than queries: with the bottom-right diagonal,
    # its first queries sit before key 0 and (for a bounded right side) see nothing at all. L = 70, S = 100:
    # several query blocks and key tiles of every kernel, the last of each partial.
    B, L, S = 3, 70, 100
    q, k, v = on(device, make_gqa(B, 2, 1, L, S, 16, 16, layout="blhd"))
    kwargs = {"window_left": window[0], "window_right": window[1],
              "key_lengths": key_lengths([S, 0, L * 2 // 3], lengths, device)}
    kernel_or_skip(device, q, k, v, **kwargs)
    out, lse = check(q, k, v, **kwargs)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    empty_rows = assert_unseen_rows_empty(out, lse, S, **kwargs)
    if window[1] == 0:
        assert empty_rows > 2 * L  # batch 1, and the first rows of batch 2


@pytest.mark.parametrize("window", [(-1, 0), (4, 1), (0, 3), (-1, -1)], ids=str)
def test_rows_outside_the_window(device, window):
    # L > S: under a bottom-right window, rows l < L - S_b - window_right sit too far before key 0 to reach it
    # and see nothing (out 0, lse +inf), sinks or not; the others see key 0 or more. is_causal's top-left
    # diagonal on top of it empties more rows.
    B, L, S = 2, 70, 52
    q, k, v = on(device, make_gqa(B, 2, 1, L, S, 16, 16))
    lengths = [S, S - 5]
    kwargs = {"window_left": window[0], "window_right": window[1],
              "key_lengths": key_lengths(lengths, "int32", device)}
    kernel_or_skip(device, q, k, v, **kwargs)
    out, lse = check(q, k, v, **kwargs)
    for b, S_b in enumerate(lengths):
        empty = max(L - S_b - window[1], 0) if window[1] >= 0 else 0
        assert (out[b, :, :empty] == 0).all() and torch.isposinf(lse[b, :, :empty]).all()
        assert torch.isfinite(lse[b, :, empty:]).all()
    sinks = on(device, make_sinks(2, torch.float32))
    out, lse = check(q, k, v, is_causal=True, sinks=sinks, **kwargs)
    assert_unseen_rows_empty(out, lse, S, is_causal=True, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decoding_and_chunked_prefill(device, dtype):
    # Decoding: one query, the last position of each batch's keys. Chunked prefill: the last L < S_b queries.
    # Bottom-right causal, with and without a sliding window; batch 2 has no key yet.
    S = 100
    lengths = key_lengths([S, 7, 0, S - 1], "int64", device)
    for L in (1, 6, 17):
        q, k, v = on(device, make_gqa(4, 2, 1, L, S, 32, 16, dtype=dtype, layout="packed"))
        kernel_or_skip(device, q, k, v, window_left=-1, window_right=0, key_lengths=lengths)
        for window in ((-1, 0), (8, 0)):
            out, lse = check(q, k, v, window_left=window[0], window_right=window[1], key_lengths=lengths)
            assert (out[2] == 0).all() and torch.isposinf(lse[2]).all()


@pytest.mark.parametrize("layout", ["lbhd", "expanded_kv", "strided_last"])
def test_decoding_step_layouts(device, layout):
    # One query per sequence against a cache: the bottom-right causal window puts it at the last valid key.
    # (The packed layout: test_decoding_and_chunked_prefill; the others: test_grouped_kv_heads_layouts.)
    q, k, v = on(device, make_gqa(4, 2, 1, 1, 77, 32, 32, layout=layout))
    lengths = on(device, torch.tensor([77, 1, 40, 64]))
    kernel_or_skip(device, q, k, v, key_lengths=lengths, window_left=-1, window_right=0)
    check(q, k, v, key_lengths=lengths, window_left=-1, window_right=0)
    check(q, k, v, window_left=15, window_right=0)  # a sliding window while decoding


@pytest.mark.parametrize("L", [1, 40], ids=lambda L: f"L{L}")
def test_keys_outside_the_range_are_never_read(device, L):
    # A KV cache's slots past a batch's length may hold anything: NaN there must not reach the output (the
    # reference runs on the clean inputs: it reads every key). S_0 puts the first key any row of batch 0 sees
    # under the window (3, 0) at 64, a multiple of every kernel's key tile.
    S_0 = 64 + L + 3
    B, S, lengths = 2, S_0 + 9, [S_0, 20]
    q, k, v = on(device, make_gqa(B, 2, 1, L, S, 16, 16))
    kernel = kernel_or_skip(device, q, k, v, key_lengths=on(device, torch.tensor(lengths)), window_right=0)
    for window, lengths_kind in (((-1, 0), "int32"), ((3, 0), "int64")):
        kwargs = {"window_left": window[0], "window_right": window[1],
                  "key_lengths": key_lengths(lengths, lengths_kind, device)}
        dirty_k, dirty_v = k.clone(), v.clone()
        for b, S_b in enumerate(lengths):
            dirty_k[b, :, S_b:] = dirty_v[b, :, S_b:] = float("nan")
        if window[0] >= 0 and kernel.startswith("metal"):
            # Metal's tiles start at a block's first key, so the keys before every row's window are never
            # read either (elsewhere a tile that a row sees part of is read whole; the reference allows it).
            dirty_k[0, :, :64] = dirty_v[0, :, :64] = float("nan")
        clean_out, clean_lse = check(q, k, v, **kwargs)
        out, lse = attnx.attention(q, dirty_k, dirty_v, **kwargs)
        torch.testing.assert_close(out.cpu(), clean_out, rtol=0, atol=0)
        torch.testing.assert_close(lse.cpu(), clean_lse, rtol=0, atol=0)


def test_keys_past_key_lengths_get_no_gradient(device):
    # The backward reads no key past a batch's length either: NaN and inf there reach no gradient, and the
    # gradients of those slots are 0.
    q, k, v = on(device, make_gqa(2, 4, 2, 3, 70, 16, 16))
    lengths = on(device, torch.tensor([51, 5]))
    kwargs = {"key_lengths": lengths, "window_left": -1, "window_right": 0}
    kernel_or_skip(device, q, k, v, **kwargs, backward=True)
    clean = check_grads(q, k, v, **kwargs)
    for t in (k, v):
        t[0, :, 51:] = float("nan")
        t[1, :, 5:] = float("inf")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attnx.attention(*leaves, **kwargs)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    grad_out = torch.randn(2, 4, 3, 16, generator=torch.Generator().manual_seed(7))  # check_grads' own
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.device))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[1][0, :, 51:] == 0).all() and (grads[2][1, :, 5:] == 0).all()
    torch.testing.assert_close(grads[0].cpu(), clean[0], rtol=0, atol=0)


@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64], ids=str)
def test_key_lengths_out_of_range(device, lengths_dtype):
    q, k, v = on(device, make_gqa(3, 2, 1, 20, 45, 8, 8))
    bad = on(device, torch.tensor([-3, 50, 7], dtype=lengths_dtype))
    kernel_or_skip(device, q, k, v, key_lengths=on(device, torch.tensor([0, 45, 7], dtype=lengths_dtype)))
    if torch.device(device).type == "cpu":
        # The glue reads CPU key_lengths, which costs no device sync, and refuses a length outside [0, S]. The
        # emulated backends' tensors are CPU tensors: the same check runs before their kernels.
        with pytest.raises(RuntimeError, match=re.escape(
                "attnx::attention: expected key_lengths in [0, S] = [0, 45], got key_lengths[0] = -3")):
            attnx.attention(q, k, v, key_lengths=bad, window_right=0)
        with pytest.raises(RuntimeError, match=re.escape("got key_lengths[1] = 50")):
            attnx.attention(q, k, v, key_lengths=bad.abs())
    else:
        # A GPU's lengths would need a sync to be read on the host: the kernels clamp them into [0, S].
        clamped = on(device, torch.tensor([0, 45, 7], dtype=lengths_dtype))
        got = attnx.attention(q, k, v, key_lengths=bad, window_right=0)
        torch.testing.assert_close(got, attnx.attention(q, k, v, key_lengths=clamped, window_right=0),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("window", [(40, 0), (-1, 5)], ids=str)
@pytest.mark.parametrize("L", [5, 40], ids=lambda L: f"L{L}")
def test_key_ranges_with_padding_that_skips_tiles(device, L, window):
    # A key range that starts mid-tile; key_padding_mask removes whole tiles of it in batch 0 and the last
    # keys of batch 1, whose key length also cuts the range. Then the same as a float mask, under is_causal.
    q, k, v = on(device, make_gqa(2, 2, 2, L, 100, 16, 16))
    kpm = torch.zeros(2, 100, dtype=torch.bool)
    kpm[0, 40:75] = True
    kpm[1, 50:] = True
    kwargs = {"window_left": window[0], "window_right": window[1]}
    lengths = on(device, torch.tensor([100, 70]))
    kernel_or_skip(device, q, k, v, key_padding_mask=on(device, kpm), key_lengths=lengths, **kwargs)
    check(q, k, v, key_padding_mask=on(device, kpm), key_lengths=lengths, **kwargs)
    check(q, k, v, key_padding_mask=on(device, torch.zeros(2, 100).masked_fill(kpm, float("-inf"))),
          is_causal=True, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Soft-capping and sinks.


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap(device, dtype):
    # scale 1 makes the scores ~N(0, 16): most of them are capped hard. float64 takes a cap that is not a
    # float (carried as softcap + softcap_lo).
    gen = torch.Generator().manual_seed(4)
    L, S = 37, 70
    cap = 10 / 3 if dtype == torch.float64 else 2.5
    q, k, v = on(device, make_gqa(2, 2, 1, L, S, 16, 16, dtype=dtype, layout="blhd"))
    kernel_or_skip(device, q, k, v, softcap=cap, scale=1.0)
    check(q, k, v, softcap=cap, scale=1.0)
    mask, kpm = on(device, (torch.rand(L, S, generator=gen) < 0.3, torch.randn(2, S, generator=gen)))
    check(q, k, v, softcap=0.5, scale=1.0, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
    check(q, k, v, softcap=50.0, attn_mask=on(device, torch.randn(L, S, generator=gen).to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sinks(device, dtype):
    L, S = 20, 45
    q, k, v = on(device, make_gqa(2, 4, 2, L, S, 16, 16, dtype=dtype, layout="blhd"))
    sinks = on(device, make_sinks(4, dtype))
    kernel_or_skip(device, q, k, v, sinks=sinks)
    check(q, k, v, sinks=sinks)
    # A sink far above every score (the row's probabilities ~exp(-40)), and a -inf sink (no sink at all), in
    # another floating dtype, which the glue converts.
    sinks[1], sinks[2] = 40.0, -math.inf
    other = torch.float32 if dtype == torch.float64 else torch.bfloat16 if dtype == torch.float32 else dtype
    check(q, k, v, sinks=sinks.to(other))
    # Query 3 sees no key, and batch 1 none at all: out 0, lse +inf, sink or not. Query 5 sees half the keys.
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[3] = True
    mask[5, ::2] = True
    kpm = torch.zeros(2, S)
    kpm[1] = -math.inf
    out, lse = check(q, k, v, sinks=sinks, attn_mask=on(device, mask), key_padding_mask=on(device, kpm),
                     is_causal=True)
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    assert torch.isfinite(lse[0, :, 5]).all()


@pytest.mark.parametrize("L", [5, 40], ids=lambda L: f"L{L}")
def test_sinks_and_rows_that_see_no_key(device, L):
    # A row that sees no key gets out 0 and lse +inf, sink or not: by its masks (query 2), by its batch's key
    # length 0 (batch 1), by a bool or a float mask.
    q, k, v = on(device, make_gqa(2, 2, 1, L, 9, 8, 8, dtype=torch.float16))
    sinks = on(device, torch.tensor([0.5, -1.0]).half())
    lengths = on(device, torch.tensor([9, 0]))
    kernel_or_skip(device, q, k, v, key_lengths=lengths, sinks=sinks)
    for masked in (torch.bool, torch.float16):
        mask = torch.zeros(L, 9, dtype=torch.bool)
        mask[2] = True
        if masked != torch.bool:
            mask = torch.zeros(L, 9, dtype=masked).masked_fill(mask, float("-inf"))
        out, lse = check(q, k, v, attn_mask=on(device, mask), key_lengths=lengths, sinks=sinks)
        assert (out[:, :, 2] == 0).all() and torch.isposinf(lse[:, :, 2]).all()
        assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
        assert torch.isfinite(lse[0, :, :2]).all()


def test_sink_takes_mass(device):
    # A huge sink takes (almost) all the probability: out tends to 0 and lse to the sink.
    q, k, v = on(device, make_gqa(1, 2, 2, 3, 5, 4, 4))
    sinks = on(device, torch.tensor([60.0, 60.0]))
    kernel_or_skip(device, q, k, v, sinks=sinks)
    out, lse = attnx.attention(q, k, v, sinks=sinks)
    assert out.abs().max() < 1e-20
    torch.testing.assert_close(lse.cpu(), torch.full((1, 2, 3), 60.0))


def test_float64_sinks_are_refused_on_metal(device):
    # Metal has no double: sinks are read as float, and float64 ones are refused rather than rounded.
    if device.backend not in ("mps", "metal-emu"):
        pytest.skip("float64 sinks are refused by the Metal backend only")
    q, k, v = on(device, make_gqa(1, 2, 2, 3, 4, 8, 8))
    with pytest.raises(RuntimeError, match="float64 sinks are not supported on MPS"):
        attnx.attention(q, k, v, sinks=torch.zeros(2, dtype=torch.float64))  # on the CPU: MPS has no float64


# ------------------------------------------------------------------------------------------------------------
# Everything together.


@pytest.mark.wheel
@pytest.mark.sanitize
@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_features_together(device, dtype, mask):
    # Grouped heads, a window, key lengths (one batch empty), soft-capping, sinks, a custom scale, an
    # attn_mask of nn.MultiheadAttention's (B*H, L, S) form and a key_padding_mask, on strided inputs (the
    # sequence-first layout, or a last-dim stride of 2).
    gen = torch.Generator().manual_seed(5)
    B, H, L, S = 3, 4, 40, 70
    layout = "lbhd" if mask == "bool" else "strided_last"
    q, k, v = on(device, make_gqa(B, H, 2, L, S, 24, 16, dtype=dtype, layout=layout))
    attn_mask, kpm = make_feature_masks(mask, B, H, L, S, dtype, gen)
    kwargs = on(device, {"attn_mask": attn_mask, "key_padding_mask": kpm, "window_left": 9, "window_right": 2,
                         "key_lengths": torch.tensor([S, 0, L - 4]), "softcap": 4.0,
                         "sinks": make_sinks(H, dtype), "scale": 0.4})
    kernel_or_skip(device, q, k, v, **kwargs)
    for is_causal in (False, True):
        out, lse = check(q, k, v, is_causal=is_causal, **kwargs)
        assert_unseen_rows_empty(out, lse, S, is_causal=is_causal, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_features_with_head_dims_above_256(device, dtype):
    # Above the kernels' head dims, CUDA runs its composite (torch ops through the stable ABI), features
    # included; Metal refuses the call.
    gen = torch.Generator().manual_seed(6)
    B, H, L, S = 3, 4, 9, 20
    q, k, v = on(device, make_gqa(B, H, 2, L, S, 288, 264, dtype=dtype, layout="lbhd"))
    kernel_or_skip(device, q, k, v, sinks=on(device, make_sinks(H, dtype)))
    extras = on(device, [
        {},
        {"sinks": make_sinks(H, dtype)},
        {"attn_mask": torch.rand(B * H, L, S, generator=gen) < 0.2,
         "key_padding_mask": torch.rand(B, S, generator=gen) < 0.2, "softcap": 3.0,
         "sinks": make_sinks(H, dtype), "key_lengths": torch.tensor([S, 0, L - 4])},
        {"attn_mask": torch.randn(L, S, generator=gen).to(dtype), "softcap": 2.0, "scale": 1.0,
         "key_lengths": torch.tensor([S, 7, 0], dtype=torch.int32)},
    ])
    for i, window in enumerate([(-1, 0), (2, 2), (0, -1)]):
        for j, extra in enumerate(extras):
            kwargs = {"is_causal": (i + j) % 2 == 1, "window_left": window[0], "window_right": window[1],
                      **extra}
            out, lse = check(q, k, v, **kwargs)
            assert_unseen_rows_empty(out, lse, S, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_big_window(device, dtype):
    # A sliding window over long sequences: each query block visits only the key tiles its window reaches.
    if device.emulated:
        pytest.skip("too large for the emulators (thousands of blocks of emulated threads)")
    B, H, L, S = 2, 4, 1030, 1500
    q, k, v = on(device, make_gqa(B, H, 2, L, S, 128, 128, dtype=dtype, layout="blhd"))
    kwargs = on(device, {"window_left": 127, "window_right": 0, "key_lengths": torch.tensor([S, 1200]),
                         "softcap": 30.0, "sinks": make_sinks(H, dtype)})
    kernel_or_skip(device, q, k, v, **kwargs)
    check(q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Gradients of the features.


def _grad_case(case, dtype, device):
    """(q, k, v, grad_names, kwargs) of a GRAD_CASES case, on device."""
    gen = torch.Generator().manual_seed(3)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    qkv = ("q", "k", "v")
    if case == "gqa causal":  # partial query and key tiles of every backward kernel
        return (*on(device, make_gqa(2, 4, 1, 37, 70, 16, 24, dtype=dtype)), qkv, {"is_causal": True})
    if case == "gqa window strided":
        q, k, v = on(device, make_gqa(2, 4, 2, 20, 30, 8, 8, dtype=dtype, layout="blhd"))
        return q, k, v, qkv, {"window_left": 5, "window_right": 1}
    if case == "key lengths":  # full, empty, partial
        q, k, v = on(device, make_gqa(3, 4, 2, 5, 40, 16, 16, dtype=dtype))
        kwargs = {"key_lengths": torch.tensor([40, 0, 14]), "window_left": 4, "window_right": 0}
        return q, k, v, qkv, on(device, kwargs)
    if case == "window masks":  # batch 1's window rows near the end see only padded keys
        q, k, v = on(device, make_gqa(2, 4, 2, 12, 30, 8, 8, dtype=dtype))
        kpm = torch.zeros(2, 30, dtype=torch.bool)
        kpm[1, 20:] = True
        kwargs = {"attn_mask": torch.randn(12, 30, generator=gen).to(dtype), "key_padding_mask": kpm,
                  "window_left": 2, "window_right": 0}
        return q, k, v, qkv, on(device, kwargs)
    if case == "softcap":  # scores beyond the cap, where tanh bends
        q, k, v = on(device, make_gqa(2, 4, 2, 20, 45, 16, 16, dtype=dtype))
        kwargs = {"softcap": 7.3, "is_causal": True,
                  "attn_mask": torch.randn(20, 45, generator=gen).to(dtype)}
        return q * 4, k, v, qkv, on(device, kwargs)
    if case == "sinks":  # batch 1 sees no key
        q, k, v = on(device, make_gqa(2, 4, 2, 20, 45, 16, 16, dtype=dtype))
        kpm = torch.zeros(2, 45, dtype=torch.bool)
        kpm[1] = True
        kwargs = {"sinks": (torch.randn(4, generator=gen) * 3).to(acc), "key_padding_mask": kpm}
        return q, k, v, (*qkv, "sinks"), on(device, kwargs)
    assert case == "everything"
    q, k, v = on(device, make_gqa(3, 4, 2, 20, 45, 16, 8, dtype=dtype, layout="blhd"))
    kwargs = {"attn_mask": torch.randn(1, 4, 20, 45, generator=gen).to(dtype),
              "key_padding_mask": torch.rand(3, 45, generator=gen) < 0.2,
              "key_lengths": torch.tensor([45, 30, 21]), "window_left": 12, "window_right": 2, "softcap": 5.0,
              "sinks": torch.randn(4, generator=gen).to(acc)}
    return q, k, v, (*qkv, "attn_mask", "sinks"), on(device, kwargs)


GRAD_CASES = [
    *(pytest.param(case, dtype, id=f"{case}-{dtype}") for case in ("gqa causal", "softcap", "sinks")
      for dtype in DTYPES),
    *(pytest.param(case, torch.float32, id=case)
      for case in ("gqa window strided", "key lengths", "window masks", "everything")),
]


@pytest.mark.parametrize(("case", "dtype"), GRAD_CASES)
def test_feature_gradients(device, case, dtype):
    q, k, v, grad_names, kwargs = _grad_case(case, dtype, device)
    kernel_or_skip(device, q, k, v, **kwargs, backward=True)
    if case in ("key lengths", "window masks", "sinks"):  # rows that see no key: lse +inf
        _, lse = check(q, k, v, **kwargs)
        assert torch.isposinf(lse[1] if case != "window masks" else lse[1, :, -1]).all()
    check_grads(q, k, v, grad_names=grad_names, **kwargs)


@pytest.mark.parametrize("shape", RANGE_SHAPES, ids=str)
def test_windows_gradients(device, shape):
    L, S = shape
    q, k, v = on(device, make_gqa(1, 2, 1, L, S, 16, 8))
    kernel_or_skip(device, q, k, v, window_left=3, window_right=0, backward=True)
    for i, (window_left, window_right) in enumerate(WINDOWS):
        check_grads(q, k, v, window_left=window_left, window_right=window_right, is_causal=i % 2 == 1)


# ------------------------------------------------------------------------------------------------------------
# The gradient of a float attn_mask (learned biases).

# (shape of the bias, B, H): every way it can broadcast over (B, H, L, S).
BIAS_SHAPES = [
    ((20, 45), 2, 4),  # (L, S): summed over B and H
    ((8, 20, 45), 2, 4),  # nn.MultiheadAttention's (B*H, L, S)
    ((1, 4, 20, 45), 2, 4),  # T5 / Swin: per head, shared by the batch
    ((2, 1, 20, 45), 2, 4),
    ((2, 4, 20, 45), 2, 4),
    ((1, 4, 1, 45), 2, 4),  # per head and key (ALiBi-like slopes times positions)
    ((2, 1, 20, 1), 2, 4),  # per query: summed over keys
    ((1, 1, 1, 1), 2, 4),
]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=str)
def test_mask_gradient(device, bias_shape):
    shape, B, H = bias_shape
    q, k, v = on(device, make_gqa(B, H, 2, 20, 45, 8, 8))
    bias = on(device, torch.randn(shape))
    kernel_or_skip(device, q, k, v, attn_mask=bias, is_causal=True, backward=True)
    grads = check_grads(q, k, v, grad_names=("q", "k", "v", "attn_mask"), attn_mask=bias, is_causal=True)
    assert grads[3].shape == bias.shape


def test_mask_gradient_of_an_expanded_mask(device):
    # An expanded (stride-0, full-size) mask gets one gradient element per element: autograd's expand
    # backward then sums them into the base.
    q, k, v = on(device, make_gqa(2, 2, 2, 6, 7, 4, 4))
    base = on(device, torch.randn(1, 1, 6, 7)).requires_grad_()
    kernel_or_skip(device, q, k, v, attn_mask=base.expand(2, 2, 6, 7), backward=True)
    out, _ = attnx.attention(q, k, v, attn_mask=base.expand(2, 2, 6, 7))
    out.sum().backward()
    base_ref = base.detach().cpu().requires_grad_()
    reference.attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=base_ref.expand(2, 2, 6, 7))[0].sum().backward()
    torch.testing.assert_close(base.grad.cpu(), base_ref.grad)


# ------------------------------------------------------------------------------------------------------------
# The CPU kernel's own tiles and thread plans, and what the CPU alone is asked (allocations, the cost of a
# window): shapes far beyond what the emulators afford.


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 7)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(200, 1100), (1, 600)], ids=str)
def test_key_ranges_across_cpu_tiles(shape, is_causal, window):
    # Past the CPU forward's 128-query, 512-key tiles, with and without key lengths that end mid-tile.
    L, S = shape
    q, k, v = make_gqa(2, 2, 1, L, S, 16, 8, dtype=torch.float64)
    kwargs = {"window_left": window[0], "window_right": window[1], "is_causal": is_causal}
    check_forward(q, k, v, **kwargs)
    check_forward(q, k, v, key_lengths=torch.tensor([S, 513]), **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_gqa_backward_cpu_tiles(heads, dtype):
    # S = 300: three backward key tiles of 128, the last partial; L = 130: two query tiles.
    H, Hkv = heads
    check_grads(*make_gqa(2, H, Hkv, 130, 300, 16, 24, dtype=dtype), is_causal=True)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_gqa_backward_plans(threads, intra_op_threads):
    # One kv head and few threads: keys are split into chunks whose dQ slots are summed afterwards.
    intra_op_threads(threads)
    check_grads(*make_gqa(1, 4, 1, 70, 600, 8, 8, dtype=torch.float64))


def test_unfilled_cache_slots_across_cpu_tiles():
    # Key lengths ending just past the CPU's first 512-key tile: NaN past them reaches no output or gradient.
    q, k, v = make_gqa(2, 4, 2, 3, 700, 16, 16)
    lengths = torch.tensor([513, 5])
    for t in (k, v):
        t[0, :, 513:] = float("nan")
        t[1, :, 5:] = float("inf")
    out, lse = check_forward(q, k, v, key_lengths=lengths, window_left=-1, window_right=0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    grads = check_grads(q, k, v, key_lengths=lengths, window_left=-1, window_right=0)
    assert all(torch.isfinite(g).all() for g in grads)


def test_window_cost_follows_the_window():
    # Tiles outside the window are skipped: NaN keys far outside every row's window do not reach the output,
    # which would happen if their tiles were read (a NaN score poisons its row's maximum).
    q, k, v = make_gqa(1, 2, 2, 2048, 2048, 16, 16)
    k[:, :, :512] = float("nan")  # only the first 512 keys, which no row of the last 1024 queries sees
    out, _ = attnx.attention(q, k, v, window_left=255, window_right=0)
    assert torch.isfinite(out[:, :, 1024:]).all()


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
# gradcheck (float64, finite differences), fakes and opcheck: the op's contract, the same on every device.

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
        "block map": (q, k, v, None, None, False, None, 0.0, None, -1, -1, None, None, None,
                      torch.tensor([[[[-2, 0], [-1, -2], [0, 1]]]], dtype=torch.int32),
                      torch.randint(-(2**31), 2**31 - 1, (2, 2, 1), dtype=torch.int32), 2, 4),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    args = _opcheck_cases()[case]
    torch.library.opcheck(torch.ops.attnx.attention.default, args)
    q, k, v = args[:3]
    out, lse = torch.ops.attnx.attention.default(*args)
    bwd = (torch.randn_like(out), q, k, v, out, lse, *args[3:])
    torch.library.opcheck(torch.ops.attnx.attention_backward.default, bwd,
                          {"grad_attn_mask": args[3] is not None})


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
# Bad input: torch-style errors, never a crash or a silent wrong answer (key_lengths' values:
# test_key_lengths_out_of_range).


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
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                attnx.attention(*args, **kwargs)
    else:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attnx.attention(*args, **kwargs)
