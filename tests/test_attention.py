"""attnx.attention's forward against reference.attention, on every device: dtypes, shapes, strided layouts,
head-dim buckets, block and tile boundaries, masks of every kind and dtype, fully masked rows, NaN, empty
sizes, head dims above 256, the fake kernel, opcheck, torch.compile and bad inputs.

The matrix: a test that takes conftest's ``device`` runs once per device, the CPU, a CUDA GPU and an MPS
device where this machine has them, and the emulated backends (``cuda-emu``: an sm_90 GPU, tensor cores
where they cover the call; ``cuda-emu-sm75``: the SIMT kernel for every call; ``metal-emu``: the Metal
kernels), which run on CPU tensors through attnx's real glue. Each test first asks the device which kernel
its main call takes (attention_helpers.kernel_or_skip): it is skipped, saying why, where the backend refuses
the call (Metal: float64, head dims above 256) or where another emulated device runs the same kernel. The
inputs are built on the CPU and moved with their exact layout (layouts.to_device); the reference runs on the
CPU copies.

Shapes are sized for the emulators (every emulated block is 128 threads) and chosen to cross every backend's
boundaries at once: the SIMT kernel's blocks of 16 query rows and 32-key tiles, the tensor-core kernel's 64
rows and 64-key tiles, Metal's tiled kernel's 32 rows and 32-key tiles and its vector kernel for a few query
rows. The CPU kernel tiles 128 queries by 512 keys: the tests without ``device`` cover its larger tiles, its
thread plans, its ISA variants and its memory.

Accuracy bound (flash-attention style), the same on every device: with ref64 the reference on float64 copies
of the same inputs and ref_same the reference in the inputs' own dtype,

    max |kernel - ref64| <= K * max |ref_same - ref64| + atol[dtype]

so the kernel may be at most K times as far from the exact result as the reference's own rounding is. atol
covers what that relative bound cannot: fp32 kernels use an exp accurate to ~20 ulp where the reference's is
~1 ulp (1e-5 on outputs and lse of magnitude <= ~10), fp64 sums in a different order (1e-12), and bf16/fp16
outputs can round to the neighbouring representable value of the reference's (2e-3, one bf16 ulp at 0.25).
Infinite and NaN entries must match exactly, position by position. The inputs, the mask factories and this
comparison are attention_helpers.py's, shared with the other attention tests.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import attnx
from attention_helpers import (
    ATTN_MASK_KINDS,
    CPU_VARIANTS,
    DTYPES,
    EMPTY_SIZES,
    KEY_PADDING_MASK_KINDS,
    MASKED_SHAPE,
    QKV_LAYOUTS,
    TESTS,
    assert_fully_masked_rows,
    assert_matches_reference,
    assert_nan_rows,
    attention_opcheck_cases,
    check_forward,
    fully_masked_rows_case,
    kernel_or_skip,
    make_attn_mask,
    make_key_padding_mask,
    make_qkv,
    nan_rows_case,
    run_python,
    run_under_cpu_capability,
    tile_classes_case,
    tile_classes_mask,
)
from layouts import to_device

pytestmark = pytest.mark.kernel

METAL = ("mps", "metal-emu")

# ------------------------------------------------------------------------------------------------------------
# The comparison on a device.


def kernel_for(device, q, k, v, **kwargs):
    """The kernel attnx.attention takes on ``device`` for CPU inputs q, k, v and options (kernel_or_skip:
    skips where the device refuses the call or another emulated device runs that kernel)."""
    return kernel_or_skip(device, *to_device((q, k, v), device), **to_device(kwargs, device))


def run(device, q, k, v, **kwargs):
    """attnx.attention on ``device`` of CPU inputs q, k, v and options, moved with their layouts; returns
    (out, lse) on the CPU, after checking that they came back on ``device``."""
    out, lse = attnx.attention(*to_device((q, k, v), device), **to_device(kwargs, device))
    assert out.device.type == lse.device.type == torch.device(device).type
    return out.cpu(), lse.cpu()


def check(device, q, k, v, **kwargs):
    """run() against the reference on the CPU inputs (the bound above); returns (out, lse) on the CPU."""
    return assert_matches_reference(*run(device, q, k, v, **kwargs), q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Dtypes, layouts, shapes, head-dim buckets, block and tile boundaries.

# (B, H, L, S, D, Dv). "few_rows": Metal's vector kernel, one query block elsewhere, B > 1 (the batch stride).
# "long": L = 70 and S = 90 cut the last query block and key tile of every backend: SIMT 5 blocks x 3 tiles,
# tensor cores 2 x 2, Metal tiled 3 x 3. Head dim 24 is a bucket of 32 with a partial 16-byte chunk (the
# tensor-core kernel stages it zero-filled); "strided_last" rows cannot be copied as 16-byte vectors.
LAYOUT_SIZES = {"few_rows": (2, 2, 5, 37, 24, 24), "long": (1, 2, 70, 90, 24, 24)}


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", LAYOUT_SIZES)
def test_dtypes_layouts(device, sizes, dtype, layout):
    q, k, v = make_qkv(*LAYOUT_SIZES[sizes], dtype=dtype, layout=layout)
    kernel_for(device, q, k, v)
    check(device, q, k, v)


SHAPES = [
    (2, 3, 37, 53, 24, 24),  # odd sizes, L != S
    (1, 2, 16, 16, 32, 8),  # Dv < D
    (2, 1, 9, 70, 8, 40),  # Dv > D, L < S
    (1, 1, 1, 1, 4, 4),  # single query and key
    (3, 2, 1, 33, 16, 16),  # decoding-like: one query
    (1, 1, 45, 1, 16, 16),  # one key
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(device, shape, dtype):
    q, k, v = make_qkv(*shape, dtype=dtype, layout="blhd")
    kernel_for(device, q, k, v)
    check(device, q, k, v)


# (L, S, D, Dv): every head-dim bucket (32, 64, 128, 256) of every kernel, at query lengths that take both of
# Metal's kernels; D != Dv; D not a multiple of any vector width; 128 itself, the tensor-core kernel's largest
# bucket.
BUCKETS = [(5, 40, 8, 32), (12, 33, 64, 40), (10, 70, 100, 128), (3, 35, 96, 96), (2, 33, 128, 3),
           (3, 34, 256, 200), (33, 9, 129, 3)]


@pytest.mark.parametrize("layout", ["blhd", "strided_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", BUCKETS, ids=str)
def test_head_dim_buckets(device, sizes, dtype, layout):
    L, S, D, Dv = sizes
    q, k, v = make_qkv(1, 1, L, S, D, Dv, dtype=dtype, layout=layout)
    kernel_for(device, q, k, v, is_causal=True)
    check(device, q, k, v, is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_many_blocks_and_tiles(device, dtype, is_causal):
    # L = 150, S = 200: 10 SIMT blocks x 7 tiles, 3 tensor-core blocks x 4 tiles, 5 Metal threadgroups x 7
    # tiles, each last one partial; causal skips the tiles past each block's last row (and orders the blocks
    # longest first).
    q, k, v = make_qkv(1, 1, 150, 200, 16, 16, dtype=dtype)
    kernel_for(device, q, k, v, is_causal=is_causal)
    check(device, q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("L", [5, 40])
def test_b1_transposed_layout(device, L):
    # nn.MultiheadAttention(batch_first=True) at B == 1 leaves (D, B*D, 1)-like views behind (MPS did); here
    # with heads too: the size-1 batch dim carries a stride that is not the contiguous one.
    q, k, v = make_qkv(1, 4, L, 12, 8, 8, layout="lbhd")
    assert q.stride(0) == 4 * 8
    kernel_for(device, q, k, v)
    check(device, q, k, v)


@pytest.mark.parametrize("L", [5, 17])
def test_sliced_with_storage_offset(device, L):
    # Windows of one buffer: storage offsets (base pointers off any 16-byte boundary), row strides > rows.
    big = torch.randn(3, 2, 50, 40)
    q, k, v = big[1:2, :, 3 : 3 + L, 5:21], big[2:, :, 1:30, 2:18], big[:1, :, :29, 20:36]
    assert q.storage_offset() > 0 and k.storage_offset() > 0
    kernel_for(device, q, k, v)
    check(device, q, k, v)


@pytest.mark.parametrize("q_offset", [0, 1], ids=["q_aligned", "q_off_16_bytes"])
def test_query_aligned_apart_from_key_and_value(device, q_offset):
    # float16 rows of 64 with K and V 16-byte aligned: the tensor-core kernel's lean instantiation, whose Q
    # rows move by 16-byte copies when they are aligned too and element by element when Q starts off a
    # 16-byte boundary; two query blocks, the second cut at L.
    L, S, D = 150, 80, 64
    _, k, v = make_qkv(1, 2, L, S, D, D, dtype=torch.float16)
    q = torch.randn(2 * L * D + q_offset).to(torch.float16)[q_offset:].view(1, 2, L, D)
    assert (q.data_ptr() % 16 == 0) == (q_offset == 0)
    kernel_for(device, q, k, v)
    check(device, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_custom_scale(device, dtype):
    q, k, v = make_qkv(1, 2, 20, 30, 16, 16, dtype=dtype)
    kernel_for(device, q, k, v, scale=0.37)
    for scale in (0.37, 0.0, 1 / 3):  # 1/3 is not a float: float64 carries it as a pair (hi + lo)
        check(device, q, k, v, scale=scale)


def test_output_layout(device):
    # out is (B, H, L, Dv) in memory order (B, L, H, Dv): out.transpose(1, 2) is the (B, L, H * Dv) input
    # of the out-projection, without a copy. lse is contiguous.
    q, k, v = make_qkv(2, 3, 5, 7, 8, 4)
    kernel_for(device, q, k, v)
    out, lse = attnx.attention(*to_device((q, k, v), device))
    assert out.shape == (2, 3, 5, 4) and out.stride() == (60, 4, 12, 1)
    assert out.transpose(1, 2).reshape(2, 5, 12).data_ptr() == out.data_ptr()
    assert out.transpose(1, 2).is_contiguous()
    assert lse.shape == (2, 3, 5) and lse.is_contiguous()


# (B, H, L, S, D, Dv): too large for the emulated kernels, which cross their own boundaries above; on a GPU,
# many blocks of both CUDA kernels with whole key tiles removed by padding.
BIG_SHAPES = [(2, 4, 300, 600, 64, 64), (1, 2, 1030, 1000, 128, 128)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", BIG_SHAPES, ids=str)
def test_big_shapes_with_masks(device, shape, is_causal, dtype):
    if device.emulated:
        pytest.skip("too large for an emulated backend (test_many_blocks_and_tiles crosses its boundaries)")
    gen = torch.Generator().manual_seed(8)
    q, k, v = make_qkv(*shape, dtype=dtype, layout="blhd")
    B, _, L, S, _, _ = shape
    kpm = torch.rand(B, S, generator=gen) < 0.2
    kpm[:, :100] = True  # whole key tiles removed by padding
    kwargs = {"attn_mask": torch.randn(L, S, generator=gen), "key_padding_mask": kpm, "is_causal": is_causal}
    kernel_for(device, q, k, v, **kwargs)
    check(device, q, k, v, **kwargs)


def test_many_heads(device):
    # B*H = 70000 (b, h) pairs of one query block each: past a GPU grid's 65535 in y (the grids are 1-D).
    if device.emulated:
        pytest.skip("70000 emulated blocks are too many (test_cuda_emulation.py checks the plan's grid)")
    q, k, v = make_qkv(700, 100, 3, 5, 8, 8)
    kernel_for(device, q, k, v)
    check(device, q, k, v)


# The CPU kernel's own boundaries: tiles of 128 queries by 512 keys, blocks of up to 8 query tiles that share
# each transposed key tile. CPU only: too big for the emulated kernels.
CPU_BIG_SHAPES = [
    (1, 2, 300, 600, 32, 32),  # partial tiles both ways
    (2, 1, 520, 1030, 16, 24),  # 5 query tiles, 3 key tiles
    (2, 4, 700, 900, 16, 16),  # blocks of 6 query tiles
]


@pytest.mark.parametrize("layout", ["contiguous", "blhd", "expanded_kv", "strided_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", CPU_BIG_SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_cpu_tile_boundaries(shape, dtype, layout, is_causal):
    check_forward(*make_qkv(*shape, dtype=dtype, layout=layout), is_causal=is_causal)


def test_cpu_single_thread_plan(intra_op_threads):
    # One thread plans larger query blocks for the same shape; results must not depend on it.
    intra_op_threads(1)
    check_forward(*make_qkv(1, 2, 1100, 700, 16, 16), is_causal=True)


# ------------------------------------------------------------------------------------------------------------
# Masks (the factories of attention_helpers: (B, H, L, S) = MASKED_SHAPE = (2, 3, 19, 41), head dim 16).

B, H, L, S = MASKED_SHAPE
D = 16


def cut_rows(mask, rows):
    """An attn_mask of MASKED_SHAPE's L rows for the first `rows` queries (masks that broadcast over L as
    they are)."""
    if mask is None or mask.dim() < 2 or mask.size(-2) == 1:
        return mask
    return mask[..., :rows, :]


# 19 rows take Metal's tiled kernel, 5 its vector kernel; float16 inputs there.
MASK_CASES = [pytest.param(L, torch.float32, False, id="fp32"),
              pytest.param(L, torch.bfloat16, True, id="bf16-causal"),
              pytest.param(5, torch.float16, False, id="fp16-5-rows")]


@pytest.mark.parametrize(("rows", "dtype", "is_causal"), MASK_CASES)
@pytest.mark.parametrize("attn_mask", [None, *ATTN_MASK_KINDS], ids=str)
def test_attn_mask(device, attn_mask, rows, dtype, is_causal):
    mask = None if attn_mask is None else make_attn_mask(attn_mask, torch.Generator().manual_seed(1))
    q, k, v = make_qkv(B, H, L, S, D, D, dtype=dtype, layout="blhd")
    q, mask = q[:, :, :rows], cut_rows(mask, rows)
    kernel_for(device, q, k, v, attn_mask=mask, is_causal=is_causal)
    check(device, q, k, v, attn_mask=mask, is_causal=is_causal)


# (attn_mask, key_padding_mask, query rows): both masks at 19 rows, and each padding kind alone on 5 rows
# (Metal's vector kernel).
PADDING_CASES = [
    *((mask, padding, L) for mask in (None, "bool_ls", "float_bhls", "float_1h1s") for padding in
      KEY_PADDING_MASK_KINDS),
    *((None, padding, 5) for padding in KEY_PADDING_MASK_KINDS),
]


@pytest.mark.parametrize(("attn_mask", "padding", "rows"), PADDING_CASES, ids=str)
def test_padding_and_attn_mask(device, attn_mask, padding, rows):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    kwargs = {"attn_mask": mask, "key_padding_mask": make_key_padding_mask(padding, gen),
              "is_causal": padding in ("bool", "float_neginf")}
    q, k, v = make_qkv(B, H, L, S, D, D)
    q = q[:, :, :rows]
    kernel_for(device, q, k, v, **kwargs)
    check(device, q, k, v, **kwargs)


@pytest.mark.parametrize("rows", [L, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_low_precision_and_strided(device, dtype, rows):
    # A float mask in the inputs' dtype, on strided inputs, with padding, causal and a scale.
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(B, H, L, S, D, 8, dtype=dtype, layout="strided_last")
    kwargs = {"attn_mask": make_attn_mask("float_ls", gen).to(dtype)[:rows],
              "key_padding_mask": make_key_padding_mask("bool", gen), "is_causal": True, "scale": 0.2}
    q = q[:, :, :rows]
    kernel_for(device, q, k, v, **kwargs)
    check(device, q, k, v, **kwargs)


MASK_DTYPES = [torch.bool, torch.float16, torch.float32, torch.float64]


@pytest.mark.sanitize
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_every_dtype(device, dtype, mask_dtype):
    # Both masks in each mask dtype, on each input dtype, over several query blocks and key tiles of every
    # kernel (L = 70 != S = 140: the causal diagonal cuts tiles anywhere; rows past L in the last block; a
    # partial last key tile): tiles inside every row's key range take the masked loop without per-element
    # range tests, tiles at its ends (the diagonal, the partial last tile) with them. Padding removes a whole
    # tile of batch 0. Half of the pairs run without a key range, half causal with an attn_mask sliced 2
    # elements into its rows: each input dtype and each mask dtype meets both.
    gen = torch.Generator().manual_seed(12)
    B_, L_, S_ = 2, 70, 140
    q, k, v = make_qkv(B_, 1, L_, S_, 32, 32, dtype=dtype)
    drop = torch.rand(L_, S_, generator=gen) < 0.15
    padding = torch.rand(B_, S_, generator=gen) < 0.2
    padding[0, 64:128] = True
    if mask_dtype == torch.bool:
        mask, kpm = drop, padding
    else:
        mask = torch.randn(L_, S_, generator=gen).masked_fill(drop, float("-inf")).to(mask_dtype)
        kpm = torch.zeros(B_, S_).masked_fill(padding, float("-inf")).to(mask_dtype)
    is_causal = (DTYPES.index(dtype) + MASK_DTYPES.index(mask_dtype)) % 2 == 1
    if is_causal:
        wide = torch.zeros(L_, S_ + 2, dtype=mask.dtype)
        wide[:, 2:] = mask
        mask = wide[:, 2:]
    kernel_for(device, q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal)
    check(device, q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal)


@pytest.mark.sanitize
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_key_padding_mask_alone(device, dtype, mask_dtype):
    # key_padding_mask without attn_mask, over 3 query blocks and 4 key tiles of the tensor cores: tiles whose
    # every term is 0 take its loop that reads no mask, the others read it. Batch 0: padding from key 150
    # (tiles 0-63 and 64-127 kept, 128-191 in part); batch 1: one removed key (bool) or one finite nonzero
    # term (float) at key 70, in tile 64-127 alone.
    q, k, v = make_qkv(2, 2, 130, 200, 32, 32, dtype=dtype)
    padding = torch.zeros(2, 200, dtype=torch.bool)
    padding[0, 150:] = True
    if mask_dtype == torch.bool:
        padding[1, 70] = True
        kpm = padding
    else:
        kpm = torch.zeros(2, 200, dtype=mask_dtype).masked_fill(padding, float("-inf"))
        kpm[1, 70] = 1.5
    kernel_for(device, q, k, v, key_padding_mask=kpm)
    check(device, q, k, v, key_padding_mask=kpm)


@pytest.mark.sanitize
def test_padding_skips_whole_tiles(device):
    # Masks that remove whole key tiles (32 keys: SIMT, Metal; 64: tensor cores), which the kernels skip, next
    # to tiles they remove in part. Batch 0: padding removes keys 0-63 (whole tiles of both sizes) and part
    # of the last tile; batch 1: the whole last, partial tile (128-139); batch 2: every key. attn_mask removes
    # keys 64-127 for the first 10 rows only (not skipped), and every key of row 3; as a bool mask, then as a
    # float one with -inf under is_causal.
    q, k, v = make_qkv(3, 2, 20, 140, 16, 16, dtype=torch.float16)
    kpm = torch.zeros(3, 140, dtype=torch.bool)
    kpm[0, :64] = True
    kpm[0, 134:] = True
    kpm[1, 128:] = True
    kpm[2] = True
    mask = torch.zeros(20, 140, dtype=torch.bool)
    mask[:10, 64:128] = True
    mask[3] = True
    kernel_for(device, q, k, v, attn_mask=mask, key_padding_mask=kpm)
    out, lse = check(device, q, k, v, attn_mask=mask, key_padding_mask=kpm)
    assert (out[2] == 0).all() and torch.isposinf(lse[2]).all()
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()
    additive = torch.zeros(20, 140).masked_fill(mask, float("-inf"))
    check(device, q, k, v, attn_mask=additive, key_padding_mask=kpm, is_causal=True)


@pytest.mark.parametrize("case", ["bool", "float", "per_batch", "per_head", "strided", "broadcast_rows",
                                  "window", "padding_causal", "softcap_sinks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_attn_mask_tile_classes(device, dtype, case):
    # attn_mask whose tiles are removed whole, in part or not at all, over 2 query blocks and 4 key tiles of
    # the tensor cores, which classify them before their tile loop (skipped, read, or the unmasked loop) and
    # read a bool mask's partly removed tiles from its packed bits.
    q, k, v = make_qkv(2, 2, 70, 200, 32, 32, dtype=dtype)
    options = tile_classes_case(case)
    kernel_for(device, q, k, v, **options)
    check(device, q, k, v, **options)


@pytest.mark.parametrize("case", ["bool", "float", "padding"])
@pytest.mark.parametrize("D", [32, 64])
def test_runs_of_full_tiles(device, D, case):
    # The tensor cores take a run of FULL tiles (no mask term but 0 on a warp's rows) without reading the
    # classes again: runs of 1 to 5 tiles per warp of one block, ended by a PARTIAL tile, by one the masks
    # remove for one warp's rows alone, by one they remove for the whole block (skipped) and by the last,
    # partial key tile, which each warp reaches in a different class.
    S = 64 * 11 + 30
    removed = torch.zeros(64, S, dtype=torch.bool)
    partial = {0: [3, 8], 1: [0, 5], 3: [1, 11]}  # warp (16 rows) -> its PARTIAL tiles
    for w, tiles in partial.items():
        for t in tiles:
            removed[16 * w + 3 + t % 5, 64 * t + 5 + t] = True
    removed[:, 384:448] = True  # tile 6: EMPTY for the block
    removed[16:32, 576:640] = True  # tile 9: removed for warp 1 alone
    q, k, v = make_qkv(2, 2, 64, S, D, D, dtype=torch.float16)
    options = {"attn_mask": removed}
    if case == "float":
        options = {"attn_mask": torch.zeros(64, S).masked_fill(removed, float("-inf"))}
    elif case == "padding":  # batch 1's keys from tile 10 on removed: its runs end there
        kpm = torch.zeros(2, S, dtype=torch.bool)
        kpm[1, 640 + 17:] = True
        options["key_padding_mask"] = kpm
    kernel_for(device, q, k, v, **options)
    check(device, q, k, v, **options)


def check_tiles_unread(device, q, k, v, **masks):
    """On the tensor-core kernel (others skip): no NaN in out or lse, and the reference's unread answer, for
    inputs whose NaN lie only in key tiles the masks remove for every row of a query block."""
    kernel = kernel_for(device, q, k, v, **masks)
    if not kernel.startswith("cuda mma"):
        pytest.skip(f"{kernel}: this checks the tensor-core kernel's tile classes")
    out, lse = run(device, q, k, v, **masks)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_matches_reference(out, lse, q, k, v, **masks, read_unseen=False)


@pytest.mark.sanitize
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=str)
def test_attn_mask_empty_tiles_are_not_read(device, mask_dtype):
    # The tensor cores never read a key tile that attn_mask removes for every row of a query block: NaN in
    # those keys and values reaches no output (the spec's unread answer; a kernel that reads them may give
    # NaN there, as a partly removed tile does). The other tiles are of every class (the pre-pass and, for
    # the bool mask, its packed bits: under the sanitizers too).
    q, k, v = make_qkv(2, 2, 70, 200, 32, 32, dtype=torch.float16)
    k[:, :, 64:128] = float("nan")
    v[:, :, 64:128] = float("nan")
    removed = tile_classes_mask()
    removed[:, 64:128] = True
    mask = removed if mask_dtype == torch.bool else torch.zeros(70, 200).masked_fill(removed, float("-inf"))
    check_tiles_unread(device, q, k, v, attn_mask=mask)


@pytest.mark.sanitize
def test_padding_empty_tiles_are_not_read(device):
    # Nor a key tile that key_padding_mask removes for the batch (batch 1: keys 64-127, NaN there), beside
    # tiles it keeps whole and in part, over both query blocks.
    q, k, v = make_qkv(2, 2, 70, 200, 32, 32, dtype=torch.float16)
    k[1, :, 64:128] = float("nan")
    v[1, :, 64:128] = float("nan")
    kpm = torch.zeros(2, 200, dtype=torch.bool)
    kpm[1, 64:128] = True
    kpm[1, 150] = True
    kpm[0, 190:] = True
    check_tiles_unread(device, q, k, v, key_padding_mask=kpm)


@pytest.mark.slow
def test_padding_tiles_known_before_the_loop(device):
    # The tensor-core kernel finds the tiles key_padding_mask removes entirely before its tile loop, 1024
    # tiles (65536 keys) at a time: keys are kept only around the first window's last tile and the second
    # window's first tiles, in a partial last tile, and (batch 1) nowhere in the first window at all. The
    # other kernels skip the same tiles one by one.
    S_ = 65536 + 3 * 64 + 20
    q, k, v = make_qkv(2, 1, 5, S_, 16, 16, dtype=torch.float16)
    kpm = torch.ones(2, S_, dtype=torch.bool)
    kpm[0, 65536 - 3] = False  # the last tile of the first window
    kpm[0, 65536 + 64 : 65536 + 70] = False  # the second window's second tile
    kpm[0, S_ - 1] = False  # the partial last tile
    kpm[1, 65536 + 130] = False  # batch 1: nothing before the second window's third tile
    kernel_for(device, q, k, v, key_padding_mask=kpm)
    out, lse = check(device, q, k, v, key_padding_mask=kpm)
    assert torch.isfinite(lse).all()
    # The same padding read element by element (the tensor-core kernel's general instantiation, for a float
    # mask): as a float key_padding_mask, and as the bool one beside a float attn_mask.
    additive = torch.zeros(2, S_).masked_fill(kpm, float("-inf"))
    check(device, q, k, v, key_padding_mask=additive)
    check(device, q, k, v, key_padding_mask=kpm, attn_mask=torch.zeros(5, S_))
    kpm[1] = True  # batch 1: every tile removed, in both windows
    out, lse = check(device, q, k, v, key_padding_mask=kpm)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


def test_float_neginf_mask_is_a_bool_mask(device):
    q, k, v = make_qkv(1, 2, 7, 11, 8, 8)
    masked = torch.rand(7, 11, generator=torch.Generator().manual_seed(4)) < 0.5
    masked[3] = True
    kernel_for(device, q, k, v, attn_mask=masked)
    out_bool, lse_bool = run(device, q, k, v, attn_mask=masked)
    additive = torch.zeros(7, 11).masked_fill(masked, float("-inf"))
    out_inf, lse_inf = run(device, q, k, v, attn_mask=additive)
    torch.testing.assert_close(out_inf, out_bool, rtol=0, atol=0)
    torch.testing.assert_close(lse_inf, lse_bool, rtol=0, atol=0)


# Decoding at the CPU kernel's scale: one query row, whose scores the CPU kernel computes from the key rows
# without transposing them (read in place, or converted when the rows are not contiguous: "strided_last").
# CPU only: 700 keys are many tiles for the emulated kernels (test_shapes has a one-query case for them).
@pytest.mark.parametrize("layout", ["blhd", "strided_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_cpu_single_query_with_masks(dtype, layout):
    gen = torch.Generator().manual_seed(6)
    q, k, v = make_qkv(2, 3, 1, 700, 19, 8, dtype=dtype, layout=layout)
    kpm = torch.rand(2, 700, generator=gen) < 0.3
    check_forward(q, k, v, attn_mask=torch.randn(2 * 3, 1, 700, generator=gen), key_padding_mask=kpm)
    check_forward(q, k, v, attn_mask=torch.rand(1, 700, generator=gen) < 0.2, is_causal=True)


def test_cpu_masked_tiles_are_skipped_correctly():
    # Masks that remove whole (128, 512) tiles of the CPU kernel, which it skips, next to tiles they remove in
    # part. CPU only: too big for the emulated kernels (test_padding_skips_whole_tiles has theirs).
    q, k, v = make_qkv(2, 2, 600, 1300, 16, 16)
    mask = torch.zeros(600, 1300, dtype=torch.bool)
    mask[:300, 512:1024] = True  # whole key tile for the first two query tiles, part of it for the third
    mask[:, 1200:] = True
    kpm = torch.zeros(2, 1300, dtype=torch.bool)
    kpm[0, :512] = True  # batch 0: whole first key tile
    kpm[1, 1024:] = True  # batch 1: the last, partial key tile
    check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm)
    additive = torch.zeros(600, 1300).masked_fill(mask, float("-inf"))
    check_forward(q, k, v, attn_mask=additive, key_padding_mask=kpm, is_causal=True)


# ------------------------------------------------------------------------------------------------------------
# Fully masked rows, NaN, infinities, empty sizes.


@pytest.mark.parametrize("L_", [6, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows(device, dtype, L_):
    # Query 2 sees no key; batch 1 sees no key at all (its tiles skipped, or its keys one by one): out 0,
    # lse +inf; every other row's lse is finite.
    (q, k, v), masks = fully_masked_rows_case(L_, dtype)
    kernel_for(device, q, k, v, **masks, scale=0.3)
    out, lse = check(device, q, k, v, **masks, scale=0.3)
    assert_fully_masked_rows(out, lse)
    assert torch.isfinite(lse[0, :, [row for row in range(L_) if row != 2]]).all()


@pytest.mark.parametrize("L_", [4, 40])
def test_fully_masked_row_with_infinite_values(device, L_):
    # A masked key whose value is inf gives 0 * inf = NaN in an accumulator; the row is written as 0 anyway.
    q, k, v = make_qkv(1, 1, L_, 5, 8, 8)
    v[0, 0, 3] = float("inf")
    mask = torch.zeros(L_, 5, dtype=torch.bool)
    mask[1] = True
    kernel_for(device, q, k, v, attn_mask=mask)
    out, lse = run(device, q, k, v, attn_mask=mask)
    assert (out[0, 0, 1] == 0).all() and torch.isposinf(lse[0, 0, 1])


@pytest.mark.parametrize("L_", [5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_nan_propagates_per_row(device, dtype, L_):
    # NaN in every score of row (h=1, l=2), and in one score of row l=4 of every head.
    (q, k, v), masks = nan_rows_case(L_)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kernel_for(device, q, k, v, **masks)
    assert_nan_rows(*check(device, q, k, v, **masks))


@pytest.mark.parametrize("S_", [37, 130])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scores_far_below_zero(device, dtype, S_):
    # Every score near -240, without masks: exp(score - max) is exact only with the row's true max as the
    # base (a max taken over anything beyond the row's scores, such as the unused lanes of a key tile's last
    # vector, would underflow every term to 0). S = 37 and 130 end in a partial vector and a partial tile.
    gen = torch.Generator().manual_seed(3)
    q = 1 + 0.1 * torch.randn(2, 2, 40, 24, generator=gen)
    k = -10 - torch.randn(2, 2, S_, 24, generator=gen)
    v = torch.randn(2, 2, S_, 24, generator=gen)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kernel_for(device, q, k, v, scale=1.0)
    out, lse = check(device, q, k, v, scale=1.0)
    assert (lse < -150).all()
    # NaN in one query row, still without masks: that row alone is NaN.
    q[1, 0, 7, 3] = float("nan")
    out, lse = run(device, q, k, v, scale=1.0)
    assert out[1, 0, 7].isnan().all() and lse[1, 0, 7].isnan()
    assert out.isnan().sum() == out.shape[-1] and lse.isnan().sum() == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", [*EMPTY_SIZES, (1, 1, 12, 0, 8, 8)], ids=str)
def test_empty_sizes(device, sizes, dtype):
    q, k, v = make_qkv(*sizes, dtype=dtype)
    kpm = torch.zeros(sizes[0], sizes[3], dtype=torch.bool)
    kernel_for(device, q, k, v, key_padding_mask=kpm)
    out, lse = check(device, q, k, v, key_padding_mask=kpm)
    if sizes[3] == 0:  # no keys: every row is fully masked
        assert (out == 0).all() and torch.isposinf(lse).all()


# ------------------------------------------------------------------------------------------------------------
# Head dims above 256: the CUDA glue runs a composite of torch's ops (cuda/attention_composite.h, on the CPU
# tensors of the emulated CUDA devices); Metal refuses them (test_metal_refusals).


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [(288, 288), (264, 64), (64, 320)], ids=str)
def test_head_dim_above_256(device, dims, dtype):
    gen = torch.Generator().manual_seed(6)
    D_, Dv = dims
    q, k, v = make_qkv(2, 2, 37, 50, D_, Dv, dtype=dtype, layout="blhd")
    kpm = torch.rand(2, 50, generator=gen) < 0.3
    kpm[1] = True  # fully masked rows here too
    kwargs = {"attn_mask": torch.randn(4, 37, 50, generator=gen), "key_padding_mask": kpm, "is_causal": True}
    kernel_for(device, q, k, v, **kwargs)
    out, lse = check(device, q, k, v, **kwargs)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    check(device, q, k, v, attn_mask=torch.rand(37, 50, generator=gen) < 0.2,
          key_padding_mask=torch.randn(2, 50, generator=gen).to(dtype), scale=1.0)


@pytest.mark.slow
def test_head_dim_above_256_in_chunks(device):
    # Scores of (B, H, L, S) = 1 x 1 x 1200 x 70000 fp32 are 336 MB: the composite takes two chunks of
    # queries (each within 256 MiB). Only on a GPU: the emulated devices would need the same 336 MB and
    # ~46 GFLOP on the CPU.
    if device.emulated:
        pytest.skip("too large for an emulated backend")
    q, k, v = (torch.randn(1, 1, n, 272) for n in (1200, 70000, 70000))
    kpm = torch.rand(1, 70000) < 0.5
    q, k, v, kpm = to_device((q, k, v, kpm), device)
    kernel = kernel_or_skip(device, q, k, v, key_padding_mask=kpm, is_causal=True)
    if kernel != "cuda composite":
        pytest.skip(f"{kernel}: the query chunks are the CUDA composite's")
    # The reference runs on the GPU too: its float64 scores alone are 672 MB.
    check_forward(q, k, v, key_padding_mask=kpm, is_causal=True)


# ------------------------------------------------------------------------------------------------------------
# What Metal cannot do: float64 (Metal has no double) and head dims above 256 are refused with an error.


def test_metal_refusals(device):
    if device.backend not in METAL:
        pytest.skip("Metal's refusals")
    q, k, v = make_qkv(1, 1, 3, 4, 8, 8)
    with pytest.raises(RuntimeError, match="float64 is not supported on MPS"):
        run(device, q.double(), k.double(), v.double())
    with pytest.raises(RuntimeError, match="float64 masks are not supported on MPS"):
        run(device, q, k, v, attn_mask=torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float64 masks are not supported on MPS"):
        run(device, q, k, v, key_padding_mask=torch.zeros(1, 4, dtype=torch.float64))
    q, k, v = make_qkv(1, 1, 3, 4, 264, 8)
    with pytest.raises(RuntimeError, match="expected head dims D and Dv up to 256 on MPS"):
        run(device, q, k, v)


# ------------------------------------------------------------------------------------------------------------
# The fake kernel, opcheck, torch.compile.


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "sizes", [(2, 3, 5, 7, 8, 4), (1, 1, 1, 1, 1, 1), (2, 0, 3, 4, 8, 8), (1, 2, 3, 4, 8, 0)], ids=str
)
def test_fake_matches_kernel(device, sizes, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = to_device(make_qkv(*sizes, dtype=dtype, layout="blhd"), device)
    kernel_or_skip(device, q, k, v)
    real = attnx.attention(q, k, v)
    with FakeTensorMode() as mode:
        fake = attnx.attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v))
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype, f.device) == (r.shape, r.stride(), r.dtype, r.device)


@pytest.mark.parametrize("case", range(4))
def test_opcheck(device, case):
    pytest.importorskip("expecttest")
    args = to_device(attention_opcheck_cases()[case], device)
    q, k, v, attn_mask, key_padding_mask, is_causal, scale = args
    kernel_or_skip(device, q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                   is_causal=is_causal, scale=scale)
    torch.library.opcheck(torch.ops.attnx.attention.default, args)


def test_compile_fullgraph(device):
    q, k, v = to_device(make_qkv(2, 2, 5, 7, 8, 8), device)
    kernel_or_skip(device, q, k, v, is_causal=True)
    fn = torch.compile(lambda q, k, v: attnx.attention(q, k, v, is_causal=True)[0] * 2, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), attnx.attention(q, k, v, is_causal=True)[0] * 2)


def test_differentiable():
    # The backward itself is tested in test_attention_backward.py; here only that gradients reach q, k and v.
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 3, 4, 8, 8))
    out, lse = attnx.attention(q, k, v)
    assert not lse.requires_grad  # not differentiable, as SDPA's logsumexp
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


# ------------------------------------------------------------------------------------------------------------
# Bad inputs: RuntimeError with a message that names what was expected, on every device (the checks are the
# shared glue's, before any kernel).


def _bad_cases(device="cpu"):
    q, k, v = to_device(make_qkv(2, 3, 5, 7, 8, 4), device)

    def zeros(*size, dtype=torch.float32, on=device):
        return torch.zeros(*size, dtype=dtype, device=on)

    where = q.device
    return {
        "query rank": ((q[0], k, v), {}, "expected query of shape (B, H, L, D), got a 3-D tensor"),
        "key rank": ((q, k[0], v), {}, "expected key of shape (B, Hkv, S, D), got a 3-D tensor"),
        "value rank": ((q, k, v[..., None]), {}, "expected value of shape (B, Hkv, S, Dv), got a 5-D tensor"),
        "query dtype": (
            (q.long(), k.long(), v.long()), {},
            "expected query of dtype float32, float64, bfloat16 or float16, got Long",
        ),
        "key dtype": ((q, k.half(), v), {}, "expected key of query's dtype Float, got Half"),
        "value dtype": ((q, k, v.half()), {}, "expected value of query's dtype Float, got Half"),
        "device": ((q, k.to("meta"), v), {}, f"expected key on query's device {where}, got meta"),
        "batch": ((q, k[:1], v[:1]), {}, "expected key of shape (B, Hkv, S, D) = (2, Hkv, S, 8)"),
        "heads": (
            (q, k[:, :2], v[:, :2]), {},
            "expected the number of key/value heads (Hkv = 2) to divide the number of query heads (H = 3)",
        ),
        "value heads": ((q, k, v[:, :1]), {}, "expected value of shape (B, Hkv, S, Dv) = (2, 3, 7, Dv)"),
        "head dim": ((q, k[..., :4], v), {}, "expected key of shape (B, Hkv, S, D) = (2, Hkv, S, 8)"),
        "value S": ((q, k, v[:, :, :6]), {}, "expected value of shape (B, Hkv, S, Dv) = (2, 3, 7, Dv)"),
        "value B": ((q, k, v[:1]), {}, "expected value of shape (B, Hkv, S, Dv) = (2, 3, 7, Dv)"),
        "mask 2-D": (
            (q, k, v), {"attn_mask": zeros(5, 6)},
            "expected attn_mask of shape (L, S) = (5, 7), (B*H, L, S) = (6, 5, 7) or 4-D broadcastable to "
            "(B, H, L, S) = (2, 3, 5, 7), got [5, 6]",
        ),
        "mask 3-D": ((q, k, v), {"attn_mask": zeros(3, 5, 7)}, "(B*H, L, S) = (6, 5, 7)"),
        "mask 4-D": ((q, k, v), {"attn_mask": zeros(2, 2, 5, 7)}, "4-D broadcastable to (B, H, L, S)"),
        "mask 1-D": ((q, k, v), {"attn_mask": zeros(7)}, "expected attn_mask of shape (L, S)"),
        "mask int": ((q, k, v), {"attn_mask": zeros(5, 7, dtype=torch.int64)},
                     "expected attn_mask of dtype bool (True = masked out) or a floating dtype"),
        "mask uint8": ((q, k, v), {"attn_mask": zeros(5, 7, dtype=torch.uint8)}, "got Byte"),
        "mask device": ((q, k, v), {"attn_mask": zeros(5, 7, on="meta")},
                        f"expected attn_mask on query's device {where}, got meta"),
        "padding shape": ((q, k, v), {"key_padding_mask": zeros(2, 6)},
                          "expected key_padding_mask of shape (B, S) = (2, 7), got [2, 6]"),
        "padding rank": ((q, k, v), {"key_padding_mask": zeros(2, 1, 7)},
                         "expected key_padding_mask of shape (B, S) = (2, 7)"),
        "padding dtype": ((q, k, v), {"key_padding_mask": zeros(2, 7, dtype=torch.int32)},
                          "expected key_padding_mask of dtype bool (True = masked out) or a floating dtype"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs(device, case):
    args, kwargs, message = _bad_cases(device)[case]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        attnx.attention(*args, **kwargs)


def test_mixed_devices_are_an_error(device):
    # A mask or key on the CPU next to inputs on a GPU.
    if device == "cpu":
        pytest.skip("the CPU is the other device")
    q, k, v = to_device(make_qkv(1, 1, 3, 4, 8, 8), device)
    with pytest.raises(RuntimeError, match="expected key on query's device"):
        attnx.attention(q, k.cpu(), v)
    with pytest.raises(RuntimeError, match="expected attn_mask on query's device"):
        attnx.attention(q, k, v, attn_mask=torch.zeros(3, 4))


@pytest.mark.parametrize("case", ["query rank", "key dtype", "batch", "value S", "mask 2-D", "mask int",
                                  "padding shape"])
def test_bad_inputs_fake(case):
    # The fake kernel raises the same errors, so torch.compile reports them at trace time.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs, message = _bad_cases()[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attnx.attention(*args, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# The CPU kernel's memory: nothing of size (B, H, L, S), or even (B, 1, L, S), is ever built.

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import torch, attnx

    def status(field):  # bytes
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    B, H, L, S, D = 2, 4, 4096, 4096, 16
    q, k, v = (torch.randn(B, H, n, D) for n in (L, S, S))
    mask = torch.rand(L, S) < 0.1
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[:, -100:] = True
    attnx.attention(q[:, :, :8], k, v, mask[:8], kpm)  # warm up: threads, JIT kernels
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = status("VmRSS")
    out, lse = attnx.attention(q, k, v, mask, kpm, is_causal=True)
    print(status("VmHWM") - before)
    """
)


@pytest.mark.slow  # and its peak under the sanitizers would be theirs
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_cpu_no_quadratic_memory():
    # Peak RSS growth during one call in a fresh process: a merged (B, 1, L, S) float mask alone would be
    # 128 MiB, attention weights (B, H, L, S) 512 MiB. The call needs its outputs (1 MiB) and per-thread
    # tiles.
    grown = int(run_python(_MEMORY_SCRIPT).strip().splitlines()[-1])
    assert grown < 16 * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB during the call"


# ------------------------------------------------------------------------------------------------------------
# Every ISA variant of the CPU kernel (torch picks one per process from ATEN_CPU_CAPABILITY).

_ISA_SCRIPT = """
    from attention_helpers import check_forward, every_feature, make_qkv
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        q, k, v = make_qkv(2, 3, 300, 530, 24, 20, dtype=dtype, layout="strided_last")
        kpm = torch.rand(2, 530) < 0.3
        mask = torch.randn(300, 530)
        check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
        check_forward(*make_qkv(1, 2, 37, 53, 24, 24, dtype=dtype))
        check_forward(*make_qkv(2, 2, 1, 70, 24, 24, dtype=dtype, layout="blhd"),
                      key_padding_mask=kpm[:, :70])
        # Odd head dims and key counts (a pair's zero half), every key-range option, one query row (keys read
        # as rows), grouped-KV decoding (the heads as a tile's rows), a paged cache whose pages split pairs.
        check_forward(*make_qkv(2, 2, 130, 301, 23, 25, dtype=dtype), is_causal=True)
        check_forward(*make_qkv(2, 4, 90, 77, 24, 24, dtype=dtype, layout="lbhd"), **every_feature(2, 4, 77))
        check_forward(*make_qkv(2, 2, 1, 301, 23, 24, dtype=dtype))
        q, k, v = make_qkv(2, 8, 1, 301, 24, 24, dtype=dtype)
        check_forward(q, k[:, :2], v[:, :2])
        # Scores near -240 without masks (test_scores_far_below_zero): the row max is the scores' own.
        gen = torch.Generator().manual_seed(3)
        q = 1 + 0.1 * torch.randn(1, 2, 40, 24, generator=gen)
        k, v = -10 - torch.randn(1, 2, 37, 24, generator=gen), torch.randn(1, 2, 37, 24, generator=gen)
        check_forward(q.to(dtype), k.to(dtype), v.to(dtype), scale=1.0)
    from test_varlen import check_forward as check_varlen, make_packed, make_paged, offsets
    lens_q, lens_k = [1, 4, 3], [9, 130, 61]
    q, _, _ = make_packed(lens_q, lens_k, 4, 2, 16, 9, torch.bfloat16)
    k_cache, v_cache, table = make_paged(lens_k, 7, 2, 16, 9, torch.bfloat16)
    check_varlen(q, k_cache, v_cache, offsets(lens_q), offsets(lens_k), is_causal=True, block_table=table)
    """


@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_isa_variants(variant):
    run_under_cpu_capability(_ISA_SCRIPT, variant)


# The files whose bfloat16 tests run again on the emulated AVX512-BF16 variant.
_BF16_FILES = ("test_attention.py", "test_attention_backward.py", "test_attention_features.py",
               "test_varlen.py", "test_dropout.py", "test_block_sparse.py", "test_degenerate.py")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["emulated_bf16", "emulated_amx"])
def test_bfloat16_tests_on_the_emulated_variant(variant):
    # The pair products of bfloat16 (forward and backward, every option) on a CPU without AVX512-BF16 or
    # AMX-BF16 are tested here: every bfloat16 test of the attention files again, in a process whose kernels
    # are the emulated variant's (this process runs the machine's own). About a minute each on two cores.
    if torch.ops.attnx._cpu_capability() == variant:
        pytest.skip("this process runs the emulated variant already")
    files = [os.path.join(TESTS, name) for name in _BF16_FILES]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "bfloat16 or bf16", "-m",
         "not slow", *files],
        capture_output=True, text=True, env=dict(os.environ, ATTNX_CPU_CAPABILITY=variant))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
