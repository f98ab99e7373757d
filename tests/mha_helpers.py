"""Shared helpers for the multi-head attention tests: masks, comparisons with torch (test_mha.py,
test_modules.py, test_convert.py), and the inputs, argument tuples and checks of the fused op attnx::mha
against its spec, reference.mha (test_mha_op.py, test_mha_backward.py, test_cuda.py)."""

import contextlib
import warnings

import pytest
import torch

import layouts
from attention_helpers import kernel_or_skip
from attnx import ops, reference

# Masks a test case can ask for: (key_padding_mask kind, attn_mask kind, is_causal).
MASK_CASES = {
    "none": (None, None, False),
    "kpm_bool": ("bool", None, False),
    "kpm_float": ("float", None, False),
    "am2_bool": (None, "2d_bool", False),
    "am2_float": (None, "2d_float", False),
    "am3_bool": (None, "3d_bool", False),
    "am3_float": (None, "3d_float", False),
    "both_bool": ("bool", "2d_bool", False),
    "both_float": ("float", "3d_float", False),
    "causal": (None, "causal_bool", True),
    "causal_float_kpm": ("float", "causal_float", True),
}


def tol(dtype):
    return {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 1e-4}


def bool_mask(*shape, p=0.3, generator=None):
    return torch.rand(*shape, generator=generator) < p


def float_mask(*shape, dtype, p=0.3):
    """Finite random biases with -inf where masked, so float masks also mask keys out."""
    mask = torch.randn(*shape, dtype=dtype)
    return mask.masked_fill(bool_mask(*shape, p=p), float("-inf"))


def make_masks(case, B, H, L, S, dtype, batched=True):
    """(key_padding_mask, attn_mask, is_causal) for a MASK_CASES key; unbatched drops B (3-D: (H, L, S))."""
    kpm_kind, am_kind, is_causal = MASK_CASES[case]
    kpm_shape = (B, S) if batched else (S,)
    kpm = None
    if kpm_kind == "bool":
        kpm = bool_mask(*kpm_shape)
    elif kpm_kind == "float":
        kpm = float_mask(*kpm_shape, dtype=dtype)
    heads = B * H if batched else H
    am = {
        None: lambda: None,
        "2d_bool": lambda: bool_mask(L, S),
        "2d_float": lambda: float_mask(L, S, dtype=dtype),
        "3d_bool": lambda: bool_mask(heads, L, S),
        "3d_float": lambda: float_mask(heads, L, S, dtype=dtype),
        "causal_bool": lambda: torch.ones(L, S, dtype=torch.bool).triu(1),
        "causal_float": lambda: torch.zeros(L, S, dtype=dtype).masked_fill(
            torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf")
        ),
    }[am_kind]()
    return kpm, am, is_causal


def assert_close(actual, expected, dtype, msg=""):
    if expected is None:
        assert actual is None, msg
        return
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    if not torch.allclose(
        actual, expected, equal_nan=True, **tol(dtype)
    ):  # the cheap test first; details below
        torch.testing.assert_close(
            actual, expected, equal_nan=True, msg=lambda m: f"{msg}\n{m}", **tol(dtype)
        )


def same_error(torch_fn, attnx_fn):
    """Both calls raise the same exception type with the same message; returns torch's exception. attnx's
    messages are those of torch 2.14, where older releases raise some AssertionErrors without one (torch
    2.10's bias_k without bias_v): only the type is compared to those."""
    with pytest.raises(Exception) as expected:
        torch_fn()
    with pytest.raises(Exception) as actual:
        attnx_fn()
    assert type(actual.value) is type(expected.value), f"{actual.value!r} vs torch's {expected.value!r}"
    if str(expected.value) or not isinstance(expected.value, AssertionError):
        assert str(actual.value) == str(expected.value)
    return expected.value


def warning_messages(fn):
    """(category, message) of every warning ``fn`` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [(w.category, str(w.message)) for w in caught]


@contextlib.contextmanager
def torch_fastpath(enabled):
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


# ------------------------------------------------------------------------------------------------------------
# attnx::mha's arguments, in the op's sizes: batch, heads, queries, keys, embedding; separate key/value dims.

B, H, L, S, E = 2, 4, 6, 9, 16
KDIM, VDIM = 12, 20


def make_inputs(projection, layout, dtype, batch=B, length=L, source=S):
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


def make_inputs_batch_first(projection, layout, dtype, batch=B, length=L, source=S):
    """(query, key, value, weights dict) in (B, L, E) form, as a batch_first module passes them to the op;
    ``layout`` is one of tests/layouts.py's (``transposed`` at B=1: the upstream report's strides)."""
    query, key, value, w = make_inputs(projection, "seq_first", dtype, batch, length, source)

    def relaid(x):
        y = layouts.make((x.shape[1], x.shape[0], x.shape[2]), layout, dtype)
        if layout == "expanded":  # stride 0 over the batch: the same sequence in every batch
            return y
        return y.copy_(x.transpose(0, 1))  # the seq-first case's values, in this layout

    q = relaid(query)
    k = q if key is query else relaid(key)
    v = k if value is key else relaid(value)
    return q, k, v, w


def key_count(projection, extras, length=L):
    """How many keys the masks of make_inputs' tensors cover: static_kv's 5, the queries themselves for
    "self", S otherwise."""
    return 5 if extras == "static_kv" else (length if projection == "self" else S)


def inputs_and_masks(projection, layout, extras="none", masks="both_bool", dtype=torch.float64,
                     batch_first=False):
    """((query, key, value, weights) of make_inputs, or of make_inputs_batch_first, and mha_args' keyword
    arguments kpm, am, is_causal of the MASK_CASES ``masks``, sized for them."""
    make = make_inputs_batch_first if batch_first else make_inputs
    inputs = make(projection, layout, dtype)
    kpm, am, is_causal = make_masks(masks, B, H, L, key_count(projection, extras), dtype)
    return inputs, {"kpm": kpm, "am": am, "is_causal": is_causal}


def mha_args(query, key, value, w, *, bias=True, extras="none", kpm=None, am=None, is_causal=False,
             need_weights=False, average=True, batch_first=False):
    """attnx::mha's positional arguments for these inputs and weights (of make_inputs): random biases,
    ``extras`` ("bias_kv", "zero_attn", "static_kv" or a "+"-joined mix), masks, the weights output."""
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


def check_mha(args, dtype=torch.float64, **kwargs):
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


def transposed_args(args):
    """batch_first args -> the sequence-first call on (L, B, E) views (one tensor passed twice stays one)."""
    views = {}
    for t in args[:3]:
        views.setdefault(id(t), t.transpose(0, 1))
    return (*(views[id(t)] for t in args[:3]), *args[3:])


def batch_first_masked_args(extras, **kwargs):
    """mha's arguments for a batch_first call with both bool masks and the given extras. Key 0 stays visible
    in every row: opcheck compares without equal_nan, and a fully masked row's weights are NaN."""
    inputs, masks = inputs_and_masks("kv_shared", "contiguous", extras, dtype=torch.float32, batch_first=True)
    masks["kpm"][:, 0], masks["am"][:, 0] = False, False
    return mha_args(*inputs, extras=extras, batch_first=True, **masks, **kwargs)


def attention_kernel_or_skip(device, dtype, batch=B, heads=H, length=L, source=S, head_dim=E // H, **kwargs):
    """attention_helpers.kernel_or_skip for the attention call inside an mha (or module) call on ``device``:
    queries (batch, heads, length, head_dim) and ``source`` keys of ``dtype``, with attention's ``kwargs``."""
    q = torch.zeros(batch, heads, length, head_dim, dtype=dtype)
    k = v = torch.zeros(batch, heads, source, head_dim, dtype=dtype)
    return kernel_or_skip(device, q, k, v, **kwargs)
