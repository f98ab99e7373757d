"""attnx's Metal kernels (metal/*.metal) compiled for the CPU with clang and run there, vs the reference.

Every .metal file is compiled as C++ against tests/emulation/metal/metal_stdlib (threadgroup memory poisoned
per threadgroup, threadgroup_barrier as a barrier of the group's threads, simd collectives that check every
lane arrives at the same call site, 8x8 simdgroup matrices; the threads are fibers here, std::threads in the
ThreadSanitizer build) and launched from csrc/mps/metal_plan.h, the launch plan the MPS glue uses. This checks
algorithm and indexing: strides (the B=1 transpose, slices, stride 0), every mask kind, causal, fully masked
rows, NaN, every dtype, both attention kernels and both linear kernels; and the attention features both
kernels take as parameters: grouped KV heads, key lengths, windows, soft-capping and sinks. It cannot check
that Apple's compiler accepts the files, nor speed: tests/test_mps.py does that on a Mac.

Shapes are small: every emulated threadgroup is 128 threads, and every lane of a simdgroup matrix product
computes all 64 elements."""

import os
import re
import subprocess
import sys

import pytest
import torch

from attention_helpers import (
    ATOL,
    ATTN_MASK_KINDS,
    EMPTY_SIZES,
    KEY_PADDING_MASK_KINDS,
    LSE_ATOL,
    MASKED_SHAPE,
    QKV_LAYOUTS,
    assert_bounded,
    assert_fully_masked_rows,
    assert_matches_reference,
    assert_nan_rows,
    fully_masked_rows_case,
    key_tile_skipping_cases,
    make_attn_mask,
    make_gqa,
    make_key_padding_mask,
    make_qkv,
    nan_rows_case,
)
from attnx import reference
from emulation import metal_emulator
from layouts import LAYOUTS as LINEAR_LAYOUTS
from layouts import make

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metal"))
import embed  # noqa: E402  (metal/embed.py, the build step that embeds the sources)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNELS = {"vector": 5, "tiled": 40}  # a query length that selects each attention kernel


# CI sets this: there, a missing clang++ or libtsan is a failure, not a skip.
REQUIRED = os.environ.get("ATTNX_REQUIRE_METAL_EMULATION") == "1"


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"{reason} (ATTNX_REQUIRE_METAL_EMULATION=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def emu():
    try:
        path = metal_emulator.build()
    except metal_emulator.Unavailable as e:
        _unavailable(f"Metal emulation unavailable: {e}")
    return metal_emulator.MetalEmulator(path)


def check(emu, q, k, v, out_layout="blhd", kernel=None, **kwargs):
    """Runs the emulated kernel and compares out and lse with the reference, as check_forward does."""
    out, lse = emu.attention(q, k, v, out_layout=out_layout, **kwargs)
    if kernel is not None:
        assert metal_emulator.ATTENTION_KERNELS[emu.last_plan.kernel] == kernel
    return assert_matches_reference(out, lse, q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Attention: dtypes, layouts, head-dim buckets, tile and threadgroup boundaries.

@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_dtypes_layouts(emu, kernel, dtype, layout):
    # tiled: L = 40 is two threadgroups of 32 rows, the second partial; S = 37 is two key tiles, the second
    # partial. vector: one threadgroup per row, keys spread over the 4 simdgroups unevenly.
    check(emu, *make_qkv(2, 2, KERNELS[kernel], 37, 24, 20, dtype=dtype, layout=layout), kernel=kernel)


# (kernel, L, S, D, Dv): every instantiated bucket; D != Dv; sizes that are not multiples of 8 or 32.
BUCKETS = [("vector", 3, 40, 8, 32), ("vector", 1, 33, 64, 40), ("vector", 2, 35, 100, 128),
           ("vector", 2, 20, 256, 200), ("vector", 33, 9, 129, 3), ("tiled", 9, 40, 30, 12),
           ("tiled", 12, 33, 64, 40), ("tiled", 10, 20, 100, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", BUCKETS, ids=str)
def test_attention_head_dim_buckets(emu, sizes, dtype):
    kernel, L, S, D, Dv = sizes
    check(emu, *make_qkv(1, 1, L, S, D, Dv, dtype=dtype, layout="blhd"), is_causal=True, kernel=kernel)


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_many_threadgroups_and_tiles(emu, is_causal):
    # 3 threadgroups of 32 rows and 3 key tiles; causal stops each threadgroup at its last row's diagonal.
    check(emu, *make_qkv(1, 1, 70, 90, 16, 16), is_causal=is_causal, kernel="tiled")


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_b1_transposed_and_out_strides(emu, kernel):
    # nn.MultiheadAttention(batch_first=True) at B=1: the size-1 batch dim carries a non-contiguous stride.
    q, k, v = make_qkv(1, 4, KERNELS[kernel], 12, 8, 8, layout="lbhd")
    assert q.stride(0) == 4 * 8
    check(emu, q, k, v)
    check(emu, q, k, v, out_layout="bhld")  # the kernels write through out's strides, whatever they are


def test_attention_sliced_with_storage_offset(emu):
    big = torch.randn(3, 2, 50, 40)
    for L in KERNELS.values():
        q, k, v = big[1:2, :, 3 : 3 + L, 5:21], big[2:, :, 1:30, 2:18], big[:1, :, :29, 20:36]
        assert q.storage_offset() > 0 and k.storage_offset() > 0
        check(emu, q, k, v)


def test_attention_custom_scale(emu):
    for L in KERNELS.values():
        q, k, v = make_qkv(1, 2, L, 30, 16, 16)
        check(emu, q, k, v, scale=0.37)
        check(emu, q, k, v, scale=0.0)


# ------------------------------------------------------------------------------------------------------------
# Masks (the factories of attention_helpers: B, H, L, S, D = 2, 3, 19, 41, 16; L = 19 takes the tiled
# kernel). Metal has no float64: no float64 mask.

B, H, L, S = MASKED_SHAPE
D = 16
ATTN_MASKS = [kind for kind in ATTN_MASK_KINDS if kind != "float64_ls"]


def _rows(q, k, v, kernel):
    """q, k, v with L cut to the vector kernel's query length when asked (masks keep their L rows)."""
    return (q[:, :, :KERNELS["vector"]], k, v) if kernel == "vector" else (q, k, v)


def _cut_mask(mask, kernel):
    if mask is None or kernel != "vector" or mask.dim() < 2 or mask.size(-2) == 1:
        return mask
    return mask[..., : KERNELS["vector"], :]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("attn_mask", ATTN_MASKS, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_attn_mask(emu, kernel, attn_mask, is_causal):
    mask = _cut_mask(make_attn_mask(attn_mask, torch.Generator().manual_seed(1)), kernel)
    q, k, v = _rows(*make_qkv(B, H, L, S, D, D, layout="blhd"), kernel)
    check(emu, q, k, v, attn_mask=mask, is_causal=is_causal, kernel=kernel)


@pytest.mark.parametrize("padding", KEY_PADDING_MASK_KINDS, ids=str)
@pytest.mark.parametrize("attn_mask", [None, "bool_ls", "float_bhls"], ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_padding_and_attn_mask(emu, kernel, attn_mask, padding):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else _cut_mask(make_attn_mask(attn_mask, gen), kernel)
    q, k, v = _rows(*make_qkv(B, H, L, S, D, D), kernel)
    check(emu, q, k, v, attn_mask=mask, key_padding_mask=make_key_padding_mask(padding, gen),
          is_causal=padding == "bool", kernel=kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_masks_low_precision_and_strided(emu, kernel, dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = _rows(*make_qkv(B, H, L, S, D, 8, dtype=dtype, layout="strided_last"), kernel)
    mask = _cut_mask(make_attn_mask("float_ls", gen).to(dtype), kernel)
    check(emu, q, k, v, attn_mask=mask, key_padding_mask=make_key_padding_mask("bool", gen), is_causal=True,
          scale=0.2, kernel=kernel)


def test_attention_padding_skips_whole_tiles(emu):
    # Batch 0: key_padding_mask removes the whole first key tile (skipped by the threadgroup) and part of the
    # third; batch 1: the whole last, partial tile. attn_mask removes a whole tile for some rows only.
    qkv, cases = key_tile_skipping_cases()
    for masks in cases:
        check(emu, *qkv, **masks, kernel="tiled")


def test_attention_float64_masks_are_refused(emu):
    q, k, v = make_qkv(1, 1, 3, 4, 8, 8)
    with pytest.raises(TypeError, match="float64"):
        emu.attention(q, k, v, attn_mask=torch.zeros(3, 4, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------------------
# Fully masked rows, NaN, infinities, empty sizes.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_fully_masked_rows(emu, kernel, dtype):
    # Query 2 sees no key; batch 1 sees no key at all (skipped key by key, or tile by tile).
    qkv, masks = fully_masked_rows_case(KERNELS[kernel], dtype)
    assert_fully_masked_rows(*check(emu, *qkv, **masks))


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_fully_masked_row_with_infinite_values(emu, kernel):
    # A masked key whose value is inf gives 0 * inf = NaN in the accumulator; the row is written as 0 anyway.
    q, k, v = make_qkv(1, 1, KERNELS[kernel], 5, 8, 8)
    v[0, 0, 3] = float("inf")
    mask = torch.zeros(KERNELS[kernel], 5, dtype=torch.bool)
    mask[1] = True
    out, lse = emu.attention(q, k, v, attn_mask=mask)
    assert (out[0, 0, 1] == 0).all() and torch.isposinf(lse[0, 0, 1])


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_nan_propagates_per_row(emu, kernel):
    # NaN in every score of row (h=1, l=2), and in one score of row l=4 of every head.
    qkv, masks = nan_rows_case(KERNELS[kernel])
    assert_nan_rows(*check(emu, *qkv, **masks))


@pytest.mark.parametrize("sizes", [*EMPTY_SIZES, (1, 1, 12, 0, 8, 8)], ids=str)
def test_attention_empty_sizes(emu, sizes):
    q, k, v = make_qkv(*sizes)
    out, lse = check(emu, q, k, v, key_padding_mask=torch.zeros(sizes[0], sizes[3], dtype=torch.bool))
    if sizes[3] == 0:
        assert (out == 0).all() and torch.isposinf(lse).all()


# ------------------------------------------------------------------------------------------------------------
# Grouped KV heads, key ranges (key lengths, windows), soft-capping and sinks: parameters of both kernels.
# Query lengths per kernel: vector 1 (a decoding step) and 5; tiled 40 (two threadgroups, the second partial).


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 3)], ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_grouped_kv_heads(emu, kernel, heads, layout):
    H, Hkv = heads
    q, k, v = make_gqa(2, H, Hkv, KERNELS[kernel], 37, 24, 20, layout=layout)
    check(emu, q, k, v, kernel=kernel)
    check(emu, q, k, v, is_causal=True, kernel=kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_grouped_kv_heads_b1_transposed(emu, kernel, dtype):
    # The B=1 transpose (a size-1 batch dim with a non-contiguous stride) on query and on the shared kv heads.
    q, k, v = make_gqa(1, 4, 2, KERNELS[kernel], 30, 16, 16, dtype=dtype, layout="lbhd")
    assert q.stride(0) == 4 * 16 and k.stride(0) == 2 * 16
    check(emu, q, k, v, kernel=kernel)
    check(emu, q, k, v, out_layout="bhld", kernel=kernel)


WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 2), (0, -1), (20, 3)]
LENGTHS = [None, torch.int32, torch.int64]


def _key_lengths(dtype, B, S):
    """Per-batch key lengths cycling through 0, S and values in between; None for dtype None."""
    if dtype is None:
        return None
    return torch.tensor([[0, S, S // 2 + 1, 1][b % 4] for b in range(B)], dtype=dtype)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("kernel, Lq", [("vector", 1), ("vector", 5), ("tiled", 40)])
def test_attention_key_ranges(emu, kernel, Lq, window, lengths, is_causal):
    # S = 75: three key tiles, the last partial; a window that reaches two of them starts mid-tile.
    B, S = 4, 75
    q, k, v = make_gqa(B, 2, 1, Lq, S, 16, 12, layout="blhd")
    check(emu, q, k, v, window_left=window[0], window_right=window[1],
          key_lengths=_key_lengths(lengths, B, S), is_causal=is_causal, kernel=kernel)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("kernel, Lq", [("vector", 7), ("tiled", 40)])
def test_attention_key_ranges_more_queries_than_keys(emu, kernel, Lq, window, lengths):
    # L > S: under a bottom-right window the first rows sit before key 0 and see nothing: out 0, lse +inf.
    B, S = 2, 4
    q, k, v = make_qkv(B, 2, Lq, S, 8, 8)
    key_lengths = _key_lengths(lengths, B, S)
    out, lse = check(emu, q, k, v, window_left=window[0], window_right=window[1], key_lengths=key_lengths,
                     kernel=kernel)
    for b in range(B):
        S_b = S if key_lengths is None else int(key_lengths[b])
        # Rows l < L - S_b - window_right sit too far before key 0 to reach it; the others see key 0 or more.
        empty = Lq if S_b == 0 else max(Lq - S_b - window[1], 0) if window[1] >= 0 else 0
        assert (out[b, :, :empty] == 0).all() and torch.isposinf(lse[b, :, :empty]).all()
        assert torch.isfinite(lse[b, :, empty:]).all()


@pytest.mark.parametrize("kernel, Lq", [("vector", 1), ("vector", 6), ("tiled", 12)])
def test_attention_chunked_prefill(emu, kernel, Lq):
    # The last L of S_b positions (a chunk of a prompt, or one decoding step, over a KV cache of S slots):
    # bottom-right causal (-1, 0), with and without a sliding window, per-batch lengths.
    B, S = 3, 50
    q, k, v = make_gqa(B, 4, 2, Lq, S, 16, 16, layout="packed")
    key_lengths = torch.tensor([S, 20, Lq], dtype=torch.int32)
    for window_left in (-1, 8):
        check(emu, q, k, v, window_left=window_left, window_right=0, key_lengths=key_lengths, kernel=kernel)


@pytest.mark.parametrize("kernel, Lq", [("vector", 1), ("vector", 5), ("tiled", 40)])
def test_attention_keys_outside_the_range_are_never_read(emu, kernel, Lq):
    # Keys past key_lengths[b] (unused KV-cache slots) and keys before every row's window are skipped, not
    # masked: NaN there changes nothing. With the window (3, 0), no row of batch b sees a key below
    # S_b - L - 3 (the tiled kernel's first threadgroup starts its tiles there: 32 in batch 0).
    B, S = 2, 75
    q, k, v = make_qkv(B, 2, Lq, S, 16, 16)
    key_lengths = torch.tensor([S, 60], dtype=torch.int64)
    kwargs = dict(window_left=3, window_right=0, key_lengths=key_lengths, kernel=kernel)
    clean, clean_lse = check(emu, q, k, v, **kwargs)
    for t in (k, v):
        for b, S_b in enumerate(key_lengths.tolist()):
            t[b, :, : S_b - Lq - 3] = float("nan")
            t[b, :, S_b:] = float("nan")
    out, lse = emu.attention(q, k, v, **{n: a for n, a in kwargs.items() if n != "kernel"})
    assert torch.equal(out, clean) and torch.equal(lse, clean_lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_softcap(emu, kernel, dtype):
    # scale 1 on D = 16: scores of size ~4, so a cap of 1.5 saturates many of them.
    gen = torch.Generator().manual_seed(4)
    q, k, v = _rows(*make_qkv(B, H, L, S, D, D, dtype=dtype, layout="blhd"), kernel)
    check(emu, q, k, v, softcap=1.5, scale=1.0, kernel=kernel)
    mask = _cut_mask(make_attn_mask("bool_ls", gen), kernel)
    check(emu, q, k, v, softcap=1.5, scale=1.0, attn_mask=mask,
          key_padding_mask=make_key_padding_mask("float", gen), is_causal=True, kernel=kernel)
    bias = _cut_mask(make_attn_mask("float_bhls", gen), kernel)
    check(emu, q, k, v, softcap=30.0, attn_mask=bias, kernel=kernel)


SINKS = {
    "randn": lambda: torch.randn(H, generator=torch.Generator().manual_seed(5)) * 2,
    "large": lambda: torch.tensor([30.0, -30.0, 0.0]),  # one sink that takes almost all the mass
    "neginf": lambda: torch.tensor([float("-inf"), 1.0, -1.0]),  # -inf: no sink for that head
}


@pytest.mark.parametrize("sinks", SINKS)
@pytest.mark.parametrize("masks", [None, "bool", "float"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_sinks(emu, kernel, masks, sinks):
    gen = torch.Generator().manual_seed(6)
    q, k, v = _rows(*make_qkv(B, H, L, S, D, D, layout="blhd"), kernel)
    kwargs = {}
    if masks is not None:
        kwargs["attn_mask"] = _cut_mask(make_attn_mask(f"{masks}_ls", gen), kernel)
        kwargs["key_padding_mask"] = make_key_padding_mask(masks, gen)
    check(emu, q, k, v, sinks=SINKS[sinks](), kernel=kernel, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_sinks_fully_masked_rows(emu, kernel, dtype):
    # A row that sees no key gets out 0 and lse +inf, sink or not: by its masks (query 2), by its batch's key
    # length 0 (batch 1), or by the window (none here: every row of batch 0 sees its own position).
    Lq = KERNELS[kernel]
    q, k, v = make_qkv(2, 2, Lq, 9, 8, 8, dtype=dtype)
    mask = torch.zeros(Lq, 9, dtype=torch.bool)
    mask[2] = True
    sinks = torch.tensor([0.5, -1.0]).to(dtype)
    out, lse = check(emu, q, k, v, attn_mask=mask, key_lengths=torch.tensor([9, 0]), sinks=sinks,
                     kernel=kernel)
    assert (out[:, :, 2] == 0).all() and torch.isposinf(lse[:, :, 2]).all()
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    assert torch.isfinite(lse[0, :, :2]).all()


@pytest.mark.parametrize("layout", ["blhd", "lbhd", "expanded_kv", "strided_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_all_features_with_masks(emu, kernel, dtype, layout):
    # Everything at once: grouped KV heads, per-batch int32 key lengths, a window, soft-capping, sinks, a bool
    # attn_mask (B*H, L, S) and a float key_padding_mask.
    gen = torch.Generator().manual_seed(7)
    Bn, Hq, Hkv, Lq, Sn = 2, 4, 2, KERNELS[kernel], 70
    q, k, v = make_gqa(Bn, Hq, Hkv, Lq, Sn, 24, 16, dtype=dtype, layout=layout)
    attn_mask = torch.rand(Bn * Hq, Lq, Sn, generator=gen) < 0.2
    kpm = torch.randn(Bn, Sn, generator=gen).to(dtype)
    sinks = torch.randn(Hq, generator=gen)
    for window in [(30, 2), (-1, 0)]:
        check(emu, q, k, v, attn_mask=attn_mask, key_padding_mask=kpm, window_left=window[0],
              window_right=window[1], key_lengths=torch.tensor([Sn, 45], dtype=torch.int32), softcap=2.0,
              scale=0.5, sinks=sinks, kernel=kernel)


def test_attention_strided_key_lengths(emu):
    # key_lengths read in place through its stride (a column of a (B, 2) tensor).
    lengths = torch.tensor([[3, 99], [40, 99], [0, 99]], dtype=torch.int64)[:, 0]
    assert lengths.stride(0) == 2
    for Lq in KERNELS.values():
        check(emu, *make_gqa(3, 2, 1, Lq, 40, 8, 8), key_lengths=lengths, window_right=1)


def test_attention_key_lengths_out_of_range_are_clamped(emu):
    # The GPU cannot report a bad length without a sync: the kernels clamp into [0, S] (range_kv_len).
    for Lq in KERNELS.values():
        q, k, v = make_qkv(3, 2, Lq, 20, 8, 8)
        out, lse = emu.attention(q, k, v, key_lengths=torch.tensor([-3, 25, 7], dtype=torch.int32),
                                 window_right=0)
        ref_out, ref_lse = reference.attention(q.double(), k.double(), v.double(), window_right=0,
                                               key_lengths=torch.tensor([0, 20, 7]))
        assert_bounded(out, ref_out, ref_out, ATOL[q.dtype], "out")
        assert_bounded(lse, ref_lse, ref_lse, LSE_ATOL[q.dtype], "lse")


@pytest.mark.parametrize("window", [(40, 0), (-1, 5)], ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_key_ranges_with_padding_that_skips_tiles(emu, kernel, window):
    # The tiled kernel's tiles start mid-range (at the block's first key); key_padding_mask removes whole
    # tiles of them in batch 0 and the last keys of batch 1, whose key length also cuts the range.
    q, k, v = make_qkv(2, 2, KERNELS[kernel], 100, 16, 16)
    kpm = torch.zeros(2, 100, dtype=torch.bool)
    kpm[0, 40:75] = True
    kpm[1, 50:] = True
    check(emu, q, k, v, key_padding_mask=kpm, window_left=window[0], window_right=window[1],
          key_lengths=torch.tensor([100, 70]), kernel=kernel)
    check(emu, q, k, v, key_padding_mask=torch.zeros(2, 100).masked_fill(kpm, float("-inf")),
          window_left=window[0], window_right=window[1], is_causal=True, kernel=kernel)


def test_attention_float64_sinks_are_refused(emu):
    q, k, v = make_qkv(1, 2, 3, 4, 8, 8)
    with pytest.raises(TypeError, match="float64"):
        emu.attention(q, k, v, sinks=torch.zeros(2, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------------------
# linear: both kernels, every input layout of tests/layouts.py, weight and bias layouts.

LINEAR_ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def check_linear(emu, x, w, b=None, kernel=None):
    out = emu.linear(x, w, b)
    if kernel is not None:
        assert metal_emulator.LINEAR_KERNELS[emu.last_plan.kernel] == kernel
    ref64 = reference.linear(x.double(), w.double(), None if b is None else b.double())
    ref = reference.linear(x, w, b)
    assert out.shape == ref64.shape and out.dtype == x.dtype
    if out.numel():
        err = (out.double() - ref64).abs().max().item()
        ref_err = (ref.double() - ref64).abs().max().item()
        assert err <= 2 * ref_err + LINEAR_ATOL[x.dtype], f"error {err:.3g} vs torch's {ref_err:.3g}"
    return out


# (batch dims, K, N): gemv for up to 8 rows, gemm beyond; tiles of 32 with partial tails in M, N and K.
LINEAR_SHAPES = [("gemv", (5, 1), 40, 37), ("gemv", (1, 8), 70, 9), ("gemm", (9, 4), 45, 70),
                 ("gemm", (40, 1), 33, 20)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LINEAR_LAYOUTS)
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=str)
def test_linear_layouts(emu, shape, layout, dtype):
    kernel, batch, K, N = shape
    x = make((*batch, K), layout, dtype)
    check_linear(emu, x, torch.randn(N, K).to(dtype), torch.randn(N).to(dtype), kernel=kernel)


def test_linear_b1_transposed_is_read_in_place(emu):
    # The upstream report's layout: (B, L, E).transpose(0, 1) at B = 1, strides (E, E * L) on a size-1 dim.
    x = torch.randn(1, 32, 24).transpose(0, 1)
    assert x.stride() == (24, 768, 1)
    p = emu.linear_input_layout(x.shape, x.stride())
    assert p is not None and p.rows == 32 and p.rows_inner == 1 and list(p.input_stride) == [24, 0, 1]
    check_linear(emu, x, torch.randn(16, 24), torch.randn(16), kernel="gemm")
    check_linear(emu, x[:5], torch.randn(16, 24), kernel="gemv")


def test_linear_input_layouts_without_copy(emu):
    # (L, B, E) views of batch-first data: two row groups, read in place.
    x = torch.randn(3, 7, 16).transpose(0, 1)
    p = emu.linear_input_layout(x.shape, x.stride())
    assert (p.rows, p.rows_inner, *p.input_stride) == (21, 3, 16, 112, 1)
    # Dims that merge: a contiguous 4-D input is one group.
    x = torch.randn(2, 3, 4, 5)
    p = emu.linear_input_layout(x.shape, x.stride())
    assert (p.rows, p.rows_inner, p.input_stride[0]) == (24, 1, 5)
    # Weight and bias through their strides (a size-1 bias broadcasts); out contiguous.
    x, w, b = torch.randn(4, 16), torch.randn(30, 16)[::3], torch.randn(1)
    p = emu.pack_linear_params(x, w, b)
    assert (list(p.weight_stride), p.bias_stride, p.has_bias, list(p.out_stride)) == ([48, 1], 0, 1, [10, 1])
    # Three groups that do not merge: the glue copies once.
    x = torch.randn(2, 6, 4, 10, 5)[:, ::2, :, ::3]
    assert emu.linear_input_layout(x.shape, x.stride()) is None
    check_linear(emu, x, torch.randn(3, 5))


@pytest.mark.parametrize("weight_layout", ["transposed_storage", "sliced_rows", "expanded"])
@pytest.mark.parametrize("rows", [3, 20])
def test_linear_weight_and_bias_layouts(emu, rows, weight_layout):
    K, N = 12, 10
    x = torch.randn(rows, K)
    w = {
        "transposed_storage": lambda: torch.randn(K, N).t(),
        "sliced_rows": lambda: torch.randn(3 * N, K)[N : 2 * N],
        "expanded": lambda: torch.randn(1, K).expand(N, K),
    }[weight_layout]()
    check_linear(emu, x, w, torch.randn(3 * N)[1::3])  # a strided bias
    check_linear(emu, x, w, torch.randn(1))  # a size-1 bias broadcasts


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (5,), (40, 0)], ids=str)
def test_linear_edge_sizes(emu, shape):
    x = torch.randn(shape)
    K = shape[-1]
    check_linear(emu, x, torch.randn(6, K), torch.randn(6))
    check_linear(emu, x, torch.randn(0, K))


# ------------------------------------------------------------------------------------------------------------
# The launch plan and the library: what the glue asks for exists, and is what the kernels declare.


def test_plans_name_instantiated_kernels(emu):
    names = set(emu.kernel_names())
    planned = set()
    for dtype in DTYPES:
        for d in (1, 32, 33, 64, 65, 128, 129, 256):
            for Lq in (1, 8, 9, 100):
                p = metal_emulator.make_params(*make_qkv(1, 1, Lq, 1, d, d))
                plan = emu.plan_attention(p, dtype)
                name = plan.launch.name.decode()
                planned.add(name)
                expected = "vector" if Lq <= 8 or d > 128 else "tiled"
                assert re.fullmatch(rf"attention_{expected}_d{plan.bucket}_{str(dtype)[6:]}", name), name
                assert plan.launch.threadgroup_bytes <= 32768 and plan.launch.threads == 128
        for rows in (1, 8, 9):
            p = metal_emulator.LinearParams(rows=rows, rows_inner=1, in_features=4, out_features=4)
            planned.add(emu.plan_linear(p, dtype).launch.name.decode())
    assert planned == names  # every instantiation is reachable, every planned name instantiated


def test_plan_grids_and_limits(emu):
    p = metal_emulator.make_params(*make_qkv(1, 1, 70, 5, 8, 8))
    p.batch, p.heads = 300, 300
    plan = emu.plan_attention(p, torch.float32)
    assert list(plan.launch.grid) == [3, 90000, 1]  # (query blocks of 32, B * H): no 65535 limit on either
    p.q_len = 5
    assert list(emu.plan_attention(p, torch.float32).launch.grid) == [5, 90000, 1]  # one per query row
    for D, Dv in [(257, 8), (8, 300)]:
        plan = emu.plan_attention(metal_emulator.make_params(*make_qkv(1, 1, 3, 5, D, Dv)), torch.float32)
        assert metal_emulator.ATTENTION_KERNELS[plan.kernel] == "none"
    with pytest.raises(RuntimeError, match="no kernel"):
        emu.attention(*make_qkv(1, 1, 3, 5, 264, 8))
    lp = metal_emulator.LinearParams(rows=100, rows_inner=1, in_features=4, out_features=70)
    assert list(emu.plan_linear(lp, torch.float16).launch.grid) == [3, 4, 1]
    lp.rows = 8
    assert list(emu.plan_linear(lp, torch.float16).launch.grid) == [18, 1, 1]


@pytest.mark.parametrize("kernel, d", [("vector", 32), ("vector", 256), ("tiled", 32), ("tiled", 128)])
def test_threadgroup_memory_is_what_the_plan_says(emu, kernel, d):
    emu.attention(*make_qkv(1, 1, KERNELS[kernel], 3, d, d))
    assert emu.last_threadgroup_bytes() == emu.last_plan.launch.threadgroup_bytes <= 32768
    emu.linear(torch.randn(40, 8), torch.randn(8, 8))
    assert emu.last_threadgroup_bytes() == emu.last_plan.launch.threadgroup_bytes


def test_embedded_source_is_self_contained():
    # What the MPS build embeds: every .metal file and the project headers they include, each header once,
    # no quoted #include left for Apple's compiler to resolve; and it compiles as one file under the shim.
    source = embed.metal_source()
    assert not re.search(r'^\s*#\s*include\s+"', source, re.MULTILINE)
    for name in ("params.h", "softmax.h", "metal_config.h", "key_range.h", "common.h", "attention.metal",
                 "linear.metal"):
        assert len(re.findall(rf"^// ---- .*\b{re.escape(name)}$", source, re.MULTILINE)) == 1, name
    header = embed.header(source)
    assert header.count('R"attnx_metal(') == 1 and header.rstrip().endswith("}  // namespace attnx::mps")
    cxx = metal_emulator.compiler()
    if cxx is None:
        _unavailable("no clang++")
    result = subprocess.run(
        [cxx, *metal_emulator.FLAGS, "-fsyntax-only", "-I" + metal_emulator.SHIM, "-x", "c++", "-"],
        input=source, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]


# ------------------------------------------------------------------------------------------------------------
# The shim itself: each rule it enforces, broken on purpose (tests/emulation/metal/shim_check.metal).

SHIM_CHECK = """
import sys, torch
from emulation import metal_emulator
emu = metal_emulator.MetalEmulator(metal_emulator.build(metal_sources=[sys.argv[1]]))
out = torch.zeros(128)
emu.launch(sys.argv[2], (1, 1, 1), 128, [out])
print(out.tolist())
"""


@pytest.mark.parametrize("kernel, message", [
    # Whichever thread checks first names its own site and the other's: both sites appear, in either order.
    ("divergent_simd_sum", r"(?s)(shim_check.metal:\d+.*<the end of the kernel>|<the end of the kernel>.*"
                           r"shim_check.metal:\d+).*reached by every lane of the simdgroup"),
    ("divergent_barrier", r"(?s)threadgroup_barrier at .*(shim_check.metal:\d+.*<the end of the kernel>|"
                          r"<the end of the kernel>.*shim_check.metal:\d+).*every thread of the threadgroup"),
    ("too_much_threadgroup_memory", r"threadgroup memory: 36000 bytes declared, more than the 32768"),
], ids=lambda x: x if x.isidentifier() else "")
def test_shim_reports(emu, kernel, message):
    source = os.path.join(metal_emulator.SHIM, "shim_check.metal")
    result = subprocess.run([sys.executable, "-c", SHIM_CHECK, source, kernel], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
    assert result.returncode != 0 and re.search(message, result.stderr), result.stderr[-3000:]


def test_shim_poisons_threadgroup_memory(emu):
    # Thread 0 runs ahead of thread 1 up to its first barrier: without one, it reads thread 1's element before
    # thread 1 has written it, and threadgroup memory starts as NaN, not as a lucky value.
    source = os.path.join(metal_emulator.SHIM, "shim_check.metal")
    results = {}
    for kernel in ("missing_barrier", "with_barrier"):
        result = subprocess.run([sys.executable, "-c", SHIM_CHECK, source, kernel], capture_output=True,
                                text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout.strip().splitlines()[-1]
        results[kernel] = torch.tensor(eval(printed, {"nan": float("nan")}))
    assert results["with_barrier"].tolist() == [float((t + 1) % 128) for t in range(128)]
    assert results["missing_barrier"].isnan().any()


# ------------------------------------------------------------------------------------------------------------
# Races: the kernels under ThreadSanitizer (tests/emulation/metal/race_check.cpp). The emulated barriers and
# simd exchanges are atomics TSan follows, so a threadgroup-memory access that no barrier orders is reported
# whatever the interleaving.


def test_no_data_races_under_thread_sanitizer():
    if not metal_emulator.has_thread_sanitizer():
        _unavailable("clang++ cannot build -fsanitize=thread programs (no clang++ or no libtsan)")
    try:
        # std::threads, not fibers: ThreadSanitizer sees each emulated thread as a thread.
        exe = metal_emulator.build(extra_flags=["-fsanitize=thread", "-g", "-DATTNX_METAL_EMU_THREADS"],
                                   sources=metal_emulator.RACE_CHECK_SOURCES, shared=False)
    except metal_emulator.Unavailable as e:
        _unavailable(f"Metal emulation unavailable: {e}")
    result = subprocess.run([exe], capture_output=True, text=True, timeout=900)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


def test_pipeline_cache_under_concurrent_first_use(tmp_path):
    """mps::pipeline's cache (csrc/mps/pipeline_cache.h, the code metal_library.mm runs) from 16 threads
    making their first calls at once, under ThreadSanitizer: one library build, one pipeline per name, the
    same pipeline for every thread, and a failed build retried
    (tests/emulation/metal/pipeline_cache_check.cpp)."""
    if not metal_emulator.has_thread_sanitizer():
        _unavailable("clang++ cannot build -fsanitize=thread programs (no clang++ or no libtsan)")
    exe = tmp_path / "pipeline_cache_check"
    source = os.path.join(metal_emulator.HERE, "metal", "pipeline_cache_check.cpp")
    cmd = [metal_emulator.compiler(), "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-pthread",
           "-I" + metal_emulator.CSRC, source, "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-4000:]
