"""attnx.attention against reference.attention: dtypes, shapes, strided layouts, masks, edge cases, errors.

Accuracy bound (flash-attention style): with ref64 the reference on float64 copies of the same inputs and
ref_same the reference in the inputs' own dtype,

    max |kernel - ref64| <= K * max |ref_same - ref64| + atol[dtype]

so the kernel may be at most K times as far from the exact result as the reference's own rounding is. atol
covers what that relative bound cannot: fp32 kernels use an exp accurate to ~20 ulp where the reference's is
~1 ulp (1e-5 on outputs and lse of magnitude <= ~10), fp64 sums in a different order (1e-12), and bf16/fp16
outputs can round to the neighbouring representable value of the reference's (2e-3, one bf16 ulp at 0.25).
Infinite and NaN entries must match exactly, position by position. The inputs, the mask factories and this
comparison are attention_helpers.py's, shared with the other attention tests.
"""

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
    MASKED_SHAPE,
    QKV_LAYOUTS,
    assert_fully_masked_rows,
    assert_nan_rows,
    attention_opcheck_cases,
    check_forward,
    fully_masked_rows_case,
    make_attn_mask,
    make_key_padding_mask,
    make_qkv,
    nan_rows_case,
    run_python,
    run_under_cpu_capability,
)

# ------------------------------------------------------------------------------------------------------------
# Shapes, dtypes and layouts.

# (B, H, L, S, D, Dv). The CPU kernel tiles 128 queries by 512 keys and hands out blocks of up to 8 query
# tiles that share each transposed key tile: the larger shapes cross those boundaries, with partial tiles.
SHAPES = [
    (2, 3, 37, 53, 24, 24),  # odd sizes, L != S
    (1, 2, 16, 16, 32, 8),  # Dv < D
    (2, 1, 9, 70, 8, 40),  # Dv > D, L < S
    (1, 1, 1, 1, 4, 4),  # single query and key
    (3, 2, 1, 33, 16, 16),  # decoding-like: one query
    (1, 1, 45, 1, 16, 16),  # one key
]
BIG_SHAPES = [
    (1, 2, 300, 600, 32, 32),  # partial tiles both ways
    (2, 1, 520, 1030, 16, 24),  # 5 query tiles, 3 key tiles
    (2, 4, 700, 900, 16, 16),  # blocks of 6 query tiles
]


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_dtypes_layouts(shape, dtype, layout):
    check_forward(*make_qkv(*shape, dtype=dtype, layout=layout))


@pytest.mark.parametrize("layout", ["contiguous", "blhd", "expanded_kv", "strided_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BIG_SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_tile_boundaries(shape, dtype, layout, is_causal):
    check_forward(*make_qkv(*shape, dtype=dtype, layout=layout), is_causal=is_causal)


def test_single_thread_plan():
    # One thread plans larger query blocks for the same shape; results must not depend on it.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        check_forward(*make_qkv(1, 2, 1100, 700, 16, 16), is_causal=True)
    finally:
        torch.set_num_threads(threads)


def test_custom_scale():
    q, k, v = make_qkv(2, 2, 20, 30, 16, 16)
    check_forward(q, k, v, scale=0.37)
    check_forward(q, k, v, scale=0.0)


def test_b1_transposed_layout():
    # batch_first=True at B == 1 on MPS leaves strides (D, B*D, 1)-like views behind; here with heads too.
    q, k, v = make_qkv(1, 4, 12, 12, 8, 8, layout="lbhd")
    assert q.stride(0) == 4 * 8  # the size-1 batch dim carries a stride that is not the contiguous one
    check_forward(q, k, v)


# ------------------------------------------------------------------------------------------------------------
# Masks.

B, H, L, S = MASKED_SHAPE
D = 16
ATTN_MASKS = [None, *ATTN_MASK_KINDS]
PADDINGS = [None, *KEY_PADDING_MASK_KINDS]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("attn_mask", ATTN_MASKS, ids=str)
def test_attn_mask(attn_mask, is_causal):
    gen = torch.Generator().manual_seed(1)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    check_forward(*make_qkv(B, H, L, S, D, D, layout="blhd"), attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padding", PADDINGS, ids=str)
@pytest.mark.parametrize("attn_mask", [None, "bool_ls", "float_bhls", "float_1h1s"], ids=str)
def test_padding_and_attn_mask(attn_mask, padding, is_causal):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else make_attn_mask(attn_mask, gen)
    kpm = None if padding is None else make_key_padding_mask(padding, gen)
    check_forward(*make_qkv(B, H, L, S, D, D), attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_low_precision_and_strided(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(B, H, L, S, D, 8, dtype=dtype, layout="strided_last")
    check_forward(q, k, v, attn_mask=make_attn_mask("float_ls", gen).to(dtype),
                  key_padding_mask=make_key_padding_mask("bool", gen), is_causal=True, scale=0.2)


@pytest.mark.parametrize("layout", ["blhd", "strided_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_single_query_with_masks(dtype, layout):
    # Decoding: one query row, whose scores the kernel computes from the key rows without transposing them
    # (read in place, or converted when the rows are not contiguous: "strided_last").
    gen = torch.Generator().manual_seed(6)
    q, k, v = make_qkv(2, 3, 1, 700, 19, 8, dtype=dtype, layout=layout)
    kpm = torch.rand(2, 700, generator=gen) < 0.3
    check_forward(q, k, v, attn_mask=torch.randn(2 * 3, 1, 700, generator=gen), key_padding_mask=kpm)
    check_forward(q, k, v, attn_mask=torch.rand(1, 700, generator=gen) < 0.2, is_causal=True)


def test_masked_tiles_are_skipped_correctly():
    # Masks that remove whole (128, 512) tiles, which the kernel skips, next to tiles they remove in part.
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
# Fully masked rows, empty sizes, NaN.


def test_fully_masked_rows():
    # Query 2 sees no key; batch 1 sees no key at all.
    qkv, masks = fully_masked_rows_case()
    out, lse = check_forward(*qkv, **masks)
    assert_fully_masked_rows(out, lse)
    assert torch.isfinite(lse[0, :, [0, 1, 3, 4, 5]]).all()


def test_float_neginf_mask_is_a_bool_mask():
    q, k, v = make_qkv(1, 2, 7, 11, 8, 8)
    masked = torch.rand(7, 11, generator=torch.Generator().manual_seed(4)) < 0.5
    masked[3] = True
    out_bool, lse_bool = attnx.attention(q, k, v, attn_mask=masked)
    additive = torch.zeros(7, 11).masked_fill(masked, float("-inf"))
    out_inf, lse_inf = attnx.attention(q, k, v, attn_mask=additive)
    torch.testing.assert_close(out_inf, out_bool, rtol=0, atol=0)
    torch.testing.assert_close(lse_inf, lse_bool, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", EMPTY_SIZES, ids=str)
def test_empty_sizes(sizes, dtype):
    q, k, v = make_qkv(*sizes, dtype=dtype)
    out, lse = check_forward(q, k, v, key_padding_mask=torch.zeros(sizes[0], sizes[3], dtype=torch.bool))
    if sizes[3] == 0:  # no keys: every row is fully masked
        assert (out == 0).all() and torch.isposinf(lse).all()


def test_nan_propagates_per_row():
    # NaN in every score of row (h=1, l=2), and in one score of row l=4 of every head.
    qkv, masks = nan_rows_case()
    assert_nan_rows(*check_forward(*qkv, **masks))


# ------------------------------------------------------------------------------------------------------------
# Layout of the outputs, fake kernel, opcheck.


def test_output_layout():
    q, k, v = make_qkv(2, 3, 5, 7, 8, 4)
    out, lse = attnx.attention(q, k, v)
    assert out.shape == (2, 3, 5, 4) and out.stride() == (60, 4, 12, 1)  # memory order (B, L, H, Dv)
    assert out.transpose(1, 2).reshape(2, 5, 12).data_ptr() == out.data_ptr()
    assert out.transpose(1, 2).is_contiguous()
    assert lse.shape == (2, 3, 5) and lse.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "sizes", [(2, 3, 5, 7, 8, 4), (1, 1, 1, 1, 1, 1), (2, 0, 3, 4, 8, 8), (1, 2, 3, 4, 8, 0)], ids=str
)
def test_fake_matches_kernel(sizes, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_qkv(*sizes, dtype=dtype, layout="blhd")
    out, lse = attnx.attention(q, k, v)
    with FakeTensorMode() as mode:
        f_out, f_lse = attnx.attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v))
    for real, fake in ((out, f_out), (lse, f_lse)):
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


@pytest.mark.parametrize("case", range(4))
def test_opcheck(case):
    pytest.importorskip("expecttest")
    torch.library.opcheck(torch.ops.attnx.attention.default, attention_opcheck_cases()[case])


def test_compile_fullgraph():
    q, k, v = make_qkv(2, 2, 5, 7, 8, 8)
    fn = torch.compile(lambda q, k, v: attnx.attention(q, k, v, is_causal=True)[0] * 2, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), attnx.attention(q, k, v, is_causal=True)[0] * 2)


# ------------------------------------------------------------------------------------------------------------
# Memory: nothing of size (B, H, L, S), or even (B, 1, L, S), is ever built.

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_no_quadratic_memory():
    # Peak RSS growth during one call in a fresh process: a merged (B, 1, L, S) float mask alone would be
    # 128 MiB, attention weights (B, H, L, S) 512 MiB. The call needs its outputs (1 MiB) and per-thread
    # tiles.
    grown = int(run_python(_MEMORY_SCRIPT).strip().splitlines()[-1])
    assert grown < 16 * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB during the call"


# ------------------------------------------------------------------------------------------------------------
# Every ISA variant of the CPU kernel (torch picks one per process from ATEN_CPU_CAPABILITY).

_ISA_SCRIPT = """
    from attention_helpers import check_forward, make_qkv
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        q, k, v = make_qkv(2, 3, 300, 530, 24, 20, dtype=dtype, layout="strided_last")
        kpm = torch.rand(2, 530) < 0.3
        mask = torch.randn(300, 530)
        check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
        check_forward(*make_qkv(1, 2, 37, 53, 24, 24, dtype=dtype))
        check_forward(*make_qkv(2, 2, 1, 70, 24, 24, dtype=dtype, layout="blhd"),
                      key_padding_mask=kpm[:, :70])
    """


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_isa_variants(isa):
    run_under_cpu_capability(_ISA_SCRIPT, isa)


# ------------------------------------------------------------------------------------------------------------
# Bad inputs: RuntimeError with a message that names what was expected.


def _bad_cases():
    q, k, v = make_qkv(2, 3, 5, 7, 8, 4)
    return {
        "query rank": ((q[0], k, v), {}, "expected query of shape (B, H, L, D), got a 3-D tensor"),
        "key rank": ((q, k[0], v), {}, "expected key of shape (B, Hkv, S, D), got a 3-D tensor"),
        "value rank": ((q, k, v[..., None]), {}, "expected value of shape (B, Hkv, S, Dv), got a 5-D tensor"),
        "query dtype": (
            (q.long(), k.long(), v.long()), {},
            "expected query of dtype float32, float64, bfloat16 or float16, got Long",
        ),
        "key dtype": ((q, k.double(), v), {}, "expected key of query's dtype Float, got Double"),
        "value dtype": ((q, k, v.half()), {}, "expected value of query's dtype Float, got Half"),
        "device": ((q, k.to("meta"), v), {}, "expected key on query's device cpu, got meta"),
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
            (q, k, v), {"attn_mask": torch.zeros(5, 6)},
            "expected attn_mask of shape (L, S) = (5, 7), (B*H, L, S) = (6, 5, 7) or 4-D broadcastable to "
            "(B, H, L, S) = (2, 3, 5, 7), got [5, 6]",
        ),
        "mask 3-D": ((q, k, v), {"attn_mask": torch.zeros(3, 5, 7)}, "(B*H, L, S) = (6, 5, 7)"),
        "mask 4-D": ((q, k, v), {"attn_mask": torch.zeros(2, 2, 5, 7)}, "4-D broadcastable to (B, H, L, S)"),
        "mask 1-D": ((q, k, v), {"attn_mask": torch.zeros(7)}, "expected attn_mask of shape (L, S)"),
        "mask int": ((q, k, v), {"attn_mask": torch.zeros(5, 7, dtype=torch.int64)},
                     "expected attn_mask of dtype bool (True = masked out) or a floating dtype"),
        "mask uint8": ((q, k, v), {"attn_mask": torch.zeros(5, 7, dtype=torch.uint8)}, "got Byte"),
        "mask device": ((q, k, v), {"attn_mask": torch.zeros(5, 7, device="meta")},
                        "expected attn_mask on query's device cpu, got meta"),
        "padding shape": ((q, k, v), {"key_padding_mask": torch.zeros(2, 6)},
                          "expected key_padding_mask of shape (B, S) = (2, 7), got [2, 6]"),
        "padding rank": ((q, k, v), {"key_padding_mask": torch.zeros(2, 1, 7)},
                         "expected key_padding_mask of shape (B, S) = (2, 7)"),
        "padding dtype": ((q, k, v), {"key_padding_mask": torch.zeros(2, 7, dtype=torch.int32)},
                          "expected key_padding_mask of dtype bool (True = masked out) or a floating dtype"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs(case):
    args, kwargs, message = _bad_cases()[case]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        attnx.attention(*args, **kwargs)


@pytest.mark.parametrize("case", ["query rank", "key dtype", "batch", "value S", "mask 2-D", "mask int",
                                  "padding shape"])
def test_bad_inputs_fake(case):
    # The fake kernel raises the same errors, so torch.compile reports them at trace time.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs, message = _bad_cases()[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attnx.attention(*args, **kwargs)


def test_differentiable():
    # The backward itself is tested in test_attention_backward.py; here only that gradients reach q, k and v.
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 3, 4, 8, 8))
    out, lse = attnx.attention(q, k, v)
    assert not lse.requires_grad  # not differentiable, as SDPA's logsumexp
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))
