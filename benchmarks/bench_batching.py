"""Variable-length batches in transformers: continuous batching and packed training, attnx against ``sdpa``.

- ``continuous batching``: a LLaMA-shaped decoder (bench_models' ``LLAMA`` config, fp32, random weights)
  serves 16 requests of mixed prompt lengths (16 to 400 tokens) with ``model.generate_batch`` (greedy, 32 new
  tokens each), once with ``attn_implementation="attnx"`` and once with ``"sdpa"`` (transformers'
  ``paged|sdpa``, which builds a dense float mask over the whole batch's tokens for every step). Tokens/s =
  generated tokens / wall time of the whole call, the median of interleaved rounds. The generated tokens are
  compared first (a greedy near-tie may flip one: reported, not a failure). Target: attnx >= 1.5x sdpa.
- ``packed training``: one training step (forward, loss, backward) of the same model on 8 sequences whose
  padding to the longest would be 40% of the padded batch's tokens: attnx on the packed batch
  (``DataCollatorWithFlattening``: one row, position ids restarting, no mask) against ``sdpa`` on the padded
  batch (right padding, attention mask). Losses are compared first. Time: paired ratio (95% CI); peak extra
  memory of one step in a fresh process each. Targets: time <= 0.7x, memory lower.

transformers is optional: without it the case prints that it is skipped.
"""

import torch

from .bench_models import LLAMA, PAD_ID, SMOKE_LLAMA, build
from .common import fmt_mib, fmt_ms, paired_ratio, progress, table, target, time_interleaved
from .memory import peak_extra_bytes_many

DEVICES = ("cpu",)
TITLE = "transformers continuous batching and packed training: attnx vs sdpa"
FACTORY = "benchmarks.bench_batching:training_case"
# Imported once by benchmarks.memory before it forks a process per job (seconds each, otherwise).
MEMORY_PRELOAD = ("transformers.modeling_utils", "attnx.integrations.transformers")

# Prompt lengths of the 16 requests (mixed, as a serving queue holds them).
PROMPTS = (16, 400, 37, 128, 250, 64, 300, 24, 180, 90, 350, 48, 210, 140, 72, 320)
NEW_TOKENS = 32
# Sequence lengths of the packed training batch: padded to 512, 40% of the padded tokens are padding.
TRAIN_LENGTHS = (512, 480, 400, 320, 256, 200, 160, 130)
SMOKE_PROMPTS, SMOKE_NEW_TOKENS, SMOKE_TRAIN_LENGTHS = (5, 17, 9), 4, (12, 7, 3)


def _prompts(lengths, vocab):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def generate_fns(model, prompts, new_tokens):
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
        pad_token_id=PAD_ID,
    )

    def call(name):
        def fn():
            model.set_attn_implementation(name)
            with torch.no_grad():
                out = model.generate_batch(prompts, generation_config=config)
            return {request: result.generated_tokens for request, result in out.items()}

        return fn

    return {name: call(name) for name in ("attnx", "sdpa")}


def training_fns(model, lengths):
    """One training step per implementation: attnx on the packed batch, sdpa on the padded one."""
    import transformers

    sequences = _prompts(lengths, model.config.vocab_size)
    packed = transformers.DataCollatorWithFlattening()([{"input_ids": s} for s in sequences])
    L = max(lengths)
    ids = torch.full((len(lengths), L), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    def step(name, inputs):
        def fn():
            model.set_attn_implementation(name)
            model.zero_grad(set_to_none=True)
            loss = model(**inputs, use_cache=False).loss
            loss.backward()
            return loss.detach()

        return fn

    return {"attnx": step("attnx", packed), "sdpa": step("sdpa", padded)}


def training_case(device: str, impl: str, lengths: list, smoke: bool):
    """(fn, warmup) for benchmarks.memory: one training step of ``impl`` (grad=True)."""
    model = build("llama", SMOKE_LLAMA if smoke else LLAMA, device).train()
    return training_fns(model, lengths)[impl], training_fns(model, [4, 3])[impl]


def run(device: str = "cpu", quick: bool = False, smoke: bool = False) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"results": {}, "text": f"{TITLE}: skipped, transformers is not installed"}
    reps = 3 if smoke else 3 if quick else 5
    config = SMOKE_LLAMA if smoke else LLAMA
    prompts_n = SMOKE_PROMPTS if smoke else PROMPTS[:8] if quick else PROMPTS
    new_tokens = SMOKE_NEW_TOKENS if smoke else NEW_TOKENS
    lengths = SMOKE_TRAIN_LENGTHS if smoke else TRAIN_LENGTHS
    model = build("llama", config, device)
    results, rows = {}, []

    progress(f"continuous batching: {len(prompts_n)} requests, {new_tokens} new tokens each")
    fns = generate_fns(model, _prompts(prompts_n, model.config.vocab_size), new_tokens)
    tokens = {name: fn() for name, fn in fns.items()}
    flips = sum(tokens["attnx"][r] != tokens["sdpa"][r] for r in tokens["sdpa"])
    t = time_interleaved(fns, device, reps=reps, min_block_s=0)
    generated = len(prompts_n) * new_tokens
    speedup = paired_ratio(t["sdpa"], t["attnx"])
    results["continuous batching"] = {
        "requests": len(prompts_n), "new_tokens": new_tokens, "attnx": t["attnx"].to_json(),
        "sdpa": t["sdpa"].to_json(), "tokens_per_s": {n: generated / t[n].median for n in t},
        "speedup": speedup.to_json(), "requests_with_other_tokens": flips,
    }
    rate = {name: f"{generated / t[name].median:.0f} tok/s" for name in t}
    rows.append([f"continuous batching, {len(prompts_n)} requests", rate["attnx"], rate["sdpa"],
                 f"{speedup} faster", target(speedup.median >= 1.5), f"{flips} requests differ"])

    progress(f"packed training step: {len(lengths)} sequences, padding {_padding_share(lengths):.0%}")
    model.train()
    fns = training_fns(model, lengths)
    losses = {name: fn() for name, fn in fns.items()}
    torch.testing.assert_close(losses["attnx"], losses["sdpa"], rtol=1e-4, atol=1e-4)
    t = time_interleaved(fns, device, reps=reps, min_block_s=0)
    ratio = paired_ratio(t["attnx"], t["sdpa"])
    memory = [None, None]
    if not quick:
        jobs = [(FACTORY, True, dict(impl=i, lengths=list(lengths), smoke=smoke)) for i in ("attnx", "sdpa")]
        memory = peak_extra_bytes_many(jobs, device, workers=2)
    results["packed training"] = {
        "lengths": list(lengths), "padding_share": _padding_share(lengths), "attnx": t["attnx"].to_json(),
        "sdpa": t["sdpa"].to_json(), "attnx/sdpa": ratio.to_json(), "attnx_peak_extra_bytes": memory[0],
        "sdpa_peak_extra_bytes": memory[1],
    }
    met = ratio.median <= 0.7 and (memory[0] is None or memory[1] is None or memory[0] < memory[1])
    rows.append([f"packed training step, {len(lengths)} sequences", f"{fmt_ms(t['attnx'].median)} ms, "
                 f"{fmt_mib(memory[0])} MiB", f"{fmt_ms(t['sdpa'].median)} ms, {fmt_mib(memory[1])} MiB",
                 f"{ratio} the time", target(met), ""])
    text = (
        f"{TITLE}, {device} fp32 (LLaMA-shaped decoder; median of {reps} interleaved rounds, paired ratio "
        "with 95% CI; peak extra memory of one step in a fresh process)\n"
        + table(["case", "attnx", "sdpa", "attnx vs sdpa", "target", "tokens"], rows)
    )
    return {"results": results, "text": text}


def _padding_share(lengths) -> float:
    return 1 - sum(lengths) / (len(lengths) * max(lengths))
