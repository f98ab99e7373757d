"""Autograd of attnx's differentiable ops: an ``autograd.Function`` per op, registered as its Autograd kernel.

Each differentiable op (``linear``, ``attention``, ``mha``) routes by grad mode (csrc/schemas.cpp,
csrc/common/routes.cpp): with grad mode off to a kernel op without autograd (``_linear``, ``_attention``,
``_mha``), so that inference runs no Python below ``torch.ops``; with grad mode on to the same kernels under a
second name (``_linear_autograd``, ``_attention_autograd``, ``mha_forward``), whose Autograd kernels are
registered here: each runs a Function around the op's kernel below autograd. That is leaner than
``torch.library.register_autograd``'s kernels, which cost about twice as much per forward and backward at
small shapes. attnx.ops's wrappers call the Functions directly (``records_backward``), one dispatch earlier.

The Functions take the op's arguments as the dispatcher hands them on: trailing arguments at their defaults
may be left out (fewer arguments to convert, save and hand to the backward op); the backward returns a
gradient per argument given (autograd accepts the trailing Nones of those left out).
"""

import math

import torch
from torch import Tensor

from attnx._fake import MHA_GRADS
from attnx._schema import (
    AttentionBackwardArgs,
    AttentionOptions,
    MhaArgs,
    MhaBackwardArgs,
    VarlenAttentionArgs,
    VarlenAttentionBackwardArgs,
)

__all__ = ["records_backward"]


def records_backward(*tensors: Tensor | None) -> bool:
    """Whether a call records a backward: grad mode on and a tensor argument that requires grad.

    attnx.ops's wrappers take the decision of the public op's router (csrc/common/routes.cpp) and of its
    Autograd kernel (below) one dispatch earlier: with nothing to record they call the kernel op (``_linear``,
    ``_attention``, ``_mha``), else the op's Function around it. The router cannot read requires_grad
    (torch's C API has no getter), so through it a grad-mode call pays the Python kernel's check (~8 us) even
    with nothing to record; and a forward + backward costs ~25 us less this way at tiny shapes.
    ``torch.ops.attnx.*`` stay the entry points for other callers, with the same results."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any(generator): this runs on every call
        if t is not None and t.requires_grad:
            return True
    return False


# Python kernels of the attnx ops: the Autograd kernels below.
_LIB = torch.library.Library("attnx", "IMPL")


def _run(op, keyset, *args):
    """A Function's forward runs its op: called (``keyset`` None: attnx.ops' direct route), or redispatched
    below autograd (the Autograd kernel's route)."""
    return op(*args) if keyset is None else op.redispatch(keyset, *args)


def _save(ctx, tensors: tuple, extras: tuple) -> None:
    """Keeps ``tensors`` and an op's further arguments ``extras`` for the backward: the tensors through
    save_for_backward (which checks that they were not modified in place), the others on ctx."""
    ctx.save_for_backward(*tensors, *(e if isinstance(e, Tensor) else None for e in extras))
    ctx.extras = tuple(None if isinstance(e, Tensor) else e for e in extras)


def _saved(ctx) -> tuple[tuple, tuple]:
    """(tensors, extras) as _save kept them."""
    saved = ctx.saved_tensors
    n = len(saved) - len(ctx.extras)
    return saved[:n], tuple(e if t is None else t for e, t in zip(ctx.extras, saved[n:], strict=True))


def _register_autograd(op_name: str, function: type) -> None:
    """Registers ``function`` (an ``autograd.Function`` whose forward takes the op, the dispatch keys below
    autograd and the op's arguments) as the Autograd kernel of ``attnx::<op_name>``."""
    op = getattr(torch.ops.attnx, op_name).default
    after_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        # Without an argument that requires grad, or in grad mode off (the router never comes here then, but
        # mha's Function calls this op from its forward), there is nothing to record: straight to the kernel,
        # without autograd.Function's cost.
        if not (torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            return op.redispatch(keyset & after_autograd, *args)
        return function.apply(op, keyset & after_autograd, *args)

    _LIB.impl(op_name, kernel, "Autograd", with_keyset=True)


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


def _backward_op(name: str, op, args: tuple) -> tuple:
    """``op(*args)``: the gradients, which depend on ``args``' tensors; guarded when the backward records a
    graph (create_graph=True)."""
    if not torch.is_grad_enabled():  # the usual backward
        return op(*args)
    with torch.no_grad():
        grads = op(*args)
    inputs = [t for t in args if isinstance(t, Tensor)]
    return _NoDoubleBackward.apply(name, len(inputs), *inputs, *grads)


# ------------------------------------------------------------------------------------------------------------
# linear


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, keyset, input, weight, bias=None):
        ctx.save_for_backward(input, weight)
        ctx.bias_size = -1 if bias is None else bias.shape[0]
        return _run(op, keyset, input, weight, bias)

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
# attention

# Positions in attention's options (AttentionOptions) of those a gradient concerns.
_ATTN_MASK = AttentionOptions._fields.index("attn_mask")
_KEY_PADDING_MASK = AttentionOptions._fields.index("key_padding_mask")
_SINKS = AttentionOptions._fields.index("sinks")
_NO_NEEDS = (False,) * len(AttentionOptions._fields)  # needs_input_grad of options left out
_attention_backward = torch.ops.attnx.attention_backward.default
# The backward passes the options on by position: attention_backward takes them in attention's order,
# between lse and grad_attn_mask.
if AttentionBackwardArgs._fields[6:-1] != AttentionOptions._fields:
    raise AssertionError("attnx::attention_backward's options differ from attnx::_attention's")


def _attention_forward(ctx, op, keyset, query, key, value, *extras):
    """The forward of both attentions' Functions: keeps what the backward recomputes the probabilities and
    the dropout mask from (the arguments, which the backward op takes in the same order, out and lse);
    nothing of size (B, H, L, S)."""
    out, lse = _run(op, keyset, query, key, value, *extras)
    _save(ctx, (query, key, value, out, lse), extras)
    # Like SDPA's logsumexp: an output for the backward (and for combining partial attentions), not a path
    # for gradients; marking it keeps a loss that uses it from silently missing that term.
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    return out, lse


class _AttentionFunction(torch.autograd.Function):
    forward = staticmethod(_attention_forward)

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        (query, key, value, out, lse), options = _saved(ctx)
        needs = ctx.needs_input_grad  # op, keyset, query, key, value, then one per option given
        want_mask = want_sinks = False
        if options:
            needs_options = needs[5:] + _NO_NEEDS[len(options):]
            if needs_options[_KEY_PADDING_MASK]:
                raise RuntimeError(
                    "attnx.attention: no gradient for a float key_padding_mask, which requires grad. Detach "
                    "it, or pass it as a (B, 1, 1, S) attn_mask, whose gradient attnx computes."
                )
            want_mask = needs_options[_ATTN_MASK] and options[_ATTN_MASK].dtype != torch.bool
            want_sinks = needs_options[_SINKS]
        if not (needs[2] or needs[3] or needs[4] or want_mask or want_sinks):
            return (None,) * len(needs)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if want_mask:  # grad_attn_mask comes after every option
            args = (grad_out, query, key, value, out, lse, *AttentionOptions(*options), True)
        else:
            args = (grad_out, query, key, value, out, lse, *options)
        dq, dk, dv, dmask, dsinks = _backward_op("attention", _attention_backward, args)
        grads = [None, None, dq if needs[2] else None, dk if needs[3] else None, dv if needs[4] else None]
        if options:
            grads += [None] * len(options)
            if want_mask:
                grads[5 + _ATTN_MASK] = dmask
            if want_sinks:
                grads[5 + _SINKS] = dsinks
        return tuple(grads)


_register_autograd("_attention_autograd", _AttentionFunction)


# ------------------------------------------------------------------------------------------------------------
# varlen_attention

_VARLEN_SINKS = VarlenAttentionArgs._fields.index("sinks")
_varlen_attention_backward = torch.ops.attnx.varlen_attention_backward.default
# The backward takes the forward's arguments from cu_seqlens_q on, in the same order, after out and lse.
if VarlenAttentionBackwardArgs._fields[6:] != VarlenAttentionArgs._fields[3:]:
    raise AssertionError(
        "attnx::varlen_attention_backward's arguments differ from attnx::_varlen_attention's"
    )


class _VarlenAttentionFunction(torch.autograd.Function):
    forward = staticmethod(_attention_forward)

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        (query, key, value, out, lse), rest = _saved(ctx)
        needs = ctx.needs_input_grad  # op, keyset, query, key, value, then one per argument after value
        sinks_at = 2 + _VARLEN_SINKS
        want_sinks = len(needs) > sinks_at and needs[sinks_at]
        if not (needs[2] or needs[3] or needs[4] or want_sinks):
            return (None,) * len(needs)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        args = (grad_out, query, key, value, out, lse, *rest)
        dq, dk, dv, dsinks = _backward_op("varlen_attention", _varlen_attention_backward, args)
        grads = [None, None, dq if needs[2] else None, dk if needs[3] else None, dv if needs[4] else None]
        grads += [None] * len(rest)
        if want_sinks:
            grads[sinks_at] = dsinks
        return tuple(grads)


_register_autograd("_varlen_attention_autograd", _VarlenAttentionFunction)


# ------------------------------------------------------------------------------------------------------------
# mha

# For each of mha's arguments, where its gradient sits in mha_backward's result (None: no gradient), the one
# mha_backward's output_mask entry names.
_MHA_GRAD_SLOT = tuple(MHA_GRADS.index(name) if name in MHA_GRADS else None for name in MhaArgs._fields)
_MHA_KEY_PADDING_MASK = MhaArgs._fields.index("key_padding_mask")
_mha_backward = torch.ops.attnx.mha_backward.default


class _MhaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, keyset, *args):
        out, lse, weights, q, k, v, attn = _run(op, keyset, *args)
        # The arguments and what attention needs to recompute its probabilities; nothing of size (B, H, L, S).
        ctx.save_for_backward(*(a if isinstance(a, Tensor) else None for a in args), q, k, v, attn, lse)
        ctx.flags = {n: a for n, a in zip(MhaArgs._fields, args, strict=False) if not isinstance(a, Tensor)}
        ctx.one_input = args[0] is args[1] and args[1] is args[2]
        # q, k, v and attn are saved for the backward (the router returns out, lse and weights only).
        ctx.mark_non_differentiable(lse, q, k, v, attn, *(() if ctx.flags["need_weights"] else (weights,)))
        ctx.set_materialize_grads(False)
        return out, lse, weights, q, k, v, attn

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, grad_weights, *_):
        needs = ctx.needs_input_grad[2:]  # after op and keyset; one per argument given
        if needs[_MHA_KEY_PADDING_MASK]:
            raise RuntimeError(
                "attnx.mha: no gradient for a float key_padding_mask, which requires grad. Detach it, or "
                "pass it as part of a float attn_mask, whose gradient attnx computes."
            )
        if grad_out is None and grad_weights is None:
            return (None,) * (2 + len(needs))
        *saved, q, k, v, attn, lse = ctx.saved_tensors
        call = MhaArgs(*saved)._replace(**ctx.flags)
        if grad_out is None:  # out is (L, B, E), or (B, L, E) with batch_first: query's first two dims
            weight = call.out_proj_weight
            grad_out = weight.new_zeros((call.query.shape[0], call.query.shape[1], weight.shape[0]))
        output_mask = [0] * len(MHA_GRADS)
        for arg, slot in enumerate(_MHA_GRAD_SLOT[: len(needs)]):
            if slot is not None:
                output_mask[slot] = int(needs[arg])
        one_input = ctx.one_input
        if one_input:  # one tensor as query, key and value goes in 3 times: mha_backward sees it as one
            output_mask[0] = int(any(output_mask[:3]))
            call = call._replace(key=call.query, value=call.query)
        args = MhaBackwardArgs(grad_out=grad_out, grad_weights=grad_weights, q=q, k=k, v=v, attn=attn,
                               lse=lse, output_mask=output_mask, **call._asdict())
        grads = _backward_op("mha", _mha_backward, args)
        result = [None] * (2 + len(needs))
        for arg, slot in enumerate(_MHA_GRAD_SLOT[: len(needs)]):
            if slot is not None and output_mask[slot] and not (one_input and slot in (1, 2)):
                result[2 + arg] = grads[slot]
        return tuple(result)


_register_autograd("mha_forward", _MhaFunction)
