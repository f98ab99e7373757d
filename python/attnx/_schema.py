"""The argument tables of attnx's ops, read once from their schemas (csrc/schemas.cpp).

An op's schema is the one declaration of its arguments: names, order and defaults. Python code that hands
arguments on without reading most of them (the fake kernels, the autograd Functions, attnx.functional's
plumbing) takes them from these tables instead of retyping the list, so that a new option of attention
touches, in Python, only the public wrapper that documents it (attnx.ops), the spec (attnx.reference) and the
code that reads it. Each table is a namedtuple class: built positionally (``AttentionOptions(*args)``, as the
dispatcher hands a kernel its arguments, trailing defaults left out) or by name, read by name, and passed
on whole (``op(*call)``).

The public wrappers keep their signatures spelled out, as API; :func:`check_signature` holds each to its
op's schema when attnx is imported.
"""

import collections
from collections.abc import Callable

import torch

__all__ = [
    "AttentionArgs", "AttentionBackwardArgs", "AttentionOptions", "MhaArgs", "MhaBackwardArgs",
    "VarlenAttentionArgs", "VarlenAttentionBackwardArgs", "check_signature",
]


def _arguments(op_name: str, first: int = 0) -> list:
    return getattr(torch.ops.attnx, op_name).default._schema.arguments[first:]


def _table(type_name: str, op_name: str, first: int = 0) -> type:
    """A namedtuple of ``attnx::<op_name>``'s arguments from position ``first`` on, with their defaults."""
    arguments = _arguments(op_name, first)
    defaults = [a.default_value for a in arguments if a.has_default_value()]
    if not all(a.has_default_value() for a in arguments[len(arguments) - len(defaults):]):
        # A namedtuple's defaults are those of its last fields; a schema's positional defaults are too.
        raise AssertionError(f"attnx::{op_name}: an argument without a default follows one with a default")
    table = collections.namedtuple(type_name, [a.name for a in arguments], defaults=defaults)
    table.__doc__ = f"attnx::{op_name}'s arguments from {arguments[0].name} on, by name (csrc/schemas.cpp)."
    return table


# attention's arguments, and its options (those after value: attn_mask ... sinks).
AttentionArgs = _table("AttentionArgs", "_attention")
AttentionOptions = _table("AttentionOptions", "_attention", first=3)
# attention_backward's arguments: grad_out, query, key, value, out, lse, attention's options, grad_attn_mask.
AttentionBackwardArgs = _table("AttentionBackwardArgs", "attention_backward")
# mha's 24 arguments (those of mha, _mha and mha_forward).
MhaArgs = _table("MhaArgs", "mha_forward")
# mha_backward's arguments: grad_out, grad_weights, mha's but batch_first, what mha_forward saved (q, k, v,
# attn, lse), output_mask, batch_first.
MhaBackwardArgs = _table("MhaBackwardArgs", "mha_backward")
# varlen_attention's arguments, and its backward's: grad_out, query, key, value, out, lse, then the forward's
# from cu_seqlens_q on.
VarlenAttentionArgs = _table("VarlenAttentionArgs", "_varlen_attention")
VarlenAttentionBackwardArgs = _table("VarlenAttentionBackwardArgs", "varlen_attention_backward")


def check_signature(fn: Callable, op_name: str) -> None:
    """Raises unless ``fn``'s positional parameters are ``attnx::<op_name>``'s arguments, with the same
    names, order and defaults: a wrapper that spells the signature out must follow the schema."""
    code = fn.__code__
    names = code.co_varnames[: code.co_argcount]
    defaults = dict(zip(names[len(names) - len(fn.__defaults__ or ()):], fn.__defaults__ or (), strict=True))
    schema = {a.name: a.default_value if a.has_default_value() else "<none>" for a in _arguments(op_name)}
    ours = {name: defaults.get(name, "<none>") for name in names}
    if list(ours.items()) != list(schema.items()):
        raise AssertionError(
            f"attnx: {fn.__module__}.{fn.__qualname__}'s parameters {ours} differ from attnx::{op_name}'s "
            f"schema {schema} (csrc/schemas.cpp)"
        )
