"""attnx.convert / attnx.revert on torch's Transformer modules: same outputs, shared parameters, and proof by
dispatch counting that a converted model runs attnx's attention (never torch's fused paths) in every mode."""

import copy
import warnings

import pytest
import torch

import attnx
from dispatch_helpers import DispatchRecorder
from mha_helpers import torch_fastpath

E, HEADS, FF = 16, 2, 32

# Ops of torch's fused attention paths; a converted model must dispatch none of them.
TORCH_FAST_PATH_OPS = (
    "aten::_native_multi_head_attention",
    "aten::_transformer_encoder_layer_fwd",
    "aten::_scaled_dot_product",  # prefix: every SDPA backend
    "aten::_nested_tensor_from_mask",
    "aten::_masked_softmax",
)
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def attnx_op_count(counts):
    return sum(n for name, n in counts.items() if name.startswith("attnx::"))


def torch_fast_path_ops(counts):
    return sorted(name for name in counts if name.startswith(TORCH_FAST_PATH_OPS))


def assert_runs_attnx(run, attention_modules):
    """``run()`` dispatches none of torch's fused attention ops, and attnx's own instead: one ``attnx::_mha``
    per attention module when no gradient is needed, one ``attnx::mha_forward`` under grad."""
    with DispatchRecorder() as recorder:
        run()
    assert torch_fast_path_ops(recorder.counts) == []
    op = "attnx::mha_forward" if torch.is_grad_enabled() else "attnx::_mha"
    assert recorder.counts[op] == attention_modules
    assert recorder.counts["attnx::_linear"] == recorder.counts["attnx::_linear_autograd"] == 0


def encoder(dtype=torch.float64, **layer_kwargs):
    layer = torch.nn.TransformerEncoderLayer(
        E, HEADS, FF, dropout=0.0, batch_first=True, dtype=dtype, **layer_kwargs
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # norm_first encoders warn that they cannot use nested tensors
        return torch.nn.TransformerEncoder(
            layer, 2, norm=torch.nn.LayerNorm(E, dtype=dtype), enable_nested_tensor=True
        )


def padding(B=3, S=7):
    """A left-aligned key padding mask (what torch's nested-tensor path accepts); batch 0 is unpadded."""
    lengths = torch.tensor([S, S - 3, S - 1])[:B]
    return torch.arange(S)[None, :] >= lengths[:, None]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder(norm_first):
    model = encoder(norm_first=norm_first)
    x = torch.randn(3, 7, E, dtype=torch.float64)
    kpm = padding()
    kpm_float = torch.zeros(kpm.shape, dtype=torch.float64).masked_fill(kpm, float("-inf"))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    cases = {
        "none": {},
        "kpm": {"src_key_padding_mask": kpm},
        "bool_masks_kpm": {"mask": torch.ones(7, 7, dtype=torch.bool).triu(1), "src_key_padding_mask": kpm},
        "detected_causal_kpm": {
            "mask": causal,
            "src_key_padding_mask": kpm_float,
        },  # is_causal=None: detected
        "causal": {"mask": causal, "is_causal": True},
    }

    def outputs(train, fastpath=True):
        model.train(train)
        with torch_fastpath(fastpath), torch.no_grad():
            return {name: model(x, **kwargs) for name, kwargs in cases.items()}

    fast, slow, train = outputs(False), outputs(False, fastpath=False), outputs(True)
    if not norm_first:  # the control: unconverted, torch takes its nested-tensor and fused-layer paths
        with torch.no_grad(), DispatchRecorder() as recorder:
            model.eval()(x, src_key_padding_mask=kpm)
        assert "aten::_transformer_encoder_layer_fwd" in recorder.counts
        assert "aten::_nested_tensor_from_mask" in recorder.counts

    params = {name: p for name, p in model.named_parameters()}
    attn = [layer.self_attn for layer in model.layers]
    assert attnx.convert(model) is model
    assert all(type(layer) is attnx.nn.TransformerEncoderLayer for layer in model.layers)
    assert all(type(layer.self_attn) is attnx.nn.MultiheadAttention for layer in model.layers)
    assert [layer.self_attn for layer in model.layers] == attn  # the same module objects ...
    assert all(p is params[name] for name, p in model.named_parameters())  # ... and the same Parameters
    assert model.use_nested_tensor is False

    for name, out in outputs(False).items():
        torch.testing.assert_close(out, slow[name])
        valid = ~kpm[..., None] if "kpm" in name else torch.ones_like(out, dtype=torch.bool)
        # torch's nested path leaves padded positions 0 (then normed); every real position agrees
        torch.testing.assert_close(out.masked_select(valid), fast[name].masked_select(valid))
    for name, out in outputs(True).items():
        torch.testing.assert_close(out, train[name])

    for kwargs in cases.values():
        for train_mode, grad in [(False, False), (False, True), (True, True)]:
            model.train(train_mode)
            with torch.set_grad_enabled(grad):
                assert_runs_attnx(lambda kwargs=kwargs: model(x, **kwargs), attention_modules=2)

    assert attnx.revert(model) is model
    assert all(type(layer) is torch.nn.TransformerEncoderLayer for layer in model.layers)
    assert all(type(layer.self_attn) is torch.nn.MultiheadAttention for layer in model.layers)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert model.use_nested_tensor is (not norm_first) and not hasattr(
        model, "_attnx_saved_use_nested_tensor"
    )
    for name, out in outputs(False).items():
        torch.testing.assert_close(out, fast[name])


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_decoder_layer(batch_first):
    layer = torch.nn.TransformerDecoderLayer(
        E, HEADS, FF, dropout=0.0, batch_first=batch_first, dtype=torch.float64
    )
    shape = (lambda n: (3, n, E)) if batch_first else (lambda n: (n, 3, E))
    tgt, memory = torch.randn(*shape(5), dtype=torch.float64), torch.randn(*shape(7), dtype=torch.float64)
    kwargs = dict(
        tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
        tgt_is_causal=True,
        memory_key_padding_mask=padding(),
    )
    expected = {train: layer.train(train)(tgt, memory, **kwargs) for train in (False, True)}
    attnx.convert(layer)
    assert type(layer.self_attn) is type(layer.multihead_attn) is attnx.nn.MultiheadAttention
    for train in (False, True):
        layer.train(train)
        torch.testing.assert_close(layer(tgt, memory, **kwargs), expected[train])
        with torch.no_grad():
            assert_runs_attnx(lambda: layer(tgt, memory, **kwargs), attention_modules=2)
    attnx.revert(layer)
    assert type(layer.self_attn) is type(layer.multihead_attn) is torch.nn.MultiheadAttention


@pytest.mark.wheel
def test_transformer():
    model = torch.nn.Transformer(E, HEADS, 2, 2, FF, dropout=0.0, batch_first=True, dtype=torch.float64)
    src, tgt = torch.randn(3, 7, E, dtype=torch.float64), torch.randn(3, 5, E, dtype=torch.float64)
    kwargs = dict(
        src_key_padding_mask=padding(),
        memory_key_padding_mask=padding(),
        tgt_mask=model.generate_square_subsequent_mask(5, dtype=torch.float64),
        tgt_is_causal=True,
    )
    with torch.no_grad():
        with torch_fastpath(False):
            slow = model.eval()(src, tgt, **kwargs)
        train = model.train()(src, tgt, **kwargs)
    params = list(model.parameters())
    attnx.convert(model)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert sum(type(m) is attnx.nn.MultiheadAttention for m in model.modules()) == 2 + 2 * 2
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(src, tgt, **kwargs), slow)
        torch.testing.assert_close(model.train()(src, tgt, **kwargs), train)
        for train_mode in (False, True):
            model.train(train_mode)
            assert_runs_attnx(lambda: model(src, tgt, **kwargs), attention_modules=2 + 2 * 2)
    attnx.revert(model)
    assert not any(type(m).__module__.startswith("attnx") for m in model.modules())


def test_convert_leaves_subclasses_and_is_idempotent():
    class MyAttention(torch.nn.MultiheadAttention):
        pass

    model = torch.nn.ModuleDict(
        {"plain": torch.nn.MultiheadAttention(E, HEADS), "mine": MyAttention(E, HEADS)}
    )
    attnx.convert(attnx.convert(model))
    assert type(model["plain"]) is attnx.nn.MultiheadAttention and type(model["mine"]) is MyAttention
    state = model.state_dict()
    torch.nn.ModuleDict(
        {"plain": torch.nn.MultiheadAttention(E, HEADS), "mine": MyAttention(E, HEADS)}
    ).load_state_dict(state, strict=True)
    bare = attnx.convert(torch.nn.MultiheadAttention(E, HEADS))  # the model may itself be the attention
    assert type(bare) is attnx.nn.MultiheadAttention
    assert type(copy.deepcopy(bare)) is attnx.nn.MultiheadAttention
    attnx.revert(model)
    assert type(model["plain"]) is torch.nn.MultiheadAttention


def test_compiled_converted_encoder_has_no_graph_breaks():
    torch._dynamo.reset()
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = attnx.convert(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)).eval()
    x, kpm = torch.randn(2, 9, 32), padding(2, 9)
    # aot_eager traces through dynamo (where graph breaks happen) and AOT autograd on fake tensors (the ops'
    # fake kernels); inductor's C++ codegen would add about a minute on a 2-core machine, testing no attnx
    # code.
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, src_key_padding_mask=kpm), model(x, src_key_padding_mask=kpm))
