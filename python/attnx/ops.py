"""Typed wrappers of the ops under ``torch.ops.attnx``: the Python API of attnx's kernels.

Each wrapper documents its op: arguments, results and semantics. :func:`attention`'s docstring states the
rules that every op shares (masks, key ranges, soft-capping, sinks, dropout, grouped kv heads, rows that see
no key) and the others refer to it. :mod:`attnx.reference` computes the same semantics in plain PyTorch: the
executable spec that the tests hold the kernels to. The rest of the op layer lives in private modules, which
importing this one loads: ``_fake`` (fake kernels for torch.compile and export, and the Python mirrors of the
C++ checks they need), ``_autograd`` (the ``autograd.Function`` registered as each differentiable op's
Autograd kernel), ``_schema`` (the ops' argument tables, read from their schemas) and ``_compat`` (torch <
2.13 support). Only these modules touch ``torch.ops.attnx``.

A wrapper calls the kernel op directly when the call records no backward (no grad mode, or no argument that
requires grad), else the op's Function around it: the decision the public op's router
(csrc/common/routes.cpp) takes, one dispatch earlier. ``torch.ops.attnx.*`` give the same results.
"""

import torch
from torch import Tensor

from attnx import _fake  # noqa: F401  (registers the fake kernels)
from attnx._autograd import (
    _AttentionFunction,
    _LinearFunction,
    _MhaFunction,
    _VarlenAttentionFunction,
    records_backward,
)
from attnx._schema import check_signature

__all__ = [
    "attention", "attention_backward", "draw_dropout_seed", "linear", "mha", "varlen_attention",
    "varlen_attention_backward",
]

# Looked up once: the wrappers are called per layer and step, and cost little more than the ops.
_linear_kernel = torch.ops.attnx._linear.default
_attention_kernel = torch.ops.attnx._attention.default
_attention_backward = torch.ops.attnx.attention_backward.default
_mha_forward_op, _mha_kernel = torch.ops.attnx.mha_forward.default, torch.ops.attnx._mha.default
_varlen_kernel = torch.ops.attnx._varlen_attention.default
_varlen_backward = torch.ops.attnx.varlen_attention_backward.default


def kernel_for(query: Tensor, key: Tensor, value: Tensor, backward: bool = False, **options) -> str | None:
    """The kernel :func:`attention` (``backward``: its backward) runs for these arguments, as the backend
    names it (``torch.ops.attnx._attention_kernel``), or None where the backend refuses the call."""
    try:
        return torch.ops.attnx._attention_kernel(query, key, value, backward=backward, **options)
    except RuntimeError:
        return None


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` that takes every input layout without a detour.

    Leading dims that form one dense block of rows, in any memory order (a B=1 transpose, ``(L, B, E)``
    views of batch-first data, slices with a storage offset, size-1 dims with any stride), run as one GEMM
    without a copy. Rows repeated by stride-0 dims are computed once. Any other layout is copied exactly
    once. Semantics: :func:`attnx.reference.linear`.

    Args:
        input: ``(*, K)``, any strides.
        weight: ``(N, K)``, of input's dtype.
        bias: ``(N,)`` (or ``(1,)``, broadcast), or None.

    Returns:
        ``(*, N)``, equal to ``F.linear(input, weight, bias)``, in the memory order of input's leading dims
        (contiguous whenever input's rows are in logical order). Differentiable in input, weight and bias.

    Raises:
        RuntimeError: for arguments ``F.linear`` rejects, with its message (``mat1 and mat2 shapes cannot be
            multiplied ...``), or ``attnx::linear: expected ...`` where attnx is stricter (a 2-D weight).
    """
    if records_backward(input, weight, bias):
        return _LinearFunction.apply(_linear_kernel, None, input, weight, bias)
    return _linear_kernel(input, weight, bias)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    key_lengths: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    block_map: Tensor | None = None,
    block_bits: Tensor | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[Tensor, Tensor]:
    """Fused scaled dot-product attention with ``nn.MultiheadAttention``'s masks; returns ``(out, lse)``.

    Each query row ``l`` attends to the keys it sees: its scores ``scale * q_l . k_s``, soft-capped when
    softcap is given, plus the masks, go through a softmax (with the row's sink, if any) that weighs the
    values. Every tensor is read in place through its strides, never copied: masks
    are never merged into a ``(B, H, L, S)`` tensor (broadcast dims cost nothing), kv heads are indexed, not
    repeated, and key tiles outside a row's key range are skipped, so a window's cost grows with the window,
    not with S. :func:`attnx.reference.attention` computes the same in plain PyTorch.

    Masks: attn_mask and key_padding_mask combine. For both, a bool ``True`` means *masked out* (the opposite
    of SDPA's bool mask, the same as ``nn.MultiheadAttention``'s) and a float mask, of any float dtype, is
    added to the scores.

    Key range: which keys a row sees at all, before the masks are read (the exact bounds:
    :func:`attnx.reference.key_range_mask`). With ``S_b`` valid keys in batch ``b`` (``key_lengths[b]``, or
    ``S``), keys ``s >= S_b`` are masked and never read: a static KV cache's unfilled slots may hold
    anything, NaN included. Query row ``l`` sits at key position ``l + S_b - L`` (the last ``L`` positions,
    FlashAttention's bottom-right alignment), and the window ``(window_left, window_right)`` keeps the keys
    from ``window_left`` before that position to ``window_right`` after it, ``-1`` leaving a side unbounded:
    ``(-1, 0)`` is bottom-right causal attention (a KV-cache step or a chunked prefill), ``(w - 1, 0)`` a
    sliding window of ``w`` keys.

    Block-sparse mask: ``block_map`` cuts the ``(L, S)`` plane into blocks of ``block_q`` queries by
    ``block_k`` keys (the last ones cut at L and S) and says, per ``(b, h)`` (or broadcast) and block, whether
    the block's rows see none of its keys (``-1``: the block is never read or computed, so the cost follows
    the blocks visited), all of them (``-2``: no mask is read), or those whose bit is clear in one of
    ``block_bits``' bit rows (an index ``p >= 0``). It combines with every other mask and the key range (the
    exact rule: :func:`attnx.reference.block_mask_seen`). FlexAttention's ``BlockMask`` converts to it
    (:func:`attnx.flex.block_sparse`). The CPU kernels take it, forward and backward, blocks of any size;
    CUDA's tensor-core kernels take blocks of whole tiles (``block_q`` a multiple of 16, ``block_k`` of 64),
    the backward where the fused tensor-core backward is on (``ATTNX_CUDA_FUSED_BACKWARD=1``, float16 and
    bfloat16); other kernels refuse it with a clear error.

    A row that sees no key (every key masked, or ``S == 0``) gives out 0 and ``lse = +inf``, sink or not, so
    that ``exp(score - lse)`` is 0 in a backward. A NaN score gives its row NaN out and lse. What a NaN or inf
    does where a row reaches it only through keys it does not see: :func:`attnx.reference.attention`.

    Args:
        query: ``(B, H, L, D)``, float32, float64, bfloat16 or float16, any strides.
        key: ``(B, Hkv, S, D)``, of query's dtype; ``Hkv`` divides ``H`` (grouped KV heads, GQA; ``Hkv == 1``
            is MQA, ``Hkv == H`` plain multi-head attention): query head ``h`` reads kv head
            ``h // (H // Hkv)``.
        value: ``(B, Hkv, S, Dv)``, of query's dtype.
        attn_mask: ``(L, S)``, ``(B*H, L, S)`` (nn.MultiheadAttention's 3-D form) or 4-D broadcastable to
            ``(B, H, L, S)``; bool or float (see Masks above), or None.
        key_padding_mask: ``(B, S)``, bool or float (see Masks above), or None.
        is_causal: masks key ``s > l``: top-left aligned, as SDPA's, unlike the window.
        scale: the scores' scale; None: ``1/sqrt(D)``.
        dropout_p: in ``[0, 1]``, dropout on the attention probabilities, fused: each probability is kept
            where :func:`attnx.reference.dropout_keep_mask` of dropout_seed says so and scaled by
            ``1 / (1 - dropout_p)``, dropped (0) elsewhere, before it multiplies value; ``1`` drops everything
            (out 0), as ``F.dropout``. The caller applies it only in training (pass ``0.0`` in eval, as to
            ``F.scaled_dot_product_attention``).
        dropout_seed: an int64 CPU tensor ``(seed, offset)``; the keep mask is a pure function of it and of
            each element's ``(b, h, l, s)``, identical on every backend, never stored (the backward
            regenerates it). None: drawn by :func:`draw_dropout_seed` when ``dropout_p > 0``, so
            ``torch.manual_seed`` makes runs reproducible.
        window_left: how many keys before its key position a row sees (see Key range above); ``-1``:
            unbounded.
        window_right: how many keys after its key position a row sees; ``-1``: unbounded.
        key_lengths: an int32/int64 ``(B,)`` tensor on query's device, the valid keys per batch (e.g. a
            static KV cache's filled length), or None (``S``); keys past it are never read. On the CPU values
            outside ``[0, S]`` raise; on a GPU, where reading them would cost a device sync, they are clamped.
        softcap: > 0 or None: scores become ``softcap * tanh(score / softcap)`` before the masks are added
            (Gemma 2).
        sinks: ``(H,)`` or None: one logit per query head that joins every row's softmax denominator and adds
            no value (gpt-oss): the probabilities are ``exp(score - lse)`` with
            ``lse = log(exp(sink_h) + sum_s exp(score_s))``, so a sink takes probability mass.
        block_map: an int32 ``(B or 1, H or 1, ceil(L / block_q), ceil(S / block_k))`` tensor on query's
            device (see Block-sparse mask above), or None. Every entry must be ``-1``, ``-2`` or an index
            into block_bits: on the CPU a bad one raises; on a GPU, where reading them would cost a device
            sync, the device asserts (asynchronously, from this wrapper) and the kernels read a bad entry as
            ``-1``, never out of bounds.
        block_bits: an int32 ``(P, block_q, ceil(block_k / 32))`` tensor on query's device: ``P`` blocks' bit
            rows, bit ``j`` of word ``w`` of row ``r`` for key ``32 w + j`` of the block (set: masked out, as
            a bool mask's True), or None when no entry of block_map is an index.
        block_q: queries per block of block_map (FlexAttention's default 128).
        block_k: keys per block of block_map.

    Returns:
        ``out``: ``(B, H, L, Dv)`` in query's dtype, laid out in memory as ``(B, L, H, Dv)`` so that
        ``out.transpose(1, 2).reshape(B, L, H * Dv)`` is a view; 0 for a row that sees no key.

        ``lse``: ``(B, H, L)``, the natural-log logsumexp of the scaled, masked scores (before dropout; sink
        included) in float32 (float64 for float64 inputs); ``+inf`` for a row that sees no key. Not
        differentiable (as SDPA's logsumexp).

        Differentiable in query, key, value, a float attn_mask (a learned bias: its gradient comes summed
        over the dims it broadcasts along, in its shape and dtype) and sinks, through
        :func:`attention_backward`; autograd saves q, k, v, out, lse, the masks and the seed, nothing of size
        ``(B, H, L, S)``. No double backward.

    Raises:
        RuntimeError: ``attnx::attention: expected ...`` for an argument of the wrong shape, dtype or device;
            in the backward, for a float key_padding_mask that requires grad (it gets no gradient) and for a
            double backward.
    """
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed(query.device)
    options = (attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed, window_left,
               window_right, key_lengths, softcap, sinks, block_map, block_bits, block_q, block_k)
    # Options past the last one given are left to the schema: torch.ops converts each one passed (~0.1 us
    # apiece; all 11 cost a quarter of the whole call at decoding shapes), and the autograd Function saves
    # and hands on fewer.
    if block_map is None and block_bits is None:
        options = options[:11]
    elif block_map is not None and block_map.device.type != "cpu":
        # The C++ checks read the entries on the CPU only (elsewhere that would synchronise the device, and
        # the kernels read a bad entry as -1, never out of bounds): here the device asserts, asynchronously.
        partial = 0 if block_bits is None else block_bits.shape[0]
        torch._assert_async(((block_map >= -2) & (block_map < partial)).all(),
                            "attnx.attention: expected block_map entries of -1, -2 or an index below "
                            "block_bits.shape[0]")
    if (len(options) == 11 and window_left == -1 and window_right == -1 and key_lengths is None
            and softcap is None and sinks is None):
        if (attn_mask is None and key_padding_mask is None and is_causal is False and scale is None
                and dropout_p == 0.0 and dropout_seed is None):
            options = ()
        else:
            options = options[:6]
    if records_backward(query, key, value, attn_mask, key_padding_mask, sinks):
        return _AttentionFunction.apply(_attention_kernel, None, query, key, value, *options)
    return _attention_kernel(query, key, value, *options)


def draw_dropout_seed(device: torch.device | str | None = None) -> Tensor:
    """A fresh dropout seed for :func:`attention`, from torch's default CPU generator, whatever the device.

    Drawn so that ``torch.manual_seed`` makes it reproducible (``torch.cuda.manual_seed`` alone does not move
    it). It lives on the CPU so that kernels read it on the host when they launch, and it is drawn there: no
    accelerator is involved, so the draw never waits for a device's queue (a CUDA call with dropout runs
    under ``torch.cuda.set_sync_debug_mode("error")`` and can be captured in a CUDA graph). The keep mask is a
    pure function of the seed, so after the same ``torch.manual_seed`` a CPU, CUDA or MPS run drops the same
    elements. A seed drawn while a CUDA graph is captured would be frozen into it (every replay would drop the
    same elements), so that draw raises: run the call with dropout outside the graph, or pass ``dropout_seed``
    yourself, knowing that each replay reuses it.

    Why not the CUDA generator: its seed and offset are host values, but torch refuses to read the offset
    during graph capture, and a host value would be frozen into the graph anyway; torch's own dropout is
    graph-safe through its Philox state read on the device (``at::PhiloxCudaState``), which is not on the
    stable ABI.

    Args:
        device: the device of the attention call.

    Returns:
        An int64 CPU tensor ``(seed, offset)``.

    Raises:
        RuntimeError: for a CUDA device while the current stream is being captured into a CUDA graph.
    """
    # (No capture can be under way before CUDA is initialised; asking would initialise it.)
    cuda = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_initialized()
    if cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "attnx: dropout while a CUDA graph is captured: the seed drawn now would be frozen into the "
            "graph and every replay would drop the same elements. Run the call with dropout outside the "
            "graph, or pass dropout_seed (a CPU int64 tensor (seed, offset)), which each replay reuses"
        )
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device="cpu")  # not the default device


def attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    # attention's options, as the forward call took them
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, dropout_p: float = 0.0, dropout_seed: Tensor | None = None,
    window_left: int = -1, window_right: int = -1, key_lengths: Tensor | None = None,
    softcap: float | None = None, sinks: Tensor | None = None,
    block_map: Tensor | None = None, block_bits: Tensor | None = None, block_q: int = 128, block_k: int = 128,
    grad_attn_mask: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`attention`'s out with respect to query, key, value, attn_mask and sinks.

    FlashAttention-2 style: the probabilities are recomputed tile by tile as ``exp(score - lse)`` and never
    stored; extra memory is ``O(B*H*L)`` plus per-thread buffers, never ``(B, H, L, S)``. Accumulates in
    float32 (float64 for float64). With the forward's ``dropout_p`` and ``dropout_seed``, the forward's
    dropout mask is regenerated (never read from memory): ``dV = (Z P)^T dO`` and
    ``dS = P (Z dP - rowsum(dO O))``, ``Z`` the mask scaled by ``1 / (1 - dropout_p)``. A fully masked row
    (``lse = +inf``) contributes 0. The options mean what they mean in :func:`attention`.

    Accuracy: ``dP - rowsum(dO O)`` subtracts two sums taken in different orders, so where a probability is
    near 1 it carries up to about ``(D + S) eps P |dO| . (|v_s| + |O|)`` of rounding, which the scale
    multiplies into dQ and dK. At a scale so large that the softmax is one-hot (the exact dQ and dK vanish)
    they are that rounding times the scale (~1e25 in float32 at scale 1e30), as in every FlashAttention-style
    backward; dV does not involve the subtraction.

    Args:
        grad_out: ``(B, H, L, Dv)`` in query's dtype, any strides.
        query: the forward call's.
        key: the forward call's.
        value: the forward call's.
        out: ``(B, H, L, Dv)``, as :func:`attention` returned it.
        lse: ``(B, H, L)``, as :func:`attention` returned it.
        attn_mask: the forward call's.
        key_padding_mask: the forward call's.
        is_causal: the forward call's.
        scale: the forward call's.
        dropout_p: the forward call's.
        dropout_seed: the forward call's.
        window_left: the forward call's.
        window_right: the forward call's.
        key_lengths: the forward call's.
        softcap: the forward call's.
        sinks: the forward call's.
        block_map: the forward call's.
        block_bits: the forward call's.
        block_q: the forward call's.
        block_k: the forward call's.
        grad_attn_mask: whether to compute a float attn_mask's gradient.

    Returns:
        ``(grad_query, grad_key, grad_value, grad_attn_mask, grad_sinks)``.

        ``grad_query`` ``(B, H, L, D)``, ``grad_key`` ``(B, Hkv, S, D)`` and ``grad_value``
        ``(B, Hkv, S, Dv)``: in query's dtype, each laid out in memory as ``(B, N, H, E)``, like out (a kv
        head's gradients summed over its query heads).

        ``grad_attn_mask``: when ``grad_attn_mask`` and attn_mask is a float mask, in attn_mask's shape and
        dtype, summed over the dims it broadcasts along (on the CPU without any ``(B, H, L, S)`` buffer
        unless the mask is that size), else an empty tensor.

        ``grad_sinks``: ``(H,)`` in sinks' dtype with sinks, else an empty tensor.

    Raises:
        RuntimeError: ``attnx::attention: expected ...`` or ``attnx::attention_backward: expected ...`` for
            an argument of the wrong shape, dtype or device.
    """
    return _attention_backward(
        grad_out, query, key, value, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
        dropout_seed, window_left, window_right, key_lengths, softcap, sinks, block_map, block_bits, block_q,
        block_k, grad_attn_mask,
    )


def mha(
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
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    batch_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole ``nn.MultiheadAttention`` forward in one dispatch; returns ``(out, lse, weights)``.

    Batched, sequence-first, or batch-first with batch_first (the same computation on the transposes). Any
    strides: every tensor is read in place, with no transposes around the call (in the forward or the
    backward), and the masks are never merged. The inputs are projected (with either in_proj_weight or the
    three q/k/v_proj_weight, and in_proj_bias in both cases) and split into ``H`` heads of ``E/H`` features;
    bias_k/bias_v, then add_zero_attn, append keys and values (``S'`` keys in all), each key extending the
    masks by one column that masks nothing; each head runs :func:`attention` with scale ``1 / sqrt(E/H)``,
    the masks and is_causal; the heads are concatenated and out-projected. :func:`attnx.reference.mha`
    computes the same in plain PyTorch.

    Args:
        query: ``(L, B, E)``, or ``(B, L, E)`` with batch_first.
        key: ``(S, B, kdim)``, or ``(B, S, kdim)`` with batch_first.
        value: ``(S, B, vdim)``, or ``(B, S, vdim)`` with batch_first.
        num_heads: ``H``; divides ``E``.
        in_proj_weight: ``(3E, E)``, the q, k and v rows in that order; exactly one of it or the three
            q/k/v_proj_weight.
        in_proj_bias: ``(3E,)`` or None; applies with either form of weights.
        q_proj_weight: ``(E, E)``.
        k_proj_weight: ``(E, kdim)``.
        v_proj_weight: ``(E, vdim)``.
        bias_k: ``(1, 1, E)``, with bias_v: one projected key/value appended per batch; not with
            static_k/static_v.
        bias_v: ``(1, 1, E)``.
        add_zero_attn: appends one zero key/value per head, after bias_k/bias_v's.
        out_proj_weight: ``(E, E)``.
        out_proj_bias: ``(E,)`` or None.
        key_padding_mask: ``(B, S)``, bool or float, as in :func:`attention`.
        attn_mask: ``(L, S)`` or ``(B*H, L, S)``, bool or float, as in :func:`attention`; the two combine.
        is_causal: masks key ``s > l``, top-left aligned over all ``S'`` keys (appended ones included), as
            SDPA's.
        static_k: ``(B*H, S, E/H)``, the keys as they are (no projection), replacing the projected ones.
        static_v: ``(B*H, S, E/H)``, the values as they are.
        need_weights: whether to return the attention weights.
        average_attn_weights: whether the weights are averaged over heads.
        dropout_p: drops attention probabilities as :func:`attention` does (the same keep mask, over the
            ``S'`` keys); not with need_weights. The caller passes 0 in eval, as to SDPA.
        dropout_seed: as :func:`attention`'s; drawn when None and ``dropout_p > 0``.
        batch_first: whether query, key, value and out are ``(B, N, F)``.

    Returns:
        ``out``: ``(L, B, E)`` (``(B, L, E)`` with batch_first) in query's dtype; 0 for a fully masked row.

        ``lse``: ``(B, H, L)`` as :func:`attention` gives it: float32 (float64 for float64 inputs), ``+inf``
        for a fully masked row.

        ``weights``: when need_weights, the attention probabilities in query's dtype, normalised as torch's
        softmax, ``(B, L, S')`` if average_attn_weights else ``(B, H, L, S')`` (NaN for a fully masked row, as
        torch's softmax gives), else an empty ``(0,)`` tensor.

        Differentiable in every tensor argument but the masks (a float attn_mask included).

    Raises:
        RuntimeError: ``attnx::mha: ...``: ``expected ...`` for an argument of the wrong shape, dtype or
            device; for bias_k with static_k/static_v and for need_weights with ``dropout_p > 0``; in the
            backward, for a float key_padding_mask that requires grad and for a double backward.
    """
    grad = records_backward(
        query, key, value, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight, bias_k,
        bias_v, out_proj_weight, out_proj_bias, key_padding_mask, attn_mask, static_k, static_v,
    )
    args = (
        query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight,
        v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias, key_padding_mask,
        attn_mask, is_causal, static_k, static_v, need_weights, average_attn_weights, dropout_p,
        draw_dropout_seed(query.device) if dropout_p > 0 and dropout_seed is None else dropout_seed,
        batch_first,
    )
    if grad:  # mha_forward under grad mode off (inside the Function) goes straight to its kernel
        return _MhaFunction.apply(_mha_forward_op, None, *args)[:3]
    return _mha_kernel(*args)


def varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False, scale: float | None = None,
    window_left: int = -1, window_right: int = -1, seqused_k: Tensor | None = None,
    block_table: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention over packed sequences of different lengths; returns ``(out, lse)``.

    The layout is FlashAttention's varlen one (``torch.nn.attention.varlen``'s too).

    ``N`` sequences are packed along the first dim: sequence ``b``'s queries are rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of query and its keys rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
    of key and value; each sequence attends only to its own keys. The kernel is :func:`attention`'s, one
    batch per sequence: a tile never crosses a sequence, so the cost is ``sum_b Lq_b * Lk_b``, not
    ``total_q * total_k``, and nothing is padded or copied (kv heads are indexed, not repeated).
    :func:`attnx.reference.varlen_attention` computes the same, sequence by sequence.

    Key range, per sequence (``Lq`` queries, ``Lk`` keys): query ``i`` sits at key position
    ``i + Lk - Lq`` (bottom-right alignment), and the window keeps keys ``j`` with
    ``i + Lk - Lq - window_left <= j <= i + Lk - Lq + window_right`` (``-1``: unbounded side). ``is_causal``
    sets the window's right side to 0: FlashAttention's and ``torch.nn.attention.varlen``'s causal, which
    is *not* :func:`attention`'s top-left ``is_causal`` (the two agree when ``Lq == Lk``). A row that sees
    no key (``Lk == 0``, or a window that reaches none) gives out 0 and ``lse = +inf``, as in
    :func:`attention`; FlashAttention-2 reports ``+inf`` there too (its split-KV path ``-inf``).

    Paged KV cache: with ``block_table``, key and value are pages ``(pages, page_size, Hkv, D)`` of any
    ``page_size`` (1, 16, 7, ...) shared by all sequences in any order; key ``j`` of sequence ``b`` is row
    ``j % page_size`` of page ``block_table[b, j // page_size]``. Keys are gathered page by page for each
    tile, never copied out of the cache. ``cu_seqlens_k`` then only gives each sequence's key count
    (``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``, at most ``pages_per_seq * page_size``); ``seqused_k`` may cut
    it further.

    CPU only: on other devices the dispatcher reports that ``attnx::_varlen_attention`` has no kernel for
    the device.

    Args:
        query: ``(total_q, H, D)``, float32, float64, bfloat16 or float16, any strides.
        key: ``(total_k, Hkv, D)`` of query's dtype, any strides, ``Hkv`` dividing ``H`` (query head ``h``
            reads kv head ``h // (H // Hkv)``); or ``(pages, page_size, Hkv, D)`` with block_table.
        value: ``(total_k, Hkv, Dv)``, or ``(pages, page_size, Hkv, Dv)`` with block_table.
        cu_seqlens_q: int32 ``(N + 1,)``, contiguous, non-decreasing, from ``>= 0`` to ``<= total_q``.
        cu_seqlens_k: int32 ``(N + 1,)``, likewise (to ``<= total_k`` without block_table).
        max_seqlen_q: at least the longest query sequence (checked on the CPU).
        max_seqlen_k: at least the longest key sequence (checked on the CPU).
        is_causal: bottom-right causal per sequence (see Key range above).
        scale: the scores' scale; None: ``1/sqrt(D)``.
        window_left: keys before a row's key position that it sees; ``-1``: unbounded.
        window_right: keys after a row's key position that it sees; ``-1``: unbounded.
        seqused_k: int32 ``(N,)`` or None: sequence ``b`` uses only its first ``seqused_k[b]`` keys (at
            most its ``cu_seqlens_k`` count; a KV cache's filled part); the rest are never read.
        block_table: int32 ``(N, pages_per_seq)`` or None: the paged cache's table (see above). Inference
            only: the backward refuses it.
        softcap: > 0 or None, as in :func:`attention`.
        sinks: ``(H,)`` or None, as in :func:`attention`.

    Returns:
        ``out``: ``(total_q, H, Dv)`` in query's dtype, contiguous; 0 on a row that sees no key and on rows
        outside every sequence.

        ``lse``: ``(H, total_q)`` (FlashAttention's layout), float32 (float64 for float64 inputs), ``+inf``
        where out is 0 for lack of keys. Not differentiable.

        Differentiable in query, key, value and sinks without block_table, through
        :func:`varlen_attention_backward`. No double backward.

    Raises:
        RuntimeError: ``attnx::varlen_attention: expected ...`` for an argument of the wrong shape, dtype or
            device, for offsets that decrease or leave their tensor, for ``max_seqlen_*`` below the longest
            sequence, for ``seqused_k`` past a sequence's keys, and for a block table entry outside the
            pages; in the backward, for a block_table.
    """
    args = (max_seqlen_q, max_seqlen_k, is_causal, scale, window_left, window_right, seqused_k, block_table,
            softcap, sinks)
    if records_backward(query, key, value, sinks):
        return _VarlenAttentionFunction.apply(_varlen_kernel, None, query, key, value, cu_seqlens_q,
                                              cu_seqlens_k, *args)
    return _varlen_kernel(query, key, value, cu_seqlens_q, cu_seqlens_k, *args)


def varlen_attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    is_causal: bool = False, scale: float | None = None, window_left: int = -1, window_right: int = -1,
    seqused_k: Tensor | None = None, block_table: Tensor | None = None, softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`varlen_attention`'s out with respect to query, key, value and sinks.

    :func:`attention_backward`'s kernel, one batch per sequence (probabilities recomputed from lse, never
    stored).

    Args:
        grad_out: ``(total_q, H, Dv)`` in query's dtype, any strides.
        query: the forward call's.
        key: the forward call's.
        value: the forward call's.
        out: ``(total_q, H, Dv)``, as :func:`varlen_attention` returned it.
        lse: ``(H, total_q)``, as :func:`varlen_attention` returned it.
        cu_seqlens_q: the forward call's.
        cu_seqlens_k: the forward call's.
        max_seqlen_q: the forward call's.
        max_seqlen_k: the forward call's.
        is_causal: the forward call's.
        scale: the forward call's.
        window_left: the forward call's.
        window_right: the forward call's.
        seqused_k: the forward call's.
        block_table: must be None (a paged cache is inference only).
        softcap: the forward call's.
        sinks: the forward call's.

    Returns:
        ``(grad_query, grad_key, grad_value, grad_sinks)``: in the shapes of query, key and value (0 for
        keys that no query sees and for rows outside every sequence), and ``(H,)`` in sinks' dtype with
        sinks, else an empty tensor.

    Raises:
        RuntimeError: ``attnx::varlen_attention: expected ...`` or
            ``attnx::varlen_attention_backward: expected ...`` for a bad argument or a block_table.
    """
    return _varlen_backward(
        grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        is_causal, scale, window_left, window_right, seqused_k, block_table, softcap, sinks,
    )


# The wrappers spell their op's signature out, as API: held to the schema (csrc/schemas.cpp) here.
for _wrapper, _op_name in ((linear, "linear"), (attention, "attention"),
                           (attention_backward, "attention_backward"), (mha, "mha"),
                           (varlen_attention, "varlen_attention"),
                           (varlen_attention_backward, "varlen_attention_backward")):
    check_signature(_wrapper, _op_name)
del _wrapper, _op_name
