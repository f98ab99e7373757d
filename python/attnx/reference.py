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
    """The spec of :func:`attnx.linear`: ``input @ weight.T + bias``.

    Args:
        input: ``(*, K)``.
        weight: ``(N, K)``.
        bias: ``(N,)``, or None.

    Returns:
        ``(*, N)``.
    """
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
    block_map: Tensor | None = None, block_bits: Tensor | None = None, block_q: int = 128, block_k: int = 128,
    *,
    read_unseen: bool = True,
) -> tuple[Tensor, Tensor]:
    """The spec of :func:`attnx.attention`, in plain PyTorch; returns ``(out, lse)``.

    Computes the semantics that :func:`attnx.attention`'s docstring states, step by step: the scores
    ``(B, H, L, S)`` in float64 for float64 inputs (float32 otherwise), the kv heads repeated, every mask
    added, the softmax and dropout applied, autograd for the gradients.

    Positions a row does not see: key ``s`` is unseen by row ``l`` when :func:`key_range_mask` or
    :func:`block_mask_seen` excludes it or a mask removes it (bool ``True``, float ``-inf``). With finite
    inputs they contribute exactly nothing. A
    NaN or inf that reaches the row *only* through unseen positions (in that key or value, in the score of
    ``(l, s)``, in a float mask there, or in query row ``l`` for the gradients of those keys) may do either of
    two things, and which one depends on how a backend tiles the work (a tile that a row sees none of is
    skipped, a partly seen one is computed and then masked, and ``0 * NaN`` is NaN): propagate as plain
    arithmetic does (``read_unseen=True``, this function's default: the masks are added to the scores,
    ``-inf + NaN = NaN``, and ``probs @ value`` meets ``0 * NaN``), or not at all, as if those positions had
    never been read (``read_unseen=False``: every product of the scores, of ``probs @ value`` and of their
    gradients is taken only over seen pairs). An output element may be NaN only where one of the two answers
    is; where they differ it is the one or the other. Keys past ``key_lengths`` are never read, in either.

    Precision: this function rounds once, ``out`` to the inputs' dtype; a kernel is held to it within the
    bound of tests/attention_helpers.py (a multiple of this function's own error in the inputs' dtype, plus
    a small absolute term per dtype). A kernel for 16-bit inputs may round the probabilities, and in the
    backward dS, to the inputs' dtype before the products they enter, as PyTorch's kernels and
    FlashAttention do (attnx's CPU kernels on AVX512-BF16 or AMX-BF16 do for bfloat16, and flush float32
    denormals in those products to zero); the scores, the softmax's sums, ``lse`` and the accumulators stay
    float32.

    Args:
        query: as in :func:`attnx.attention`.
        key: as in :func:`attnx.attention`.
        value: as in :func:`attnx.attention`.
        attn_mask: as in :func:`attnx.attention`.
        key_padding_mask: as in :func:`attnx.attention`.
        is_causal: as in :func:`attnx.attention`.
        scale: as in :func:`attnx.attention`.
        dropout_p: as in :func:`attnx.attention`.
        dropout_seed: as in :func:`attnx.attention`, on any device; required when ``dropout_p > 0``.
        window_left: as in :func:`attnx.attention`.
        window_right: as in :func:`attnx.attention`.
        key_lengths: as in :func:`attnx.attention`.
        softcap: as in :func:`attnx.attention`.
        sinks: as in :func:`attnx.attention`.
        block_map: as in :func:`attnx.attention`.
        block_bits: as in :func:`attnx.attention`.
        block_q: as in :func:`attnx.attention`.
        block_k: as in :func:`attnx.attention`.
        read_unseen: which of the two answers above to give for non-finite values at unseen positions:
            True, propagate them; False, never read them.

    Returns:
        ``out`` and ``lse`` as :func:`attnx.attention` defines them, a row that sees no key included (out 0,
        ``lse = +inf``). Differentiable (through autograd) in query, key, value, a float attn_mask and sinks.

    Raises:
        ValueError: for ``dropout_p > 0`` without a dropout_seed.
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
    if block_map is not None:
        seen = seen & block_mask_seen(block_map, block_bits, block_q, block_k, L, S).to(query.device)
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



def varlen_attention(
    # attnx::varlen_attention's arguments, in its schema's order
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False, scale: float | None = None,
    window_left: int = -1, window_right: int = -1, seqused_k: Tensor | None = None,
    block_table: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The spec of :func:`attnx.varlen_attention`, sequence by sequence; returns ``(out, lse)``.

    Runs :func:`attention` on each sequence in turn.

    Sequence ``b`` is a ``(1, H, Lq, D)`` problem of its own: its keys are gathered (through block_table for
    a paged cache) and cut to ``seqused_k[b]``, and bottom-right causal is :func:`attention`'s window with
    its right side at 0. Rows outside every sequence get out 0 and ``lse = +inf``.

    Args:
        query: as in :func:`attnx.varlen_attention`.
        key: as in :func:`attnx.varlen_attention`.
        value: as in :func:`attnx.varlen_attention`.
        cu_seqlens_q: as in :func:`attnx.varlen_attention`.
        cu_seqlens_k: as in :func:`attnx.varlen_attention`.
        max_seqlen_q: unused (the lengths come from the offsets).
        max_seqlen_k: unused.
        is_causal: as in :func:`attnx.varlen_attention`.
        scale: as in :func:`attnx.varlen_attention`.
        window_left: as in :func:`attnx.varlen_attention`.
        window_right: as in :func:`attnx.varlen_attention`.
        seqused_k: as in :func:`attnx.varlen_attention`.
        block_table: as in :func:`attnx.varlen_attention`.
        softcap: as in :func:`attnx.varlen_attention`.
        sinks: as in :func:`attnx.varlen_attention`.

    Returns:
        ``out`` ``(total_q, H, Dv)`` and ``lse`` ``(H, total_q)``, as :func:`attnx.varlen_attention` defines
        them. Differentiable (through autograd) in query, key, value and sinks.
    """
    total_q, H, D = query.shape
    Dv = value.shape[-1]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    if scale is None:
        scale = D**-0.5 if D > 0 else 1.0
    outs, lses, rows = [], [], []
    for b in range(len(cq) - 1):
        q = query[cq[b]:cq[b + 1]]
        n_k = ck[b + 1] - ck[b] if used is None else min(used[b], ck[b + 1] - ck[b])
        if block_table is None:
            k, v = key[ck[b]:ck[b] + n_k], value[ck[b]:ck[b] + n_k]
        else:
            page_size = key.shape[1]
            j = torch.arange(n_k)
            pages = block_table[b].to("cpu", torch.int64)[j // page_size]
            k, v = key[pages, j % page_size], value[pages, j % page_size]
        o, lse = attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            scale=scale, window_left=window_left, window_right=0 if is_causal else window_right,
            softcap=softcap, sinks=sinks,
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
        rows.append(torch.arange(cq[b], cq[b + 1]))
    out = query.new_zeros((total_q, H, Dv))
    lse = torch.full((H, total_q), float("inf"), dtype=acc, device=query.device)
    if outs:
        index = torch.cat(rows).to(query.device)
        out = out.index_put((index,), torch.cat(outs))
        lse = lse.index_copy(1, index, torch.cat(lses, dim=1))
    return out, lse


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
    """The keys each query row may see before the masks are read: :func:`attnx.attention`'s key range.

    Row ``l`` sees key ``s`` iff ``s < S_b``, ``l + S_b - L - window_left <= s <= l + S_b - L +
    window_right`` (each window bound ignored when -1) and, under ``is_causal``, ``s <= l``; ``S_b`` is
    ``key_lengths[b]`` clamped to ``[0, S]``, or ``S``.

    Args:
        B: the batch size.
        L: the query length.
        S: the key length.
        is_causal: as in :func:`attnx.attention`.
        window_left: as in :func:`attnx.attention`.
        window_right: as in :func:`attnx.attention`.
        key_lengths: as in :func:`attnx.attention`, on any device.
        device: where the mask is returned (None: the CPU).

    Returns:
        A bool ``(B, 1, L, S)`` tensor, True where the key is seen.
    """
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


def block_mask_seen(block_map: Tensor, block_bits: Tensor | None, block_q: int, block_k: int, L: int,
                    S: int) -> Tensor:
    """The pairs a block-sparse mask lets rows see: :func:`attnx.attention`'s ``block_map``, expanded.

    Row ``l`` and key ``s`` fall in block ``(l // block_q, s // block_k)``; its entry ``e`` of ``block_map``
    is ``-1`` (no pair of the block is seen), ``-2`` (every pair is) or an index into ``block_bits``: the pair
    is seen iff bit ``(s % block_k) % 32`` of word ``block_bits[e, l % block_q, (s % block_k) // 32]`` is
    clear.

    Args:
        block_map: as in :func:`attnx.attention`, on any device.
        block_bits: as in :func:`attnx.attention`, on any device, or None (no entry of block_map is >= 0).
        block_q: as in :func:`attnx.attention`.
        block_k: as in :func:`attnx.attention`.
        L: the query length.
        S: the key length.

    Returns:
        A bool ``(Bm, Hm, L, S)`` tensor on the CPU, block_map's first two dims, True where the pair is seen.
    """
    entry = block_map.to("cpu", torch.int64)
    entry = entry[:, :, torch.arange(L) // block_q][:, :, :, torch.arange(S) // block_k]  # (Bm, Hm, L, S)
    seen = entry == -2
    if block_bits is not None and block_bits.shape[0] > 0:
        row = (torch.arange(L) % block_q).view(L, 1)
        col = (torch.arange(S) % block_k).view(1, S)
        words = block_bits.to("cpu", torch.int64)[entry.clamp(min=0), row, col // 32]  # (Bm, Hm, L, S)
        seen = seen | ((entry >= 0) & ((words >> (col % 32)) & 1 == 0))
    return seen


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
    """Philox4x32-10 (Salmon et al., SC 2011; Random123): the counter-based generator of attention dropout.

    Args:
        counter: the counters ``(x, y, z, w)``, int64 tensors (or ints) of values in ``[0, 2^32)``,
            broadcastable.
        key: the key ``(k0, k1)``, ints in ``[0, 2^32)``.

    Returns:
        The four output words, int64 tensors of values in ``[0, 2^32)`` of the counters' broadcast shape.
    """
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
    """The keep mask of attention dropout with probability ``p``: which probabilities dropout keeps.

    Element ``(b, h, l, s)`` has the row-major index
    ``e = ((b * H + h) * L + l) * S + s``; its draw is word ``e % 4`` of Philox4x32-10 at counter
    ``(e // 4 mod 2^32, e // 4 >> 32, offset mod 2^32, offset >> 32)`` under key
    ``(seed mod 2^32, seed >> 32)`` (both taken as uint64), and it is kept when the draw is below
    ``floor((1 - p) * 2^32)`` (capped at 2^32 - 1), a keep rate of ``1 - p`` to within 2^-32.

    Args:
        dropout_seed: an int64 tensor ``(seed, offset)``.
        B: the batch size.
        H: the number of (query) heads.
        L: the query length.
        S: the key length.
        p: the dropout probability, in ``[0, 1]``.

    Returns:
        A bool ``(B, H, L, S)`` tensor on the CPU, True where the element is kept.
    """
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
    """The spec of :func:`attnx.mha`, in plain PyTorch; returns ``(out, lse, weights)``.

    Computes the semantics that :func:`attnx.mha`'s docstring states, step by step: the projections, the
    appended keys, :func:`attention` per head, the out projection. Unlike the op, it takes need_weights with
    ``dropout_p > 0``: the weights it returns are then the dropped ones, as torch's.

    Args:
        query: as in :func:`attnx.mha`.
        key: as in :func:`attnx.mha`.
        value: as in :func:`attnx.mha`.
        num_heads: as in :func:`attnx.mha`.
        in_proj_weight: as in :func:`attnx.mha`.
        in_proj_bias: as in :func:`attnx.mha`.
        q_proj_weight: as in :func:`attnx.mha`.
        k_proj_weight: as in :func:`attnx.mha`.
        v_proj_weight: as in :func:`attnx.mha`.
        bias_k: as in :func:`attnx.mha`.
        bias_v: as in :func:`attnx.mha`.
        add_zero_attn: as in :func:`attnx.mha`.
        out_proj_weight: as in :func:`attnx.mha`.
        out_proj_bias: as in :func:`attnx.mha`.
        key_padding_mask: as in :func:`attnx.mha`.
        attn_mask: as in :func:`attnx.mha`.
        is_causal: as in :func:`attnx.mha`.
        static_k: as in :func:`attnx.mha`.
        static_v: as in :func:`attnx.mha`.
        need_weights: as in :func:`attnx.mha`.
        average_attn_weights: as in :func:`attnx.mha`.
        dropout_p: as in :func:`attnx.mha`, need_weights or not.
        dropout_seed: as in :func:`attnx.mha`; required when ``dropout_p > 0``.
        batch_first: as in :func:`attnx.mha`.
        project: computes the in- and out-projections (``linear``'s signature); attnx.functional passes
            :func:`attnx.linear` to differentiate through attnx's own projections.

    Returns:
        ``out``, ``lse`` and ``weights`` as :func:`attnx.mha` defines them.

    Raises:
        ValueError: for bias_k/bias_v with static_k/static_v, and for ``dropout_p > 0`` without a
            dropout_seed.
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
