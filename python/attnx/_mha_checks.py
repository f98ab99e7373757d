"""Torch's argument checks of ``F.multi_head_attention_forward`` and ``nn.MultiheadAttention.forward``.

attnx.functional and attnx.nn run them so that a bad call raises what torch raises (same types, same
messages, same warnings) before attnx's op runs; the op then checks its own arguments (csrc/common/mha.cpp)
for callers that come to it directly. Unlike torch's, these checks never convert a mask (bool stays bool).
"""

import warnings

import torch
from torch import Tensor

__all__ = ["check_args", "check_mask", "check_ranks", "check_separate_proj", "none_or_dtype"]


def check_ranks(
    query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None,
    num_heads: int,
) -> bool:
    """Torch's rank checks (``_mha_shape_check``, same AssertionErrors); returns whether the input is batched
    (3-D query)."""
    if query.dim() not in (2, 3):
        raise AssertionError(
            f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor"
        )
    batched = query.dim() == 3
    form, rank = ("batched (3-D)", 3) if batched else ("unbatched (2-D)", 2)
    if key.dim() != rank or value.dim() != rank:
        raise AssertionError(
            f"For {form} `query`, expected `key` and `value` to be {rank}-D"
            f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != rank - 1:
        raise AssertionError(
            f"For {form} `query`, expected `key_padding_mask` to be `None` or {rank - 1}-D"
            f" but found {key_padding_mask.dim()}-D tensor instead"
        )
    if attn_mask is not None:
        if attn_mask.dim() not in (2, 3):
            raise AssertionError(
                f"For {form} `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
                f" but found {attn_mask.dim()}-D tensor instead"
            )
        if not batched and attn_mask.dim() == 3:
            expected_shape = (num_heads, query.shape[0], key.shape[0])
            if attn_mask.shape != expected_shape:
                raise AssertionError(
                    f"Expected `attn_mask` shape to be {expected_shape} but got {attn_mask.shape}"
                )
    return batched


def check_mask(
    mask: Tensor | None,
    mask_name: str,
    other_type: torch.dtype | None,
    other_name: str,
    check_other: bool = True,
    stacklevel: int = 3,
) -> None:
    """The checks of torch's ``_canonical_mask``, without its conversion of bool masks to float.

    Raises torch's AssertionError for a mask that is neither bool nor floating (uint8, int64, ...) and gives
    torch's UserWarning when the two masks' dtypes differ. ``stacklevel`` points the warning at the caller.
    """
    if mask is None:
        return
    if mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {mask_name} are supported")
    if check_other and other_type is not None and mask.dtype != other_type:
        warnings.warn(
            f"Support for mismatched {mask_name} and {other_name} is deprecated. "
            "Use same type for both instead.",
            stacklevel=stacklevel,
        )


def none_or_dtype(input: Tensor | None) -> torch.dtype | None:
    """Torch's ``F._none_or_dtype``: the mask's dtype, or None."""
    if input is None:
        return None
    if isinstance(input, torch.Tensor):
        return input.dtype
    raise RuntimeError("input to _none_or_dtype() must be None or torch.Tensor")


def check_separate_proj(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    q_proj_weight: Tensor | None,
    k_proj_weight: Tensor | None,
    v_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
) -> None:
    """Torch's checks of separate projection weights (``_in_projection``), same AssertionErrors."""
    for name, w in (("q", q_proj_weight), ("k", k_proj_weight), ("v", v_proj_weight)):
        if w is None:
            raise AssertionError(f"use_separate_proj_weight is True but {name}_proj_weight is None")
    # Torch unpacks the bias the same way, before the shape checks (a ValueError if it has < 3 chunks).
    biases = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
    b_q, b_k, b_v = biases
    Eq, Ek, Ev = query.size(-1), key.size(-1), value.size(-1)
    for name, w, shape in (
        ("query", q_proj_weight, (Eq, Eq)),
        ("key", k_proj_weight, (Eq, Ek)),
        ("value", v_proj_weight, (Eq, Ev)),
    ):
        if w.shape != shape:
            raise AssertionError(f"expecting {name} weights shape of {shape}, but got {w.shape}")
    for name, b in (("query", b_q), ("key", b_k), ("value", b_v)):
        if b is not None and b.shape != (Eq,):
            raise AssertionError(f"expecting {name} bias shape of {(Eq,)}, but got {b.shape}")


def check_args(
    call,
    shapes: tuple[torch.Size, torch.Size, torch.Size],
    embed_dim_to_check: int,
    use_separate_proj_weight: bool,
) -> None:
    """The rest of ``F.multi_head_attention_forward``'s checks, in its order, with its AssertionErrors and
    RuntimeErrors: embed_dim and heads, key and value shapes, projection weights, attn_mask's shape,
    bias_k/bias_v, static_k/static_v, key_padding_mask's shape.

    ``call``: attnx.ops.mha's arguments by name (batched: unbatched inputs already unsqueezed to B = 1),
    attn_mask as torch applies it (None where its causal hint replaces it); ``shapes``: query's, key's and
    value's, sequence-first (as torch's function sees them).
    """
    query_shape, key_shape, value_shape = shapes
    tgt_len, bsz, embed_dim = query_shape
    src_len = key_shape[0]
    num_heads, attn_mask, key_padding_mask = call.num_heads, call.attn_mask, call.key_padding_mask
    if embed_dim != embed_dim_to_check:
        raise AssertionError(
            f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}"
        )
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    if use_separate_proj_weight:
        if key_shape[:2] != value_shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key_shape[:2]} do not match value's {value_shape[:2]}"
            )
    elif key_shape != value_shape:
        raise AssertionError(f"key shape {key_shape} does not match value shape {value_shape}")

    if not use_separate_proj_weight:
        if call.in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
    else:
        check_separate_proj(call.query, call.key, call.value, call.q_proj_weight, call.k_proj_weight,
                            call.v_proj_weight, call.in_proj_bias)

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, "
                    f"but should be {(bsz * num_heads, tgt_len, src_len)}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

    bias_k, bias_v, static_k = call.bias_k, call.bias_v, call.static_k
    if bias_k is not None and bias_v is not None:
        if static_k is not None:
            raise AssertionError("bias cannot be added to static key.")
        if call.static_v is not None:
            raise AssertionError("bias cannot be added to static value.")
    elif bias_k is not None:
        raise AssertionError("bias_k is set but bias_v is None")
    elif bias_v is not None:
        raise AssertionError("bias_v is set but bias_k is None")

    for name, static in (("static_k", static_k), ("static_v", call.static_v)):
        if static is not None:
            if static.size(0) != bsz * num_heads:
                raise AssertionError(
                    f"expecting {name}.size(0) of {bsz * num_heads}, but got {static.size(0)}"
                )
            if static.size(2) != head_dim:
                raise AssertionError(f"expecting {name}.size(2) of {head_dim}, but got {static.size(2)}")

    if key_padding_mask is not None:
        # Torch checks the padding mask after appending the bias_k / zero-attention columns to it, against the
        # key count S' after static_k, bias_k and add_zero_attn; the numbers in its message are those.
        appended = int(bias_k is not None) + int(call.add_zero_attn)
        keys = (src_len if static_k is None else static_k.size(1)) + appended
        if key_padding_mask.shape[0] != bsz:
            raise AssertionError(
                f"Expected key_padded_mask.shape[0] to be {bsz}, but got {key_padding_mask.shape[0]}"
            )
        if key_padding_mask.shape[1] + appended != keys:
            got = key_padding_mask.shape[1] + appended
            raise AssertionError(f"Expected key_padded_mask.shape[1] to be {keys}, but got {got}")
