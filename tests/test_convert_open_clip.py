"""attnx.convert / attnx.revert on open_clip models: the towers' attention runs on attnx, the text tower's
causal mask as causal attention (never read), other masks as masks, with the unconverted model's outputs and
gradients; revert restores it exactly."""

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

open_clip = pytest.importorskip("open_clip", reason="open_clip is not installed: its converter is not tested")

from open_clip import transformer as oc  # noqa: E402
from open_clip.model import CLIP, CustomTextCLIP  # noqa: E402

import attnx  # noqa: E402
from attnx.integrations import open_clip as attnx_open_clip  # noqa: E402

pytestmark = pytest.mark.integration

B, CONTEXT, VOCAB, WIDTH, HEADS, LAYERS = 2, 12, 100, 64, 4, 2
VISION_CFG = {"layers": LAYERS, "width": WIDTH, "head_width": WIDTH // HEADS, "patch_size": 8,
              "image_size": 32}
TEXT_CFG = {"context_length": CONTEXT, "vocab_size": VOCAB, "width": WIDTH, "heads": HEADS, "layers": LAYERS}
CUSTOM_TEXT_CFG = {**TEXT_CFG, "qk_norm": True, "scale_heads": True, "scale_attn_inner": True}


class AttentionCalls(TorchDispatchMode):
    """Records each attnx attention op call: its name, and whether it was given a mask and ``is_causal``."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        if func.name() in ("attnx::_mha", "attnx::mha_forward", "attnx::_attention",
                           "attnx::_attention_autograd"):
            named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | (kwargs or {})
            has_mask = named.get("attn_mask") is not None or named.get("key_padding_mask") is not None
            self.calls.append((func.name(), has_mask, bool(named.get("is_causal"))))
        return func(*args, **(kwargs or {}))


def clip(cls=CLIP, text_cfg=TEXT_CFG, dtype=torch.float64):
    return cls(embed_dim=32, vision_cfg=VISION_CFG, text_cfg=text_cfg).to(dtype)


def text_tower(**kwargs):
    kwargs = {**TEXT_CFG, "output_dim": 32, **kwargs}
    return oc.TextTransformer(**kwargs).double()


def images(dtype=torch.float64):
    return torch.randn(B, 3, 32, 32, dtype=dtype)


def texts(pad_from=None):
    """Token ids in [1, VOCAB) (0 is the pad id), padded from ``pad_from[b]`` on in batch ``b``."""
    text = torch.randint(1, VOCAB, (B, CONTEXT))
    if pad_from is not None:
        text[torch.arange(CONTEXT)[None, :] >= torch.tensor(pad_from)[:, None]] = 0
    return text


def assert_grads_match(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def attnx_types(model):
    return sorted({type(m).__qualname__ for m in model.modules() if type(m).__module__.startswith("attnx")})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("cls, text_cfg", [(CLIP, TEXT_CFG), (CustomTextCLIP, CUSTOM_TEXT_CFG)],
                         ids=["clip", "custom_text"])
def test_encoders_match_open_clip(cls, text_cfg, training):
    model = clip(cls, text_cfg)
    reference = copy.deepcopy(model)
    attnx.convert(model)
    model.train(training)
    reference.train(training)
    image, text = images(), texts()
    out_image, out_text = model.encode_image(image), model.encode_text(text)
    expected_image, expected_text = reference.encode_image(image), reference.encode_text(text)
    torch.testing.assert_close(out_image, expected_image, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_text, expected_text, rtol=1e-12, atol=1e-12)
    (out_image.square().sum() + out_text.square().sum()).backward()
    (expected_image.square().sum() + expected_text.square().sum()).backward()
    assert_grads_match(model, reference)


def test_types_after_convert():
    assert attnx_types(attnx.convert(clip())) == [
        "MultiheadAttention", "ResidualAttentionBlock", "Transformer",
    ]
    assert attnx_types(attnx.convert(clip(CustomTextCLIP, CUSTOM_TEXT_CFG))) == [
        "Attention", "CustomResidualAttentionBlock", "MultiheadAttention", "ResidualAttentionBlock",
        "Transformer",
    ]


@pytest.mark.parametrize("cls, text_cfg, op", [(CLIP, TEXT_CFG, "attnx::_mha"),
                                               (CustomTextCLIP, CUSTOM_TEXT_CFG, "attnx::_attention")],
                         ids=["clip", "custom_text"])
def test_text_causal_mask_runs_as_causal_attention(cls, text_cfg, op):
    model = attnx.convert(clip(cls, text_cfg))
    with torch.no_grad(), AttentionCalls() as recorder:
        model.encode_text(texts())
    assert recorder.calls == [(op, False, True)] * LAYERS  # no mask tensor, is_causal
    assert not [name for name in recorder.counts if "scaled_dot_product" in name or "softmax" in name]
    with torch.no_grad(), AttentionCalls() as recorder:
        model.encode_image(images())
    assert recorder.calls == [(op if cls is CLIP else "attnx::_mha", False, False)] * LAYERS


@pytest.mark.parametrize(
    "kwargs",
    [{"embed_cls": True}, {"embed_cls": True, "correct_cls_mask": True},
     {"no_causal_mask": True, "use_pad_mask": True}, {"no_causal_mask": True, "use_pad_mask": True,
                                                      "qk_norm": True}],
    ids=["causal_cls", "causal_cls_correct", "padding", "padding_custom"],
)
def test_text_tower_additive_masks(kwargs):
    """``_build_additive_mask``'s (B*heads, L, L) masks (padding, cls) stay masks and keep their meaning."""
    tower = text_tower(**kwargs)
    reference = copy.deepcopy(tower)
    attnx.convert(tower)
    text = texts(pad_from=[CONTEXT, CONTEXT - 4])
    with AttentionCalls() as recorder:
        out = tower(text)
    assert recorder.calls and all(has_mask and not causal for _, has_mask, causal in recorder.calls)
    expected = reference(text)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_match(tower, reference)


@pytest.mark.parametrize("block_type", ["default", "custom"])
def test_other_masks_are_added(block_type):
    """2-D masks that are not causal (float or bool), or causal of another size, keep open_clip's meaning."""
    stack = oc.Transformer(WIDTH, LAYERS, HEADS, block_type=block_type).double()
    reference = copy.deepcopy(stack)
    attnx.convert(stack)
    x = torch.randn(B, CONTEXT, WIDTH, dtype=torch.float64)
    causal = torch.full((CONTEXT, CONTEXT), float("-inf"), dtype=torch.float64).triu(1)
    banded = causal + torch.full_like(causal, float("-inf")).tril(-3)
    random_bool = (torch.rand(CONTEXT, CONTEXT) > 0.7) & ~torch.eye(CONTEXT, dtype=torch.bool)
    random_float = torch.randn(CONTEXT, CONTEXT, dtype=torch.float64)

    def assert_same(mask):
        expected = reference(x, attn_mask=mask)
        torch.testing.assert_close(stack(x, attn_mask=mask), expected, rtol=1e-12, atol=1e-12)

    for mask in (banded, causal.T.contiguous(), random_bool, random_float):
        assert_same(mask)
    assert_same(causal)
    mask = causal.clone()
    stack(x, attn_mask=mask)
    mask[0, 1] = 0.0  # mutated in place after a first check: no longer causal, and seen so
    assert_same(mask)
    with pytest.raises(RuntimeError):  # a causal mask of the wrong size fails as in open_clip
        stack(x[:, :-1], attn_mask=causal)
    with pytest.raises(RuntimeError):
        reference(x[:, :-1], attn_mask=causal)


@pytest.mark.wheel
def test_float32_close():
    model = clip(dtype=torch.float32)
    reference = copy.deepcopy(model)
    attnx.convert(model)
    text, image = texts(), images(torch.float32)
    torch.testing.assert_close(model.encode_text(text), reference.encode_text(text), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.encode_image(image), reference.encode_image(image), rtol=1e-4, atol=1e-5)


def test_state_dict_revert_and_idempotence():
    model = clip(CustomTextCLIP, CUSTOM_TEXT_CFG)
    reference = copy.deepcopy(model)
    parameters = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state = model.state_dict()
    text, image = texts(), images()
    attnx.convert(model)
    attnx.convert(model)  # idempotent
    assert dict(model.named_parameters()) == parameters and dict(model.named_buffers()) == buffers
    converted_state = model.state_dict()
    assert list(converted_state) == list(state)
    assert all(converted_state[k].equal(state[k]) for k in state)
    torch.testing.assert_close(model.encode_text(text), reference.encode_text(text), rtol=1e-12, atol=1e-12)

    attnx.revert(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert dict(model.named_parameters()) == parameters and dict(model.named_buffers()) == buffers
    with AttentionCalls() as recorder:
        out_text, out_image = model.encode_text(text), model.encode_image(image)
    assert recorder.calls == []
    torch.testing.assert_close(out_text, reference.encode_text(text), rtol=0, atol=0)
    torch.testing.assert_close(out_image, reference.encode_image(image), rtol=0, atol=0)


def test_scaled_cosine_attention_is_left_alone():
    attn = oc.Attention(WIDTH, HEADS, scaled_cosine=True)
    attnx.convert(attn)
    assert type(attn) is oc.Attention
    assert attnx_open_clip.accepts(oc.Attention(WIDTH, HEADS))


def test_grad_checkpointing():
    model = clip()
    model.set_grad_checkpointing(True)
    reference = copy.deepcopy(model)
    attnx.convert(model)
    text = texts()
    out, expected = model.encode_text(text), reference.encode_text(text)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_match(model, reference)
