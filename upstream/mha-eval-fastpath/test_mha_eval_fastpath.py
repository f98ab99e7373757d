"""Tests of patch.diff: MultiheadAttention / TransformerEncoderLayer eval fast path through SDPA with masks.

The patched ``activation.py`` and ``transformer.py`` are loaded from a scratch copy (``harness``); the
installed torch is the reference: its slow path (``torch.backends.mha.set_fastpath_enabled(False)``) for the
outputs, its fast path for what changes (memory, fully masked rows, float masks in the encoder layer).
"""

from __future__ import annotations

import contextlib
import pathlib
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import harness

pytestmark = pytest.mark.skipif(not harness.is_pinned(), reason=harness.skip_reason())

PATCH = pathlib.Path(__file__).resolve().parent / "patch.diff"
E, H = 16, 4  # embed_dim, num_heads: head_dim 4


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """``(activation, transformer)``: the patched modules, the encoder layer built on the patched MHA."""
    files = harness.apply(PATCH, tmp_path_factory.mktemp("torch"))
    activation = harness.load(files["torch/nn/modules/activation.py"], "torch.nn.modules.activation")
    with harness.swapped_in(torch__nn__modules__activation=activation):
        transformer = harness.load(files["torch/nn/modules/transformer.py"], "torch.nn.modules.transformer")
    assert transformer.MultiheadAttention is activation.MultiheadAttention
    return activation, transformer


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def slow_path():
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def twin(patched_cls, reference_cls, *args, dtype=torch.float64, **kwargs):
    """The same module twice, same parameters: ``(patched, reference)``, both in eval mode."""
    torch.manual_seed(0)
    ref = reference_cls(*args, **kwargs).to(dtype).eval()
    new = patched_cls(*args, **kwargs).to(dtype).eval()
    new.load_state_dict(ref.state_dict())
    return new, ref


def make_masks(case: str, B: int, L: int, dtype=torch.float64, seed: int = 1):
    """``(attn_mask, key_padding_mask, is_causal)`` for a named case; no row is fully masked (key 0 is
    never masked). Float masks are additive: 0 / -inf where the bool mask is
    False / True, plus a random bias on the kept positions (``float+bias``)."""
    g = torch.Generator().manual_seed(seed)
    kind, _, what = case.partition(":")
    attn = kpm = None
    is_causal = False
    if "attn2d" in what or "causal" in what:
        attn = torch.rand(L, L, generator=g) < 0.4
        if "causal" in what:
            attn = torch.ones(L, L, dtype=torch.bool).triu(1)
            is_causal = True
    if "attn3d" in what:
        attn = torch.rand(B * H, L, L, generator=g) < 0.4
    if attn is not None:
        attn[..., 0] = False
    if "kpm" in what:
        kpm = torch.rand(B, L, generator=g) < 0.4
        kpm[:, 0] = False

    def to_float(mask, bias):
        if mask is None:
            return None
        out = torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf"))
        if bias:
            out = out + torch.randn(mask.shape, generator=g, dtype=dtype).masked_fill(mask, 0.0)
        return out

    if kind.startswith("float"):
        bias = kind == "float+bias"
        attn, kpm = to_float(attn, bias), to_float(kpm, False)
    return attn, kpm, is_causal


MASK_CASES = [
    f"{kind}:{what}"
    for kind in ("bool", "float", "float+bias")
    for what in ("kpm", "attn2d", "attn3d", "attn2d+kpm", "attn3d+kpm", "causal", "causal+kpm")
]


# --- the diff ----------------------------------------------------------------------------------------------


def test_patch_applies_to_pinned_torch(tmp_path):
    files = harness.apply(PATCH, tmp_path)
    assert sorted(files) == ["torch/nn/modules/activation.py", "torch/nn/modules/transformer.py"]
    installed = (harness.TORCH_ROOT / "torch/nn/modules/activation.py").read_text()
    assert files["torch/nn/modules/activation.py"].read_text() != installed


# --- outputs equal the slow path ---------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("case", MASK_CASES)
@torch.no_grad()
def test_mha_matches_slow_path(patched, case, B, need_weights):
    activation, _ = patched
    L = 7
    new, ref = twin(activation.MultiheadAttention, torch.nn.MultiheadAttention, E, H, batch_first=True)
    x = torch.randn(B, L, E, dtype=torch.float64)
    attn, kpm, is_causal = make_masks(case, B, L)
    kwargs = dict(attn_mask=attn, key_padding_mask=kpm, need_weights=need_weights, is_causal=is_causal)
    out, weights = new(x, x, x, **kwargs)
    with slow_path():
        out_ref, weights_ref = ref(x, x, x, **kwargs)
    torch.testing.assert_close(out, out_ref)
    if need_weights:
        torch.testing.assert_close(weights, weights_ref)
    else:
        assert weights is None and weights_ref is None
    if case.startswith("bool:") and not need_weights:
        assert out.is_contiguous()  # as the native fast path's output (float masks take the slow path)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation_fn", ["relu", "gelu"])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("case", MASK_CASES)
@torch.no_grad()
def test_encoder_layer_matches_slow_path(patched, case, B, activation_fn, norm_first):
    _, transformer = patched
    L = 7
    new, ref = twin(transformer.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer, E, H, 32,
                    batch_first=True, activation=activation_fn, norm_first=norm_first)
    x = torch.randn(B, L, E, dtype=torch.float64)
    attn, kpm, is_causal = make_masks(case, B, L)
    out = new(x, src_mask=attn, src_key_padding_mask=kpm, is_causal=is_causal)
    with slow_path():
        out_ref = ref(x, src_mask=attn, src_key_padding_mask=kpm, is_causal=is_causal)
    torch.testing.assert_close(out, out_ref)


@pytest.mark.parametrize("case", ["bool:attn2d+kpm", "float+bias:attn2d", "bool:kpm"])
@torch.no_grad()
def test_encoder_matches_slow_path(patched, case):
    """TransformerEncoder is not patched; it reaches the patched layer whenever it does not convert to a
    NestedTensor (here: a mask that is not left aligned, or both masks)."""
    _, transformer = patched
    B, L = 3, 7
    layer_new, layer_ref = twin(transformer.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer,
                                E, H, 32, batch_first=True)
    new = transformer.TransformerEncoder(layer_new, 2, enable_nested_tensor=False).eval()
    ref = torch.nn.TransformerEncoder(layer_ref, 2, enable_nested_tensor=False).eval()
    new.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E, dtype=torch.float64)
    attn, kpm, _ = make_masks(case, B, L)
    out = new(x, mask=attn, src_key_padding_mask=kpm)
    with slow_path():
        out_ref = ref(x, mask=attn, src_key_padding_mask=kpm)
    torch.testing.assert_close(out, out_ref)


# --- which path runs ---------------------------------------------------------------------------------------


def spies():
    """Mocks that count the calls of the native fast path and of SDPA (still running them)."""
    return (mock.patch("torch._native_multi_head_attention", wraps=torch._native_multi_head_attention),
            mock.patch("torch.nn.functional.scaled_dot_product_attention",
                       wraps=F.scaled_dot_product_attention))


@torch.no_grad()
def test_fast_path_routing(patched):
    """The fast-path checks still decide whether the fast path runs; with masks and need_weights=False it
    runs through SDPA; need_weights=True, no mask, and NestedTensor inputs keep the native op."""
    activation, _ = patched
    mha = activation.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 5, E)
    attn, kpm, _ = make_masks("bool:attn2d+kpm", 2, 5, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are in prototype stage"
        nested = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])

    def calls(module, *args, **kwargs):
        native_spy, sdpa_spy = spies()
        with native_spy as native, sdpa_spy as sdpa:
            module(*args, **kwargs)
        return native.call_count, sdpa.call_count

    assert calls(mha, x, x, x, attn_mask=attn, key_padding_mask=kpm, need_weights=False) == (0, 1)
    assert calls(mha, x, x, x, key_padding_mask=kpm, need_weights=False) == (0, 1)
    assert calls(mha, x, x, x, attn_mask=attn, need_weights=False) == (0, 1)
    # unchanged: the upstream mock test (test_multihead_self_attn_two_masks_fast_path_mock) asks for weights
    assert calls(mha, x, x, x, attn_mask=attn, key_padding_mask=kpm) == (1, 0)
    assert calls(mha, x, x, x, need_weights=False) == (1, 0)
    assert calls(mha, nested, nested, nested, need_weights=False) == (1, 0)
    # fast path refused: the slow path (F.multi_head_attention_forward -> SDPA), as before
    mha.train()
    assert calls(mha, x, x, x, attn_mask=attn, key_padding_mask=kpm, need_weights=False) == (0, 1)
    mha.eval()
    y = x.clone()
    assert calls(mha, x, y, y, key_padding_mask=kpm, need_weights=False) == (0, 1)


def fused_spy():
    return mock.patch("torch._transformer_encoder_layer_fwd", wraps=torch._transformer_encoder_layer_fwd)


@torch.no_grad()
def test_encoder_layer_routing(patched):
    """Dense input with masks: SDPA instead of torch._transformer_encoder_layer_fwd; NestedTensor and
    mask-free inputs keep the fused layer."""
    _, transformer = patched
    layer = transformer.TransformerEncoderLayer(E, H, 32, batch_first=True).eval()
    x = torch.randn(2, 5, E)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    for kwargs, fused_calls in [(dict(src_key_padding_mask=kpm), 0), ({}, 1)]:
        with fused_spy() as fused:
            layer(x, **kwargs)
        assert fused.call_count == fused_calls
    # TransformerEncoder.__init__ checks isinstance(layer, torch.nn.TransformerEncoderLayer)
    with mock.patch.object(torch.nn, "TransformerEncoderLayer", transformer.TransformerEncoderLayer):
        encoder = transformer.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    assert encoder.use_nested_tensor
    with fused_spy() as fused:
        encoder(x, src_key_padding_mask=kpm)  # left aligned: NestedTensor through both layers
    assert fused.call_count == 2 and all(c.args[0].is_nested for c in fused.call_args_list)


# --- memory ------------------------------------------------------------------------------------------------


def largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation made by ``fn()`` (torch.profiler, profile_memory)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("case", ["bool:kpm", "bool:attn2d", "bool:attn2d+kpm"])
@torch.no_grad()
def test_no_bhls_allocation(patched, case):
    activation, _ = patched
    B, L = 2, 64
    new, ref = twin(activation.MultiheadAttention, torch.nn.MultiheadAttention, E, H, batch_first=True,
                    dtype=torch.float32)
    x = torch.randn(B, L, E)
    attn, kpm, _ = make_masks(case, B, L, dtype=torch.float32)
    bhls = B * H * L * L * x.element_size()

    def run(module):
        return largest_allocation(lambda: module(x, x, x, attn_mask=attn, key_padding_mask=kpm,
                                                 need_weights=False))

    before, after = run(ref), run(new)
    assert before >= bhls  # the installed fast path: scores (and merged mask) of (B, H, L, S)
    assert after < bhls, f"largest allocation {after} B, (B, H, L, S) is {bhls} B"
    if attn is not None and kpm is not None:
        assert after <= B * L * L * x.element_size()  # the combined (B, 1, L, S) mask at most


# --- what changes: fully masked rows, float masks in TransformerEncoderLayer (#118628) ----------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@torch.no_grad()
def test_fully_masked_rows(patched, dtype):
    """A row whose keys are all masked: NaN on the installed fast path (CPU), 0 attention (so the
    out-projection bias) on the patched one, as on the slow path; with need_weights=True still NaN."""
    activation, _ = patched
    B, L = 2, 5
    new, ref = twin(activation.MultiheadAttention, torch.nn.MultiheadAttention, E, H, batch_first=True,
                    dtype=dtype)
    torch.nn.init.normal_(new.out_proj.bias)
    ref.out_proj.bias.copy_(new.out_proj.bias)
    x = torch.randn(B, L, E, dtype=dtype)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0] = True  # every key of batch 0
    attn = torch.zeros(L, L, dtype=torch.bool)
    attn[2] = True  # every key of query 2

    for kwargs in (dict(key_padding_mask=kpm), dict(attn_mask=attn, key_padding_mask=kpm)):
        before = ref(x, x, x, need_weights=False, **kwargs)[0]
        after = new(x, x, x, need_weights=False, **kwargs)[0]
        with slow_path():
            slow = ref(x, x, x, need_weights=False, **kwargs)[0]
        assert before[0].isnan().all()
        assert not after.isnan().any()
        torch.testing.assert_close(after[0], new.out_proj.bias.expand(L, E))
        torch.testing.assert_close(after, slow)
        assert new(x, x, x, need_weights=True, **kwargs)[0][0].isnan().all()  # unchanged


@torch.no_grad()
def test_encoder_layer_float_mask_no_nan(patched):
    """#118628: an additive float src_mask (no -inf) on the encoder layer's fast path. The installed fast
    path reads it as a bool mask (nonzero = masked), so every key is masked: NaN. Patched: as the slow
    path."""
    _, transformer = patched
    B, L = 3, 5
    new, ref = twin(transformer.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer, 8, 2, 16,
                    batch_first=True, dtype=torch.float32)
    x = torch.randn(B, L, 8)
    bias = torch.randn(L, L)
    assert ref(x, src_mask=bias).isnan().all()
    with slow_path():
        slow = ref(x, src_mask=bias)
    out = new(x, src_mask=bias)
    assert not out.isnan().any()
    torch.testing.assert_close(out, slow)
