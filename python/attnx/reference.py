"""The reference semantics of every attnx op, in plain PyTorch.

This module is the spec: tests compare the kernels against it (in float64 where precision matters),
benchmarks check outputs against it before timing, and fallbacks call it. Clarity beats speed here.
"""

from typing import Optional

import torch
from torch import Tensor


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``input @ weight.T + bias`` for input ``(*, K)``, weight ``(N, K)``, bias ``(N,)``; returns ``(*, N)``."""
    out = torch.matmul(input, weight.t())
    return out if bias is None else out + bias


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention with nn.MultiheadAttention's mask semantics; returns ``(out, lse)``.

    query ``(B, H, L, D)``, key ``(B, H, S, D)``, value ``(B, H, S, Dv)``.
    attn_mask: ``(L, S)``, ``(B*H, L, S)`` (nn.MultiheadAttention's 3-D form) or 4-D broadcastable to
    ``(B, H, L, S)``. key_padding_mask: ``(B, S)``. For both, bool ``True`` means *masked out* (the opposite
    of SDPA's bool mask) and a float mask is added to the scores; the two combine. ``is_causal`` masks key
    ``s > l`` (top-left aligned, as SDPA). ``scale`` defaults to ``1 / sqrt(D)``.

    Returns out ``(B, H, L, Dv)`` in query's dtype and the logsumexp of the scaled, masked scores, ``lse``
    ``(B, H, L)``, in float32 (float64 for float64 inputs). A row whose keys are all masked (or S == 0) gives
    out 0 and ``lse = +inf``, so that ``exp(score - lse)`` is 0 in a backward. A NaN score gives its row NaN
    out and lse.
    """
    B, H, L, D = query.shape
    S = key.shape[-2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = D**-0.5 if D > 0 else 1.0  # D == 0: every score is an empty sum, 0 whatever the scale
    scores = torch.matmul(query.to(acc), key.to(acc).transpose(-2, -1)) * scale  # (B, H, L, S)
    bias = torch.zeros(L, S, dtype=acc, device=query.device)
    if is_causal:
        bias = bias.masked_fill(torch.ones(L, S, dtype=torch.bool, device=query.device).triu(1), float("-inf"))
    for mask in (_as_4d_attn_mask(attn_mask, B, H), _as_4d_padding_mask(key_padding_mask)):
        if mask is not None:
            bias = bias + (_bool_to_additive(mask, acc) if mask.dtype == torch.bool else mask.to(acc))
    scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a fully masked row
    # Fully masked rows would give -inf - -inf = nan: zero exactly those. A NaN anywhere else in a row (a NaN
    # input or mask value) propagates to its output.
    probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)
    out = torch.matmul(probs, value.to(acc)).to(query.dtype)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse.to(acc)


def _bool_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _as_4d_attn_mask(mask: Optional[Tensor], B: int, H: int) -> Optional[Tensor]:
    if mask is None or mask.dim() != 3:
        return mask  # (L, S) and 4-D masks broadcast as they are
    return mask.view(B, H, *mask.shape[1:])  # nn.MultiheadAttention's (B*H, L, S)


def _as_4d_padding_mask(mask: Optional[Tensor]) -> Optional[Tensor]:
    return None if mask is None else mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
