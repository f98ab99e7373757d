"""The fused op attnx::mha against its spec, reference.mha: every argument, strided inputs, memory,
opcheck; and on every device (the ``device`` fixture), where it composes that backend's linear and attention
kernels (on the emulated CUDA backends, the emulated attention kernels with torch's GEMM; on metal-emu, the
Metal attention and linear kernels)."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import layouts
from attnx import ops
from layouts import to_device
from mha_helpers import (
    MASK_CASES,
    B,
    E,
    H,
    L,
    S,
    attention_kernel_or_skip,
    batch_first_masked_args,
    check_mha,
    inputs_and_masks,
    key_count,
    make_inputs,
    make_inputs_batch_first,
    make_masks,
    mha_args,
    transposed_args,
)

pytestmark = pytest.mark.kernel


@pytest.mark.wheel
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("masks", MASK_CASES)
def test_masks_and_weights(masks, need_weights, average):
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", masks=masks)
    check_mha(mha_args(*inputs, **mask_args, need_weights=need_weights, average=average))


@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "sliced"])
@pytest.mark.parametrize("projection", ["self", "kv_shared", "distinct", "separate"])
@pytest.mark.parametrize("extras", ["none", "bias_kv", "zero_attn", "bias_kv+zero_attn", "static_kv"])
def test_projections_and_appended_keys(projection, layout, extras):
    inputs, mask_args = inputs_and_masks(projection, layout, extras)
    for bias in (True, False):
        check_mha(mha_args(*inputs, bias=bias, extras=extras, **mask_args, need_weights=True))


@pytest.mark.parametrize("batch,length,source", [(1, 1, 1), (1, 32, 7), (3, 1, 4), (2, 5, 0)], ids=str)
def test_size_one_and_empty_dims(batch, length, source):
    """B=1 (the transposed layout of the upstream report), a single query, and no keys at all (every row fully
    masked: out is the out-projection bias, lse +inf)."""
    query, key, value, w = make_inputs("kv_shared", "batch_first", torch.float64, batch, length, source)
    check_mha(mha_args(query, key, value, w, need_weights=True))


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_inference_mode_with_ordinary_tensors(extras):
    """Under inference_mode, ordinary (not inference) inputs: mha runs below view tracking, as without
    gradients; the results are those of no_grad, as inference tensors that alias no input."""
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", extras)
    args = mha_args(*inputs, extras=extras, **mask_args, need_weights=True)
    with torch.no_grad():
        want = ops.mha(*args)
        want_forward = torch.ops.attnx.mha_forward.default(*args)
    with torch.inference_mode():
        got = ops.mha(*args)
        got_forward = torch.ops.attnx.mha_forward.default(*args)
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    for g, e in zip((*got, *got_forward), (*want, *want_forward), strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)
        assert g.is_inference()
        assert g.numel() == 0 or not any(g.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                                         for a in inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision(dtype):
    inputs, mask_args = inputs_and_masks("self", "batch_first", masks="both_float", dtype=dtype)
    check_mha(mha_args(*inputs, **mask_args, need_weights=True), dtype)


def test_fully_masked_rows():
    query, key, value, w = make_inputs("kv_shared", "seq_first", torch.float64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # every key of batch 1
    am = torch.zeros(L, S, dtype=torch.bool)
    am[2] = True  # every key for query 2
    args = mha_args(query, key, value, w, bias=False, kpm=kpm, am=am, need_weights=True)
    out, lse, weights = ops.mha(*args)
    assert torch.isposinf(lse[1]).all() and torch.isposinf(lse[0, :, 2]).all()
    assert (out[:, 1] == 0).all() and (out[2] == 0).all()  # no out-projection bias here
    assert weights[1].isnan().all() and weights[0, 2].isnan().all()
    assert not out.isnan().any()
    check_mha(args)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("projection", ["self", "kv_shared", "separate", "static_k", "strided_rows"])
def test_in_projections_shared_out_among_threads(projection, threads, intra_op_threads):
    """On the CPU (with MKL under OpenMP), in-projections large enough (>= 2^20 multiply-adds) run at once,
    their rows or columns shared out among the threads (csrc/cpu/linear.cpp): every part of every output
    computed, exactly as one GEMM after another computes it (which other builds run, to the same result).
    Shapes put the cuts inside and at the ends of GEMMs whose splits run along rows (key/value: 150 rows > 96
    outputs) and along columns (query: 40 rows)."""
    intra_op_threads(threads)
    e, h, n_q, n_kv, b = 96, 4, 40, 150, 2
    kdim, vdim = (72, 112) if projection == "separate" else (e, e)
    query = torch.randn(b, n_q, e, dtype=torch.float64).transpose(0, 1)
    memory = torch.randn(b, n_kv, kdim, dtype=torch.float64).transpose(0, 1)
    key = value = memory
    if projection == "separate":
        value = torch.randn(n_kv, b, vdim, dtype=torch.float64)
    if projection == "self":
        key = value = query = torch.randn(n_kv, b, e, dtype=torch.float64)
    if projection == "strided_rows":  # rows of a wider buffer: a row stride above the feature count
        key = value = torch.randn(n_kv, b, e + 7, dtype=torch.float64)[..., 3 : 3 + e]
    weights = [torch.randn(e, d, dtype=torch.float64) / d**0.5 for d in (e, kdim, vdim)]
    static_k = torch.randn(b * h, n_kv, e // h, dtype=torch.float64) if projection == "static_k" else None
    args = (
        query, key, value, h,
        None if projection == "separate" else torch.cat(weights),
        torch.randn(3 * e, dtype=torch.float64),
        *(weights if projection == "separate" else (None, None, None)),
        None, None, False,
        torch.randn(e, e, dtype=torch.float64) / e**0.5, torch.randn(e, dtype=torch.float64),
        None, None, False, static_k, None, False, True,
    )
    check_mha(args)


def test_no_attention_sized_memory():
    """Without need_weights no allocation is anywhere near [B, H, L, S]: extra memory is O(B*H*L)."""
    b, h, n = 2, 4, 128
    query, key, value, w = make_inputs("self", "batch_first", torch.float32, b, n, n)
    kpm, am, _ = make_masks("both_float", b, h, n, n, torch.float32)
    attention_bytes = b * h * n * n * 4
    for need_weights in (False, True):
        args = mha_args(query, key, value, w, kpm=kpm, am=am, need_weights=need_weights, average=False)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as p:
            ops.mha(*args)
        largest = max(e.cpu_memory_usage for e in p.events())
        if need_weights:  # the control: asking for the weights does allocate them
            assert largest >= attention_bytes
        else:
            assert largest < attention_bytes / 4, largest


@pytest.mark.parametrize("projection,layout", [("self", "batch_first"), ("separate", "seq_first")])
def test_fake_kernel_matches(projection, layout):
    for batch, length in [(B, L), (1, L), (B, 1)]:
        query, key, value, w = make_inputs(projection, layout, torch.float32, batch, length)
        for extras, need_weights, average in itertools.product(["none", "bias_kv+zero_attn"], [False, True],
                                                                [False, True]):
            args = mha_args(query, key, value, w, extras=extras, need_weights=need_weights, average=average)
            real = ops.mha(*args)
            with FakeTensorMode() as mode:
                fake = ops.mha(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_opcheck(extras):
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", extras, dtype=torch.float32)
    args = mha_args(*inputs, extras=extras, **mask_args, need_weights=True)
    torch.library.opcheck(torch.ops.attnx.mha.default, args)


# ------------------------------------------------------------------------------------------------------------
# On every device: mha composes the device's linear and attention. float32 (Metal has no float64; the
# emulated CUDA backends then run the tensor-core and SIMT kernels, one each).


@pytest.mark.parametrize("masks, need_weights", [("none", True), ("both_bool", False), ("both_float", True),
                                                 ("causal", False), ("am3_float", True)])
def test_on_device(device, masks, need_weights):
    query, key, value, w = make_inputs("kv_shared", "batch_first", torch.float32)
    kpm, am, is_causal = make_masks(masks, B, H, L, S, torch.float32)
    attention_kernel_or_skip(device, torch.float32)
    args = mha_args(query, key, value, w, kpm=kpm, am=am, is_causal=is_causal, need_weights=need_weights)
    check_mha(to_device(args, device), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_on_device_low_precision_and_extras(device, dtype, extras):
    query, key, value, w = make_inputs("separate" if extras == "none" else "kv_shared", "sliced", dtype)
    s = 5 if extras == "static_kv" else 9
    attention_kernel_or_skip(device, dtype, source=s)
    kpm, am, _ = make_masks("both_float", B, H, L, s, dtype)
    check_mha(to_device(mha_args(query, key, value, w, extras=extras, kpm=kpm, am=am), device), dtype)


def test_on_device_batch_first(device):
    """(B, L, E) inputs at B=1 in the transposed layout of the upstream report, read as they are."""
    query, key, value, w = make_inputs_batch_first("kv_shared", "transposed", torch.float32, batch=1)
    attention_kernel_or_skip(device, torch.float32, batch=1)
    kpm, am, _ = make_masks("both_bool", 1, H, L, S, torch.float32)
    args = mha_args(query, key, value, w, kpm=kpm, am=am, need_weights=True, batch_first=True)
    check_mha(to_device(args, device), torch.float32, batch_first=True)


@pytest.mark.slow
def test_on_device_opcheck(device):
    attention_kernel_or_skip(device, torch.float32)
    query, key, value, w = make_inputs("kv_shared", "batch_first", torch.float32)
    kpm, am, _ = make_masks("both_bool", B, H, L, S, torch.float32)
    kpm[:, 0], am[:, 0] = False, False  # key 0 seen by every row: no NaN weights (opcheck has no equal_nan)
    args = mha_args(query, key, value, w, kpm=kpm, am=am, need_weights=True)
    torch.library.opcheck(torch.ops.attnx.mha.default, to_device(args, device))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.__setitem__(3, 5),
         r"attnx::mha: expected embed_dim \(16\) divisible by num_heads \(5\)"),
        (lambda a: a.__setitem__(14, torch.zeros(B, S + 1, dtype=torch.bool)),
         r"attnx::mha: expected key_padding_mask of shape \(B, S\) = \(2, 9\), got \[2, 10\]"),
        (lambda a: a.__setitem__(15, torch.zeros(L, L, dtype=torch.bool)),
         r"attnx::mha: expected attn_mask of shape \(L, S\) = \(6, 9\) or \(B\*H, L, S\) = \(8, 6, 9\)"),
        (lambda a: a.__setitem__(4, None), "attnx::mha: expected either in_proj_weight or all three"),
    ],
    ids=["heads", "key_padding_mask", "attn_mask", "no weights"],
)
def test_bad_input(change, message):
    query, key, value, w = make_inputs("kv_shared", "seq_first", torch.float32)
    args = list(mha_args(query, key, value, w))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.mha(*args)


# ------------------------------------------------------------------------------------------------------------
# batch_first: (B, L, E), (B, S, kdim), (B, S, vdim) arguments, read as they are


@pytest.mark.parametrize("batch", [B, 1])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("projection", ["self", "kv_shared", "distinct", "separate"])
def test_batch_first(projection, layout, batch):
    """Against reference.mha(batch_first=True) in float64, and bitwise the sequence-first call on the
    transposed views (what a batch_first module ran before the op took batch_first)."""
    query, key, value, w = make_inputs_batch_first(projection, layout, torch.float64, batch)
    for extras, masks in [("none", "both_bool"), ("bias_kv+zero_attn", "causal_float_kpm"),
                          ("static_kv", "am3_float")]:
        kpm, am, is_causal = make_masks(masks, batch, H, L, key_count(projection, extras), torch.float64)
        for need_weights, average in [(False, True), (True, False)]:
            args = mha_args(query, key, value, w, extras=extras, kpm=kpm, am=am, is_causal=is_causal,
                            need_weights=need_weights, average=average, batch_first=True)
            check_mha(args, batch_first=True)
            out, lse, weights = ops.mha(*args, batch_first=True)
            assert out.shape == (batch, L, E)
            seq_out, seq_lse, seq_weights = ops.mha(*transposed_args(args))
            assert torch.equal(out, seq_out.transpose(0, 1)) and torch.equal(lse, seq_lse)
            assert torch.equal(weights.nan_to_num(7.0), seq_weights.nan_to_num(7.0))


@pytest.mark.parametrize("projection,layout", [("self", "contiguous"), ("separate", "transposed")])
def test_batch_first_fake_kernel_matches(projection, layout):
    for batch, length in [(B, L), (1, L), (B, 1)]:
        query, key, value, w = make_inputs_batch_first(projection, layout, torch.float32, batch, length)
        for extras, need_weights in itertools.product(["none", "bias_kv+zero_attn"], [False, True]):
            args = mha_args(query, key, value, w, extras=extras, need_weights=need_weights, batch_first=True)
            real = ops.mha(*args, batch_first=True)
            with FakeTensorMode() as mode:
                fake = ops.mha(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args],
                               batch_first=True)
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_batch_first_opcheck(extras):
    args = batch_first_masked_args(extras, need_weights=True)
    torch.library.opcheck(torch.ops.attnx.mha.default, (*args, 0.0, None, True))


def test_batch_first_bad_input():
    query, key, value, w = make_inputs_batch_first("kv_shared", "contiguous", torch.float32)
    args = list(mha_args(query, key, value, w, batch_first=True))
    with pytest.raises(RuntimeError, match=r"attnx::mha: expected query of shape \(B, L, E\), got \[6, 16\]"):
        ops.mha(query[0], *args[1:], batch_first=True)
    # Sequence-first key and value (S, B, E) beside a batch_first query: B would not match.
    message = r"expected key \(B, S, kdim\) and value \(B, S, vdim\) with B = 2,"
    with pytest.raises(RuntimeError, match=message):
        ops.mha(query, key.transpose(0, 1), value.transpose(0, 1), *args[3:], batch_first=True)
    # The sequence-first reading of the same tensors: query (L=2, B=6, E).
    message = r"expected key \(S, B, kdim\) and value \(S, B, vdim\) with B = 6,"
    with pytest.raises(RuntimeError, match=message):
        ops.mha(*args)
