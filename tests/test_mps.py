"""attnx's Metal kernels on a real MPS device: the checks the CPU emulation cannot make.

That Apple's compiler accepts metal/*.metal (the library is compiled at the first call), that the glue
(csrc/mps/*.mm) binds buffers and offsets right on torch's MPS stream, and that results match the reference
on the GPU's own arithmetic. Every test takes the device as a parameter and is skipped, visibly, where there
is no MPS device or no MPS kernel in the build. tests/test_metal_emulation.py covers the kernels' logic on
Linux.
"""

import pytest
import torch
import torch.nn as nn

import attnx
from attention_helpers import (
    ATOL,
    LSE_ATOL,
    assert_bounded,
    make_attn_mask,
    make_gqa,
    make_key_padding_mask,
    make_qkv,
    upcast,
)
from attnx import reference
from conftest import DEVICES, require_kernel

MPS = [d for d in DEVICES if d.id == "mps"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QUERY_LENGTHS = {"vector": 5, "tiled": 70}


def _to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def check(device, q, k, v, attn_mask=None, key_padding_mask=None, key_lengths=None, sinks=None, **kwargs):
    """attnx.attention on `device` vs the reference on CPU copies (float64 and the inputs' dtype)."""
    require_kernel("attnx::attention", device)
    masks = {"attn_mask": attn_mask, "key_padding_mask": key_padding_mask, "key_lengths": key_lengths,
             "sinks": sinks}
    dq, dk, dv, dm, dp, dl, ds = _to(device, q, k, v, attn_mask, key_padding_mask, key_lengths, sinks)
    out, lse = attnx.attention(dq, dk, dv, attn_mask=dm, key_padding_mask=dp, key_lengths=dl, sinks=ds,
                               **kwargs)
    masks64 = {n: upcast(m) for n, m in masks.items()}
    ref64 = reference.attention(upcast(q), upcast(k), upcast(v), **masks64, **kwargs)
    ref = reference.attention(q, k, v, **masks, **kwargs)
    assert_bounded(out.cpu(), ref64[0], ref[0], ATOL[q.dtype], "out")
    assert_bounded(lse.cpu(), ref64[1], ref[1], LSE_ATOL[q.dtype], "lse")
    return out, lse


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("layout", ["contiguous", "blhd", "lbhd", "packed", "expanded_kv", "strided_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", QUERY_LENGTHS)
def test_attention(device, kernel, dtype, layout):
    q, k, v = make_qkv(2, 3, QUERY_LENGTHS[kernel], 77, 64, 64, dtype=dtype, layout=layout)
    check(device, q, k, v, is_causal=True)


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 200, 256])
@pytest.mark.parametrize("kernel", QUERY_LENGTHS)
def test_attention_head_dims(device, kernel, d):
    check(device, *make_qkv(1, 2, QUERY_LENGTHS[kernel], 50, d, d, layout="blhd"))


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("attn_mask", ["bool_ls", "float_bhls", "bf16_ls", "float_1h1s",
                                       "float_ls_transposed", "float_bhls_sliced"])
@pytest.mark.parametrize("padding", [None, "bool", "float16_expanded"])
def test_attention_masks(device, attn_mask, padding):
    gen = torch.Generator().manual_seed(1)
    mask = make_attn_mask(attn_mask, gen)
    kpm = None if padding is None else make_key_padding_mask(padding, gen)
    check(device, *make_qkv(2, 3, 19, 41, 16, 16, layout="blhd"), attn_mask=mask, key_padding_mask=kpm)


@pytest.mark.parametrize("device", MPS)
def test_attention_fully_masked_rows(device):
    q, k, v = make_qkv(2, 2, 6, 9, 8, 8)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1] = True
    out, lse = check(device, q, k, v, key_padding_mask=kpm)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


# Grouped KV heads, key ranges, soft-capping and sinks (tests/test_metal_emulation.py has the finer cases).


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("layout", ["contiguous", "blhd", "lbhd", "expanded_kv", "strided_last"])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 3)], ids=str)
@pytest.mark.parametrize("kernel", QUERY_LENGTHS)
def test_attention_grouped_kv_heads(device, kernel, heads, layout):
    q, k, v = make_gqa(2, *heads, QUERY_LENGTHS[kernel], 77, 64, 64, layout=layout)
    check(device, q, k, v, is_causal=True)
    q, k, v = make_gqa(1, *heads, QUERY_LENGTHS[kernel], 40, 64, 64, layout="lbhd")  # the B=1 transpose
    check(device, q, k, v)


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("lengths", [None, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (2, 2), (0, -1), (40, 3)], ids=str)
@pytest.mark.parametrize("kernel, lq", [("vector", 1), ("vector", 5), ("tiled", 70)])
def test_attention_key_ranges(device, kernel, lq, window, lengths):
    B, S = 4, 100
    key_lengths = None if lengths is None else torch.tensor([0, S, 37, 1], dtype=lengths)
    q, k, v = make_gqa(B, 4, 2, lq, S, 64, 64, layout="blhd")
    for is_causal in (False, True):
        check(device, q, k, v, window_left=window[0], window_right=window[1], key_lengths=key_lengths,
              is_causal=is_causal)


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("kernel, lq", [("vector", 7), ("tiled", 40)])
def test_attention_rows_outside_the_window(device, kernel, lq):
    # L > S with a bottom-right causal window: rows l < L - S see no key (out 0, lse +inf), sinks or not.
    q, k, v = make_qkv(2, 2, lq, 5, 16, 16)
    for sinks in (None, torch.tensor([0.5, -1.0])):
        out, lse = check(device, q, k, v, window_right=0, sinks=sinks)
        assert (out[:, :, : lq - 5] == 0).all() and torch.isposinf(lse[:, :, : lq - 5]).all()
        assert torch.isfinite(lse[:, :, lq - 5 :]).all()


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", QUERY_LENGTHS)
def test_attention_softcap_and_sinks(device, kernel, dtype):
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(2, 3, QUERY_LENGTHS[kernel], 41, 16, 16, dtype=dtype, layout="blhd")
    mask = torch.rand(QUERY_LENGTHS[kernel], 41, generator=gen) < 0.3
    kpm = torch.randn(2, 41, generator=gen)
    sinks = torch.randn(3, generator=gen).to(dtype)
    check(device, q, k, v, softcap=1.5, scale=1.0)
    check(device, q, k, v, softcap=1.5, scale=1.0, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
    check(device, q, k, v, sinks=sinks)
    kpm_all = torch.zeros(2, 41, dtype=torch.bool)
    kpm_all[1] = True  # batch 1 sees no key: out 0, lse +inf despite the sink
    out, lse = check(device, q, k, v, sinks=sinks, attn_mask=mask, key_padding_mask=kpm_all)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", QUERY_LENGTHS)
def test_attention_all_features(device, kernel, dtype):
    gen = torch.Generator().manual_seed(3)
    lq, S = QUERY_LENGTHS[kernel], 90
    q, k, v = make_gqa(2, 4, 2, lq, S, 64, 48, dtype=dtype, layout="strided_last")
    check(device, q, k, v, attn_mask=torch.rand(2 * 4, lq, S, generator=gen) < 0.2,
          key_padding_mask=torch.randn(2, S, generator=gen).to(dtype), window_left=50, window_right=2,
          key_lengths=torch.tensor([S, 61]), softcap=2.0, sinks=torch.randn(4, generator=gen))


@pytest.mark.parametrize("device", MPS)
def test_attention_refuses_what_metal_cannot_do(device):
    require_kernel("attnx::attention", device)
    q, k, v = make_qkv(1, 1, 3, 4, 8, 8)
    with pytest.raises(RuntimeError, match="float64"):
        attnx.attention(*_to(device, q, k, v), attn_mask=torch.zeros(3, 4, dtype=torch.float64).to("cpu"))
    with pytest.raises(RuntimeError, match="float64 sinks"):
        attnx.attention(*_to(device, q, k, v), sinks=torch.zeros(1, dtype=torch.float64))
    q, k, v = make_qkv(1, 1, 3, 4, 264, 8)
    with pytest.raises(RuntimeError, match="up to 256"):
        attnx.attention(*_to(device, q, k, v))


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 8, 32, 100])
def test_linear_b1_transposed(device, rows, dtype):
    # The upstream report's input: (B, L, E).transpose(0, 1) at B = 1, read in place.
    require_kernel("attnx::linear", device)
    x = torch.randn(1, rows, 512).to(dtype)
    w, b = torch.randn(256, 512).to(dtype), torch.randn(256).to(dtype)
    out = attnx.linear(*_to(device, x.transpose(0, 1), w, b)).cpu()
    ref64 = reference.linear(x.transpose(0, 1).double(), w.double(), b.double())
    ref = reference.linear(x.transpose(0, 1), w, b)
    err, ref_err = (out.double() - ref64).abs().max().item(), (ref.double() - ref64).abs().max().item()
    assert err <= 2 * ref_err + {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-1}[dtype]


@pytest.mark.parametrize("device", MPS)
@pytest.mark.parametrize("lq, lkv", [(32, 256), (1, 64)])
def test_mha_b1_batch_first_matches_torch(device, lq, lkv):
    require_kernel("attnx::linear", device)
    require_kernel("attnx::attention", device)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(512, 8, batch_first=True).eval()
    mod = attnx.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    mod.load_state_dict(ref.state_dict())
    q, mem = torch.randn(1, lq, 512), torch.randn(1, lkv, 512)
    with torch.no_grad():
        expected = ref(q, mem, mem, need_weights=False)[0]
        out = mod.to(device)(q.to(device), mem.to(device), mem.to(device), need_weights=False)[0].cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
