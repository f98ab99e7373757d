"""The fused op attnx::mha against its spec, reference.mha: every argument, strided inputs, memory,
opcheck."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import layouts
from attnx import ops, reference
from mha_helpers import MASK_CASES, make_masks

B, H, L, S, E = 2, 4, 6, 9, 16
KDIM, VDIM = 12, 20


def _inputs(projection, layout, dtype, batch=B, length=L, source=S):
    """(query, key, value, weights dict) in (L, B, E) form; ``layout`` decides their strides."""

    def tensor(n, b, e):
        if layout == "seq_first":
            return torch.randn(n, b, e, dtype=dtype)
        if layout == "batch_first":  # what a batch_first module passes: x.transpose(0, 1) of (B, N, E)
            return torch.randn(b, n, e, dtype=dtype).transpose(0, 1)
        if layout == "sliced":  # a window of a wider buffer: storage offset, row stride > E
            return torch.randn(n + 1, b, e + 5, dtype=dtype)[1:, :, 2 : 2 + e]
        raise ValueError(layout)

    query = tensor(length, batch, E)
    kdim, vdim = (KDIM, VDIM) if projection == "separate" else (E, E)
    if projection == "self":
        key = value = query
    elif projection == "kv_shared":
        key = value = tensor(source, batch, E)
    else:
        key, value = tensor(source, batch, kdim), tensor(source, batch, vdim)
    w = {"out_proj_weight": torch.randn(E, E, dtype=dtype) / E**0.5}
    if projection == "separate":
        w["q_proj_weight"] = torch.randn(E, E, dtype=dtype) / E**0.5
        w["k_proj_weight"] = torch.randn(E, kdim, dtype=dtype) / kdim**0.5
        w["v_proj_weight"] = torch.randn(E, vdim, dtype=dtype) / vdim**0.5
    else:
        w["in_proj_weight"] = torch.randn(3 * E, E, dtype=dtype) / E**0.5
    return query, key, value, w


def _inputs_batch_first(projection, layout, dtype, batch=B, length=L, source=S):
    """(query, key, value, weights dict) in (B, L, E) form, as a batch_first module passes them to the op;
    ``layout`` is one of tests/layouts.py's (``transposed`` at B=1: the seed report's strides)."""
    query, key, value, w = _inputs(projection, "seq_first", dtype, batch, length, source)

    def relaid(x):
        y = layouts.make((x.shape[1], x.shape[0], x.shape[2]), layout, dtype)
        if layout == "expanded":  # stride 0 over the batch: the same sequence in every batch
            return y
        return y.copy_(x.transpose(0, 1))  # the seq-first case's values, in this layout

    q = relaid(query)
    k = q if key is query else relaid(key)
    v = k if value is key else relaid(value)
    return q, k, v, w


def _args(query, key, value, w, *, bias=True, extras="none", kpm=None, am=None, is_causal=False,
          need_weights=False, average=True, batch_first=False):
    dtype, batch = query.dtype, query.shape[0 if batch_first else 1]
    static = extras == "static_kv"
    hd = E // H
    s_static = 5
    return (
        query, key, value, H, w.get("in_proj_weight"),
        torch.randn(3 * E, dtype=dtype) if bias else None,
        w.get("q_proj_weight"), w.get("k_proj_weight"), w.get("v_proj_weight"),
        torch.randn(1, 1, E, dtype=dtype) if "bias_kv" in extras else None,
        torch.randn(1, 1, E, dtype=dtype) if "bias_kv" in extras else None,
        "zero_attn" in extras, w["out_proj_weight"], torch.randn(E, dtype=dtype) if bias else None,
        kpm, am, is_causal,
        torch.randn(batch * H, s_static, hd, dtype=dtype) if static else None,
        torch.randn(batch * H, s_static, hd, dtype=dtype) if static else None,
        need_weights, average,
    )


def _check(args, dtype=torch.float64, **kwargs):
    """ops.mha vs reference.mha: float64 to rounding; lower precisions within 3x the reference's own error."""
    out, lse, weights = ops.mha(*args, **kwargs)
    ref = reference.mha(*args, **kwargs)
    if dtype == torch.float64:
        for got, want in zip((out, lse, weights), ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, equal_nan=True)
        return
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref64 = reference.mha(*args64, **kwargs)
    for got, want, want64 in zip((out, lse, weights), ref, ref64, strict=True):
        assert got.shape == want64.shape and got.dtype == want.dtype
        finite = torch.isfinite(want64)
        assert torch.equal(torch.isfinite(got), finite)
        err = (got.double() - want64)[finite].abs().max().item() if finite.any() else 0.0
        ref_err = (want.double() - want64)[finite].abs().max().item() if finite.any() else 0.0
        assert err <= 3 * ref_err + 1e-5, (err, ref_err)


@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("masks", MASK_CASES)
def test_masks_and_weights(masks, need_weights, average):
    query, key, value, w = _inputs("kv_shared", "batch_first", torch.float64)
    kpm, am, is_causal = make_masks(masks, B, H, L, S, torch.float64)
    _check(_args(query, key, value, w, kpm=kpm, am=am, is_causal=is_causal, need_weights=need_weights,
                 average=average))


@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "sliced"])
@pytest.mark.parametrize("projection", ["self", "kv_shared", "distinct", "separate"])
@pytest.mark.parametrize("extras", ["none", "bias_kv", "zero_attn", "bias_kv+zero_attn", "static_kv"])
def test_projections_and_appended_keys(projection, layout, extras):
    query, key, value, w = _inputs(projection, layout, torch.float64)
    s = 5 if extras == "static_kv" else (L if projection == "self" else S)
    kpm, am, _ = make_masks("both_bool", B, H, L, s, torch.float64)
    for bias in (True, False):
        _check(_args(query, key, value, w, bias=bias, extras=extras, kpm=kpm, am=am, need_weights=True))


@pytest.mark.parametrize("batch,length,source", [(1, 1, 1), (1, 32, 7), (3, 1, 4), (2, 5, 0)], ids=str)
def test_size_one_and_empty_dims(batch, length, source):
    """B=1 (the transposed layout of the seed report), a single query, and no keys at all (every row fully
    masked: out is the out-projection bias, lse +inf)."""
    query, key, value, w = _inputs("kv_shared", "batch_first", torch.float64, batch, length, source)
    _check(_args(query, key, value, w, need_weights=True))


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_inference_mode_with_ordinary_tensors(extras):
    """Under inference_mode, ordinary (not inference) inputs: mha runs below view tracking, as without
    gradients; the results are those of no_grad, as inference tensors that alias no input."""
    query, key, value, w = _inputs("kv_shared", "batch_first", torch.float64)
    kpm, am, _ = make_masks("both_bool", B, H, L, 5 if extras == "static_kv" else S, torch.float64)
    args = _args(query, key, value, w, extras=extras, kpm=kpm, am=am, need_weights=True)
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
    query, key, value, w = _inputs("self", "batch_first", dtype)
    kpm, am, _ = make_masks("both_float", B, H, L, L, dtype)
    _check(_args(query, key, value, w, kpm=kpm, am=am, need_weights=True), dtype)


def test_fully_masked_rows():
    query, key, value, w = _inputs("kv_shared", "seq_first", torch.float64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # every key of batch 1
    am = torch.zeros(L, S, dtype=torch.bool)
    am[2] = True  # every key for query 2
    args = _args(query, key, value, w, bias=False, kpm=kpm, am=am, need_weights=True)
    out, lse, weights = ops.mha(*args)
    assert torch.isposinf(lse[1]).all() and torch.isposinf(lse[0, :, 2]).all()
    assert (out[:, 1] == 0).all() and (out[2] == 0).all()  # no out-projection bias here
    assert weights[1].isnan().all() and weights[0, 2].isnan().all()
    assert not out.isnan().any()
    _check(args)


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
    _check(args)


def test_no_attention_sized_memory():
    """Without need_weights no allocation is anywhere near [B, H, L, S]: extra memory is O(B*H*L)."""
    b, h, n = 2, 4, 128
    query, key, value, w = _inputs("self", "batch_first", torch.float32, b, n, n)
    kpm, am, _ = make_masks("both_float", b, h, n, n, torch.float32)
    attention_bytes = b * h * n * n * 4
    for need_weights in (False, True):
        args = _args(query, key, value, w, kpm=kpm, am=am, need_weights=need_weights, average=False)
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
        query, key, value, w = _inputs(projection, layout, torch.float32, batch, length)
        for extras, need_weights, average in itertools.product(["none", "bias_kv+zero_attn"], [False, True],
                                                                [False, True]):
            args = _args(query, key, value, w, extras=extras, need_weights=need_weights, average=average)
            real = ops.mha(*args)
            with FakeTensorMode() as mode:
                fake = ops.mha(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_opcheck(extras):
    query, key, value, w = _inputs("kv_shared", "batch_first", torch.float32)
    s = 5 if extras == "static_kv" else S
    kpm, am, _ = make_masks("both_bool", B, H, L, s, torch.float32)
    args = _args(query, key, value, w, extras=extras, kpm=kpm, am=am, need_weights=True)
    torch.library.opcheck(torch.ops.attnx.mha.default, args)


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
    query, key, value, w = _inputs("kv_shared", "seq_first", torch.float32)
    args = list(_args(query, key, value, w))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.mha(*args)


# ------------------------------------------------------------------------------------------------------------
# batch_first: (B, L, E), (B, S, kdim), (B, S, vdim) arguments, read as they are


def _transposed_args(args):
    """batch_first args -> the sequence-first call on (L, B, E) views (one tensor passed twice stays one)."""
    views = {}
    for t in args[:3]:
        views.setdefault(id(t), t.transpose(0, 1))
    return (*(views[id(t)] for t in args[:3]), *args[3:])


@pytest.mark.parametrize("batch", [B, 1])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("projection", ["self", "kv_shared", "distinct", "separate"])
def test_batch_first(projection, layout, batch):
    """Against reference.mha(batch_first=True) in float64, and bitwise the sequence-first call on the
    transposed views (what a batch_first module ran before the op took batch_first)."""
    query, key, value, w = _inputs_batch_first(projection, layout, torch.float64, batch)
    for extras, masks in [("none", "both_bool"), ("bias_kv+zero_attn", "causal_float_kpm"),
                          ("static_kv", "am3_float")]:
        s = 5 if extras == "static_kv" else (L if projection == "self" else S)
        kpm, am, is_causal = make_masks(masks, batch, H, L, s, torch.float64)
        for need_weights, average in [(False, True), (True, False)]:
            args = _args(query, key, value, w, extras=extras, kpm=kpm, am=am, is_causal=is_causal,
                         need_weights=need_weights, average=average, batch_first=True)
            _check(args, batch_first=True)
            out, lse, weights = ops.mha(*args, batch_first=True)
            assert out.shape == (batch, L, E)
            seq_out, seq_lse, seq_weights = ops.mha(*_transposed_args(args))
            assert torch.equal(out, seq_out.transpose(0, 1)) and torch.equal(lse, seq_lse)
            assert torch.equal(weights.nan_to_num(7.0), seq_weights.nan_to_num(7.0))


@pytest.mark.parametrize("projection,layout", [("self", "contiguous"), ("separate", "transposed")])
def test_batch_first_fake_kernel_matches(projection, layout):
    for batch, length in [(B, L), (1, L), (B, 1)]:
        query, key, value, w = _inputs_batch_first(projection, layout, torch.float32, batch, length)
        for extras, need_weights in itertools.product(["none", "bias_kv+zero_attn"], [False, True]):
            args = _args(query, key, value, w, extras=extras, need_weights=need_weights, batch_first=True)
            real = ops.mha(*args, batch_first=True)
            with FakeTensorMode() as mode:
                fake = ops.mha(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args],
                               batch_first=True)
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def _batch_first_masked_args(extras, **kwargs):
    """mha's arguments for a batch_first call with both bool masks and the given extras. Key 0 stays visible
    in every row: opcheck compares without equal_nan, and a fully masked row's weights are NaN."""
    query, key, value, w = _inputs_batch_first("kv_shared", "contiguous", torch.float32)
    s = 5 if extras == "static_kv" else S
    kpm, am, _ = make_masks("both_bool", B, H, L, s, torch.float32)
    kpm[:, 0], am[:, 0] = False, False
    return _args(query, key, value, w, extras=extras, kpm=kpm, am=am, batch_first=True, **kwargs)


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_batch_first_opcheck(extras):
    args = _batch_first_masked_args(extras, need_weights=True)
    torch.library.opcheck(torch.ops.attnx.mha.default, (*args, 0.0, None, True))


def test_batch_first_bad_input():
    query, key, value, w = _inputs_batch_first("kv_shared", "contiguous", torch.float32)
    args = list(_args(query, key, value, w, batch_first=True))
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
