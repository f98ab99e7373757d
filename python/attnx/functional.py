"""``multi_head_attention_forward`` with torch's signature, validation and results, on attnx's fused op.

The same arguments as ``torch.nn.functional.multi_head_attention_forward`` give the same results, the same
exceptions (types and messages) and the same warnings. What differs is how the work is done: torch
canonicalises both masks to float, merges ``key_padding_mask`` into ``attn_mask`` as a ``(B*H, L, S)`` tensor
and runs a chain of ops; here the masks are only validated and go, as they are (bool stays bool, each in its
own shape), to ONE call of :func:`attnx.ops.mha`, which reads them in place.
"""

import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from attnx import _composite, ops

__all__ = ["multi_head_attention_forward"]


def multi_head_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    r"""Drop-in for torch's ``F.multi_head_attention_forward``; returns ``(attn_output, attn_weights)``.

    Shapes (sequence-first; the unbatched forms drop ``B``):
      query ``(L, B, E)`` or ``(L, E)``; key ``(S, B, kdim)`` or ``(S, kdim)``; value ``(S, B, vdim)`` or
      ``(S, vdim)``; key_padding_mask ``(B, S)`` or ``(S,)``; attn_mask ``(L, S)`` or ``(B*H, L, S)``
      (``(H, L, S)`` unbatched); static_k, static_v ``(B*H, S, E/H)``.
      in_proj_weight ``(3E, E)``, or with ``use_separate_proj_weight`` q/k/v_proj_weight ``(E, E)``,
      ``(E, kdim)``, ``(E, vdim)``; in_proj_bias ``(3E,)``; bias_k, bias_v ``(1, 1, E)``; out_proj ``(E, E)``.
    Masks: bool ``True`` = masked out, float = added to the scores.

    Returns attn_output ``(L, B, E)`` (``(L, E)`` unbatched) and, when ``need_weights``, the attention
    weights ``(B, L, S')`` averaged over heads or ``(B, H, L, S')`` per head (batch dim dropped when
    unbatched; ``S'`` counts the keys appended by bias_k and add_zero_attn), else ``None``.

    ``is_causal`` is torch's hint that attn_mask is causal, and like torch it needs attn_mask. Torch applies
    a causal mask instead of attn_mask only when there is no key_padding_mask and ``need_weights=False``;
    otherwise it applies attn_mask. This function applies the same mask in each case.

    Forward and backward are each one fused op (:func:`attnx.ops.mha`, differentiable in every tensor
    argument but the masks), dropout included: its keep mask comes from attnx's counter-based RNG seeded from
    torch's generator, so ``torch.manual_seed`` reproduces a run, and outputs match torch's in distribution,
    not draw for draw. Dropout with ``need_weights`` (whose weights are the dropped probabilities), or on a
    device without a fused dropout backward (all but the CPU for now), runs
    :mod:`attnx.reference` projected through :func:`attnx.linear` with torch's ``F.dropout``, materialising
    the ``(B, H, L, S')`` probabilities as torch does, and equals torch's result under one seed.
    """
    tens_ops = (
        query,
        key,
        value,
        in_proj_weight,
        in_proj_bias,
        bias_k,
        bias_v,
        out_proj_weight,
        out_proj_bias,
    )
    if has_torch_function(tens_ops):
        return handle_torch_function(
            multi_head_attention_forward,
            tens_ops,
            query,
            key,
            value,
            embed_dim_to_check,
            num_heads,
            in_proj_weight,
            in_proj_bias,
            bias_k,
            bias_v,
            add_zero_attn,
            dropout_p,
            out_proj_weight,
            out_proj_bias,
            training=training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            use_separate_proj_weight=use_separate_proj_weight,
            q_proj_weight=q_proj_weight,
            k_proj_weight=k_proj_weight,
            v_proj_weight=v_proj_weight,
            static_k=static_k,
            static_v=static_v,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
    return _forward(
        query,
        key,
        value,
        embed_dim_to_check,
        num_heads,
        in_proj_weight,
        in_proj_bias,
        bias_k,
        bias_v,
        add_zero_attn,
        dropout_p,
        out_proj_weight,
        out_proj_bias,
        training,
        key_padding_mask,
        need_weights,
        attn_mask,
        use_separate_proj_weight,
        q_proj_weight,
        k_proj_weight,
        v_proj_weight,
        static_k,
        static_v,
        average_attn_weights,
        is_causal,
        check_mask_dtypes=True,
    )


def _forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    use_separate_proj_weight: bool,
    q_proj_weight: Tensor | None,
    k_proj_weight: Tensor | None,
    v_proj_weight: Tensor | None,
    static_k: Tensor | None,
    static_v: Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
    check_mask_dtypes: bool,
    batch_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`multi_head_attention_forward` without the ``__torch_function__`` hook.

    ``check_mask_dtypes=False`` skips the mask dtype checks and the mismatched-mask warning because the caller
    (``attnx.nn.MultiheadAttention``) has done them already, as torch's module does before calling torch's
    function (torch's module converts both masks to float, so its function never warns a second time).

    ``batch_first=True`` (from a batch_first module, batched inputs only) takes query ``(B, L, E)``, key
    ``(B, S, kdim)`` and value ``(B, S, vdim)`` and returns attn_output ``(B, L, E)``: the op reads them as
    they are, so no transposes run before or after it (nor in the backward). Checks and messages are those
    of the sequence-first call torch's module makes on the transposed views.
    """
    is_batched = _mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if batch_first and not is_batched:
        raise ValueError("attnx: batch_first needs batched (3-D) query, key and value")

    # Unbatched input runs as B = 1: size-1 views, no copies; squeezed again at the end.
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)

    # Shapes as torch's module sees them after its batch_first transposes: sequence-first. Read off the sizes
    # (no transposed views: each would be one more dispatch, and one more in the backward).
    query_shape, key_shape, value_shape = (_seq_first_shape(x, batch_first) for x in (query, key, value))
    tgt_len, bsz, embed_dim = query_shape
    src_len = key_shape[0]

    if check_mask_dtypes:
        _check_mask(key_padding_mask, "key_padding_mask", _none_or_dtype(attn_mask), "attn_mask")

    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. "
            "You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )

    if is_causal and key_padding_mask is None and not need_weights:
        # Torch hands the hint to SDPA as is_causal and drops attn_mask (unchecked): a causal mask it is.
        attn_mask = None
    else:
        if check_mask_dtypes:
            _check_mask(attn_mask, "attn_mask", None, "", check_other=False)
        # Torch applies attn_mask here: merged with the padding mask (the hint is dropped), or through the
        # need_weights path, which never reads is_causal.
        is_causal = False

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
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        q_proj_weight = k_proj_weight = v_proj_weight = None
    else:
        _check_separate_proj(query, key, value, q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias)
        in_proj_weight = None

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

    if bias_k is not None and bias_v is not None:
        if static_k is not None:
            raise AssertionError("bias cannot be added to static key.")
        if static_v is not None:
            raise AssertionError("bias cannot be added to static value.")
    elif bias_k is not None:
        raise AssertionError("bias_k is set but bias_v is None")
    elif bias_v is not None:
        raise AssertionError("bias_v is set but bias_k is None")

    for name, static in (("static_k", static_k), ("static_v", static_v)):
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
        appended = int(bias_k is not None) + int(add_zero_attn)
        keys = (src_len if static_k is None else static_k.size(1)) + appended
        if key_padding_mask.shape[0] != bsz:
            raise AssertionError(
                f"Expected key_padded_mask.shape[0] to be {bsz}, but got {key_padding_mask.shape[0]}"
            )
        if key_padding_mask.shape[1] + appended != keys:
            got = key_padding_mask.shape[1] + appended
            raise AssertionError(f"Expected key_padded_mask.shape[1] to be {keys}, but got {got}")

    args = (
        query,
        key,
        value,
        num_heads,
        in_proj_weight,
        in_proj_bias,
        q_proj_weight,
        k_proj_weight,
        v_proj_weight,
        bias_k,
        bias_v,
        add_zero_attn,
        out_proj_weight,
        out_proj_bias,
        key_padding_mask,
        attn_mask,
        is_causal,
        static_k,
        static_v,
        need_weights,
        average_attn_weights,
    )
    dropout_p = dropout_p if training else 0.0
    if dropout_p > 0.0 and (need_weights or query.device.type not in _FUSED_DROPOUT_DEVICES):
        attn_output, fully_masked, attn_weights = _mha_with_dropout(
            *args, dropout_p=dropout_p, batch_first=batch_first
        )
    else:
        attn_output, lse, attn_weights = ops.mha(*args, dropout_p, batch_first=batch_first)
        fully_masked = torch.isposinf(lse).any(dim=1) if need_weights else None  # (B, L)

    if need_weights:
        # Torch's need_weights path softmaxes an all -inf row to NaN and carries it through the out projection
        # into every feature of that (query, batch) row; the fused op gives 0 there (as torch's SDPA path
        # does), so the NaN is restored here, at O(L*B*E), only where torch produces it.
        rows = fully_masked if batch_first else fully_masked.t()  # attn_output's (B, L) or (L, B)
        attn_output = attn_output.masked_fill(rows.unsqueeze(-1), float("nan"))
        if not is_batched:
            return attn_output.squeeze(1), attn_weights.squeeze(0)
        return attn_output, attn_weights
    return (attn_output if is_batched else attn_output.squeeze(1)), None


# Where attention's dropout has a fused forward and backward (the backward regenerates the mask); elsewhere
# dropout takes the composition.
_FUSED_DROPOUT_DEVICES = ("cpu",)


def _mha_with_dropout(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    q_proj_weight: Tensor | None,
    k_proj_weight: Tensor | None,
    v_proj_weight: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    static_k: Tensor | None,
    static_v: Tensor | None,
    need_weights: bool,
    average_attn_weights: bool,
    dropout_p: float,
    batch_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attnx.reference.mha` with ``F.dropout`` on the attention probabilities, as torch applies it.

    Runs where the fused op does not drop: need_weights with dropout (the weights returned are the dropped
    probabilities, which the op never forms) and devices without fused dropout. Like torch, dropout acts
    on the softmax ``(B, H, L, S')`` (one Bernoulli draw per element, in that order, so one seed gives torch's
    mask) and the returned weights are the dropped-out ones. Returns out ``(L, B, E)`` (``(B, L, E)`` with
    ``batch_first``; 0 from a fully masked row, as the fused op), the fully masked rows ``(B, L)`` and the
    weights (or an empty tensor).
    """
    # mha's arguments by name, for the steps shared with attnx.reference.mha (attnx/_composite.py); the
    # first statement, so that locals() holds exactly the arguments.
    call = SimpleNamespace(**locals())
    q, k, v, attn_mask, key_padding_mask = _composite.in_projections(call, ops.linear)
    scores = _composite.scores(q, k, attn_mask, key_padding_mask, is_causal)  # (B, H, L, S')
    fully_masked = torch.isneginf(scores).all(dim=-1)  # (B, H, L)
    probs = F.dropout(
        torch.softmax(scores, dim=-1), p=dropout_p, training=True
    )  # NaN rows where fully masked
    out = torch.matmul(probs.masked_fill(fully_masked.unsqueeze(-1), 0.0), v.to(probs.dtype)).to(query.dtype)
    attn_output = _composite.out_projection(out, call, ops.linear)
    if not need_weights:
        return attn_output, fully_masked.any(dim=1), query.new_empty(0)
    weights = probs.to(query.dtype)
    return attn_output, fully_masked.any(dim=1), weights.mean(dim=1) if average_attn_weights else weights


def _seq_first_shape(x: Tensor, batch_first: bool) -> torch.Size:
    """x's shape, with its first two dims swapped when batch_first: the shape of ``x.transpose(1, 0)``."""
    return torch.Size((x.shape[1], x.shape[0], *x.shape[2:])) if batch_first else x.shape


def _mha_shape_check(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    num_heads: int,
) -> bool:
    """Torch's rank checks (same AssertionErrors); returns whether the input is batched (3-D query)."""
    if query.dim() == 3:
        if key.dim() != 3 or value.dim() != 3:
            raise AssertionError(
                "For batched (3-D) `query`, expected `key` and `value` to be 3-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != 2:
            raise AssertionError(
                "For batched (3-D) `query`, expected `key_padding_mask` to be `None` or 2-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise AssertionError(
                "For batched (3-D) `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
                f" but found {attn_mask.dim()}-D tensor instead"
            )
        return True
    if query.dim() == 2:
        if key.dim() != 2 or value.dim() != 2:
            raise AssertionError(
                "For unbatched (2-D) `query`, expected `key` and `value` to be 2-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != 1:
            raise AssertionError(
                "For unbatched (2-D) `query`, expected `key_padding_mask` to be `None` or 1-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        if attn_mask is not None:
            if attn_mask.dim() not in (2, 3):
                raise AssertionError(
                    "For unbatched (2-D) `query`, expected `attn_mask` to be `None`, 2-D or 3-D"
                    f" but found {attn_mask.dim()}-D tensor instead"
                )
            if attn_mask.dim() == 3:
                expected_shape = (num_heads, query.shape[0], key.shape[0])
                if attn_mask.shape != expected_shape:
                    raise AssertionError(
                        f"Expected `attn_mask` shape to be {expected_shape} but got {attn_mask.shape}"
                    )
        return False
    raise AssertionError(
        f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor"
    )


def _check_mask(
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


def _none_or_dtype(input: Tensor | None) -> torch.dtype | None:
    if input is None:
        return None
    if isinstance(input, torch.Tensor):
        return input.dtype
    raise RuntimeError("input to _none_or_dtype() must be None or torch.Tensor")


def _check_separate_proj(
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
