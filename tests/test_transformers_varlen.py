"""Variable-length batches in transformers with ``attn_implementation="attnx"``: packed sequences
(``DataCollatorWithFlattening``) and continuous batching (``generate_batch``), on attnx.varlen_attention.

Packed training must give the loss and gradients of each sequence run alone through the model's eager
attention (the sequences never see each other), with or without the model's cache object and with or without
the collator's varlen keyword arguments, and build no ``(1, 1, T, T)`` mask. Continuous batching must give
transformers' own greedy tokens, on varlen calls only. Small random float64 models built from configs (nothing
is downloaded).
"""

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
SMALL = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)

MODELS = {
    "llama-gqa": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, num_key_value_heads=2, **SMALL)),
    "qwen2-sliding": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=VOCAB, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, **SMALL)),
    "gemma2": lambda: (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=1.5,
        final_logit_softcapping=None, query_pre_attn_scalar=8, **SMALL)),
    "gpt-oss": lambda: (transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, sliding_window=4, num_local_experts=2,
        num_experts_per_tok=1, **SMALL)),
}
LENGTHS = [7, 1, 12, 5]  # a length-1 sequence included


def _build(name, attn_implementation):
    cls, cfg = MODELS[name]()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls._from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float64,
                                 experts_implementation="eager")
    return model


class _Calls:
    """Counts attnx.varlen_attention and attnx.attention calls (the latter would mean a dense path)."""

    def __init__(self, monkeypatch):
        self.varlen = self.dense = 0
        self.lengths = []  # per varlen call, each sequence's (queries, keys)
        varlen, dense = attnx.varlen_attention, attnx.attention

        def count_varlen(*args, **kwargs):
            self.varlen += 1
            q_lengths, k_lengths = (torch.diff(c).tolist() for c in args[3:5])
            self.lengths.append(list(zip(q_lengths, k_lengths, strict=True)))
            return varlen(*args, **kwargs)

        def count_dense(*args, **kwargs):
            self.dense += 1
            return dense(*args, **kwargs)

        monkeypatch.setattr(attnx, "varlen_attention", count_varlen)
        monkeypatch.setattr(attnx, "attention", count_dense)


def _sequences():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _summed_loss(logits, labels):
    """The next-token cross entropy summed over the predicted tokens, in float64 (transformers' own loss takes
    it in float32)."""
    return torch.nn.functional.cross_entropy(
        logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
    )


def _per_sequence_loss(model):
    """The packed batch's loss computed sequence by sequence (batch 1, no padding, no packing), summed."""
    total = 0.0
    for s in _sequences():
        ids = torch.tensor([s])
        total = total + _summed_loss(model(input_ids=ids).logits, ids)
    return total


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "cache_object"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "varlen_kwargs"])
def test_packed_training_matches_each_sequence_alone(name, use_cache, flash_kwargs, monkeypatch):
    model = _build(name, "eager").train()
    expected = _grads(model, _per_sequence_loss(model))

    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    packed = collator([{"input_ids": s} for s in _sequences()])
    model.set_attn_implementation("attnx")
    calls = _Calls(monkeypatch)
    labels = packed.pop("labels")
    actual = _grads(model, _summed_loss(model(**packed, use_cache=use_cache).logits, labels))
    assert calls.varlen == model.config.num_hidden_layers and calls.dense == 0
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-9, atol=1e-10)
    assert actual[1].keys() == expected[1].keys()
    for n in expected[1]:
        # 1e-6 of the largest element: Gemma 2's RMSNorm sums its weight's gradient in float32, in an order
        # that depends on the batch's layout (1e-7 apart here); attention's own error is float64's.
        scale = expected[1][n].abs().max().item()
        torch.testing.assert_close(actual[1][n], expected[1][n], rtol=0, atol=1e-6 * scale + 1e-12, msg=n)


def test_packed_mask_is_recognised_not_built():
    """transformers' packed-sequence mask pattern becomes sequence boundaries: no (B, 1, T, T) mask."""
    f = transformers.masking_utils
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = f.find_packed_sequence_indices(position_ids)
    pattern = f.packed_sequence_compatibility_function(f.causal_mask_function, position_ids, ids)
    args = attnx_hf.attention_mask(1, 9, 9, mask_function=pattern, allow_is_causal_skip=False)
    assert args.attn_mask is None and args.key_padding_mask is None
    assert args.cu_seqlens.tolist() == [0, 3, 5, 9] and args.max_seqlen == 4
    assert (args.window_left, args.window_right) == (-1, 0)


def _generate_batch(model, implementation, prompts):
    model.set_attn_implementation(implementation)
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A cache sized for these prompts, not from the machine's free memory (gigabytes, filled at start): pages
    # of 16 tokens, so that each sequence spans several and the block table is read across pages, and batches
    # of 32 tokens, so that prefill is split into chunks that read earlier ones from the cache.
    batching = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching)
    return {request: result.generated_tokens for request, result in out.items()}


# Each generate_batch call starts transformers' batching manager (seconds): LLaMA (GQA), Gemma 2
# (soft-capping, sliding window) and gpt-oss (sinks, sliding window) cover the features.
@pytest.mark.parametrize("name", ["gemma2", "gpt-oss", "llama-gqa"])
def test_continuous_batching_is_token_identical_to_sdpa(name, monkeypatch):
    """attnx against transformers' own continuous batching: ``sdpa`` (``paged|sdpa`` before 5.23), or
    ``paged|eager`` for models that have no SDPA path (soft-capping, sinks)."""
    model = _build(name, "eager").eval()
    reference = "sdpa" if model._supports_sdpa else "paged|eager"
    prompts = _sequences() + [list(range(3, 40))]
    expected = _generate_batch(model, reference, prompts)
    calls = _Calls(monkeypatch)
    actual = _generate_batch(model, "attnx", prompts)
    assert actual == expected
    assert calls.varlen > 0 and calls.dense == 0
    assert model.config._attn_implementation == "attnx"
    # The cache's sizes above are in effect: prefill in chunks of at most 32 queries, a chunk after the first
    # reading the earlier ones' keys, and sequences whose keys span several 16-token pages.
    lengths = [pair for call in calls.lengths for pair in call]
    assert max(q for q, _ in lengths) <= 32 and any(1 < q < k for q, k in lengths)
    assert max(k for _, k in lengths) > 16


def test_continuous_batching_admission_is_only_widened_for_attnx():
    from transformers.generation.continuous_batching import continuous_api

    attnx_hf.allow_continuous_batching()  # idempotent
    switch = continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn
    assert switch.attnx_wrapped is not None and not hasattr(switch.attnx_wrapped, "attnx_wrapped")

    class Config:
        _attn_implementation = "flex_attention"

    class Model:
        config = Config()
        _supports_flash_attn = False

    with pytest.raises(ValueError, match="not supported for continuous batching"):
        switch(object.__new__(continuous_api.ContinuousBatchingManager), Model(), False)
