"""attnx::attention's CUDA SIMT kernel compiled for the CPU, run on std::threads, vs the float64 reference.

The source is csrc/cuda/attention_kernel.cu itself, compiled by g++ against tests/emulation/cuda_shim.h (one
std::thread per CUDA thread, __syncthreads as a barrier, warp shuffles through exchange slots) and launched
through the real launcher with the real launch plan. This checks the kernel's algorithm and indexing:
strides, masks, causal skipping, partial tiles and blocks, fully masked rows, every dtype and head-dim
bucket. It cannot show GPU-only behaviour (memory model, timing, compiler differences): tests/test_cuda.py
does that on a GPU.

Shapes are tiny: every emulated block is 128 OS threads, and each warp shuffle is a barrier of 32 of them.
"""

import ctypes
import math
import os
import subprocess

import pytest
import torch

from attention_helpers import (
    ATTN_MASK_KINDS,
    EMPTY_SIZES,
    KEY_PADDING_MASK_KINDS,
    MASKED_SHAPE,
    QKV_LAYOUTS,
    assert_fully_masked_rows,
    assert_matches_reference,
    assert_nan_rows,
    assert_unseen_rows_empty,
    fully_masked_rows_case,
    key_tile_skipping_cases,
    make_attn_mask,
    make_feature_masks,
    make_gqa,
    make_key_padding_mask,
    make_qkv,
    make_sinks,
    nan_rows_case,
    seed_of,
)
from emulation import build_cache, emulator

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def emu():
    return emulator.load()


def check(emu, q, k, v, out_layout="blhd", kernel="simt", **kwargs):
    """Runs the emulated kernel and compares out and lse with the reference, as check_forward does."""
    out, lse = emu.attention(q, k, v, out_layout=out_layout, kernel=kernel, **kwargs)
    return assert_matches_reference(out, lse, q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Dtypes, layouts, head-dim buckets, tile and block boundaries.

@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_layouts(emu, dtype, layout):
    # L = 20: two query blocks of 16, the second partial; S = 37: two key tiles, the second partial.
    check(emu, *make_qkv(2, 2, 20, 37, 24, 24, dtype=dtype, layout=layout))


# (L, S, D, Dv): one per head-dim bucket (32, 64, 128, 256); D != Dv; D not a multiple of the vector width.
BUCKETS = [(5, 40, 8, 32), (6, 33, 64, 40), (3, 35, 100, 128), (3, 34, 256, 200), (2, 33, 129, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", BUCKETS, ids=str)
def test_head_dim_buckets(emu, sizes, dtype):
    L, S, D, Dv = sizes
    check(emu, *make_qkv(1, 1, L, S, D, Dv, dtype=dtype, layout="blhd"), is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_many_blocks_and_tiles(emu, dtype, is_causal):
    # 4 query blocks (the causal ordering reverses them) and 3 key tiles; causal skips tiles past each block.
    check(emu, *make_qkv(1, 1, 50, 70, 16, 16, dtype=dtype), is_causal=is_causal)


def test_b1_transposed_and_out_strides(emu):
    q, k, v = make_qkv(1, 4, 12, 12, 8, 8, layout="lbhd")
    assert q.stride(0) == 4 * 8  # the size-1 batch dim carries a stride that is not the contiguous one
    check(emu, q, k, v)
    check(emu, q, k, v, out_layout="bhld")  # the kernel writes through out's strides, whatever they are


def test_sliced_with_storage_offset(emu):
    big = torch.randn(3, 2, 30, 40)
    q, k, v = big[1:2, :, 3:20, 5:21], big[2:, :, 1:30, 2:18], big[:1, :, :29, 20:36]
    assert q.storage_offset() > 0 and k.storage_offset() > 0
    check(emu, q, k, v)


def test_custom_scale(emu):
    q, k, v = make_qkv(1, 2, 10, 30, 16, 16)
    check(emu, q, k, v, scale=0.37)
    check(emu, q, k, v, scale=0.0)
    # float64 carries the scale as a float pair (hi + lo); 1/3 is not a float.
    q, k, v = make_qkv(1, 1, 5, 30, 16, 16, dtype=torch.float64)
    check(emu, q, k, v, scale=1 / 3)


# ------------------------------------------------------------------------------------------------------------
# Masks (the factories of attention_helpers: B, H, L, S, D = 2, 3, 19, 41, 16).

B, H, L, S = MASKED_SHAPE
D = 16


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("attn_mask", ATTN_MASK_KINDS, ids=str)
def test_attn_mask(emu, attn_mask, is_causal):
    mask = make_attn_mask(attn_mask, torch.Generator().manual_seed(1))
    check(emu, *make_qkv(B, H, L, S, D, D, layout="blhd"), attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("padding", KEY_PADDING_MASK_KINDS, ids=str)
@pytest.mark.parametrize("attn_mask", [None, "bool_ls", "float_bhls"], ids=str)
def test_padding_and_attn_mask(emu, attn_mask, padding):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    kpm = make_key_padding_mask(padding, gen)
    check(emu, *make_qkv(B, H, L, S, D, D), attn_mask=mask, key_padding_mask=kpm, is_causal=padding == "bool")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_low_precision_and_strided(emu, dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(B, H, L, S, D, 8, dtype=dtype, layout="strided_last")
    check(emu, q, k, v, attn_mask=make_attn_mask("float_ls", gen).to(dtype),
          key_padding_mask=make_key_padding_mask("bool", gen), is_causal=True, scale=0.2)


def test_padding_skips_whole_tiles(emu):
    # Batch 0: key_padding_mask removes the whole first key tile (skipped by the block) and part of the third;
    # batch 1: the whole last, partial tile. attn_mask removes a whole tile for some rows only (not skipped).
    qkv, cases = key_tile_skipping_cases()
    for masks in cases:
        check(emu, *qkv, **masks)


# ------------------------------------------------------------------------------------------------------------
# Fully masked rows, NaN, empty sizes.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fully_masked_rows(emu, dtype):
    # Query 2 sees no key; batch 1 sees no key at all (its only tile is skipped).
    qkv, masks = fully_masked_rows_case(dtype=dtype)
    assert_fully_masked_rows(*check(emu, *qkv, **masks))


def test_fully_masked_row_with_infinite_values(emu):
    # A masked key whose value is inf gives 0 * inf = NaN in the accumulator; the row is written as 0 anyway.
    q, k, v = make_qkv(1, 1, 4, 5, 8, 8)
    v[0, 0, 3] = math.inf
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1] = True
    out, lse = emu.attention(q, k, v, attn_mask=mask)
    assert (out[0, 0, 1] == 0).all() and torch.isposinf(lse[0, 0, 1])


def test_nan_propagates_per_row(emu):
    # NaN in every score of row (h=1, l=2), and in one score of row l=4 of every head.
    qkv, masks = nan_rows_case()
    assert_nan_rows(*check(emu, *qkv, **masks))


@pytest.mark.parametrize("sizes", EMPTY_SIZES, ids=str)
def test_empty_sizes(emu, sizes):
    q, k, v = make_qkv(*sizes)
    out, lse = check(emu, q, k, v, key_padding_mask=torch.zeros(sizes[0], sizes[3], dtype=torch.bool))
    if sizes[3] == 0:
        assert (out == 0).all() and torch.isposinf(lse).all()


# ------------------------------------------------------------------------------------------------------------
# The launch plan: the glue and the emulation launch exactly what it says.


def test_plan_limits(emu):
    # Shared memory within an sm80 block's 163 KiB opt-in for every dtype and bucket. Above 48 KiB the
    # launcher opts in (the emulated launch refuses otherwise, as the runtime does; the D = 256 cases pass).
    for dtype in DTYPES:
        for d in (32, 64, 128, 256):
            p = emulator.make_params(*make_qkv(1, 1, 1, 1, d, d, dtype=dtype))
            plan = emu.plan(p, dtype)
            assert plan.bucket == d and plan.threads == 128
            assert plan.smem_bytes <= 163 * 1024, (dtype, d, plan.smem_bytes)
    # B * H past grid.y's 65535: the grid is 1-D, blockIdx.x = query block and (b, h).
    p = emulator.make_params(*make_qkv(1, 1, 40, 1, 8, 8))
    p.batch, p.heads = 300, 300
    plan = emu.plan(p, torch.float32)
    assert plan.bh == 90000 and plan.q_blocks == 3 and plan.blocks == 270000


def test_head_dim_above_256_has_no_kernel(emu):
    # The glue falls back to a chunked ATen composition (tested on a GPU in test_cuda.py); the launcher
    # refuses.
    q, k, v = make_qkv(1, 1, 3, 5, 264, 8)
    assert emu.plan(emulator.make_params(q, k, v), torch.float32).bucket == 0
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        emu.attention(q, k, v)
    q, k, v = make_qkv(1, 1, 3, 5, 8, 300)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        emu.attention(q, k, v)


# ------------------------------------------------------------------------------------------------------------
# The tensor-core kernel (cuda/attention_kernel_mma.cu), with mma.sync emulated over the PTX fragment
# layouts. It rounds P to the input type before P V, as FlashAttention does; the bounds above absorb that.
# float32 runs 3xTF32 (mma.m16n8k8.tf32, its fragments split into tf32 parts) and is held to float32's bound.

MMA_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", MMA_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [24, 64])
def test_mma_dtypes_layouts(emu, dtype, layout, head_dim):
    # L = 70: two query blocks of 64, the second partial; S = 90: two key tiles of 64, the second partial.
    # K/V go by cp.async where the layout allows it (head dim 24: the chunk past it zero-filled), element by
    # element otherwise ("strided_last").
    check(emu, *make_qkv(2, 2, 70, 90, head_dim, head_dim, dtype=dtype, layout=layout), kernel="mma")


@pytest.mark.parametrize("dtype", MMA_DTYPES, ids=str)
@pytest.mark.parametrize("sizes", [(5, 40, 8, 32), (6, 33, 64, 40), (3, 70, 100, 128), (2, 33, 128, 3)],
                         ids=str)
def test_mma_head_dim_buckets(emu, sizes, dtype):
    L, S, D, Dv = sizes
    qkv = make_qkv(1, 1, L, S, D, Dv, dtype=dtype, layout="blhd")
    if dtype == torch.float32 and max(D, Dv) > 64:  # float32 stops at bucket 64 (kMmaMaxHeadDimTf32)
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            emu.attention(*qkv, is_causal=True, kernel="mma")
        return
    check(emu, *qkv, is_causal=True, kernel="mma")


@pytest.mark.parametrize("is_causal", [False, True])
def test_mma_many_blocks_and_tiles(emu, is_causal):
    check(emu, *make_qkv(1, 1, 150, 200, 16, 16, dtype=torch.float16), is_causal=is_causal, kernel="mma")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("attn_mask", ["bool_ls", "float64_ls", "neginf_ls", "float_bhls", "float_1h1s",
                                       "bool_4d_full", "float_ls_transposed", "float_ls_expanded"], ids=str)
def test_mma_attn_mask(emu, attn_mask, is_causal):
    mask = make_attn_mask(attn_mask, torch.Generator().manual_seed(1))
    q, k, v = make_qkv(B, H, L, S, D, D, dtype=torch.bfloat16, layout="blhd")
    check(emu, q, k, v, attn_mask=mask, is_causal=is_causal, kernel="mma")


@pytest.mark.parametrize("padding", KEY_PADDING_MASK_KINDS, ids=str)
def test_mma_padding_and_attn_mask(emu, padding):
    gen = torch.Generator().manual_seed(2)
    mask, kpm = make_attn_mask("float_bhls", gen), make_key_padding_mask(padding, gen)
    q, k, v = make_qkv(B, H, L, S, D, D, dtype=torch.float16)
    check(emu, q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=padding == "bool", scale=0.3,
          kernel="mma")


def test_mma_padding_skips_whole_tiles_and_fully_masked_rows(emu):
    q, k, v = make_qkv(2, 2, 20, 140, 16, 16, dtype=torch.float16)
    kpm = torch.zeros(2, 140, dtype=torch.bool)
    kpm[0, :64] = True  # batch 0: the whole first key tile, skipped
    kpm[1] = True  # batch 1: every key
    mask = torch.zeros(20, 140, dtype=torch.bool)
    mask[3] = True  # query 3 sees no key
    out, lse = check(emu, q, k, v, attn_mask=mask, key_padding_mask=kpm, kernel="mma")
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()


def test_mma_padding_tiles_known_before_the_loop(emu):
    # The kernel finds the tiles key_padding_mask removes entirely before its tile loop, 1024 tiles (65536
    # keys) at a time: keys are kept only around the first window's last tile and the second window's first
    # tiles, in a partial last tile, and (batch 1) nowhere in the first window at all.
    S = 65536 + 3 * 64 + 20
    q, k, v = make_qkv(2, 1, 5, S, 16, 16, dtype=torch.float16)
    kpm = torch.ones(2, S, dtype=torch.bool)
    kpm[0, 65536 - 3] = False  # the last tile of the first window
    kpm[0, 65536 + 64 : 65536 + 70] = False  # the second window's second tile
    kpm[0, S - 1] = False  # the partial last tile
    kpm[1, 65536 + 130] = False  # batch 1: nothing before the second window's third tile
    out, lse = check(emu, q, k, v, key_padding_mask=kpm, kernel="mma")
    assert torch.isfinite(lse).all()
    kpm[1] = True  # batch 1: every tile removed, in both windows
    out, lse = check(emu, q, k, v, key_padding_mask=kpm, kernel="mma")
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


@pytest.mark.parametrize("window", [(-1, -1), (100, 0), (70, 40)], ids=str)
def test_mma_masks_on_interior_and_boundary_tiles(emu, window):
    # Several query blocks and key tiles with both masks: tiles inside every row's key interval take the
    # masked path without per-element range tests, the tiles at the interval ends (the causal diagonal, the
    # window's edges, the partial last tile, rows past L) with them.
    gen = torch.Generator().manual_seed(9)
    B_, L_, S_ = 2, 150, 330
    q, k, v = make_qkv(B_, 2, L_, S_, 32, 32, dtype=torch.bfloat16)
    mask = torch.randn(L_, S_, generator=gen)
    mask[torch.rand(L_, S_, generator=gen) < 0.1] = float("-inf")
    kpm = torch.rand(B_, S_, generator=gen) < 0.2
    kpm[0, 64:128] = True  # a whole tile removed
    check(emu, q, k, v, attn_mask=mask, key_padding_mask=kpm, window_left=window[0], window_right=window[1],
          kernel="mma")
    check(emu, q, k, v, attn_mask=mask, is_causal=True, window_left=window[0], kernel="mma")


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("dtype", MMA_DTYPES, ids=str)
def test_mma_masks_every_dtype(emu, dtype, mask_dtype):
    # Both masks in each mask dtype, on each of the kernel's dtypes: without a key range, causal (L = 150 !=
    # S: the diagonal cuts tiles anywhere, rows past L in the last query block), a window (rows start at
    # keys off any tile boundary), and an attn_mask sliced 2 elements into its rows.
    gen = torch.Generator().manual_seed(12)
    B_, L_, S_ = 2, 150, 208
    q, k, v = make_qkv(B_, 2, L_, S_, 32, 32, dtype=dtype)
    drop = torch.rand(L_, S_, generator=gen) < 0.15
    padding = torch.rand(B_, S_, generator=gen) < 0.2
    if mask_dtype == torch.bool:
        mask, kpm = drop, padding
    else:
        mask = torch.randn(L_, S_, generator=gen).masked_fill(drop, float("-inf")).to(mask_dtype)
        kpm = torch.zeros(B_, S_).masked_fill(padding, float("-inf")).to(mask_dtype)
    for kwargs in [{}, {"is_causal": True}, {"window_left": 37, "window_right": 5}]:
        check(emu, q, k, v, attn_mask=mask, key_padding_mask=kpm, kernel="mma", **kwargs)
    wide = torch.zeros(L_, S_ + 2, dtype=mask.dtype)
    wide[:, 2:] = mask
    check(emu, q, k, v, attn_mask=wide[:, 2:], key_padding_mask=kpm, is_causal=True, kernel="mma")


def test_mma_nan_and_empty(emu):
    q, k, v = make_qkv(1, 2, 5, 6, 16, 16, dtype=torch.float16)
    q[0, 1, 2, 0] = float("nan")
    mask = torch.zeros(5, 6)
    mask[4, 3] = float("nan")
    out, lse = check(emu, q, k, v, attn_mask=mask, kernel="mma")
    assert out[0, 1, 2].isnan().all() and out[0, :, 4].isnan().all()
    for sizes in [(2, 2, 0, 4, 8, 8), (2, 2, 3, 0, 8, 8), (2, 2, 3, 4, 0, 8), (2, 2, 3, 4, 8, 0)]:
        check(emu, *make_qkv(*sizes, dtype=torch.float16), kernel="mma")


def test_mma_refuses_what_it_does_not_cover(emu):
    for dtype, d in [(torch.float32, 72), (torch.float64, 64), (torch.float16, 136), (torch.bfloat16, 256)]:
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            emu.attention(*make_qkv(1, 1, 3, 5, d, d, dtype=dtype), kernel="mma")


# ------------------------------------------------------------------------------------------------------------
# Dropout (SIMT kernel): the element's Philox draw is a pure function of (seed, offset, b, h, l, s), so the
# emulated kernel must drop exactly the reference's mask, and the CPU kernel's.


@pytest.mark.parametrize("layout", ["contiguous", "blhd", "expanded_kv", "strided_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_reference(emu, dtype, layout):
    # Two query blocks and two key tiles, both partial.
    check(emu, *make_qkv(2, 2, 20, 37, 24, 24, dtype=dtype, layout=layout), dropout_p=0.3,
          dropout_seed=seed_of(17, 3))


@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_masks_and_tiles(emu, is_causal):
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(B, H, L, S, D, D, dtype=torch.float64, layout="blhd")
    check(emu, q, k, v, attn_mask=make_attn_mask("float_bhls", gen),
          key_padding_mask=make_key_padding_mask("bool", gen), is_causal=is_causal, dropout_p=0.5,
          dropout_seed=seed_of(-3, 2**33))
    check(emu, *make_qkv(1, 1, 50, 70, 16, 16, dtype=torch.float64), is_causal=is_causal, dropout_p=0.2,
          dropout_seed=seed_of(5))


def test_dropout_same_mask_as_the_cpu_kernel(emu):
    import attnx

    q, k, v = make_qkv(2, 3, 21, 45, 16, 16, dtype=torch.float64, layout="blhd")
    for p in (0.1, 0.6, 1.0):
        kwargs = {"is_causal": True, "dropout_p": p, "dropout_seed": seed_of(2024, 1)}
        emu_out, emu_lse = emu.attention(q, k, v, **kwargs)
        cpu_out, cpu_lse = attnx.attention(q, k, v, **kwargs)
        torch.testing.assert_close(emu_out, cpu_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(emu_lse, cpu_lse, rtol=0, atol=1e-12)


def test_dropout_is_not_on_the_mma_kernel(emu):
    # The glue runs the SIMT kernel when dropout_p > 0; the mma launcher refuses it.
    q, k, v = make_qkv(1, 1, 3, 5, 16, 16, dtype=torch.float16)
    params = emulator.make_params(q, k, v, dropout_p=0.1, dropout_seed=seed_of(1))
    assert emu.plan(params, torch.float16).bucket
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        emu.attention(q, k, v, dropout_p=0.1, dropout_seed=seed_of(1), kernel="mma")


# ------------------------------------------------------------------------------------------------------------
# Grouped KV heads, key ranges (windows, per-batch key lengths), soft-capping and sinks: parameters of both
# kernels. Each case runs on the SIMT kernel in every dtype and on the mma kernel in each of its dtypes.

KERNEL_DTYPES = [pytest.param("simt", dt, id=f"simt-{dt}") for dt in DTYPES] + [
    pytest.param("mma", dt, id=f"mma-{dt}") for dt in MMA_DTYPES
]
# One float32 SIMT case and one float16 mma case, for the parameters that do not depend on the dtype.
KERNELS = [pytest.param("simt", torch.float32, id="simt"), pytest.param("mma", torch.float16, id="mma")]
WINDOWS = [(-1, 0), (3, 0), (2, 2), (0, -1), (-1, -1)]


def _lens(kernel):
    """(L, S): two query blocks and two key tiles of the kernel, each pair with a partial last one."""
    return (20, 45) if kernel == "simt" else (70, 100)


def _key_lengths(values, kind):
    """values as a (B,) key_lengths tensor: None, "int32", or "int64" read through a stride of 2."""
    if kind is None:
        return None
    if kind == "int32":
        return torch.tensor(values, dtype=torch.int32)
    return torch.tensor([x for v in values for x in (v, -7)], dtype=torch.int64)[::2]


@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 3)], ids=str)
@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES)
def test_grouped_kv_heads(emu, kernel, dtype, heads):
    H, Hkv = heads
    L, S = _lens(kernel)
    check(emu, *make_gqa(2, H, Hkv, L, S, 24, 24, dtype=dtype, layout="blhd"), is_causal=True, kernel=kernel)


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_grouped_kv_heads_layouts(emu, kernel, dtype, layout):
    L, S = _lens(kernel)
    q, k, v = make_gqa(2, 4, 2, L, S, 16, 16, dtype=dtype, layout=layout)
    if layout == "expanded_kv":
        assert k.stride(1) == 0 and v.stride(1) == 0  # both kv heads are one stored head
    check(emu, q, k, v, kernel=kernel)


@pytest.mark.parametrize("lengths", [None, "int32", "int64"], ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_windows_and_key_lengths(emu, kernel, dtype, window, lengths):
    # Batch 0 sees every key, batch 1 none, batch 2 fewer keys than queries: with the bottom-right diagonal,
    # its first queries sit before key 0 and (for a bounded right side) see nothing at all.
    L, S = _lens(kernel)
    key_lengths = _key_lengths([S, 0, L * 2 // 3], lengths)
    kwargs = {"window_left": window[0], "window_right": window[1], "key_lengths": key_lengths}
    q, k, v = make_gqa(3, 2, 2, L, S, 16, 16, dtype=dtype, layout="blhd")
    out, lse = check(emu, q, k, v, kernel=kernel, **kwargs)
    if lengths is not None:
        assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    empty_rows = assert_unseen_rows_empty(out, lse, S, **kwargs)
    if window[1] == 0 and lengths is not None:
        assert empty_rows > 2 * L  # batch 1, and the first rows of batch 2


@pytest.mark.parametrize("window", [(-1, 0), (4, 1), (0, 3)], ids=str)
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_windows_with_causal_and_more_queries_than_keys(emu, kernel, dtype, window):
    # is_causal keeps its top-left diagonal on top of the bottom-right window; L > S puts rows outside both.
    L, _ = _lens(kernel)
    S = L * 3 // 4
    for is_causal in (False, True):
        kwargs = {"is_causal": is_causal, "window_left": window[0], "window_right": window[1],
                  "key_lengths": _key_lengths([S, S - 5], "int32")}
        out, lse = check(emu, *make_gqa(2, 2, 1, L, S, 16, 16, dtype=dtype), kernel=kernel, **kwargs)
        assert_unseen_rows_empty(out, lse, S, **kwargs)


@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES)
def test_decoding_and_chunked_prefill(emu, kernel, dtype):
    # Decoding: one query, the last position of each batch's keys. Chunked prefill: the last L < S queries.
    _, S = _lens(kernel)
    for L in (1, 5, 17):
        for window in ((-1, 0), (8, 0), (-1, -1)):
            kwargs = {"window_left": window[0], "window_right": window[1],
                      "key_lengths": _key_lengths([S, 7, 0, S - 1], "int64")}
            out, lse = check(emu, *make_gqa(4, 4, 2, L, S, 32, 16, dtype=dtype), kernel=kernel, **kwargs)
            assert (out[2] == 0).all() and torch.isposinf(lse[2]).all()


@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_keys_past_key_lengths_are_never_read(emu, kernel, dtype):
    # A KV cache's slots past a batch's length may hold anything: NaN there must not reach the output. (The
    # float64 reference computes every score and would carry NaN * 0; it runs on the cleaned inputs.)
    L, S = _lens(kernel)
    lengths = [S - 3, 20, 9]
    q, k, v = make_gqa(3, 2, 1, L, S, 16, 16, dtype=dtype)
    dirty_k, dirty_v = k.clone(), v.clone()
    for b, n in enumerate(lengths):
        dirty_k[b, :, n:] = float("nan")
        dirty_v[b, :, n:] = float("nan")
    for window in ((-1, 0), (5, 0), (-1, -1)):
        kwargs = {"window_left": window[0], "window_right": window[1],
                  "key_lengths": _key_lengths(lengths, "int32")}
        out, lse = emu.attention(q, dirty_k, dirty_v, kernel=kernel, **kwargs)
        clean_out, clean_lse = emu.attention(q, k, v, kernel=kernel, **kwargs)
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, clean_lse, rtol=0, atol=0)
        check(emu, q, k, v, kernel=kernel, **kwargs)


@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES)
def test_softcap(emu, kernel, dtype):
    # scale 1 makes the scores ~N(0, 16): most of them are capped hard. float64 takes a cap that is not a
    # float (carried as softcap + softcap_lo).
    gen = torch.Generator().manual_seed(4)
    L, S = _lens(kernel)
    cap = 10 / 3 if dtype == torch.float64 else 2.5
    q, k, v = make_gqa(2, 3, 3, L, S, 16, 16, dtype=dtype, layout="blhd")
    check(emu, q, k, v, softcap=cap, scale=1.0, kernel=kernel)
    mask = torch.rand(L, S, generator=gen) < 0.3
    kpm = torch.randn(2, S, generator=gen)
    check(emu, q, k, v, softcap=cap, scale=1.0, attn_mask=mask, key_padding_mask=kpm, is_causal=True,
          kernel=kernel)
    check(emu, q, k, v, softcap=50.0, attn_mask=torch.randn(L, S, generator=gen).to(dtype), kernel=kernel)


@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES)
def test_sinks(emu, kernel, dtype):
    L, S = _lens(kernel)
    q, k, v = make_gqa(2, 4, 2, L, S, 16, 16, dtype=dtype, layout="blhd")
    sinks = make_sinks(4, dtype)
    check(emu, q, k, v, sinks=sinks, kernel=kernel)
    # A sink far above every score (the row's probabilities ~exp(-40)), and a -inf sink (no sink at all).
    sinks[1], sinks[2] = 40.0, -math.inf
    check(emu, q, k, v, sinks=sinks, kernel=kernel)
    # With masks: query 3 of every head sees no key, and batch 1 none at all; the sink does not make them
    # rows: out 0, lse +inf.
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[3] = True
    mask[5, ::2] = True
    kpm = torch.zeros(2, S)
    kpm[1] = -math.inf
    out, lse = check(emu, q, k, v, sinks=sinks, attn_mask=mask, key_padding_mask=kpm, is_causal=True,
                     kernel=kernel)
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    assert torch.isfinite(lse[0, :, 5]).all()


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES)
def test_all_features_together(emu, kernel, dtype, mask):
    # Grouped heads (6 over 3), a window, key lengths (one batch empty), soft-capping, sinks, an attn_mask of
    # nn.MultiheadAttention's (B*H, L, S) form and a key_padding_mask, on strided inputs.
    gen = torch.Generator().manual_seed(5)
    L, S = _lens(kernel)
    B, H = 3, 6
    q, k, v = make_gqa(B, H, 3, L, S, 24, 16, dtype=dtype, layout="lbhd")
    attn_mask, kpm = make_feature_masks(mask, B, H, L, S, dtype, gen)
    kwargs = {"attn_mask": attn_mask, "key_padding_mask": kpm, "window_left": 9, "window_right": 2,
              "key_lengths": _key_lengths([S, 0, L - 4], "int64"), "softcap": 4.0,
              "sinks": make_sinks(H, dtype), "scale": 0.4}
    out, lse = check(emu, q, k, v, kernel=kernel, **kwargs)
    assert_unseen_rows_empty(out, lse, S, **kwargs)
    check(emu, q, k, v, kernel=kernel, is_causal=True, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_features_with_dropout(emu, dtype):
    # The SIMT kernel's dropout draws by (b, h, l, s) of the query head: the same mask as the reference's.
    q, k, v = make_gqa(2, 4, 2, 20, 45, 16, 16, dtype=dtype)
    check(emu, q, k, v, window_left=6, window_right=0, key_lengths=_key_lengths([45, 30], "int32"),
          softcap=3.0, sinks=make_sinks(4, dtype), dropout_p=0.3, dropout_seed=seed_of(11, 5))


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_inconsistent_params_are_refused(emu, kernel):
    # The launchers check what the kernels would otherwise divide by or dereference.
    q, k, v = make_gqa(1, 4, 2, 3, 5, 16, 16, dtype=torch.float16)
    out = torch.empty(1, 4, 3, 16, dtype=torch.float16)
    lse = torch.empty(1, 4, 3)
    lengths, sinks = torch.tensor([5], dtype=torch.int32), torch.zeros(4)
    ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, out.data_ptr(), lse.data_ptr()]

    def launch(p, key_lengths=None, sink_ptr=None):
        return emu.lib.attnx_emu_attention(ctypes.byref(p), emulator.DTYPES[torch.float16],
                                           emulator.KERNELS[kernel], *ptrs, key_lengths, sink_ptr)

    def params(**kwargs):
        return emulator.make_params(q, k, v, out=out, lse=lse, **kwargs)

    assert launch(params()) == 0
    assert launch(params(key_lengths=lengths), lengths.data_ptr()) == 0
    assert launch(params(sinks=sinks), None, sinks.data_ptr()) == 0
    invalid = next(code for code, name in emulator.CUDA_ERRORS.items() if name == "cudaErrorInvalidValue")
    for kv_heads in (0, 3, 8):
        p = params()
        p.kv_heads = kv_heads
        assert launch(p) == invalid, kv_heads
    assert launch(params(key_lengths=lengths)) == invalid  # no key_lengths pointer
    assert launch(params(sinks=sinks)) == invalid  # no sinks pointer
    p = params()
    p.window_left = -2
    assert launch(p) == invalid


# ------------------------------------------------------------------------------------------------------------
# The composite the CUDA glue runs above head dim 256 (csrc/cuda/attention_composite.h): torch's ops through
# the stable ABI only, device-agnostic, so it is registered here for CPU tensors and run against the
# reference, features included.

_COMPOSITE_HARNESS = r"""
// header digest: %s
#include <torch/csrc/stable/library.h>

#include <optional>
#include <tuple>

#include "cuda/attention_composite.h"

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

std::tuple<Tensor, Tensor> composite(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const std::optional<Tensor>& attn_mask,
                                     const std::optional<Tensor>& key_padding_mask, bool is_causal,
                                     int64_t window_left, int64_t window_right,
                                     const std::optional<Tensor>& key_lengths, std::optional<double> scale,
                                     std::optional<double> softcap, const std::optional<Tensor>& sinks) {
  // The fields the composite reads, as common/attention.cpp's prepare_attention sets them.
  attnx::AttentionProblem pb{};
  pb.query = q, pb.key = k, pb.value = v;
  attnx::AttentionOptions& o = pb.options;
  o.attn_mask = attn_mask, o.key_padding_mask = key_padding_mask, o.is_causal = is_causal;
  o.window_left = window_left, o.window_right = window_right, o.key_lengths = key_lengths;
  o.scale = scale, o.softcap = softcap, o.sinks = sinks;
  attnx::AttentionParams& p = pb.params;
  p.batch = q.size(0), p.heads = q.size(1), p.q_len = q.size(2), p.head_dim = q.size(3);
  p.kv_heads = k.size(1), p.kv_len = k.size(2), p.v_head_dim = v.size(3);
  p.is_causal = is_causal, p.window_left = window_left, p.window_right = window_right;
  pb.dtype = q.scalar_type();
  const ScalarType acc = pb.dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  if (sinks) pb.sinks_acc = attnx::aten::contiguous(attnx::aten::to(*sinks, acc));
  pb.out = attnx::views::transpose(
      attnx::aten::empty({p.batch, p.q_len, p.heads, p.v_head_dim}, pb.dtype, q.device()), 1, 2);
  pb.lse = attnx::aten::empty({p.batch, p.heads, p.q_len}, acc, q.device());
  attnx::cuda::attention_composite(pb);
  return {pb.out, pb.lse};
}

STABLE_TORCH_LIBRARY(attnx_composite_check, m) {
  m.def("composite(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? key_padding_mask, "
        "bool is_causal, int window_left, int window_right, Tensor? key_lengths, float? scale, "
        "float? softcap, Tensor? sinks) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(attnx_composite_check, CPU, m) {
  m.impl("composite", TORCH_BOX(&composite));
}
"""


@pytest.fixture(scope="module")
def composite():
    import hashlib
    import os

    from torch.utils import cpp_extension

    csrc = emulator.CSRC
    digest = hashlib.sha256()  # load hashes its sources, not the headers
    for header in ("cuda/attention_composite.h", "common/attention.h", "common/aten.h", "common/views.h",
                   "common/stable.h", "common/compat.h", "include/attnx/params.h"):
        with open(os.path.join(csrc, header), "rb") as f:
            digest.update(f.read())
    digest = digest.hexdigest()[:16]
    build_dir = os.path.join(build_cache.BUILD_DIR, "composite")
    os.makedirs(build_dir, exist_ok=True)
    source = os.path.join(build_dir, f"composite_{digest}.cpp")
    with open(source, "w") as f:
        f.write(_COMPOSITE_HARNESS % digest)
    if not cpp_extension.is_ninja_available():
        pytest.skip("cannot build a torch extension here: no ninja (pip install ninja)")
    # TORCH_TARGET_VERSION: the header builds against torch 2.10's stable ABI, as the library does. A build
    # error fails the tests that use it.
    cpp_extension.load(
        f"attnx_composite_{digest}", [source], extra_include_paths=[csrc, os.path.join(csrc, "include")],
        extra_cflags=["-O1", "-std=c++20", "-DTORCH_TARGET_VERSION=0x020a000000000000"],
        build_directory=build_dir, is_python_module=False)
    return torch.ops.attnx_composite_check.composite


def check_composite(composite, q, k, v, **kwargs):
    """The composite's (out, lse) for attnx.attention's keyword arguments, checked as check() does."""
    args = {"attn_mask": None, "key_padding_mask": None, "is_causal": False, "window_left": -1,
            "window_right": -1, "key_lengths": None, "scale": None, "softcap": None, "sinks": None, **kwargs}
    out, lse = composite(q, k, v, *args.values())
    return assert_matches_reference(out, lse, q, k, v, **args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_composite_features(composite, dtype):
    gen = torch.Generator().manual_seed(6)
    B, H, L, S = 3, 6, 30, 50
    q, k, v = make_gqa(B, H, 3, L, S, 40, 24, dtype=dtype, layout="lbhd")
    bool_mask = torch.rand(B * H, L, S, generator=gen) < 0.2
    float_mask = torch.randn(L, S, generator=gen).to(dtype)
    kpm = torch.rand(B, S, generator=gen) < 0.2
    sinks = make_sinks(H, dtype)
    for window in WINDOWS:
        for is_causal in (False, True):
            for extra in (
                {},
                {"sinks": sinks},
                {"attn_mask": bool_mask, "key_padding_mask": kpm, "softcap": 3.0, "sinks": sinks,
                 "key_lengths": _key_lengths([S, 0, L - 4], "int64")},
                {"attn_mask": float_mask, "softcap": 2.0, "scale": 1.0,
                 "key_lengths": _key_lengths([S, 7, 0], "int32")},
            ):
                kwargs = {"is_causal": is_causal, "window_left": window[0], "window_right": window[1],
                          **extra}
                out, lse = check_composite(composite, q, k, v, **kwargs)
                assert_unseen_rows_empty(out, lse, S, **kwargs)
    # A head dim the kernels do not cover, as the glue sends it here.
    q, k, v = make_gqa(2, 4, 1, 9, 20, 288, 264, dtype=dtype)
    check_composite(composite, q, k, v, is_causal=True, window_left=4,
                    key_lengths=_key_lengths([20, 5], "int32"), softcap=5.0, sinks=make_sinks(4, dtype))


# ------------------------------------------------------------------------------------------------------------
# Races: both kernels under ThreadSanitizer (tests/emulation/race_check.cpp). The emulated barriers and warp
# exchanges are atomics TSan follows, so a shared-memory access that no __syncthreads/__syncwarp orders is
# reported whatever the interleaving.


def test_no_data_races_under_thread_sanitizer():
    if not emulator.has_thread_sanitizer():
        pytest.skip("the C++ compiler cannot build -fsanitize=thread programs (no libtsan)")
    try:
        exe = emulator.build(extra_flags=["-fsanitize=thread", "-g"], sources=emulator.RACE_CHECK_SOURCES,
                             shared=False)
    except emulator.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    # Without a preloaded AddressSanitizer runtime (`make sanitize` preloads one), which TSan cannot share a
    # process with.
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    result = subprocess.run([exe], capture_output=True, text=True, timeout=900, env=env)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
