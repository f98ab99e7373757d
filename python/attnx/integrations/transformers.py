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

transformers is optional: this module imports it, attnx does not.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers import masking_utils as _masks

import attnx

__all__ = ["NAME", "MaskArgs", "attention_forward", "attention_mask", "enable", "register"]

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
    **kwargs,
) -> tuple[Tensor, None]:
    """The attention function registered as ``"attnx"`` in ``AttentionInterface``.

    query ``(B, H, L, D)``, key and value ``(B, Hkv, S, D)``, any strides. ``attention_mask`` is what
    :func:`attention_mask` returned, or a 4-D mask the caller built (bool: True = keep; float: added), or
    None: then the layer is causal (``is_causal``, else ``module.is_causal``) when L > 1, top-left aligned,
    exactly as transformers' ``sdpa`` path decides. Returns ``(out (B, L, H, D), None)``: attention weights
    are never computed (as ``sdpa``).
    """
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
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        args["is_causal"] = bool(causal) and query.shape[2] > 1
    if position_bias is not None:
        mask = args.get("attn_mask")
        if mask is None:
            args["attn_mask"] = position_bias
        elif mask.dtype == torch.bool:
            args["attn_mask"] = position_bias.masked_fill(mask, float("-inf"))
        else:
            args["attn_mask"] = position_bias + mask
    out, _ = attnx.attention(
        query, key, value, scale=scaling, dropout_p=dropout, softcap=softcap, sinks=s_aux, **args
    )
    return out.transpose(1, 2), None


def register() -> str:
    """Register attnx in transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` under the name
    ``"attnx"``, which it returns. Idempotent. Afterwards ``attn_implementation="attnx"`` works in
    ``from_pretrained``, ``from_config`` and ``model.set_attn_implementation``."""
    AttentionInterface.register(NAME, attention_forward)
    _masks.AttentionMaskInterface.register(NAME, attention_mask)
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
