"""attnx.convert / attnx.revert on timm models: timm's attention modules run attnx's op, with the outputs and
gradients of timm's own (SDPA) path, masks included, and revert restores them exactly."""

import copy
import subprocess
import sys

import pytest
import torch

timm = pytest.importorskip("timm", reason="timm is not installed: its converters are not tested")

from timm.layers.attention import Attention, AttentionRope  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

import attnx  # noqa: E402
from attnx.integrations import timm as attnx_timm  # noqa: E402
from dispatch_helpers import DispatchRecorder  # noqa: E402

pytestmark = pytest.mark.integration

B, IMG, PATCH, E, HEADS, DEPTH = 3, 32, 8, 64, 4, 2
N = (IMG // PATCH) ** 2 + 1  # tokens: patches and the class token


def vit(dtype=torch.float64, **kwargs):
    kwargs = {"qkv_bias": True, **kwargs}
    return VisionTransformer(
        img_size=IMG, patch_size=PATCH, embed_dim=E, depth=DEPTH, num_heads=HEADS, num_classes=10, **kwargs
    ).to(dtype)


def converted_pair(model):
    """(converted model, its unconverted deep copy)."""
    reference = copy.deepcopy(model)
    return attnx.convert(model), reference


def images(dtype=torch.float64):
    return torch.randn(B, 3, IMG, IMG, dtype=dtype)


def assert_grads_match(model, reference, rtol=1e-10, atol=1e-12):
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"qk_norm": True}, {"qkv_bias": False, "attn_drop_rate": 0.0}],
    ids=["vit", "qk_norm", "no_bias"],
)
def test_vit_matches_timm(training, kwargs):
    model, reference = converted_pair(vit(**kwargs))
    assert sum(type(m) is attnx_timm.Attention for m in model.modules()) == DEPTH
    model.train(training)
    reference.train(training)
    x = images()
    out, expected = model(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_match(model, reference)


@pytest.mark.wheel
def test_runs_attnx_not_sdpa():
    model, _ = converted_pair(vit())
    with torch.no_grad(), DispatchRecorder() as recorder:
        model(images())
    assert recorder.counts["attnx::_attention"] == DEPTH  # attnx::attention without grad
    assert not [name for name in recorder.counts if "scaled_dot_product" in name]


def test_float32_close():
    model, reference = converted_pair(vit(torch.float32))
    x = images(torch.float32)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "make_mask",
    [
        lambda: (torch.rand(B, 1, N, N) > 0.3) | torch.eye(N, dtype=torch.bool),  # SDPA's True = attend
        lambda: (torch.rand(N, N) > 0.3) | torch.eye(N, dtype=torch.bool),
        lambda: torch.randn(HEADS, N, N, dtype=torch.float64),  # 3-D: broadcast over batch, as SDPA does
        lambda: torch.randn(B, HEADS, N, N, dtype=torch.float64).requires_grad_(),  # learned bias
    ],
    ids=["bool_4d", "bool_2d", "float_3d", "float_4d_grad"],
)
def test_attn_mask(make_mask):
    model, reference = converted_pair(vit())
    mask = make_mask()
    mask_ref = mask.detach().clone().requires_grad_(mask.requires_grad)
    x = images()
    out = model.forward_features(x, attn_mask=mask)
    expected = reference.forward_features(x, attn_mask=mask_ref)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert (out - model.forward_features(x)).abs().max() > 1e-3  # the mask did something
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_match(model, reference)
    if mask.requires_grad:
        torch.testing.assert_close(mask.grad, mask_ref.grad, rtol=1e-10, atol=1e-12)


def test_is_causal_and_its_refusal_with_a_mask():
    attn = Attention(E, HEADS, qkv_bias=True).double()
    reference = copy.deepcopy(attn)
    attnx.convert(attn)
    x = torch.randn(B, N, E, dtype=torch.float64)
    torch.testing.assert_close(attn(x, is_causal=True), reference(x, is_causal=True), rtol=1e-12, atol=1e-12)
    mask = torch.ones(N, N, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        attn(x, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"qkv_fused": False, "num_kv_heads": 2, "qk_norm": True, "norm_layer": torch.nn.LayerNorm}],
    ids=["fused", "gqa_qk_norm"],
)
def test_attention_rope(training, kwargs):
    prefix, dim = 1, E // HEADS
    attn = AttentionRope(E, HEADS, num_prefix_tokens=prefix, **kwargs).double()
    reference = copy.deepcopy(attn)
    attnx.convert(attn)
    assert type(attn) is attnx_timm.AttentionRope
    attn.train(training)
    reference.train(training)
    x = torch.randn(B, N, E, dtype=torch.float64)
    rope = torch.randn(N - prefix, 2 * dim, dtype=torch.float64)
    mask = (torch.rand(B, 1, N, N) > 0.3) | torch.eye(N, dtype=torch.bool)
    for kw in ({"rope": rope}, {"rope": rope, "attn_mask": mask}, {"is_causal": True}):
        out, expected = attn(x, **kw), reference(x, **kw)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        out.square().sum().backward()
        expected.square().sum().backward()
    assert_grads_match(attn, reference)


def test_attention_dropout_in_training_only():
    model, _ = converted_pair(vit(attn_drop_rate=0.5))
    x = images()
    model.eval()
    first = model(x)
    torch.testing.assert_close(model(x), first, rtol=0, atol=0)
    model.train()
    torch.manual_seed(1)
    dropped = model(x)
    torch.manual_seed(1)
    torch.testing.assert_close(model(x), dropped, rtol=0, atol=0)  # reproducible from torch's seed
    assert (dropped - first).abs().max() > 1e-3


def test_state_dict_revert_and_idempotence():
    model = vit()
    parameters = {name: p for name, p in model.named_parameters()}
    state = model.state_dict()
    reference = copy.deepcopy(model)
    x = images()
    attnx.convert(model)
    attnx.convert(model)  # idempotent
    assert all(type(m) is not Attention for m in model.modules())
    assert dict(model.named_parameters()) == parameters  # the same Parameter objects
    converted_state = model.state_dict()
    assert list(converted_state) == list(state)
    assert all(converted_state[k] is state[k] or converted_state[k].equal(state[k]) for k in state)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-12, atol=1e-12)

    attnx.revert(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert dict(model.named_parameters()) == parameters
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    attnx.revert(model)  # reverting a torch model changes nothing
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]


def test_subclasses_are_left_alone():
    class MyAttention(Attention):
        def forward(self, x, attn_mask=None, is_causal=False):
            return super().forward(x, attn_mask, is_causal) * 2

    module = MyAttention(E, HEADS)
    attnx.convert(module)
    assert type(module) is MyAttention


def test_attnx_never_imports_the_libraries():
    code = (
        "import sys, torch, attnx\n"
        "attnx.revert(attnx.convert(torch.nn.Transformer(8, 2, 1, 1, 16)))\n"
        "print(sorted(m for m in ('timm', 'open_clip', 'attnx.integrations.timm') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
