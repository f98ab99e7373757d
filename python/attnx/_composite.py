"""The composed multi-head attention math, in plain PyTorch, shared by the spec and by attnx.functional.

:func:`attnx.reference.mha` (the spec) and attnx.functional's composite path (dropout as torch applies it,
where the fused op does not) run the same steps around their attention core: the in-projections with the
appended keys (:func:`in_projections`), the scaled, masked scores (:func:`scores`) and the out projection
(:func:`out_projection`). The semantics are documented once, in :func:`attnx.ops.mha`.

``call`` is mha's arguments by name: any object with the attributes of :func:`attnx.ops.mha`'s parameters
(``query``, ``key``, ..., ``batch_first``). ``linear`` computes the projections (``F.linear``'s signature):
:func:`attnx.reference.linear` in the spec, :func:`attnx.linear` to differentiate through attnx's own.
"""

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["as_4d_attn_mask", "as_4d_padding_mask", "bool_to_additive", "in_projections", "out_projection",
           "scores"]

Linear = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def bool_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = masked out) as the float mask that adds the same: 0 and -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def as_4d_attn_mask(mask: Tensor | None, B: int, H: int) -> Tensor | None:
    """attn_mask broadcastable to ``(B, H, L, S)``."""
    if mask is None or mask.dim() != 3:
        return mask  # (L, S) and 4-D masks broadcast as they are
    return mask.view(B, H, *mask.shape[1:])  # nn.MultiheadAttention's (B*H, L, S)


def as_4d_padding_mask(mask: Tensor | None) -> Tensor | None:
    """key_padding_mask ``(B, S)`` as ``(B, 1, 1, S)``."""
    return None if mask is None else mask[:, None, None, :]


def in_projections(call, linear: Linear) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """:func:`attnx.reference.mha` up to the attention core: q ``(B, H, L, D)``, k ``(B, H, S', D)``, v
    ``(B, H, S', D)`` and the masks extended by one unmasked key column per appended key (attn_mask
    ``(L, S')`` or ``(B*H, L, S')``, key_padding_mask ``(B, S')``)."""
    query, key, value = call.query, call.key, call.value
    if call.batch_first:  # the same computation on the sequence-first transposes
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    bias_k, bias_v, static_k, static_v = call.bias_k, call.bias_v, call.static_k, call.static_v
    attn_mask, key_padding_mask = call.attn_mask, call.key_padding_mask
    L, B, E = query.shape
    H = call.num_heads
    D = E // H
    if call.in_proj_weight is not None:
        w_q, w_k, w_v = call.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = call.q_proj_weight, call.k_proj_weight, call.v_proj_weight
    b_q, b_k, b_v = (None, None, None) if call.in_proj_bias is None else call.in_proj_bias.chunk(3)
    if (bias_k is not None or bias_v is not None) and (static_k is not None or static_v is not None):
        raise ValueError("attnx: bias_k/bias_v cannot be combined with static_k/static_v")

    def heads(x: Tensor) -> Tensor:  # (S, B, E) -> (B, H, S, D); head h of batch b is row b*H + h, as torch's
        return x.reshape(x.shape[0], B, H, D).permute(1, 2, 0, 3)

    def keys(x: Tensor, w: Tensor, b: Tensor | None, bias: Tensor | None, static: Tensor | None) -> Tensor:
        """Keys (values) ``(B, H, S, D)``: x projected, with bias appended; or static as it is."""
        if static is not None:
            return static.reshape(B, H, *static.shape[1:])
        x = linear(x, w, b)
        return heads(x if bias is None else torch.cat([x, bias.expand(1, B, E)]))

    q = heads(linear(query, w_q, b_q))
    k = keys(key, w_k, b_k, bias_k, static_k)
    v = keys(value, w_v, b_v, bias_v, static_v)
    if call.add_zero_attn:
        k = torch.cat([k, k.new_zeros(B, H, 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(B, H, 1, v.shape[-1])], dim=2)
    appended = int(bias_k is not None) + int(call.add_zero_attn)
    if appended:
        # False / 0.0: the appended keys are visible to every query that sees any key.
        attn_mask = None if attn_mask is None else torch.nn.functional.pad(attn_mask, (0, appended))
        if key_padding_mask is not None:
            key_padding_mask = torch.nn.functional.pad(key_padding_mask, (0, appended))
    return q, k, v, attn_mask, key_padding_mask


def scores(
    q: Tensor, k: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool
) -> Tensor:
    """The scaled, masked scores ``(B, H, L, S)`` that :func:`attnx.reference.attention` takes the softmax of,
    in its accumulation dtype (float64 for float64 inputs, else float32); masked entries are ``-inf``."""
    B, H, L, D = q.shape
    S = k.shape[-2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    result = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * D**-0.5
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
        result = result.masked_fill(causal, float("-inf"))
    for mask in (as_4d_attn_mask(attn_mask, B, H), as_4d_padding_mask(key_padding_mask)):
        if mask is not None:
            result = result + (bool_to_additive(mask, acc) if mask.dtype == torch.bool else mask.to(acc))
    return result


def out_projection(out: Tensor, call, linear: Linear) -> Tensor:
    """Heads ``(B, H, L, D)`` -> concatenated ``(L, B, H*D)`` -> out projection ``(L, B, E)`` (``(B, L, E)``
    with batch_first)."""
    B, H, L, D = out.shape
    result = linear(out.permute(2, 0, 1, 3).reshape(L, B, H * D), call.out_proj_weight, call.out_proj_bias)
    return result.transpose(0, 1) if call.batch_first else result
