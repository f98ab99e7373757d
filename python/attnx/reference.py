"""The reference semantics of every attnx op, in plain PyTorch.

This module is the spec: tests compare the kernels against it (in float64 where precision matters),
benchmarks check outputs against it before timing, and fallbacks call it. Clarity beats speed here.
"""

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
from torch import Tensor

from attnx import _composite
from attnx._composite import as_4d_attn_mask, as_4d_padding_mask, bool_to_additive


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` for input ``(*, K)``, weight ``(N, K)``, bias ``(N,)``; returns
    ``(*, N)``."""
    out = torch.matmul(input, weight.t())
    return out if bias is None else out + bias


def attention(
    # attnx::attention's arguments, in its schema's order, a line per concept of the spec below
    query: Tensor, key: Tensor, value: Tensor,
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0, dropout_seed: Tensor | None = None,
    window_left: int = -1, window_right: int = -1, key_lengths: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    *,
    read_unseen: bool = True,
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention with nn.MultiheadAttention's mask semantics; returns ``(out, lse)``.

    query ``(B, H, L, D)``, key ``(B, Hkv, S, D)``, value ``(B, Hkv, S, Dv)``. ``Hkv`` divides ``H``
    (grouped KV heads; ``Hkv == H`` is plain multi-head attention): query head ``h`` reads kv head
    ``h // (H // Hkv)``.

    The score of query ``l`` and key ``s`` is ``x = scale * q_l . k_s`` (``scale`` defaults to
    ``1 / sqrt(D)``); with ``softcap > 0`` it becomes ``softcap * tanh(x / softcap)``; then the masks are
    added. attn_mask: ``(L, S)``, ``(B*H, L, S)`` (nn.MultiheadAttention's 3-D form) or 4-D broadcastable to
    ``(B, H, L, S)``. key_padding_mask: ``(B, S)``. For both, bool ``True`` means *masked out* (the opposite
    of SDPA's bool mask) and a float mask is added to the scores; the two combine.

    Which keys a row sees at all (:func:`key_range_mask`): ``is_causal`` masks key ``s > l`` (top-left
    aligned, as SDPA). With ``S_b`` valid keys in batch ``b`` (``key_lengths[b]``, an integer ``(B,)``
    tensor, or ``S``), keys ``s >= S_b`` are masked, and query row ``l`` sits at key position
    ``l + S_b - L`` (the last ``L`` positions, FlashAttention's bottom-right alignment): a window
    ``(window_left, window_right)`` keeps key ``s`` iff ``l + S_b - L - window_left <= s <= l + S_b - L +
    window_right``, ``-1`` leaving that side unbounded (``(-1, 0)`` is bottom-right causal attention). Keys
    at or past ``S_b`` are never read: a static KV cache's unfilled slots may hold anything, NaN included.

    sinks: ``(H,)`` logits, one per query head, that join each row's softmax denominator: the probabilities
    are ``exp(score - lse)`` with ``lse = log(exp(sink_h) + sum_s exp(score_s))``, so a sink takes
    probability mass but adds no value.

    ``dropout_p`` in ``[0, 1]``: each probability is kept where :func:`dropout_keep_mask` of ``dropout_seed``
    (an int64 tensor ``(seed, offset)``) says so and scaled by ``1 / (1 - dropout_p)``, dropped (0) elsewhere,
    before it multiplies value; ``dropout_p == 1`` drops everything (out 0), as ``F.dropout``. ``lse`` is that
    of the undropped scores.

    Returns out ``(B, H, L, Dv)`` in query's dtype and the logsumexp ``lse`` ``(B, H, L)`` (sink included) in
    float32 (float64 for float64 inputs). A row that sees no key (every key masked, or S == 0) gives out 0 and
    ``lse = +inf``, sink or not, so that ``exp(score - lse)`` is 0 in a backward. A NaN score gives its row
    NaN out and lse. Differentiable (through autograd) in query, key, value, a float attn_mask and sinks.

    Positions a row does not see: key ``s`` is unseen by row ``l`` when :func:`key_range_mask` excludes it or
    a mask removes it (bool ``True``, float ``-inf``). With finite inputs they contribute exactly nothing. A
    NaN or inf that reaches the row *only* through unseen positions (in that key or value, in the score of
    ``(l, s)``, in a float mask there, or in query row ``l`` for the gradients of those keys) may do either of
    two things, and which one depends on how a backend tiles the work (a tile that a row sees none of is
    skipped, a partly seen one is computed and then masked, and ``0 * NaN`` is NaN): propagate as plain
    arithmetic does (``read_unseen=True``, this function's default: the masks are added to the scores,
    ``-inf + NaN = NaN``, and ``probs @ value`` meets ``0 * NaN``), or not at all, as if those positions had
    never been read (``read_unseen=False``: every product of the scores, of ``probs @ value`` and of their
    gradients is taken only over seen pairs). An output element may be NaN only where one of the two answers
    is; where they differ it is the one or the other. Keys past ``key_lengths`` are never read, in either.
    """
    B, H, L, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = D**-0.5 if D > 0 else 1.0  # D == 0: every score is an empty sum, 0 whatever the scale
    if key_lengths is not None:  # keys past S_b: never read (zeroed here, so that NaN there cannot leak)
        beyond = torch.arange(S).view(S, 1) >= key_lengths.to("cpu", torch.int64).view(B, 1, 1, 1)
        beyond = beyond.to(key.device)  # (B, 1, S, 1)
        key, value = key.masked_fill(beyond, 0), value.masked_fill(beyond, 0)
    if Hkv != H:  # clarity over memory: the kernels index the shared kv head instead
        key, value = key.repeat_interleave(H // Hkv, dim=1), value.repeat_interleave(H // Hkv, dim=1)
    seen = key_range_mask(B, L, S, is_causal, window_left, window_right, key_lengths, query.device)
    bias = torch.zeros(seen.shape, dtype=acc, device=query.device).masked_fill(~seen, float("-inf"))
    for mask in (as_4d_attn_mask(attn_mask, B, H), as_4d_padding_mask(key_padding_mask)):
        if mask is not None:
            bias = bias + (bool_to_additive(mask, acc) if mask.dtype == torch.bool else mask.to(acc))
            seen = seen & (~mask if mask.dtype == torch.bool else mask != float("-inf"))
    if read_unseen:
        scores = torch.matmul(query.to(acc), key.to(acc).transpose(-2, -1)) * scale  # (B, H, L, S)
    else:
        # Products over seen pairs only: (B, H, L, S, D) operands with unseen pairs zeroed before they are
        # multiplied, so that neither the forward nor autograd's backward ever multiplies an unseen value.
        seen = seen.expand(B, H, L, S).unsqueeze(-1)
        pairs_q = query.to(acc).unsqueeze(-2).where(seen, 0.0)
        pairs_k = key.to(acc).unsqueeze(-3).where(seen, 0.0)
        scores = (pairs_q * pairs_k).sum(-1) * scale
        value = value.to(acc).unsqueeze(-3).where(seen, 0.0)  # (B, H, L, S, Dv)
        bias = bias.where(seen.squeeze(-1), float("-inf"))  # a NaN mask value at an unseen position dropped
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + bias
    # A fully masked row (every score -inf, or S == 0) would give lse = -inf and probabilities
    # -inf - -inf = nan. Its scores are replaced by 0 for the logsumexp only: its probabilities are then
    # exp(-inf - finite) = 0, and autograd through this function gives it zero gradients instead of NaN (the
    # spec of the backward). A NaN anywhere else in a row (a NaN input or mask value) propagates to its
    # output.
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    logits = scores.masked_fill(empty, 0.0)
    if sinks is not None:
        logits = torch.cat([logits, sinks.to(acc).view(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if dropout_p > 0:
        if dropout_seed is None:
            raise ValueError("attnx.reference.attention: dropout_p > 0 needs a dropout_seed (seed, offset)")
        keep = dropout_keep_mask(dropout_seed, B, H, L, S, dropout_p).to(query.device)
        probs = probs * keep / (1.0 - dropout_p) if dropout_p < 1 else torch.zeros_like(probs)
    if read_unseen:
        out = torch.matmul(probs, value.to(acc)).to(query.dtype)
    else:
        out = (probs.unsqueeze(-1) * value).sum(-2).to(query.dtype)
    lse = lse.masked_fill(empty.squeeze(-1), float("inf"))
    return out, lse.to(acc)


def key_range_mask(
    B: int,
    L: int,
    S: int,
    is_causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    key_lengths: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The keys each query row may see before the masks are read, as a bool ``(B, 1, L, S)`` tensor (True =
    seen): ``s <= l`` under ``is_causal``; ``s < S_b``; ``l + S_b - L - window_left <= s <= l + S_b - L +
    window_right`` (each bound ignored when -1). See :func:`attention`."""
    lengths = torch.full((B,), S) if key_lengths is None else key_lengths.to("cpu", torch.int64).clamp(0, S)
    lengths = lengths.view(B, 1, 1, 1)
    row = torch.arange(L).view(1, 1, L, 1)
    col = torch.arange(S).view(1, 1, 1, S)
    seen = col < lengths
    diagonal = row + lengths - L  # the key position of query row l
    if window_left >= 0:
        seen = seen & (col >= diagonal - window_left)
    if window_right >= 0:
        seen = seen & (col <= diagonal + window_right)
    if is_causal:
        seen = seen & (col <= row)
    return seen.to(device)


# ------------------------------------------------------------------------------------------------------------
# Dropout: Philox4x32-10 in plain PyTorch, uint32 arithmetic carried in int64 tensors (the spec of
# csrc/include/attnx/philox.h).

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def _mulhilo32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit halves of ``a * b`` for a constant ``a`` and int64 ``b``, both in [0, 2^32).

    The 64-bit product would overflow int64, so b is split into 16-bit halves: every partial product stays
    below 2^48."""
    p_lo = a * (b & 0xFFFF)  # < 2^48
    p_hi = a * (b >> 16)  # < 2^48, weight 2^16
    t = (p_lo & _MASK32) + ((p_hi & 0xFFFF) << 16)  # < 2^33
    return (p_lo >> 32) + (p_hi >> 16) + (t >> 32), t & _MASK32


def philox4x32_10(counter: Sequence[Tensor], key: Sequence[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 (Salmon et al., SC 2011; Random123) of the counters ``(x, y, z, w)`` (int64 tensors of
    values in [0, 2^32), broadcastable) under the key ``(k0, k1)``; returns the four output words likewise."""
    x, y, z, w = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = key
    for round_ in range(10):
        if round_ > 0:
            k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(_PHILOX_M0, x)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, z)
        x, y, z, w = hi1 ^ y ^ k0, lo1, hi0 ^ w ^ k1, lo0
    return x, y, z, w


def dropout_keep_mask(dropout_seed: Tensor, B: int, H: int, L: int, S: int, p: float) -> Tensor:
    """The keep mask ``(B, H, L, S)`` (bool, on the CPU) of attention dropout with probability ``p``.

    ``dropout_seed`` is an int64 tensor ``(seed, offset)``. Element ``(b, h, l, s)`` has the row-major index
    ``e = ((b * H + h) * L + l) * S + s``; its draw is word ``e % 4`` of Philox4x32-10 at counter
    ``(e // 4 mod 2^32, e // 4 >> 32, offset mod 2^32, offset >> 32)`` under key
    ``(seed mod 2^32, seed >> 32)`` (both taken as uint64), and it is kept when the draw is below
    ``floor((1 - p) * 2^32)`` (capped at 2^32 - 1), a keep rate of ``1 - p`` to within 2^-32."""
    seed, offset = (int(v) & 0xFFFFFFFFFFFFFFFF for v in dropout_seed.tolist())
    n = B * H * L * S
    g = torch.arange((n + 3) // 4, dtype=torch.int64)
    words = philox4x32_10(
        (g & _MASK32, g >> 32, torch.tensor(offset & _MASK32), torch.tensor(offset >> 32)),
        (seed & _MASK32, seed >> 32),
    )
    draws = torch.stack(words, dim=-1).flatten()[:n]
    threshold = min(int((1.0 - p) * 4294967296.0), _MASK32)
    return (draws < threshold).view(B, H, L, S)


def mha(
    # attnx::mha's arguments, in its schema's order, grouped as the paragraphs below take them
    query: Tensor, key: Tensor, value: Tensor, num_heads: int,
    in_proj_weight: Tensor | None, in_proj_bias: Tensor | None,
    q_proj_weight: Tensor | None, k_proj_weight: Tensor | None, v_proj_weight: Tensor | None,
    bias_k: Tensor | None, bias_v: Tensor | None, add_zero_attn: bool,
    out_proj_weight: Tensor, out_proj_bias: Tensor | None,
    key_padding_mask: Tensor | None, attn_mask: Tensor | None, is_causal: bool,
    static_k: Tensor | None, static_v: Tensor | None,
    need_weights: bool, average_attn_weights: bool,
    dropout_p: float = 0.0, dropout_seed: Tensor | None = None,
    batch_first: bool = False,
    *,
    project: Callable[[Tensor, Tensor, Tensor | None], Tensor] = linear,
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole ``nn.MultiheadAttention`` forward; returns ``(out, lse, weights)``.

    Batched, sequence-first: query ``(L, B, E)``, key ``(S, B, kdim)``, value ``(S, B, vdim)``, or with
    ``batch_first`` ``(B, L, E)``, ``(B, S, kdim)``, ``(B, S, vdim)`` (the same computation on their
    transposes); any strides. Projections: either in_proj_weight ``(3E, E)`` (q, k, v rows in that order)
    or q_proj_weight ``(E, E)``, k_proj_weight ``(E, kdim)``, v_proj_weight ``(E, vdim)``; in_proj_bias
    ``(3E,)`` applies in both cases.
    bias_k, bias_v ``(1, 1, E)`` append one projected key/value per batch; static_k, static_v
    ``(B*H, S, E/H)`` replace the projected keys/values (and cannot be combined with bias_k/bias_v);
    add_zero_attn appends one zero key/value per head after both. Each appended key extends the masks by one
    column that masks nothing.

    key_padding_mask ``(B, S)`` and attn_mask ``(L, S)`` or ``(B*H, L, S)``: bool ``True`` = masked out, float
    = added to the scores; the two combine. ``is_causal`` applies a causal mask on top (key ``s > l`` masked,
    top-left aligned over all ``S'`` keys, appended ones included, as SDPA). Scores are scaled by
    ``1 / sqrt(E/H)``.

    Returns out ``(L, B, E)`` (``(B, L, E)`` with ``batch_first``) in query's dtype; ``lse`` ``(B, H, L)``
    as :func:`attention` gives it (a fully masked row has ``lse = +inf`` and contributes 0 to out); and when
    ``need_weights`` the attention probabilities ``exp(score - lse)`` in query's dtype, ``(B, L, S')``
    averaged over heads if ``average_attn_weights`` else ``(B, H, L, S')`` (``S'`` counts the appended keys;
    a fully masked row's weights are NaN, as torch's softmax gives), else an empty ``(0,)`` tensor.

    ``dropout_p`` / ``dropout_seed`` drop attention probabilities as :func:`attention` does (the same keep
    mask, :func:`dropout_keep_mask` over the ``S'`` keys); the weights returned are the dropped ones, as
    torch's.

    ``project`` computes the in- and out-projections (``linear``'s signature); attnx.functional passes
    :func:`attnx.linear` to differentiate through attnx's own projections.
    """
    # mha's arguments by name, for the steps it shares with attnx.functional (attnx/_composite.py); the first
    # statement, so that locals() holds exactly the arguments.
    call = SimpleNamespace(**locals())
    q, k, v, attn_mask, key_padding_mask = _composite.in_projections(call, project)
    out, lse = attention(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p=dropout_p,
                         dropout_seed=dropout_seed)
    if need_weights:
        scores = _composite.scores(q, k, attn_mask, key_padding_mask, is_causal)
        # Normalised by each row's maximum and sum, as torch's softmax: exp(score - lse) with a rounded lse
        # would be off by lse's rounding error, visible where scores are large. A fully masked row's scores
        # are replaced by 0 first, so that autograd through the softmax stays finite (its weights are NaN
        # below, whatever the softmax gives, and get no gradient).
        empty = torch.isposinf(lse).unsqueeze(-1)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
        if dropout_p > 0:
            keep = dropout_keep_mask(dropout_seed, *weights.shape, dropout_p).to(weights.device)
            weights = weights * keep / (1.0 - dropout_p) if dropout_p < 1 else torch.zeros_like(weights)
        # lse = +inf marks a fully masked row; torch's softmax gives NaN there, and so do we.
        weights = weights.masked_fill(torch.isposinf(lse).unsqueeze(-1), float("nan")).to(query.dtype)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        weights = query.new_empty(0)
    return _composite.out_projection(out, call, project), lse, weights
