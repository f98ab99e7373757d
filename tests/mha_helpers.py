"""Shared helpers for the multi-head attention tests: inputs, masks, and comparisons with torch."""

import contextlib
import warnings

import pytest
import torch

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
