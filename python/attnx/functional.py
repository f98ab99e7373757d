"""``multi_head_attention_forward`` with torch's signature, validation and results, on attnx's fused op.

The same arguments as ``torch.nn.functional.multi_head_attention_forward`` give the same results, the same
exceptions (types and messages) and the same warnings. What differs is how the work is done: torch
canonicalises both masks to float, merges ``key_padding_mask`` into ``attn_mask`` as a ``(B*H, L, S)`` tensor
and runs a chain of ops; here the masks are only validated and go, as they are (bool stays bool, each in its
own shape), to ONE call of :func:`attnx.ops.mha`, which reads them in place.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from attnx import _composite, _mha_checks, ops
from attnx._schema import MhaArgs

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

    Forward and backward are each one fused op (:func:`attnx.mha`), dropout included: its keep mask comes
    from attnx's counter-based RNG seeded from torch's generator, so ``torch.manual_seed`` reproduces a run,
    and outputs match torch's in distribution, not draw for draw. Dropout with ``need_weights`` (whose
    weights are the dropped probabilities), or on a device without a fused dropout backward (all but the CPU
    for now), runs :mod:`attnx.reference`'s composition projected through :func:`attnx.linear` with torch's
    ``F.dropout``, materialising the ``(B, H, L, S')`` probabilities as torch does, and equals torch's result
    under one seed.

    Shapes are sequence-first; the unbatched forms drop ``B``. Masks, bool or float, as in
    :func:`attnx.attention`.

    Args:
        query: ``(L, B, E)`` or ``(L, E)``.
        key: ``(S, B, kdim)`` or ``(S, kdim)``.
        value: ``(S, B, vdim)`` or ``(S, vdim)``.
        embed_dim_to_check: ``E``, checked against query's.
        num_heads: ``H``; divides ``E``.
        in_proj_weight: ``(3E, E)``, unless use_separate_proj_weight.
        in_proj_bias: ``(3E,)`` or None.
        bias_k: ``(1, 1, E)`` or None, with bias_v: one key/value appended per batch.
        bias_v: ``(1, 1, E)`` or None.
        add_zero_attn: appends a zero key/value.
        dropout_p: dropout on the attention probabilities, when ``training``.
        out_proj_weight: ``(E, E)``.
        out_proj_bias: ``(E,)`` or None.
        training: whether dropout applies.
        key_padding_mask: ``(B, S)`` or ``(S,)``, or None.
        need_weights: whether to return the attention weights.
        attn_mask: ``(L, S)`` or ``(B*H, L, S)`` (``(H, L, S)`` unbatched), or None.
        use_separate_proj_weight: whether q/k/v_proj_weight replace in_proj_weight.
        q_proj_weight: ``(E, E)``.
        k_proj_weight: ``(E, kdim)``.
        v_proj_weight: ``(E, vdim)``.
        static_k: ``(B*H, S, E/H)`` or None, the keys as they are (no projection).
        static_v: ``(B*H, S, E/H)`` or None, the values as they are.
        average_attn_weights: whether the weights are averaged over heads.
        is_causal: torch's hint that attn_mask is causal; like torch it needs attn_mask. Torch applies a
            causal mask instead of attn_mask only when there is no key_padding_mask and
            ``need_weights=False``; otherwise it applies attn_mask. This function applies the same mask in
            each case.

    Returns:
        ``attn_output``: ``(L, B, E)`` (``(L, E)`` unbatched).

        ``attn_weights``: when need_weights, ``(B, L, S')`` averaged over heads or ``(B, H, L, S')`` per
        head (batch dim dropped when unbatched; ``S'`` counts the keys appended by bias_k and
        add_zero_attn), else ``None``.

    Raises:
        AssertionError, RuntimeError, ValueError: torch's, with its messages, for the arguments torch's
            function rejects; it warns as torch's does for masks of mismatched dtypes.
    """
    tens_ops = (
        query, key, value, in_proj_weight, in_proj_bias, bias_k, bias_v, out_proj_weight, out_proj_bias
    )
    if has_torch_function(tens_ops):
        return handle_torch_function(
            multi_head_attention_forward, tens_ops, query, key, value, embed_dim_to_check, num_heads,
            in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight,
            out_proj_bias, training=training, key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, use_separate_proj_weight=use_separate_proj_weight,
            q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight,
            static_k=static_k, static_v=static_v, average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
    # torch's arguments that are attnx.ops.mha's, by name; the others are _forward's.
    call = MhaArgs(
        query=query, key=key, value=value, num_heads=num_heads, in_proj_weight=in_proj_weight,
        in_proj_bias=in_proj_bias, q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight,
        v_proj_weight=v_proj_weight, bias_k=bias_k, bias_v=bias_v, add_zero_attn=add_zero_attn,
        out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias, key_padding_mask=key_padding_mask,
        attn_mask=attn_mask, is_causal=is_causal, static_k=static_k, static_v=static_v,
        need_weights=need_weights, average_attn_weights=average_attn_weights, dropout_p=dropout_p,
    )
    return _forward(call, embed_dim_to_check, training, use_separate_proj_weight, check_mask_dtypes=True)


def _forward(
    call: MhaArgs,
    embed_dim_to_check: int,
    training: bool,
    use_separate_proj_weight: bool,
    check_mask_dtypes: bool,
) -> tuple[Tensor, Tensor | None]:
    """:func:`multi_head_attention_forward` without the ``__torch_function__`` hook, on ``call``: torch's
    arguments that are :func:`attnx.ops.mha`'s (dropout_p before ``training`` applies; no dropout_seed),
    by name.

    ``check_mask_dtypes=False`` skips the mask dtype checks and the mismatched-mask warning because the caller
    (``attnx.nn.MultiheadAttention``) has done them already, as torch's module does before calling torch's
    function (torch's module converts both masks to float, so its function never warns a second time).

    ``call.batch_first`` (from a batch_first module, batched inputs only) takes query ``(B, L, E)``, key
    ``(B, S, kdim)`` and value ``(B, S, vdim)`` and returns attn_output ``(B, L, E)``: the op reads them as
    they are, so no transposes run before or after it (nor in the backward). Checks and messages are those
    of the sequence-first call torch's module makes on the transposed views.
    """
    query, key_padding_mask, attn_mask = call.query, call.key_padding_mask, call.attn_mask
    need_weights, batch_first = call.need_weights, call.batch_first
    is_batched = _mha_checks.check_ranks(query, call.key, call.value, key_padding_mask, attn_mask,
                                         call.num_heads)
    if batch_first and not is_batched:
        raise ValueError("attnx: batch_first needs batched (3-D) query, key and value")
    # What the op gets other than call's values, applied at once: a _replace of 24 arguments costs ~2 us.
    changes = {}

    # Unbatched input runs as B = 1: size-1 views, no copies; squeezed again at the end.
    if not is_batched:
        query = changes["query"] = query.unsqueeze(1)
        changes.update(key=call.key.unsqueeze(1), value=call.value.unsqueeze(1))
        if key_padding_mask is not None:
            key_padding_mask = changes["key_padding_mask"] = key_padding_mask.unsqueeze(0)

    if check_mask_dtypes:
        _mha_checks.check_mask(key_padding_mask, "key_padding_mask", _mha_checks.none_or_dtype(attn_mask),
                               "attn_mask")

    if call.is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. "
            "You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )

    if call.is_causal and key_padding_mask is None and not need_weights:
        # Torch hands the hint to SDPA as is_causal and drops attn_mask (unchecked): a causal mask it is.
        changes["attn_mask"] = None
    else:
        if check_mask_dtypes:
            _mha_checks.check_mask(attn_mask, "attn_mask", None, "", check_other=False)
        # Torch applies attn_mask here: merged with the padding mask (the hint is dropped), or through the
        # need_weights path, which never reads is_causal.
        if call.is_causal:
            changes["is_causal"] = False
    # The projection weights torch's function does not read stay out of the op's call (it takes one form).
    if use_separate_proj_weight:
        if call.in_proj_weight is not None:
            changes["in_proj_weight"] = None
    elif call.q_proj_weight is not None or call.k_proj_weight is not None or call.v_proj_weight is not None:
        changes.update(q_proj_weight=None, k_proj_weight=None, v_proj_weight=None)
    if not training and call.dropout_p != 0.0:
        changes["dropout_p"] = 0.0
    if changes:
        call = call._replace(**changes)

    # Shapes as torch's module sees them after its batch_first transposes: sequence-first. Read off the sizes
    # (no transposed views: each would be one more dispatch, and one more in the backward).
    shapes = (_seq_first_shape(call.query, batch_first), _seq_first_shape(call.key, batch_first),
              _seq_first_shape(call.value, batch_first))
    _mha_checks.check_args(call, shapes, embed_dim_to_check, use_separate_proj_weight)

    if call.dropout_p > 0.0 and (need_weights or query.device.type not in _FUSED_DROPOUT_DEVICES):
        attn_output, fully_masked, attn_weights = _mha_with_dropout(call)
    else:
        # batch_first (the last argument) by name: a bare bool after 23 positional arguments says nothing
        attn_output, lse, attn_weights = ops.mha(*call[:-1], batch_first=call.batch_first)
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


def _mha_with_dropout(call: MhaArgs) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attnx.reference.mha` of ``call`` with ``F.dropout`` on the attention probabilities, as torch
    applies it.

    Runs where the fused op does not drop: need_weights with dropout (the weights returned are the dropped
    probabilities, which the op never forms) and devices without fused dropout. Like torch, dropout acts
    on the softmax ``(B, H, L, S')`` (one Bernoulli draw per element, in that order, so one seed gives torch's
    mask) and the returned weights are the dropped-out ones. Returns out ``(L, B, E)`` (``(B, L, E)`` with
    ``batch_first``; 0 from a fully masked row, as the fused op), the fully masked rows ``(B, L)`` and the
    weights (or an empty tensor).
    """
    q, k, v, attn_mask, key_padding_mask = _composite.in_projections(call, ops.linear)
    scores = _composite.scores(q, k, attn_mask, key_padding_mask, call.is_causal)  # (B, H, L, S')
    fully_masked = torch.isneginf(scores).all(dim=-1)  # (B, H, L)
    # NaN rows where fully masked
    probs = F.dropout(torch.softmax(scores, dim=-1), p=call.dropout_p, training=True)
    dtype = call.query.dtype
    out = torch.matmul(probs.masked_fill(fully_masked.unsqueeze(-1), 0.0), v.to(probs.dtype)).to(dtype)
    attn_output = _composite.out_projection(out, call, ops.linear)
    if not call.need_weights:
        return attn_output, fully_masked.any(dim=1), call.query.new_empty(0)
    weights = probs.to(dtype)
    return attn_output, fully_masked.any(dim=1), weights.mean(dim=1) if call.average_attn_weights else weights


def _seq_first_shape(x: Tensor, batch_first: bool) -> torch.Size:
    """x's shape, with its first two dims swapped when batch_first: the shape of ``x.transpose(1, 0)``."""
    shape = x.shape
    return torch.Size((shape[1], shape[0], *shape[2:])) if batch_first else shape
