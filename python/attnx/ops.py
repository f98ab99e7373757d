"""Typed wrappers and fake kernels for the ops under ``torch.ops.attnx``.

This is the only module that touches ``torch.ops.attnx``. Fakes let torch.compile and export trace the ops
without running them.

Autograd: each differentiable op (``linear``, ``attention``, ``mha``) routes by grad mode (csrc/schemas.cpp,
csrc/common/routes.cpp): with grad mode off to a kernel op without autograd (``_linear``, ``_attention``,
``_mha``), so that inference runs no Python below ``torch.ops``; with grad mode on to the same kernels under a
second name (``_linear_autograd``, ``_attention_autograd``, ``mha_forward``), whose Autograd kernels are
registered here: each runs an ``autograd.Function`` around the op's kernel below autograd (leaner than
``torch.library.register_autograd``'s kernels, which cost about twice as much per forward and backward at
small shapes). Fakes are registered on the kernel ops; the routers need none (fake tensors go through them to
the op they choose).
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from attnx._compat import register_fake

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
# linear: layout rule (mirrors csrc/common/linear.cpp), fake kernel and autograd


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


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, extent = [0] * len(sizes), 1
    for d in reversed(range(len(sizes))):
        strides[d] = extent
        extent *= max(sizes[d], 1)
    return strides


def _linear_out_strides(sizes: Sequence[int], strides: Sequence[int], out_sizes: Sequence[int]) -> list[int]:
    """Strides of linear's output; the same rule as ``fold_rows``/``output_strides`` in
    csrc/common/linear.cpp."""
    leading = len(sizes) - 1
    if math.prod(sizes[:leading]) == 0 or out_sizes[-1] == 0:
        return _contiguous_strides(out_sizes)
    if any(sizes[d] > 1 and strides[d] == 0 for d in range(leading)):
        return _contiguous_strides(out_sizes)  # repeated rows are broadcast into a fresh contiguous output
    dims = sorted((d for d in range(leading) if sizes[d] != 1), key=lambda d: -strides[d])
    if dims == sorted(dims):
        return _contiguous_strides(out_sizes)
    expected = strides[dims[-1]]
    for d in reversed(dims):
        if strides[d] != expected:
            return _contiguous_strides(out_sizes)  # not one block of rows: copied to contiguous first
        expected *= sizes[d]
    out_strides, extent = [0] * len(out_sizes), out_sizes[-1]
    out_strides[-1] = 1
    for d in reversed(dims):
        out_strides[d] = extent
        extent *= out_sizes[d]
    for d in range(leading):
        if out_sizes[d] == 1:
            out_strides[d] = extent
    return out_strides


def _check_linear_args(input: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """The checks of ``check_linear_args`` in csrc/common/linear.cpp, for fake tensors."""
    torch._check(
        input.dim() >= 1 and weight.dim() >= 1,
        lambda: "both arguments to linear need to be at least 1D, "
        f"but they are {input.dim()}D and {weight.dim()}D",
    )
    torch._check(
        weight.dim() == 2,
        lambda: "attnx::linear: expected weight of shape (out_features, in_features), "
        f"got a {weight.dim()}-D tensor of shape {list(weight.shape)}",
    )
    for t in (weight, bias):
        if t is not None:
            torch._check(
                t.device == input.device,
                lambda t=t: "Expected all tensors to be on the same device, but found at least two devices, "
                f"{input.device} and {t.device}!",
            )
    torch._check(
        input.dtype == weight.dtype,
        lambda: "expected m1 and m2 to have the same dtype, but got: "
        f"{_type_meta_name(input.dtype)} != {_type_meta_name(weight.dtype)}",
    )
    m, k, n = math.prod(input.shape[:-1]), input.shape[-1], weight.shape[0]
    torch._check(
        weight.shape[1] == k,
        lambda: f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {weight.shape[1]}x{n})",
    )
    if bias is not None:
        torch._check(
            bias.dtype == weight.dtype,
            lambda: f"self and mat2 must have the same dtype, but got {_scalar_name(bias.dtype)} "
            f"and {_scalar_name(weight.dtype)}",
        )
        torch._check(
            bias.dim() == 1,
            lambda: f"attnx::linear: expected bias of shape (out_features,) = ({n},), got {list(bias.shape)}",
        )
        torch._check(
            bias.shape[0] == n or bias.shape[0] == 1,
            lambda: f"The expanded size of the tensor ({n}) must match the existing size ({bias.shape[0]}) "
            f"at non-singleton dimension 1.  Target sizes: [{m}, {n}].  Tensor sizes: [{bias.shape[0]}]",
        )


def _type_meta_name(dtype: torch.dtype) -> str:
    """c10's TypeMeta name (``float``, ``c10::Half``), as torch's C++ messages print a dtype."""
    return {
        torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
        torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
        torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
        torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>",
    }.get(dtype, str(dtype).removeprefix("torch."))


def _scalar_name(dtype: torch.dtype) -> str:
    """c10's ScalarType name (``Float``, ``BFloat16``), as torch's C++ messages print it."""
    return {
        torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
        torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
        torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
        torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype).removeprefix("torch."))


@register_fake("attnx::_linear")
def _linear_fake(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    _check_linear_args(input, weight, bias)
    out_sizes = [*input.shape[:-1], weight.shape[0]]
    return input.new_empty_strided(out_sizes, _linear_out_strides(input.shape, input.stride(), out_sizes))


register_fake("attnx::_linear_autograd")(_linear_fake)


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
# attention: argument checks (mirror csrc/common/attention.cpp), fake kernels and autograd

_ATTENTION_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_attention_mask(mask: Tensor, name: str, query: Tensor) -> None:
    torch._check(
        mask.dtype == torch.bool or mask.dtype in _ATTENTION_DTYPES,
        lambda: f"attnx::attention: expected {name} of dtype bool (True = masked out) or a floating dtype "
        f"(added to the scores: float16, bfloat16, float32 or float64), got {_scalar_name(mask.dtype)}",
    )
    torch._check(
        mask.device == query.device,
        lambda: f"attnx::attention: expected {name} on query's device {query.device}, got {mask.device}",
    )


def _check_dropout_args(dropout_p: float, dropout_seed: Tensor | None) -> None:
    """The checks of ``check_dropout_args`` in csrc/common/attention.cpp, for fake tensors."""
    torch._check(
        0.0 <= dropout_p <= 1.0, lambda: f"attnx::attention: expected dropout_p in [0, 1], got {dropout_p}"
    )
    if dropout_seed is not None:
        torch._check(
            dropout_seed.device.type == "cpu" and dropout_seed.dtype == torch.int64
            and list(dropout_seed.shape) == [2],
            lambda: "attnx::attention: expected dropout_seed to be a CPU int64 tensor (seed, offset) of "
            f"shape (2,), got a {dropout_seed.device} {_scalar_name(dropout_seed.dtype)} tensor of shape "
            f"{list(dropout_seed.shape)}",
        )
    else:
        torch._check(
            dropout_p == 0.0,
            lambda: "attnx::attention: expected dropout_seed, a CPU int64 tensor (seed, offset) of shape "
            "(2,), when dropout_p > 0 (attnx.attention draws one from torch's generator), got None with "
            f"dropout_p = {dropout_p}",
        )


def _check_attention_args(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    key_lengths: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> None:
    """The checks of ``check_attention_args`` in csrc/common/attention.cpp, for fake tensors (key_lengths'
    values are not checked here: they are data)."""
    for t, name, shape in ((query, "query", "(B, H, L, D)"), (key, "key", "(B, Hkv, S, D)"),
                           (value, "value", "(B, Hkv, S, Dv)")):
        torch._check(
            t.dim() == 4,
            lambda t=t, name=name, shape=shape: f"attnx::attention: expected {name} of shape {shape}, "
            f"got a {t.dim()}-D tensor of shape {list(t.shape)}",
        )
    torch._check(
        query.dtype in _ATTENTION_DTYPES,
        lambda: "attnx::attention: expected query of dtype float32, float64, bfloat16 or float16, "
        f"got {_scalar_name(query.dtype)}",
    )
    for t, name in ((key, "key"), (value, "value")):
        torch._check(
            t.dtype == query.dtype,
            lambda t=t, name=name: f"attnx::attention: expected {name} of query's dtype "
            f"{_scalar_name(query.dtype)}, got {_scalar_name(t.dtype)}",
        )
        torch._check(
            t.device == query.device,
            lambda t=t, name=name: f"attnx::attention: expected {name} on query's device {query.device}, "
            f"got {t.device}",
        )
    B, H, L, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    torch._check(
        key.shape[0] == B and key.shape[3] == D,
        lambda: f"attnx::attention: expected key of shape (B, Hkv, S, D) = ({B}, Hkv, S, {D}) to match "
        f"query's B and D, got {list(key.shape)}",
    )
    torch._check(
        H % Hkv == 0 if Hkv > 0 else H == 0,
        lambda: f"attnx::attention: expected the number of key/value heads (Hkv = {Hkv}) to divide the "
        f"number of query heads (H = {H})",
    )
    torch._check(
        value.shape[0] == B and value.shape[1] == Hkv and value.shape[2] == S,
        lambda: f"attnx::attention: expected value of shape (B, Hkv, S, Dv) = ({B}, {Hkv}, {S}, Dv) to match "
        f"query's B and key's Hkv and S, got {list(value.shape)}",
    )
    if attn_mask is not None:
        _check_attention_mask(attn_mask, "attn_mask", query)
        shape = list(attn_mask.shape)
        if attn_mask.dim() == 2:
            ok = shape == [L, S]
        elif attn_mask.dim() == 3:
            ok = shape == [B * H, L, S]
        else:
            ok = attn_mask.dim() == 4 and all(n in (t, 1) for n, t in zip(shape, (B, H, L, S), strict=True))
        torch._check(
            ok,
            lambda: f"attnx::attention: expected attn_mask of shape (L, S) = ({L}, {S}), (B*H, L, S) = "
            f"({B * H}, {L}, {S}) or 4-D broadcastable to (B, H, L, S) = ({B}, {H}, {L}, {S}), got {shape}",
        )
    if key_padding_mask is not None:
        _check_attention_mask(key_padding_mask, "key_padding_mask", query)
        torch._check(
            list(key_padding_mask.shape) == [B, S],
            lambda: f"attnx::attention: expected key_padding_mask of shape (B, S) = ({B}, {S}), "
            f"got {list(key_padding_mask.shape)}",
        )
    _check_dropout_args(dropout_p, dropout_seed)
    torch._check(
        window_left >= -1 and window_right >= -1,
        lambda: "attnx::attention: expected window_left and window_right >= -1 (-1 = unbounded), got "
        f"({window_left}, {window_right})",
    )
    if key_lengths is not None:
        torch._check(
            key_lengths.dtype in (torch.int32, torch.int64),
            lambda: f"attnx::attention: expected key_lengths of dtype int32 or int64, got "
            f"{_scalar_name(key_lengths.dtype)}",
        )
        torch._check(
            list(key_lengths.shape) == [B],
            lambda: f"attnx::attention: expected key_lengths of shape (B,) = ({B},), "
            f"got {list(key_lengths.shape)}",
        )
        torch._check(
            key_lengths.device == query.device,
            lambda: f"attnx::attention: expected key_lengths on query's device {query.device}, "
            f"got {key_lengths.device}",
        )
    if softcap is not None:
        torch._check(
            math.isfinite(softcap) and softcap > 0,
            lambda: "attnx::attention: expected softcap to be a finite number > 0 (None: no soft-capping), "
            f"got {softcap}",
        )
    if sinks is not None:
        torch._check(
            sinks.dtype in _ATTENTION_DTYPES,
            lambda: "attnx::attention: expected sinks of a floating dtype (float16, bfloat16, float32 or "
            f"float64), got {_scalar_name(sinks.dtype)}",
        )
        torch._check(
            list(sinks.shape) == [H],
            lambda: f"attnx::attention: expected sinks of shape (H,) = ({H},), got {list(sinks.shape)}",
        )
        torch._check(
            sinks.device == query.device,
            lambda: f"attnx::attention: expected sinks on query's device {query.device}, got {sinks.device}",
        )


@register_fake("attnx::_attention")
def _attention_fake(
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
    _check_attention_args(query, key, value, attn_mask, key_padding_mask, dropout_p, dropout_seed,
                          window_left, window_right, key_lengths, softcap, sinks)
    B, H, L, _ = query.shape
    Dv = value.shape[3]
    # The kernel's layout: out in memory order (B, L, H, Dv), lse contiguous.
    out = query.new_empty((B, L, H, Dv)).transpose(1, 2)
    lse = query.new_empty((B, H, L), dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    return out, lse


register_fake("attnx::_attention_autograd")(_attention_fake)


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


def _check_attention_backward_tensor(
    t: Tensor, name: str, shape: list, shape_name: str, dtype: torch.dtype, query: Tensor
) -> None:
    """The checks of ``check_backward_tensor`` in csrc/common/attention.cpp, for fake tensors."""
    torch._check(
        list(t.shape) == shape,
        lambda: f"attnx::attention_backward: expected {name} of shape {shape_name} = {shape}, "
        f"got {list(t.shape)}",
    )
    torch._check(
        t.dtype == dtype,
        lambda: f"attnx::attention_backward: expected {name} of dtype {_scalar_name(dtype)}, "
        f"got {_scalar_name(t.dtype)}",
    )
    torch._check(
        t.device == query.device,
        lambda: f"attnx::attention_backward: expected {name} on query's device {query.device}, "
        f"got {t.device}",
    )


@register_fake("attnx::attention_backward")
def _attention_backward_fake(
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
    _check_attention_args(query, key, value, attn_mask, key_padding_mask, dropout_p, dropout_seed,
                          window_left, window_right, key_lengths, softcap, sinks)
    B, H, L, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[3]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    _check_attention_backward_tensor(grad_out, "grad_out", [B, H, L, Dv], "(B, H, L, Dv)", query.dtype, query)
    _check_attention_backward_tensor(out, "out", [B, H, L, Dv], "(B, H, L, Dv)", query.dtype, query)
    _check_attention_backward_tensor(lse, "lse", [B, H, L], "(B, H, L)", acc, query)
    # The kernel's layout: out's, memory order (B, N, H, E); the mask's gradient contiguous in its shape.
    want_mask_grad = grad_attn_mask and attn_mask is not None and attn_mask.dtype != torch.bool
    return (
        query.new_empty((B, L, H, D)).transpose(1, 2),
        query.new_empty((B, S, Hkv, D)).transpose(1, 2),
        query.new_empty((B, S, Hkv, Dv)).transpose(1, 2),
        attn_mask.new_empty(attn_mask.shape) if want_mask_grad else query.new_empty(0),
        sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0),
    )


# ------------------------------------------------------------------------------------------------------------
# mha: fake kernels (the checks that shape the outputs; the kernel checks the rest) and autograd


def _mha_out_fake(query, num_heads, key_len, need_weights, average_attn_weights):
    """mha's (out, lse, weights) for fake tensors; ``key_len`` counts the appended keys."""
    L, B, E = query.shape
    H = num_heads
    # The out projection reads the attention output, laid out (B, L, H, D), through its (L, B, E) view: the
    # output's strides follow linear's layout rule for that view.
    out_sizes = (L, B, E)
    out = query.new_empty_strided(out_sizes, _linear_out_strides(out_sizes, (E, L * E, 1), out_sizes))
    lse = query.new_empty((B, H, L), dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    if not need_weights:
        weights = query.new_empty(0)
    else:
        weights = query.new_empty((B, L, key_len) if average_attn_weights else (B, H, L, key_len))
    return out, lse, weights


def _check_mha_fake_args(query, num_heads, batch_first=False):
    torch._check(
        query.dim() == 3,
        lambda: f"attnx::mha: expected query of shape {'(B, L, E)' if batch_first else '(L, B, E)'}, "
        f"got {list(query.shape)}",
    )
    E = query.shape[2]
    torch._check(
        num_heads > 0 and E % num_heads == 0,
        lambda: f"attnx::mha: expected embed_dim ({E}) divisible by num_heads ({num_heads})",
    )


@register_fake("attnx::_mha")
def _mha_fake(
    query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight,
    bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias, key_padding_mask, attn_mask, is_causal,
    static_k, static_v, need_weights, average_attn_weights, dropout_p=0.0, dropout_seed=None,
    batch_first=False,
):
    _check_mha_fake_args(query, num_heads, batch_first)
    query, key, value = _seq_first(query, key, value, batch_first)
    appended = int(bias_k is not None) + int(add_zero_attn)
    S = (key.shape[0] if static_k is None else static_k.shape[1]) + appended
    out, lse, weights = _mha_out_fake(query, num_heads, S, need_weights, average_attn_weights)
    return (out.transpose(0, 1) if batch_first else out), lse, weights


def _seq_first(query, key, value, batch_first):
    """``seq_first`` in csrc/common/mha.cpp: (N, B, F) views of batch_first (B, N, F) arguments, one tensor
    passed as several staying one."""
    if not batch_first:
        return query, key, value
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = k if value is key else q if value is query else value.transpose(0, 1)
    return q, k, v


def _same_view(a: Tensor, b: Tensor) -> bool:
    """``same_view`` in csrc/common/mha.cpp: the same memory seen the same way."""
    return a is b or (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    )


@register_fake("attnx::mha_forward")
def _mha_forward_fake(
    query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight,
    bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias, key_padding_mask, attn_mask, is_causal,
    static_k, static_v, need_weights, average_attn_weights, dropout_p=0.0, dropout_seed=None,
    batch_first=False,
):
    # The layouts of mha_forward_impl in csrc/common/mha.cpp: the same projections (run as linear's fake), the
    # same views and appended keys.
    _check_mha_fake_args(query, num_heads, batch_first)
    query, key, value = _seq_first(query, key, value, batch_first)
    L, B, E = query.shape
    H = num_heads

    def project(x, rows):
        w = x.new_empty((rows, x.shape[2]))
        return _linear_fake(x, w, None)

    # Packed in-projections off the CPU only (pack_in_projections in mha.cpp).
    packed = (
        in_proj_weight is not None and static_k is None and static_v is None and query.device.type != "cpu"
    )
    if packed and _same_view(query, key) and _same_view(key, value):
        q, k, v = project(query, 3 * E).split(E, dim=2)
    else:
        q = project(query, E)
        if packed and _same_view(key, value):
            k, v = project(key, 2 * E).split(E, dim=2)
        else:
            k = project(key, E) if static_k is None else None
            v = project(value, E) if static_v is None else None
    if bias_k is not None:
        k = torch.cat([k, k.new_empty((1, B, E))])
        v = torch.cat([v, v.new_empty((1, B, E))])

    def split_heads(t):
        return t.unflatten(2, (H, E // H)).permute(1, 2, 0, 3)

    q4 = split_heads(q)
    k4 = static_k.unflatten(0, (B, H)) if static_k is not None else split_heads(k)
    v4 = static_v.unflatten(0, (B, H)) if static_v is not None else split_heads(v)
    if add_zero_attn:
        k4 = torch.constant_pad_nd(k4, (0, 0, 0, 1))
        v4 = torch.constant_pad_nd(v4, (0, 0, 0, 1))
    else:  # static_k / static_v used as they are: not returned (outputs never alias inputs)
        k4 = query.new_empty(0) if static_k is not None else k4
        v4 = query.new_empty(0) if static_v is not None else v4
    attn = query.new_empty((B, L, H, E // H)).transpose(1, 2)
    appended = int(bias_k is not None) + int(add_zero_attn)
    S = (key.shape[0] if static_k is None else static_k.shape[1]) + appended
    out, lse, weights = _mha_out_fake(query, H, S, need_weights, average_attn_weights)
    return (out.transpose(0, 1) if batch_first else out), lse, weights, q4, k4, v4, attn


# Positions of mha_backward's gradients (and of its output_mask entries); mirrors MhaGrad in
# csrc/common/mha.cpp.
_MHA_GRADS = (
    "query", "key", "value", "in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "bias_k", "bias_v", "out_proj_weight", "out_proj_bias", "static_k", "static_v",
    "attn_mask",
)


@register_fake("attnx::mha_backward")
def _mha_backward_fake(
    grad_out, grad_weights, query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight,
    k_proj_weight, v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias,
    key_padding_mask, attn_mask, is_causal, static_k, static_v, need_weights, average_attn_weights, dropout_p,
    dropout_seed, q, k, v, attn, lse, output_mask, batch_first=False,
):
    _check_mha_fake_args(query, num_heads, batch_first)
    torch._check(
        len(output_mask) == len(_MHA_GRADS),
        lambda: f"attnx::mha_backward: expected output_mask of {len(_MHA_GRADS)} entries, "
        f"got {len(output_mask)}",
    )
    args = dict(query=query, key=key, value=value, in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias,
                q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight,
                bias_k=bias_k, bias_v=bias_v, out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias,
                static_k=static_k, static_v=static_v,
                attn_mask=attn_mask if attn_mask is not None and attn_mask.dtype != torch.bool else None)
    one_input = query is key and key is value
    wanted = dict(zip(_MHA_GRADS, output_mask, strict=True))
    if one_input:
        wanted["query"] = wanted["query"] or wanted["key"] or wanted["value"]
        wanted["key"] = wanted["value"] = False
    grads = []
    for name in _MHA_GRADS:
        t = args[name]
        if t is None or not wanted[name]:
            grads.append(query.new_empty(0))
        elif name in ("query", "key", "value"):  # memory order (B, N, F), as the GEMM writes it
            if batch_first:  # t is (B, N, F)
                grads.append(t.new_empty(t.shape))
            else:
                grads.append(t.new_empty((t.shape[1], t.shape[0], t.shape[2])).transpose(0, 1))
        else:
            grads.append(t.new_empty(t.shape))
    return grads


# mha's arguments (24) in schema order: where each one's gradient sits in mha_backward's result (None: no
# gradient), the one mha_backward's output_mask entry names.
_MHA_ARGS = (
    "query", "key", "value", "num_heads", "in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "bias_k", "bias_v", "add_zero_attn", "out_proj_weight", "out_proj_bias",
    "key_padding_mask", "attn_mask", "is_causal", "static_k", "static_v", "need_weights",
    "average_attn_weights", "dropout_p", "dropout_seed", "batch_first",
)
_MHA_GRAD_SLOT = tuple(_MHA_GRADS.index(name) if name in _MHA_GRADS else None for name in _MHA_ARGS)
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
        output_mask = [0] * len(_MHA_GRADS)
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
