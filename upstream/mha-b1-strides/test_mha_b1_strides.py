"""Upstream patch mha-b1-strides (patch.diff): at B=1, batch_first ``nn.MultiheadAttention`` hands
``F.multi_head_attention_forward`` ``(L, 1, E)`` views with natural strides, and nothing else changes."""

import pathlib

import pytest
import torch
import torch.nn.functional as F

import harness

PATCH = pathlib.Path(__file__).resolve().parent / "patch.diff"

pytestmark = pytest.mark.skipif(not harness.is_pinned(), reason=harness.skip_reason())


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    files = harness.apply(PATCH, tmp_path_factory.mktemp("mha-b1-strides"))
    return harness.load(files["torch/nn/modules/activation.py"], "torch.nn.modules.activation")


def test_the_patch_applies_to_the_pinned_torch(tmp_path):
    assert set(harness.apply(PATCH, tmp_path)) == {"torch/nn/modules/activation.py"}


def _pair(patched, **kwargs):
    """torch's module and the patched one with the same parameters."""
    torch.manual_seed(0)
    original = torch.nn.MultiheadAttention(**kwargs, batch_first=True, dtype=torch.float64)
    twin = patched.MultiheadAttention(**kwargs, batch_first=True, dtype=torch.float64)
    twin.load_state_dict(original.state_dict())
    return original, twin


def _inputs(B, L, S, E, kdim, vdim, same):
    q = torch.randn(B, L, E, dtype=torch.float64)
    if same == "qkv":
        return q, q, q
    k = torch.randn(B, S, kdim, dtype=torch.float64)
    return (q, k, k) if same == "kv" else (q, k, torch.randn(B, S, vdim, dtype=torch.float64))


def _masks(kind, B, L, S, H):
    if kind == "none":
        return {}
    if kind == "bool":
        return dict(key_padding_mask=torch.rand(B, S) < 0.3, attn_mask=torch.rand(L, S) < 0.2)
    if kind == "float3d":
        return dict(attn_mask=torch.randn(B * H, L, S, dtype=torch.float64))
    return dict(is_causal=True, attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("masks", ["none", "bool", "float3d", "causal"])
@pytest.mark.parametrize("same", ["qkv", "kv", "none"])
@pytest.mark.parametrize("B", [1, 3])
def test_outputs_are_unchanged(patched, B, same, masks, need_weights, training):
    L, E, H = 5, 16, 4
    S = L if same == "qkv" or masks == "causal" else 7
    kdim = vdim = E if same != "none" else 12
    original, twin = _pair(patched, embed_dim=E, num_heads=H, kdim=kdim, vdim=vdim)
    original.train(training)
    twin.train(training)
    args = _inputs(B, L, S, E, kdim, vdim, same)
    kwargs = dict(_masks(masks, B, L, S, H), need_weights=need_weights)
    expected = original(*args, **kwargs)
    actual = twin(*args, **kwargs)
    for a, e in zip(actual, expected, strict=True):
        if e is None:
            assert a is None
        else:  # the same memory seen with other strides on a size-1 dim: the same arithmetic, bit for bit
            assert torch.equal(a, e)


def test_gradients_are_unchanged(patched):
    original, twin = _pair(patched, embed_dim=16, num_heads=4)
    q = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    grads = []
    for module in (original, twin):
        out = module(q, q, q, need_weights=False)[0]
        grads.append(torch.autograd.grad(out.square().sum(), (q, *module.parameters())))
    for a, e in zip(*grads, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("same", ["qkv", "kv", "none"])
def test_b1_inputs_reach_the_functional_form_with_natural_strides(patched, monkeypatch, same):
    seen = []
    real = F.multi_head_attention_forward

    def spy(query, key, value, *args, **kwargs):
        seen.append((query, key, value))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "multi_head_attention_forward", spy)
    E, L, S = 16, 5, 7
    original, twin = _pair(patched, embed_dim=E, num_heads=4)  # in training mode: no eval fast path
    args = _inputs(1, L, S, E, E, E, same)
    original(*args, need_weights=False)
    twin(*args, need_weights=False)
    (before, after) = seen
    assert before[0].stride() == (E, L * E, 1)  # torch's transpose: the stride MPS's linear is slow on
    for t, n in zip(after, (L, L, L) if same == "qkv" else (L, S, S), strict=True):
        assert t.shape == (n, 1, E) and t.stride() == (E, E, 1)
    # identity kept: the functional form's `query is key` / `key is value` fast checks still hold
    assert (after[0] is after[1]) == (same == "qkv") and (after[1] is after[2]) == (same != "none")
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(after, args, strict=True))  # views, no copy


def test_larger_batches_keep_the_transpose(patched, monkeypatch):
    seen = []
    real = F.multi_head_attention_forward
    monkeypatch.setattr(F, "multi_head_attention_forward",
                        lambda q, *a, **k: seen.append(q.stride()) or real(q, *a, **k))
    _, twin = _pair(patched, embed_dim=16, num_heads=4)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    twin(x, x, x, need_weights=False)
    assert seen == [(16, 80, 1)]
