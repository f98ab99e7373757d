"""attnx as the attention of Hugging Face transformers models: ``attn_implementation="attnx"``.

::

    import attnx.integrations.transformers as attnx_hf

    attnx_hf.register()                                  # once, before building models
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnx")
    model = attnx_hf.enable(existing_model)              # or switch a built model, checking that it took

transformers (5.x) calls attention through a registry (``AttentionInterface``) and builds each forward's mask
through a second one (``AttentionMaskInterface``). :func:`register` adds ``"attnx"`` to both:

- :func:`attention_mask` (the mask function) runs once per forward. For the masks that are a key padding
  mask plus a range of keys per row, which is every plain causal, bidirectional and sliding-window mask with
  a KV cache of any kind, it hands the layers a :class:`MaskArgs`: the ``(B, S)`` padding mask (nothing when
  no key is padded), the number of filled keys when a static cache is not full, and the window. Nothing of
  size ``(B, 1, L, S)`` is built, where transformers' ``sdpa`` path builds one whenever a key is padded. Any
  other mask (or-/and-combined masks, packed sequences, block masks) is transformers' own ``sdpa_mask``,
  materialised once per forward and handed over in attnx's convention.
- :func:`attention_forward` (the attention function) runs once per layer and maps the call onto
  :func:`attnx.attention`: grouped KV heads as they are (no ``repeat_kv``), causal attention with a cache
  bottom-right aligned, ``softcap`` (Gemma 2), ``s_aux`` sinks (gpt-oss), T5's ``position_bias`` as a float
  bias (with its gradient), ``scaling`` and dropout. It returns ``(B, L, H, D)`` without a copy. Rows that see
  no key (left padding) give zeros, not NaN.
- Variable-length batches run on :func:`attnx.varlen_attention`, whose tiles never cross a sequence, with no
  mask at all. Packed sequences (``DataCollatorWithFlattening``): the varlen keyword arguments
  (``cu_seq_lens_q``, ...) when the collator gives them, else position ids that restart; found whether or not
  the model holds a cache object, as transformers' flash path does. Continuous batching (``generate_batch``,
  ``ContinuousBatchingManager``): the paged cache's ``update`` is called, then one varlen call covers every
  request of the batch, each seeing only its own keys. transformers (5.23) lets only ``"paged|eager"``,
  ``"sdpa"`` and names containing "flash" into continuous batching; :func:`register` lets ``"attnx"`` in too,
  as it is (see :func:`allow_continuous_batching`).

transformers is optional: this module imports it, attnx does not.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers import masking_utils as _masks

import attnx

__all__ = [
    "NAME", "MaskArgs", "allow_continuous_batching", "attention_forward", "attention_mask", "enable",
    "register",
]

NAME = "attnx"


@dataclasses.dataclass(frozen=True)
class MaskArgs:
    """What :func:`attention_mask` hands every layer instead of a 4-D mask: :func:`attnx.attention`'s masking
    arguments, in attnx's conventions (bool ``True`` = masked out; the window and key lengths as
    :func:`attnx.reference.key_range_mask` defines them)."""

    key_padding_mask: Tensor | None = None  # (B, S) bool
    attn_mask: Tensor | None = None  # (B, 1, L, S) bool: transformers' own mask, for any other pattern
    key_lengths: Tensor | None = None  # (B,): filled keys of a static cache; None: all S
    window_left: int = -1
    window_right: int = -1
    # Packed sequences: the (B * L) rows cut into sequences at cu_seqlens (int32, (N + 1,)), the longest
    # max_seqlen; each attends to its own keys only (queries and keys are the same positions: L == S).
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0

    # generate() prepares the masks of a static cache itself, calls .contiguous() on them and passes them to
    # the model, whose mask functions must then hand them on unchanged: what a prepared 4-D mask gets.
    ndim = 4

    def contiguous(self) -> MaskArgs:
        return self


def _closure(fn) -> dict:
    cells = fn.__closure__ or ()
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in cells), strict=True))


# The code objects of transformers' mask factories: a sliding window is recognised by its structure, never by
# evaluating it (which would cost the (L, S) grid this module avoids).
_AND_CODE = _masks.and_masks(_masks.causal_mask_function).__code__
_SLIDING_CODE = _masks.sliding_window_overlay(1).__code__
_BIDIRECTIONAL_SLIDING_CODE = _masks.sliding_window_bidirectional_overlay(1).__code__


def _window(mask_function) -> tuple[int, int, bool] | None:
    """``(window_left, window_right, causal)`` when ``mask_function`` is one of transformers' plain patterns
    in positions (causal, bidirectional, or either with a sliding window), else None."""
    if mask_function is _masks.causal_mask_function:
        return -1, 0, True
    if mask_function is _masks.bidirectional_mask_function:
        return -1, -1, False
    if getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    overlays = (_SLIDING_CODE, _BIDIRECTIONAL_SLIDING_CODE)
    if len(parts) != 2 or getattr(parts[0], "__code__", None) not in overlays:
        return None
    width = _closure(parts[0]).get("sliding_window")
    if not isinstance(width, int) or width < 1:
        return None
    if parts[0].__code__ is _SLIDING_CODE and parts[1] is _masks.causal_mask_function:
        return width - 1, 0, True  # kv_idx > q_idx - width
    if parts[0].__code__ is _BIDIRECTIONAL_SLIDING_CODE and parts[1] is _masks.bidirectional_mask_function:
        return width, width, False  # |q_idx - kv_idx| <= width
    return None


_PACKED_CODE = _masks.packed_sequence_mask_function(torch.zeros(1, 1)).__code__
_REMAP_CODE = _masks.remap_positions_for_packed_sequence(
    _masks.causal_mask_function, torch.zeros(1, 1)
).__code__


def _packed(mask_function) -> tuple[Tensor, Callable] | None:
    """``(sequence ids (B, L), the mask function within a sequence)`` when ``mask_function`` is transformers'
    packed-sequence pattern (``packed_sequence_compatibility_function``), else None."""
    if getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    if len(parts) != 2 or getattr(parts[0], "__code__", None) is not _PACKED_CODE:
        return None
    if getattr(parts[1], "__code__", None) is not _REMAP_CODE:
        return None
    return _closure(parts[0])["packed_sequence_mask"], _closure(parts[1])["mask_function"]


def _runs(ids: Tensor) -> tuple[Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the runs of equal consecutive values along each row of ``ids`` (B, L),
    rows one after another: the sequences of a packed batch. (One host sync, for the longest run.)"""
    flat = ids.reshape(-1)
    starts = torch.ones(flat.shape[0], dtype=torch.bool, device=ids.device)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: ids.shape[1]] = True  # every row starts a sequence
    bounds = torch.cat([starts.nonzero().flatten(), flat.new_tensor([flat.shape[0]], dtype=torch.long)])
    cu_seqlens = bounds.to(torch.int32)
    return cu_seqlens, int((bounds[1:] - bounds[:-1]).max()) if bounds.shape[0] > 1 else 0


# position_ids -> (cu_seqlens, max_seqlen): a forward's layers all pass the same position ids, so the host
# sync that reading them costs is paid once per forward. One entry: (weak reference, version, result).
_positions_memo: list = [None, -1, None]


def _packed_from_positions(position_ids: Tensor) -> tuple[Tensor, int] | None:
    """The sequences of a packed batch given by its position ids ``(1, L)``, each sequence's positions going
    up by one from where it starts (transformers' ``find_packed_sequence_indices``); None when they form one
    sequence."""
    ref, version, result = _positions_memo
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return result
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    ids = torch.cat([position_ids.new_zeros(position_ids.shape[0], 1), (steps != 1).cumsum(-1)], dim=-1)
    result = _runs(ids) if bool(ids[:, -1].any()) else None
    _positions_memo[:] = [weakref.ref(position_ids), position_ids._version, result]
    return result


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function=_masks.causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> MaskArgs | None:
    """The mask function registered as ``"attnx"`` in ``AttentionMaskInterface`` (the signature of
    ``transformers.masking_utils.sdpa_mask``).

    The queries are positions ``q_offset + l``, ``l < q_length``; the keys positions ``kv_offset + s``,
    ``s < kv_length``; ``attention_mask`` is the ``(B, positions)`` padding mask (True = keep), shorter than
    the keys with a static cache that is not full. Returns None (nothing to mask: the layer's own
    ``is_causal``, as for ``sdpa``) for bidirectional attention without padding, else a :class:`MaskArgs`.
    """
    if isinstance(attention_mask, MaskArgs):  # prepared by generate() (see MaskArgs.ndim)
        return attention_mask
    packed = _packed(mask_function)
    if packed is not None and attention_mask is None and q_length == kv_length:
        ids, within = packed
        window = _window(within)
        if window is not None:  # a plain pattern within each sequence: varlen attention, no mask built
            window_left, window_right, causal = window
            cu_seqlens, max_seqlen = _runs(ids.expand(batch_size, -1).to(device))
            return MaskArgs(window_left=window_left, window_right=window_right, cu_seqlens=cu_seqlens,
                            max_seqlen=max_seqlen)
    window = _window(mask_function)
    if window is not None:
        window_left, window_right, causal = window
        if causal or window_left >= 0:
            # Rows sit at key index l + S_b - L (bottom-right): S_b = the keys up to the last query's place.
            filled = q_offset + q_length - kv_offset
            if not causal and not (isinstance(filled, int) and filled == kv_length):
                window = None  # a windowed bidirectional mask over a cache: not a plain key range
    if window is None:
        mask = _masks.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, device=device,
            **kwargs,
        )
        return None if mask is None else MaskArgs(attn_mask=mask.logical_not())

    key_padding_mask = None
    if attention_mask is not None:
        padding = _masks.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if not bool(padding.all()):
            key_padding_mask = padding.logical_not()
    if not causal and window_left < 0:
        if key_padding_mask is None:
            return None
        return MaskArgs(key_padding_mask=key_padding_mask)
    key_lengths = None
    if isinstance(filled, Tensor):  # a static cache's length lives in a tensor (no host sync to read it)
        key_lengths = filled.to(device=device, dtype=torch.int64).reshape(1).expand(batch_size)
    elif filled != kv_length:
        key_lengths = torch.full((batch_size,), filled, dtype=torch.int64, device=device)
    return MaskArgs(key_padding_mask, None, key_lengths, window_left, window_right)


def _varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, *, window_left=-1, window_right=-1,
            is_causal=False, **kwargs) -> Tensor:
    """attnx.varlen_attention on ``(B, H, L, D)`` query and ``(B, Hkv, S, D)`` key and value whose ``B * L``
    (``B * S``) rows hold the packed sequences; returns ``(B, L, H, D)``. The rows are flattened as views when
    the layout allows (the projections' ``(B, L, H, D)`` layout does), else copied."""
    B, H, L, D = query.shape
    q = query.transpose(1, 2).reshape(B * L, H, D)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
    out, _ = attnx.varlen_attention(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_q), int(max_k),
        is_causal=is_causal, window_left=window_left, window_right=window_right, **kwargs,
    )
    return out.view(B, L, H, out.shape[-1])


def _block_diagonal(cu_seqlens: Tensor, batch: int, length: int, window: dict) -> MaskArgs:
    """The ``(B, 1, L, L)`` bool mask (True = masked out) of packed sequences, for what varlen attention does
    not take (dropout, a position bias): each row sees its own sequence's keys within ``window``."""
    rows = torch.arange(batch * length, device=cu_seqlens.device)
    ids = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    pos = (rows - cu_seqlens.long()[ids]).view(batch, length)
    ids = ids.view(batch, length)
    i, j = pos[:, :, None], pos[:, None, :]
    masked = ids[:, :, None] != ids[:, None, :]
    left, right = window["window_left"], window["window_right"]
    if left >= 0:
        masked |= j < i - left
    if right >= 0:
        masked |= j > i + right
    return MaskArgs(attn_mask=masked[:, None])


def _packed_call(query, key, attention_mask, module, causal, kwargs) -> tuple | None:
    """``(cu_seqlens_q, cu_seqlens_k, max_q, max_k, key range)`` when this call holds packed sequences (see
    :func:`attention_forward`), else None. ``max_q``/``max_k`` are None where the caller did not give them."""
    if isinstance(attention_mask, MaskArgs) and attention_mask.cu_seqlens is not None:
        cu, longest = attention_mask.cu_seqlens, attention_mask.max_seqlen
        key_range = {"window_left": attention_mask.window_left, "window_right": attention_mask.window_right}
        return cu, cu, longest, longest, key_range
    if isinstance(attention_mask, MaskArgs):
        if any(x is not None for x in (attention_mask.key_padding_mask, attention_mask.attn_mask,
                                       attention_mask.key_lengths)):
            return None  # padding or another pattern: not a packed batch
        key_range = {"window_left": attention_mask.window_left, "window_right": attention_mask.window_right}
    elif attention_mask is None:
        key_range = {"window_left": _sliding_window(module, kwargs) if causal else -1,
                     "window_right": 0 if causal else -1}
    else:
        return None
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        return (kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs.get("max_length_q"),
                kwargs.get("max_length_k"), key_range)
    positions = kwargs.get("position_ids")
    if isinstance(positions, Tensor) and query.shape[0] == 1 and query.shape[2] == key.shape[2] > 1:
        found = _packed_from_positions(positions)
        if found is not None:
            return found[0], found[0], found[1], found[1], key_range
    return None


def _sliding_window(module, kwargs) -> int:
    """The layer's sliding window (keys within ``w - 1`` positions before the query), or -1."""
    width = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return width - 1 if isinstance(width, int) and width > 0 else -1


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: MaskArgs | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    cache=None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The attention function registered as ``"attnx"`` in ``AttentionInterface``.

    query ``(B, H, L, D)``, key and value ``(B, Hkv, S, D)``, any strides. ``attention_mask`` is what
    :func:`attention_mask` returned, or a 4-D mask the caller built (bool: True = keep; float: added), or
    None: then the layer is causal (``is_causal``, else ``module.is_causal``) when L > 1, top-left aligned,
    exactly as transformers' ``sdpa`` path decides. Returns ``(out (B, L, H, D), None)``: attention weights
    are never computed (as ``sdpa``).

    Variable-length batches go to :func:`attnx.varlen_attention`: with ``cache``, continuous batching's
    ``PagedAttentionCache`` (its requests packed along L, described by ``cu_seq_lens_q``/``cu_seq_lens_k``);
    packed sequences, described by the varlen keyword arguments (``cu_seq_lens_q``, ``cu_seq_lens_k``,
    ``max_length_q``, ``max_length_k``), by :func:`attention_mask` or by ``position_ids`` that restart
    (batch 1, no past keys). Causal layers see their own sequence's keys up to their position (bottom-right
    aligned, as transformers' flash path), windowed by the layer's ``sliding_window``.
    """
    features = {"scale": scaling, "softcap": softcap, "sinks": s_aux}
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if cache is not None and hasattr(cache, "update"):  # continuous batching: a PagedAttentionCache
        key, value = cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs
        )
        out = _varlen(
            query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"],
            kwargs["max_length_k"], window_left=_sliding_window(module, kwargs), window_right=0, **features,
        )
        return out, None
    packed = _packed_call(query, key, attention_mask, module, causal, kwargs)
    if packed is not None:
        cu_q, cu_k, max_q, max_k, key_range = packed
        if position_bias is None and dropout == 0.0:
            if max_q is None or max_k is None:  # the collator gave the lengths without their maxima
                max_q = int((cu_q[1:] - cu_q[:-1]).max())
                max_k = int((cu_k[1:] - cu_k[:-1]).max())
            return _varlen(query, key, value, cu_q, cu_k, max_q, max_k, **key_range, **features), None
        # Dropout or a position bias: attnx.attention, with the packed sequences as a block-diagonal mask.
        attention_mask = _block_diagonal(cu_q, query.shape[0], query.shape[2], key_range)

    args = {}
    if isinstance(attention_mask, MaskArgs):
        args = {
            "key_padding_mask": attention_mask.key_padding_mask, "attn_mask": attention_mask.attn_mask,
            "key_lengths": attention_mask.key_lengths, "window_left": attention_mask.window_left,
            "window_right": attention_mask.window_right,
        }
    elif attention_mask is not None:  # a user's 4-D mask: transformers' conventions
        is_bool = attention_mask.dtype == torch.bool
        args["attn_mask"] = attention_mask.logical_not() if is_bool else attention_mask
    else:
        args["is_causal"] = causal and query.shape[2] > 1
    if position_bias is not None:
        mask = args.get("attn_mask")
        if mask is None:
            args["attn_mask"] = position_bias
        elif mask.dtype == torch.bool:
            args["attn_mask"] = position_bias.masked_fill(mask, float("-inf"))
        else:
            args["attn_mask"] = position_bias + mask
    out, _ = attnx.attention(query, key, value, dropout_p=dropout, **features, **args)
    return out.transpose(1, 2), None


def allow_continuous_batching() -> None:
    """Let ``"attnx"`` into transformers' continuous batching as it is. Idempotent; :func:`register` calls it.

    transformers (5.23) admits only ``"paged|eager"``, ``"sdpa"`` and names containing "flash"
    (``ContinuousBatchingManager.switch_to_cb_friendly_attn`` raises "Implementation attnx is not supported
    for continuous batching" otherwise). A name containing "flash" would also switch on flash-only code paths
    that load flash-attention packages. So this wraps that one method: a model whose implementation is
    ``"attnx"`` keeps it (no dense masks are built for it: transformers builds them only for ``"sdpa"`` and
    ``"paged|eager"``), any other goes through transformers' own method. :func:`attention_forward` serves the
    paged cache."""
    from transformers.generation.continuous_batching import continuous_api

    manager = continuous_api.ContinuousBatchingManager
    switch = manager.switch_to_cb_friendly_attn
    if getattr(switch, "attnx_wrapped", None) is not None:
        return

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if model.config._attn_implementation == NAME:
            return None
        return switch(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn.attnx_wrapped = switch
    switch_to_cb_friendly_attn.__doc__ = switch.__doc__
    manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


def register() -> str:
    """Register attnx in transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` under the name
    ``"attnx"``, which it returns, and let it into continuous batching (:func:`allow_continuous_batching`).
    Idempotent. Afterwards ``attn_implementation="attnx"`` works in ``from_pretrained``, ``from_config`` and
    ``model.set_attn_implementation``, and ``generate_batch`` keeps it."""
    AttentionInterface.register(NAME, attention_forward)
    _masks.AttentionMaskInterface.register(NAME, attention_mask)
    allow_continuous_batching()
    return NAME


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Register attnx, switch ``model`` (and every sub-model) to it in place, and check that it took: a
    sub-model whose attention does not go through transformers' registry keeps its own attention and is named
    in a warning. Returns ``model``."""
    register()
    model.set_attn_implementation(NAME)
    missed = sorted({
        type(module).__name__ for module in model.modules()
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation != NAME
    })
    if missed:
        warnings.warn(
            f"attnx: {', '.join(missed)} kept their own attention: their attention modules do not call "
            "transformers' AttentionInterface", stacklevel=2,
        )
    return model
