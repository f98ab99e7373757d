"""Typed wrappers and autograd for the ops under ``torch.ops.attnx``.

This module and its private parts (``_fake``: the fake kernels, which let torch.compile and export trace the
ops without running them, with the Python mirrors of the C++ checks they need; ``_schema``: the ops' argument
tables; ``_compat``) are the only ones that touch ``torch.ops.attnx``.

Autograd: each differentiable op (``linear``, ``attention``, ``mha``) routes by grad mode (csrc/schemas.cpp,
csrc/common/routes.cpp): with grad mode off to a kernel op without autograd (``_linear``, ``_attention``,
``_mha``), so that inference runs no Python below ``torch.ops``; with grad mode on to the same kernels under a
second name (``_linear_autograd``, ``_attention_autograd``, ``mha_forward``), whose Autograd kernels are
registered here: each runs an ``autograd.Function`` around the op's kernel below autograd (leaner than
``torch.library.register_autograd``'s kernels, which cost about twice as much per forward and backward at
small shapes).
"""

import math

import torch
from torch import Tensor

from attnx import _fake  # noqa: F401  (registers the fake kernels)
from attnx._fake import MHA_GRADS

__all__ = ["attention", "attention_backward", "draw_dropout_seed", "linear", "mha"]


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` that takes every input layout without a detour.

    input ``(*, K)``, weight ``(N, K)``, bias ``(N,)`` or None; returns ``(*, N)``, equal to
    ``F.linear(input, weight, bias)``. Leading dims that form one dense block of rows, in any memory order
    (a B=1 transpose, ``(L, B, E)`` views of batch-first data, slices with a storage offset, size-1 dims with
    any stride), run as one GEMM without a copy, and the output keeps the memory order of input's leading
    dims (contiguous whenever input's rows are in logical order). Rows repeated by stride-0 dims are computed
    once.
    Any other layout is copied exactly once. Differentiable in input, weight and bias.
    """
    if _records_backward(input, weight, bias):
        return _LinearFunction.apply(_linear_kernel, None, input, weight, bias)
    return _linear_kernel(input, weight, bias)


def _records_backward(*tensors: Tensor | None) -> bool:
    """Whether a call records a backward: grad mode on and a tensor argument that requires grad.

    The wrappers here take the decision of the public op's router (csrc/common/routes.cpp) and of its Python
    autograd kernel one dispatch earlier: with nothing to record they call the kernel op (``_linear``,
    ``_attention``, ``_mha``), else the op's ``autograd.Function`` around it. The router cannot read
    requires_grad (torch's C API has no getter), so through it a grad-mode call pays the Python kernel's
    check (~8 us) even with nothing to record; and a forward + backward costs ~25 us less this way at tiny
    shapes. ``torch.ops.attnx.*`` stay the entry points for other callers, with the same results."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Looked up once: the wrappers are called per layer and step, and cost little more than the ops.
_linear_kernel = torch.ops.attnx._linear.default


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
) -> tuple[Tensor, Tensor]:
    """Fused scaled dot-product attention with ``nn.MultiheadAttention``'s masks; returns ``(out, lse)``.

    query ``(B, H, L, D)``, key ``(B, Hkv, S, D)`` and value ``(B, Hkv, S, Dv)``, of one dtype (float32,
    float64, bfloat16 or float16) and any strides: they are read in place, never copied. ``Hkv`` divides
    ``H`` (grouped KV heads, GQA; ``Hkv == 1`` is MQA): query head ``h`` reads kv head ``h // (H // Hkv)``,
    indexed in place (no repeat).

    attn_mask: ``(L, S)``, ``(B*H, L, S)`` (nn.MultiheadAttention's 3-D form) or 4-D broadcastable to
    ``(B, H, L, S)``. key_padding_mask: ``(B, S)``. For both, bool ``True`` means *masked out* (the
    opposite of SDPA's bool mask) and a floating mask (any float dtype) is added to the scores; the two
    combine. Masks are read in place through their own strides (broadcast dims cost nothing), never merged
    into a ``(B, H, L, S)`` tensor. ``is_causal`` masks key ``s > l`` (top-left aligned, as SDPA).
    ``scale`` defaults to ``1/sqrt(D)``.

    Which keys a row sees, without a mask tensor: with ``S_b`` valid keys in batch ``b``
    (``key_lengths[b]``, an int32/int64 ``(B,)`` tensor on query's device, e.g. a static KV cache's filled
    length; else ``S``), keys ``s >= S_b`` are ignored, and query row ``l`` sits at key position
    ``l + S_b - L`` (bottom-right aligned, as FlashAttention: a decoding step's query is the last position).
    A window keeps key ``s`` iff ``l + S_b - L - window_left <= s <= l + S_b - L + window_right``, ``-1``
    leaving a side unbounded: ``(-1, 0)`` is causal attention for a KV-cache step or a chunked prefill,
    ``(w - 1, 0)`` a sliding window of ``w`` keys. Key tiles outside a row's range are skipped, so the cost
    grows with the window, not with S. On the CPU key_lengths outside ``[0, S]`` raise; on a GPU, where
    reading them would cost a device sync, they are clamped into ``[0, S]``.

    ``softcap`` (> 0, or None): scores become ``softcap * tanh(score / softcap)`` before the masks are added
    (Gemma 2). ``sinks`` ``(H,)``: one logit per query head that joins every row's softmax denominator (and
    ``lse``) and adds no value (gpt-oss).

    ``dropout_p`` in ``[0, 1]``: dropout on the attention probabilities, fused (each is zeroed with
    probability ``dropout_p`` and the kept ones scaled by ``1 / (1 - dropout_p)`` before they multiply value;
    ``1`` drops everything, as ``F.dropout``). The mask is never stored: it is a pure function of
    ``dropout_seed``, an int64 CPU tensor ``(seed, offset)``, and of each element's ``(b, h, l, s)``
    (Philox4x32-10, see :func:`attnx.reference.dropout_keep_mask`), identical on every backend, and the
    backward regenerates it. When ``dropout_seed`` is None it is drawn by :func:`draw_dropout_seed` from
    torch's default generator of query's device type, so ``torch.manual_seed`` makes runs reproducible. The
    caller applies dropout only in training (pass ``dropout_p=0.0`` in eval, as
    ``F.scaled_dot_product_attention``).

    Returns out ``(B, H, L, Dv)`` in query's dtype, laid out in memory as ``(B, L, H, Dv)`` so that
    ``out.transpose(1, 2).reshape(B, L, H * Dv)`` is a view, and ``lse`` ``(B, H, L)``, the natural-log
    logsumexp of the scaled, masked scores in float32 (float64 for float64 inputs), before dropout. A row
    that sees no key (every key masked or outside its range, or S == 0) gives out 0 and ``lse = +inf``. The
    semantics are those of :func:`attnx.reference.attention`.

    Differentiable in query, key, value, a float ``attn_mask`` (a learned bias: its gradient comes summed
    over the dims it broadcasts along, in its shape and dtype) and ``sinks``, through
    :func:`attention_backward`, which recomputes the probabilities from the saved ``lse`` and the dropout
    mask from the saved seed (autograd saves q, k, v, out, lse, the masks and the seed, nothing of size
    ``(B, H, L, S)``). ``lse`` is not differentiable (as SDPA's logsumexp), a float ``key_padding_mask``
    gets no gradient (one that requires grad makes the backward raise), and there is no double backward.
    """
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed(query.device)
    if _records_backward(query, key, value, attn_mask, key_padding_mask, sinks):
        return _AttentionFunction.apply(
            _attention_kernel, None, query, key, value, attn_mask, key_padding_mask, is_causal, scale,
            dropout_p, dropout_seed, window_left, window_right, key_lengths, softcap, sinks,
        )
    op = _attention_kernel
    # Arguments at their defaults are left to the schema: torch.ops converts each one passed (~0.1 us apiece;
    # all 14 cost a quarter of the whole call at decoding shapes).
    if window_left == -1 and window_right == -1 and key_lengths is None and softcap is None and sinks is None:
        if (attn_mask is None and key_padding_mask is None and is_causal is False and scale is None
                and dropout_p == 0.0 and dropout_seed is None):
            return op(query, key, value)
        return op(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed)
    return op(
        query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_seed,
        window_left, window_right, key_lengths, softcap, sinks,
    )


_attention_kernel = torch.ops.attnx._attention.default


def draw_dropout_seed(device: torch.device) -> Tensor:
    """A fresh dropout seed for :func:`attention`: an int64 CPU tensor ``(seed, offset)`` drawn from torch's
    default generator of ``device``'s type, so that ``torch.manual_seed`` (or ``torch.cuda.manual_seed``)
    makes it reproducible.

    It lives on the CPU so that kernels read it on the host when they launch; for an accelerator the two
    numbers are drawn there and copied back, which waits for the device's queue."""
    seed = torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device)
    return seed if seed.device.type == "cpu" else seed.cpu()


def attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
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
    grad_attn_mask: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`attention`'s out with respect to query, key, value, attn_mask and sinks.

    grad_out and out ``(B, H, L, Dv)`` in query's dtype and ``lse`` ``(B, H, L)`` as :func:`attention`
    returned them; the other arguments are those of the forward call. Any strides. FlashAttention-2 style: the
    probabilities are recomputed tile by tile as ``exp(score - lse)`` and never stored; extra memory is
    O(B*H*L) plus per-thread buffers, never ``(B, H, L, S)``. Accumulates in float32 (float64 for float64).
    Returns ``(grad_query, grad_key, grad_value, grad_attn_mask, grad_sinks)``: grad_query ``(B, H, L, D)``,
    grad_key ``(B, Hkv, S, D)`` and grad_value ``(B, Hkv, S, Dv)`` in query's dtype, each laid out in memory
    as ``(B, N, H, E)``, like out (a kv head's gradients summed over its query heads); when
    ``grad_attn_mask`` and attn_mask is a float mask, its gradient in its shape and dtype, summed over the
    dims it broadcasts along (on the CPU without any ``(B, H, L, S)`` buffer unless the mask is that size),
    else an empty tensor; with sinks, their gradient ``(H,)`` in their dtype, else an empty tensor. A fully
    masked row (``lse = +inf``) contributes 0. With the forward's ``dropout_p`` and ``dropout_seed``, the
    forward's dropout mask is regenerated (never read from memory): ``dV = (Z P)^T dO`` and
    ``dS = P (Z dP - rowsum(dO O))``, ``Z`` the mask scaled by ``1 / (1 - dropout_p)``.

    Accuracy: ``dP - rowsum(dO O)`` subtracts two sums taken in different orders, so where a probability is
    near 1 it carries up to about ``(D + S) eps P |dO| . (|v_s| + |O|)`` of rounding, which the scale
    multiplies into dQ and dK. At a scale so large that the softmax is one-hot (the exact dQ and dK vanish)
    they are that rounding times the scale (~1e25 in float32 at scale 1e30), as in every FlashAttention-style
    backward; dV does not involve the subtraction.
    """
    return torch.ops.attnx.attention_backward.default(
        grad_out, query, key, value, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
        dropout_seed, window_left, window_right, key_lengths, softcap, sinks, grad_attn_mask,
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

    Batched, any strides: query ``(L, B, E)``, key ``(S, B, kdim)``, value ``(S, B, vdim)``, or with
    ``batch_first`` ``(B, L, E)``, ``(B, S, kdim)``, ``(B, S, vdim)``, read in place like the others (no
    transposes around the call, in the forward or the backward). Exactly one of in_proj_weight ``(3E, E)`` or
    q/k/v_proj_weight ``(E, E)``, ``(E, kdim)``, ``(E, vdim)``; in_proj_bias ``(3E,)`` applies in both cases.
    bias_k, bias_v ``(1, 1, E)``; static_k, static_v ``(B*H, S, E/H)``; add_zero_attn appends a zero key.
    key_padding_mask ``(B, S)`` and attn_mask ``(L, S)`` or ``(B*H, L, S)``, each bool (``True`` = masked out)
    or float (added), read in place, never merged; appended keys extend them by one unmasked column.
    ``is_causal`` applies a causal mask. ``dropout_p`` drops attention probabilities as :func:`attention`
    does (a seed is drawn when none is given; not with need_weights): the caller passes 0 in eval, as to SDPA.

    Returns out ``(L, B, E)`` (``(B, L, E)`` with ``batch_first``); lse ``(B, H, L)`` in float32 (float64
    for float64 inputs), ``+inf`` for a fully masked row, whose out is 0; weights ``(B, L, S')`` if
    average_attn_weights else ``(B, H, L, S')`` when need_weights (NaN for a fully masked row), else an empty
    ``(0,)`` tensor. The semantics are :func:`attnx.reference.mha`.
    """
    grad = _records_backward(
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


_mha_forward_op, _mha_kernel = torch.ops.attnx.mha_forward.default, torch.ops.attnx._mha.default


# ------------------------------------------------------------------------------------------------------------
# linear: autograd


# Python kernels of the attnx ops: the Autograd kernels below.
_LIB = torch.library.Library("attnx", "IMPL")


def _register_autograd(op_name: str, function: type) -> None:
    """Registers ``function`` (an ``autograd.Function`` whose forward takes the op, the dispatch keys below
    autograd and the op's arguments) as the Autograd kernel of ``attnx::<op_name>``. The dispatcher leaves out
    trailing arguments at their defaults; the kernel puts them back, so forward and backward see them all (the
    gradients of the ones put back are None, which autograd accepts)."""
    op = getattr(torch.ops.attnx, op_name).default
    defaults = tuple(a.default_value if a.has_default_value() else None for a in op._schema.arguments)
    after_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        # Without an argument that requires grad, or in grad mode off (the router never comes here then, but
        # mha's Function calls this op from its forward), there is nothing to record: straight to the kernel,
        # without autograd.Function's cost.
        if not (torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            return op.redispatch(keyset & after_autograd, *args)
        return function.apply(op, keyset & after_autograd, *args, *defaults[len(args):])

    _LIB.impl(op_name, kernel, "Autograd", with_keyset=True)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, keyset, input, weight, bias):
        ctx.save_for_backward(input, weight)
        ctx.bias_size = -1 if bias is None else bias.shape[0]
        return op(input, weight, bias) if keyset is None else op.redispatch(keyset, input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        N, K = weight.shape
        M = math.prod(grad.shape[:-1])  # rows, spelled out: -1 is ambiguous when N or K is 0
        needs = ctx.needs_input_grad
        grad_input = grad_weight = grad_bias = None
        if needs[2]:
            # (*, N) @ (N, K): the op itself, so the backward is as layout-robust as the forward (and
            # differentiable).
            grad_input = torch.ops.attnx.linear.default(grad, weight.t(), None)
        if needs[3]:
            grad_weight = grad.reshape(M, N).t().mm(input.reshape(M, K))
        if ctx.bias_size >= 0 and needs[4]:
            grad_bias = grad.reshape(M, N).sum(0)
            if ctx.bias_size != N:  # a size-1 bias broadcast over N
                grad_bias = grad_bias.sum().reshape(ctx.bias_size)
        return None, None, grad_input, grad_weight, grad_bias


_register_autograd("_linear_autograd", _LinearFunction)


# ------------------------------------------------------------------------------------------------------------
# attention: autograd


class _NoDoubleBackward(torch.autograd.Function):
    """Gradients computed with create_graph=True come out of this node, which raises if a second backward
    reaches it: attention_backward and mha_backward are not differentiable, and gradients silently missing a
    term would be worse than an error. Its inputs are the tensors the gradients depend on, so that they
    require grad."""

    @staticmethod
    def forward(ctx, op, num_inputs, *tensors):
        ctx.op = op
        return tensors[num_inputs:]

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"attnx.{ctx.op}: double backward is not implemented "
            f"(attnx::{ctx.op}_backward is not differentiable)"
        )


def _no_double_backward(op: str, inputs: list, compute) -> tuple:
    """``compute()``'s gradients, which depend on ``inputs``; guarded when the backward records a graph."""
    if not torch.is_grad_enabled():  # the usual backward
        return compute()
    with torch.no_grad():
        grads = compute()
    inputs = [t for t in inputs if isinstance(t, Tensor)]
    return _NoDoubleBackward.apply(op, len(inputs), *inputs, *grads)


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, keyset, query, key, value, *options):
        if keyset is None:
            out, lse = op(query, key, value, *options)
        else:
            out, lse = op.redispatch(keyset, query, key, value, *options)
        # Everything the backward recomputes the probabilities and the dropout mask from (attention's
        # arguments from attn_mask on, which attention_backward takes in the same order); nothing of size
        # (B, H, L, S).
        tensor_options = (o if isinstance(o, Tensor) else None for o in options)
        ctx.save_for_backward(query, key, value, out, lse, *tensor_options)
        ctx.options = [None if isinstance(o, Tensor) else o for o in options]
        # Like SDPA's logsumexp: an output for the backward (and for combining partial attentions), not a path
        # for gradients; marking it keeps a loss that uses it from silently missing that term.
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        # needs_input_grad: op, keyset, query, key, value, attn_mask, key_padding_mask, ..., sinks.
        needs = ctx.needs_input_grad[2:]
        query, key, value, out, lse, *saved_options = ctx.saved_tensors
        options = [o if t is None else t for o, t in zip(ctx.options, saved_options, strict=True)]
        attn_mask = options[0]
        if needs[4]:
            raise RuntimeError(
                "attnx.attention: no gradient for a float key_padding_mask, which requires grad. Detach it, "
                "or pass it as a (B, 1, 1, S) attn_mask, whose gradient attnx computes."
            )
        want_mask = needs[3] and attn_mask.dtype != torch.bool
        result = [None] * (2 + len(needs))
        if not (needs[0] or needs[1] or needs[2] or want_mask or needs[13]):
            return tuple(result)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        args = (grad_out, query, key, value, out, lse, *options, want_mask)
        dq, dk, dv, dmask, dsinks = _no_double_backward(
            "attention", args, lambda: torch.ops.attnx.attention_backward.default(*args)
        )
        for i, grad in ((0, dq), (1, dk), (2, dv), (3, dmask), (13, dsinks)):
            if needs[i] and (i != 3 or want_mask):
                result[2 + i] = grad
        return tuple(result)


_register_autograd("_attention_autograd", _AttentionFunction)


# ------------------------------------------------------------------------------------------------------------
# mha: autograd


# mha's arguments (24) in schema order: where each one's gradient sits in mha_backward's result (None: no
# gradient), the one mha_backward's output_mask entry names.
_MHA_ARGS = (
    "query", "key", "value", "num_heads", "in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "bias_k", "bias_v", "add_zero_attn", "out_proj_weight", "out_proj_bias",
    "key_padding_mask", "attn_mask", "is_causal", "static_k", "static_v", "need_weights",
    "average_attn_weights", "dropout_p", "dropout_seed", "batch_first",
)
_MHA_GRAD_SLOT = tuple(MHA_GRADS.index(name) if name in MHA_GRADS else None for name in _MHA_ARGS)
_MHA_KEY_PADDING_MASK = _MHA_ARGS.index("key_padding_mask")


class _MhaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, keyset, *args):
        out, lse, weights, q, k, v, attn = op(*args) if keyset is None else op.redispatch(keyset, *args)
        # The arguments and what attention needs to recompute its probabilities; nothing of size (B, H, L, S).
        ctx.save_for_backward(*(a if isinstance(a, Tensor) else None for a in args), q, k, v, attn, lse)
        ctx.flags = {n: a for n, a in zip(_MHA_ARGS, args, strict=True) if not isinstance(a, Tensor)}
        ctx.one_input = args[0] is args[1] and args[1] is args[2]
        # q, k, v and attn are saved for the backward (the router returns out, lse and weights only).
        ctx.mark_non_differentiable(lse, q, k, v, attn, *(() if ctx.flags["need_weights"] else (weights,)))
        ctx.set_materialize_grads(False)
        return out, lse, weights, q, k, v, attn

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, grad_weights, *_):
        needs = ctx.needs_input_grad[2:]  # after op and keyset
        if needs[_MHA_KEY_PADDING_MASK]:
            raise RuntimeError(
                "attnx.mha: no gradient for a float key_padding_mask, which requires grad. Detach it, or "
                "pass it as part of a float attn_mask, whose gradient attnx computes."
            )
        result = [None] * (2 + len(_MHA_ARGS))
        if grad_out is None and grad_weights is None:
            return tuple(result)
        *saved, q, k, v, attn, lse = ctx.saved_tensors
        args = dict(zip(_MHA_ARGS, saved, strict=True))
        args.update(ctx.flags)
        query = args["query"]
        if grad_out is None:  # out is (L, B, E), or (B, L, E) with batch_first: query's first two dims
            weight = args["out_proj_weight"]
            grad_out = weight.new_zeros((query.shape[0], query.shape[1], weight.shape[0]))
        output_mask = [0] * len(MHA_GRADS)
        for arg, slot in enumerate(_MHA_GRAD_SLOT):
            if slot is not None:
                output_mask[slot] = int(needs[arg])
        one_input = ctx.one_input
        if one_input:  # one tensor as query, key and value goes in 3 times: mha_backward sees it as one
            output_mask[0] = int(any(output_mask[:3]))
            args["key"] = args["value"] = query
        call_args = (grad_out, grad_weights, *(args[name] for name in _MHA_ARGS[:-1]), q, k, v, attn, lse,
                     output_mask, args["batch_first"])
        grads = _no_double_backward(
            "mha", call_args, lambda: torch.ops.attnx.mha_backward.default(*call_args)
        )
        for arg, slot in enumerate(_MHA_GRAD_SLOT):
            if slot is not None and output_mask[slot] and not (one_input and slot in (1, 2)):
                result[2 + arg] = grads[slot]
        return tuple(result)


_register_autograd("mha_forward", _MhaFunction)
