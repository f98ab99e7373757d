"""attnx as the attention of Hugging Face transformers models (``attn_implementation="attnx"``), against the
models' own eager attention, on small randomly initialised configs (nothing is downloaded).

For every family: forward with no, left and right padding (compared where tokens are kept); for decoders
greedy ``generate`` with the default and the static cache and a chunked prefill; training loss and every
parameter's gradient. Models are float64 so that the comparisons are tight and greedy decoding cannot flip on
a rounding.
"""

import contextlib
import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'attnx[models]')"
)

import attnx  # noqa: E402
import attnx.integrations.transformers as attnx_hf  # noqa: E402

attnx_hf.register()

# Eager attention takes its softmax in float32; float64 comparisons need it in float64 (conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("float64_softmax")]

VOCAB = 97
SMALL = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4)
NO_DROPOUT = dict(attention_dropout=0.0)


def _llama(kv_heads):
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, num_key_value_heads=kv_heads, max_position_embeddings=64, **SMALL
    )


# name -> (model class, config); decoder-only causal LMs
DECODERS = {
    "gpt2": lambda: (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
    "llama-gqa": lambda: _llama(2),
    "llama-mqa": lambda: _llama(1),
    "qwen2-sliding": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=VOCAB, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, max_position_embeddings=64, **SMALL)),
    "mistral": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        vocab_size=VOCAB, num_key_value_heads=2, sliding_window=5, max_position_embeddings=64, **SMALL)),
    "gemma2": lambda: (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=1.5,
        final_logit_softcapping=None, query_pre_attn_scalar=8, max_position_embeddings=64, **SMALL)),
    "gpt-oss": lambda: (transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, sliding_window=4, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=64, **SMALL)),
}

# encoder-decoders: (model class, config, encoder input name)
SEQ2SEQ = {
    "t5": lambda: (transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1), "input_ids"),
    "bart": lambda: (transformers.BartForConditionalGeneration, transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None), "input_ids"),
    "whisper": lambda: (transformers.WhisperForConditionalGeneration, transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40,
        max_source_positions=8, max_target_positions=48, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None), "input_features"),
}

# encoders: (model class, config, input builder)
ENCODERS = {
    "bert": lambda: (transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=64, **SMALL)),
    "vit": lambda: (transformers.ViTForImageClassification, transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=5, **SMALL)),
    "clip": lambda: (transformers.CLIPModel, transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                         eos_token_id=VOCAB - 1, **SMALL),
        vision_config=dict(image_size=16, patch_size=4, **SMALL), projection_dim=16)),
}

B, L = 3, 12


def _padding(kind):
    """A (B, L) padding mask (1 = keep): none, left (a row padded by 3 and one by 5) or right."""
    if kind == "none":
        return None
    mask = torch.ones(B, L, dtype=torch.long)
    if kind == "left":
        mask[1, :3] = 0
        mask[2, :5] = 0
    else:
        mask[1, -3:] = 0
        mask[2, -5:] = 0
    return mask


def _text(padding):
    """B random sequences of L tokens with _padding(padding): forward's input_ids and attention_mask."""
    return dict(input_ids=torch.randint(3, VOCAB, (B, L)), attention_mask=_padding(padding))


def _build(factory, attn_implementation="eager"):
    cls, cfg, *_ = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # gpt-oss's experts: the loop over experts, as the grouped GEMM takes no float64
        model = cls._from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float64,
                                 experts_implementation="eager")
    return model.eval()


@contextlib.contextmanager
def _implementation(model, name):
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def _outputs(model, inputs, name, field):
    with _implementation(model, name), torch.no_grad():
        return getattr(model(**inputs), field)


def _assert_close_where_kept(actual, expected, keep):
    if keep is not None:
        actual, expected = actual[keep.bool()], expected[keep.bool()]
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10)


class _Spy:
    """Records the keyword arguments of every attnx.attention call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = attnx.attention

        def spy(query, key, value, **kwargs):
            self.calls.append(dict(kwargs, query=query, key=key))
            return real(query, key, value, **kwargs)

        monkeypatch.setattr(attnx, "attention", spy)


# ------------------------------------------------------------------------------------------------------------
# registration


def test_register_returns_the_name_and_every_way_of_selecting_it_works():
    assert attnx_hf.register() == "attnx"
    assert transformers.AttentionInterface._global_mapping["attnx"] is attnx_hf.attention_forward
    masks = transformers.masking_utils.AttentionMaskInterface._global_mapping
    assert masks["attnx"] is attnx_hf.attention_mask
    cls, cfg = DECODERS["llama-gqa"]()
    assert cls._from_config(cfg, attn_implementation="attnx").config._attn_implementation == "attnx"
    auto = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="attnx")
    assert auto.config._attn_implementation == "attnx"
    model = _build(DECODERS["llama-gqa"])
    model.set_attn_implementation("attnx")
    assert model.config._attn_implementation == "attnx"


@pytest.mark.wheel
def test_from_pretrained_selects_attnx(tmp_path):
    model = _build(DECODERS["llama-gqa"])
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="attnx", dtype=torch.float64).eval()
    assert loaded.config._attn_implementation == "attnx"
    inputs = _text("left")
    with torch.no_grad():
        actual = loaded(**inputs).logits
    _assert_close_where_kept(actual, _outputs(model, inputs, "eager", "logits"), inputs["attention_mask"])


def test_enable_switches_every_submodel():
    model = _build(ENCODERS["clip"])
    assert attnx_hf.enable(model) is model
    assert model.text_model.config._attn_implementation == "attnx"
    assert model.vision_model.config._attn_implementation == "attnx"


def test_enable_names_models_whose_attention_is_not_in_the_registry():
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)
    model = transformers.BloomForCausalLM(cfg)  # Bloom's attention module never calls the AttentionInterface
    with pytest.warns(UserWarning, match="BloomForCausalLM.* kept their own attention"):
        attnx_hf.enable(model)


# ------------------------------------------------------------------------------------------------------------
# forward against eager


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_forward_matches_eager(name, padding):
    model = _build(DECODERS[name])
    inputs = _text(padding)
    actual, expected = (_outputs(model, inputs, impl, "logits") for impl in ("attnx", "eager"))
    _assert_close_where_kept(actual, expected, inputs["attention_mask"])


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2", "gpt-oss"])
def test_decoder_forward_in_lower_precision(name, dtype, tol):
    """The dtypes models run in: within the spread of transformers' own sdpa path around eager."""
    cls, cfg = DECODERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls._from_config(cfg, attn_implementation="eager", dtype=dtype,
                                 experts_implementation="eager").eval()
    inputs = _text("left")
    keep = inputs["attention_mask"].bool()
    actual, expected = (_outputs(model, inputs, impl, "logits")[keep].float() for impl in ("attnx", "eager"))
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_seq2seq_forward_matches_eager(name, padding):
    model = _build(SEQ2SEQ[name])
    *_, source = SEQ2SEQ[name]()
    decoder_mask = _padding(padding)
    inputs = dict(decoder_input_ids=torch.randint(3, VOCAB, (B, L)), decoder_attention_mask=decoder_mask)
    if source == "input_features":  # Whisper's encoder takes no padding mask
        inputs["input_features"] = torch.randn(B, 8, 16, dtype=torch.float64)
    else:
        inputs.update(_text(padding))
    actual, expected = (_outputs(model, inputs, impl, "logits") for impl in ("attnx", "eager"))
    _assert_close_where_kept(actual, expected, decoder_mask)


def _encoder_inputs(name, padding):
    pixels = torch.randn(B, 3, 16, 16, dtype=torch.float64)
    if name == "vit":
        return dict(pixel_values=pixels), "logits", None
    inputs = _text(padding)
    if name == "clip":
        inputs["pixel_values"] = pixels
        return inputs, "text_embeds", None  # pooled at the last (EOS-id) token, which the padding keeps
    return inputs, "logits", inputs["attention_mask"]


@pytest.mark.parametrize(("name", "padding"), [
    (name, padding) for name in sorted(ENCODERS) for padding in ("none", "left", "right")
    if name != "vit" or padding == "none"  # ViT takes no padding mask
])
def test_encoder_forward_matches_eager(name, padding):
    model = _build(ENCODERS[name])
    inputs, field, keep = _encoder_inputs(name, padding)
    if name == "clip":
        inputs["input_ids"].clamp_(max=VOCAB - 2)[:, -1] = VOCAB - 1  # the pooled (EOS) token last
        if padding == "right":  # the pooled token must be a kept one
            inputs["attention_mask"] = _padding("left")
    _assert_close_where_kept(
        _outputs(model, inputs, "attnx", field), _outputs(model, inputs, "eager", field), keep
    )
    if name == "clip":
        torch.testing.assert_close(_outputs(model, inputs, "attnx", "image_embeds"),
                                   _outputs(model, inputs, "eager", "image_embeds"), rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------------------------------
# decoding


def _generate(model, name, inputs, **kwargs):
    with _implementation(model, name), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**inputs, max_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_greedy_generate_is_token_identical(name):
    model = _build(DECODERS[name])
    model.generation_config.pad_token_id = 0
    inputs = _text("left")
    expected = _generate(model, "eager", inputs)
    assert torch.equal(_generate(model, "attnx", inputs), expected)
    assert torch.equal(_generate(model, "attnx", inputs, cache_implementation="static"), expected)


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_seq2seq_greedy_generate_is_token_identical(name):
    model = _build(SEQ2SEQ[name])
    *_, source = SEQ2SEQ[name]()
    if source == "input_features":
        inputs = dict(input_features=torch.randn(B, 8, 16, dtype=torch.float64))
        # Whisper's own generate() wants language/task tables that a random config lacks: the plain one
        generate = transformers.GenerationMixin.generate

        def run(impl, **kwargs):
            with _implementation(model, impl), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return generate(model, **inputs, max_new_tokens=10, do_sample=False, **kwargs)
    else:
        inputs = _text("right")

        def run(impl, **kwargs):
            return _generate(model, impl, inputs, **kwargs)
    expected = run("eager")
    assert torch.equal(run("attnx"), expected)
    assert torch.equal(run("attnx", cache_implementation="static"), expected)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_chunked_prefill_matches_one_pass(name):
    model = _build(DECODERS[name])
    ids, mask = torch.randint(3, VOCAB, (B, L)), _padding("left")
    with _implementation(model, "attnx"), torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        cache = transformers.DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)
        second = model(input_ids=ids[:, 5:], attention_mask=mask, past_key_values=first.past_key_values,
                       use_cache=True)
    chunked = torch.cat([first.logits, second.logits], dim=1)
    _assert_close_where_kept(chunked, whole, mask)


# ------------------------------------------------------------------------------------------------------------
# training


def _grads(model, inputs, name):
    model.zero_grad(set_to_none=True)
    with _implementation(model, name):
        loss = model(**inputs).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _labels(ids, mask, shifted=False):
    """Labels that leave out what padded rows predict (``shifted``: a causal LM predicts label t at t - 1): a
    row that sees no key is 0 in attnx and an average of values in eager, both finite, neither meaningful."""
    left_out = mask == 0
    if shifted:
        left_out |= torch.cat([torch.zeros_like(left_out[:, :1]), left_out[:, :-1]], dim=1)
    return ids.masked_fill(left_out, -100)


def _training_inputs(name):
    if name in DECODERS:
        ids, mask = torch.randint(3, VOCAB, (B, L)), _padding("left")
        return DECODERS, dict(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask, shifted=True))
    if name in SEQ2SEQ:
        *_, source = SEQ2SEQ[name]()
        labels = torch.randint(3, VOCAB, (B, L))
        if source == "input_features":
            return SEQ2SEQ, dict(input_features=torch.randn(B, 8, 16, dtype=torch.float64), labels=labels)
        return SEQ2SEQ, dict(**_text("right"), labels=labels)
    if name == "vit":
        return ENCODERS, dict(pixel_values=torch.randn(B, 3, 16, 16, dtype=torch.float64),
                              labels=torch.randint(0, 5, (B,)))
    if name == "clip":
        ids = torch.randint(3, VOCAB - 1, (B, L))
        ids[:, -1] = VOCAB - 1  # EOS, where the text is pooled
        return ENCODERS, dict(input_ids=ids, attention_mask=_padding("left"),
                              pixel_values=torch.randn(B, 3, 16, 16, dtype=torch.float64), return_loss=True)
    ids, mask = torch.randint(3, VOCAB, (B, L)), _padding("right")
    return ENCODERS, dict(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask))


@pytest.mark.parametrize("name", sorted(DECODERS) + sorted(SEQ2SEQ) + sorted(ENCODERS))
def test_training_loss_and_every_gradient_match_eager(name):
    table, inputs = _training_inputs(name)
    model = _build(table[name]).train()
    loss, grads = _grads(model, inputs, "attnx")
    expected_loss, expected = _grads(model, inputs, "eager")
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    assert grads.keys() == expected.keys()
    for n in expected:
        assert grads[n] is not None and expected[n] is not None, n
        torch.testing.assert_close(
            grads[n], expected[n], rtol=1e-8, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}"
        )


def test_t5_relative_position_bias_gets_its_gradient():
    table, inputs = _training_inputs("t5")
    model = _build(table["t5"]).train()
    _, grads = _grads(model, inputs, "attnx")
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert grads[bias].abs().sum() > 0


def test_attention_dropout_runs_in_training_only():
    cls, cfg = ENCODERS["bert"]()
    cfg.attention_probs_dropout_prob = 0.5
    model = cls._from_config(cfg, attn_implementation="attnx", dtype=torch.float64)
    inputs = dict(input_ids=torch.randint(3, VOCAB, (B, L)))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, model(**inputs).logits)
    model.train()
    torch.manual_seed(1)
    first = model(**inputs).logits
    torch.manual_seed(1)
    assert torch.equal(model(**inputs).logits, first)  # reproducible under torch.manual_seed
    torch.manual_seed(2)
    assert not torch.equal(model(**inputs).logits, first)


# ------------------------------------------------------------------------------------------------------------
# what the layers get: the lean form


def test_padding_and_gqa_are_read_in_place(monkeypatch):
    spy = _Spy(monkeypatch)
    model = _build(DECODERS["llama-gqa"], "attnx")
    with torch.no_grad():
        model(**_text("left"))
    assert len(spy.calls) == 2
    for call in spy.calls:
        assert call["attn_mask"] is None  # no (B, 1, L, S) mask
        assert call["key_padding_mask"].shape == (B, L) and call["key_padding_mask"].dtype == torch.bool
        assert call["key"].shape[1] == 2  # the kv heads, not repeated
        assert (call["window_left"], call["window_right"]) == (-1, 0)


def test_unpadded_bidirectional_attention_gets_no_mask(monkeypatch):
    spy = _Spy(monkeypatch)
    model = _build(ENCODERS["bert"], "attnx")
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (B, L)))
    assert spy.calls
    for call in spy.calls:
        assert call.get("attn_mask") is None and call.get("key_padding_mask") is None
        assert not call["is_causal"]


def test_sliding_window_and_static_cache_become_a_key_range(monkeypatch):
    model = _build(DECODERS["qwen2-sliding"], "attnx")
    model.generation_config.pad_token_id = 0
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        model.generate(**_text("left"), max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert spy.calls and all(call["attn_mask"] is None for call in spy.calls)
    windows = {(call["window_left"], call["window_right"]) for call in spy.calls}
    assert windows == {(-1, 0), (3, 0)}  # the full layer and the sliding one (a window of 4 keys)
    full = [call for call in spy.calls if call["window_left"] == -1]
    assert all(call["key_lengths"] is not None for call in full)  # the static cache's filled length


def test_other_masks_fall_back_to_transformers_own():
    f = transformers.masking_utils
    combined = f.and_masks(f.causal_mask_function, lambda b, h, q, kv: kv != 2)
    args = attnx_hf.attention_mask(2, 4, 4, mask_function=combined, allow_is_causal_skip=False)
    expected = f.sdpa_mask(2, 4, 4, mask_function=combined, allow_is_causal_skip=False)
    assert torch.equal(args.attn_mask, expected.logical_not())
    plain = attnx_hf.attention_mask(2, 4, 4, mask_function=f.causal_mask_function)
    assert plain.attn_mask is None and plain.key_padding_mask is None


def test_windowed_bidirectional_mask_is_a_key_range():
    f = transformers.masking_utils
    args = attnx_hf.attention_mask(2, 6, 6, mask_function=f.sliding_window_bidirectional_mask_function(2))
    assert (args.window_left, args.window_right, args.attn_mask) == (2, 2, None)
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    out, _ = attnx.attention(q, q, q, window_left=2, window_right=2)
    dense = f.sdpa_mask(2, 6, 6, mask_function=f.sliding_window_bidirectional_mask_function(2),
                        allow_is_causal_skip=False)
    expected, _ = attnx.attention(q, q, q, attn_mask=dense.logical_not())
    torch.testing.assert_close(out, expected)


def test_a_users_4d_masks_keep_transformers_conventions():
    # eager adds any mask, a bool one too: the reference for these is transformers' sdpa path
    model = _build(DECODERS["llama-gqa"])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    bool_mask = causal.expand(B, 1, L, L)
    float_mask = torch.zeros(B, 1, L, L, dtype=torch.float64).masked_fill(~bool_mask, float("-inf"))
    ids = torch.randint(3, VOCAB, (B, L))
    for mask in (bool_mask, float_mask):
        inputs = dict(input_ids=ids, attention_mask=mask)
        _assert_close_where_kept(_outputs(model, inputs, "attnx", "logits"),
                                 _outputs(model, inputs, "sdpa", "logits"), None)


def test_fully_padded_rows_are_finite():
    model = _build(DECODERS["llama-gqa"], "attnx")
    with torch.no_grad():
        logits = model(**_text("left")).logits
    assert torch.isfinite(logits).all()


def test_output_is_a_view_of_attnx_output_in_the_models_layout():
    q = torch.randn(2, 4, 5, 8).transpose(1, 2).contiguous().transpose(1, 2)
    out, weights = attnx_hf.attention_forward(torch.nn.Module(), q, q[:, :2], q[:, :2], None)
    assert weights is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
