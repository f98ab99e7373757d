"""CPU kernels of ``torch.nn.attention.varlen.varlen_attn``, on :func:`attnx.varlen_attention`.

PyTorch defines ``torch_attn::_varlen_attn`` (and ``_varlen_attn_out`` and ``_varlen_attn_backward``) as
Python custom ops (``torch.library.custom_op``) whose only kernels run FlashAttention or cuDNN on CUDA; their
fake and autograd kernels are PyTorch's. Importing this module (``import attnx`` does) adds a ``"cpu"``
kernel to each through ``torch.library.register_kernel``, so ``varlen_attn`` works on CPU tensors, forward and
backward, with PyTorch's layouts exactly: out ``(T_q, H, D)`` in query's layout, lse ``(H, T_q)`` float32
(whatever the input dtype, as PyTorch's fake kernel says), and a zero ``rng_state`` (no dropout). Nothing
is overridden: PyTorch has no CPU kernel for these ops.

Why Python rather than a C++ registration: these ops are Python custom ops, so every call runs PyTorch's
Python anyway (``varlen_attn``, the custom op's autograd kernel and its device dispatch); the kernels here add
~3 us per call (docs/integrations.md has the measurements). A C++ kernel under the ``torch_attn`` namespace
would skip the custom op's Python device dispatch too, but it depends on when PyTorch's module defines the op
(after attnx's library loads) and on how the stable ABI boxes its ``SymInt[]?`` and ``SymInt?`` arguments
under the oldest supported torch, which could not be verified here.

Translation:

- ``is_causal`` (``varlen_attn`` sets it for ``window_size == (-1, 0)``) and ``window_size = (left,
  right)`` map onto attnx's bottom-right ``is_causal``, ``window_left`` and ``window_right``, with
  FlashAttention's rule (causal sets the window's right side to 0).
- ``block_table`` (paged cache ``(pages, page_size, H_kv, D)``) and ``seqused_k`` pass through; with
  ``cu_seq_k=None`` each sequence's key count is its ``seqused_k``.
- ``enable_gqa`` only gates PyTorch's own head check in ``varlen_attn``; attnx's kernel indexes the shared kv
  heads either way. ``num_splits`` is accepted and ignored: the CPU kernel never splits a sequence's keys by
  the batch (a sequence's key tiles are 512 keys whatever the other sequences), so a sequence's output does
  not depend on the batch it is in.
- The backward receives PyTorch's float32 lse; for float64 inputs it is widened back (attnx's backward reads
  lse in the accumulator dtype), so float64 gradients carry lse's float32 rounding (~1e-7 relative).
"""

import inspect

import torch
from torch import Tensor

from attnx.ops import varlen_attention, varlen_attention_backward

__all__ = ["AVAILABLE", "REASON"]


def _torch_varlen_ops() -> tuple[bool, str]:
    try:
        import torch.nn.attention.varlen  # noqa: F401  (defines the torch_attn ops)
    except Exception as error:  # absent (ImportError), or a version whose module fails here: never fatal
        return False, f"torch {torch.__version__} has no usable torch.nn.attention.varlen ({error!r})"
    missing = [n for n in ("_varlen_attn", "_varlen_attn_backward") if not hasattr(torch.ops.torch_attn, n)]
    if missing:
        return False, f"torch {torch.__version__} defines no torch_attn::{', '.join(missing)}"
    return True, ""


# Whether the kernels are registered under this torch, and if not, why.
AVAILABLE, REASON = _torch_varlen_ops()


def _window(window_size) -> tuple[int, int]:
    if window_size is None:
        return -1, -1
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    return int(window_size[0]), int(window_size[1])


def _like(reference: Tensor, result: Tensor) -> Tensor:
    """result (contiguous) in reference's layout, as PyTorch's fake kernels promise (``torch.empty_like``):
    itself for a contiguous reference, else copied once into that layout."""
    if reference.is_contiguous():
        return result
    layout = torch.empty_like(reference)
    if layout.stride() == result.stride():
        return result
    return layout.copy_(result)


def _key_offsets(cu_seq_k: Tensor | None, seqused_k: Tensor | None, block_table: Tensor | None) -> Tensor:
    if cu_seq_k is not None:
        return cu_seq_k
    if seqused_k is None or block_table is None:
        raise ValueError("varlen_attn on CPU (attnx): cu_seq_k=None needs block_table and seqused_k")
    return torch.cat([seqused_k.new_zeros(1), seqused_k.cumsum(0, dtype=torch.int32)])


def _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size, seqused_k,
             block_table):
    left, right = _window(window_size)
    out, lse = varlen_attention(
        query, key, value, cu_seq_q, _key_offsets(cu_seq_k, seqused_k, block_table), int(max_q), int(max_k),
        bool(is_causal), scale, left, right, seqused_k, block_table,
    )
    return _like(query, out), lse if lse.dtype == torch.float32 else lse.float()


def varlen_attn_cpu(
    query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None, max_q: int,
    max_k: int, is_causal: bool = False, scale: float | None = None, window_size: list[int] | None = None,
    enable_gqa: bool = False, seqused_k: Tensor | None = None, block_table: Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU kernel of ``torch_attn::_varlen_attn``: ``(out, lse, rng_state)`` as PyTorch's op returns
    them (see the module's docstring for the translation)."""
    out, lse = _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size,
                        seqused_k, block_table)
    return out, lse, torch.zeros((2,), dtype=torch.uint64, device=query.device)


def varlen_attn_out_cpu(
    out: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None,
    max_q: int, max_k: int, is_causal: bool = False, scale: float | None = None,
    window_size: list[int] | None = None, enable_gqa: bool = False, seqused_k: Tensor | None = None,
    block_table: Tensor | None = None, num_splits: int | None = None,
) -> Tensor:
    """The CPU kernel of ``torch_attn::_varlen_attn_out``: writes out, returns lse."""
    result, lse = _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size,
                           seqused_k, block_table)
    out.copy_(result)
    return lse


def varlen_attn_backward_cpu(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, cu_seq_q: Tensor,
    cu_seq_k: Tensor, max_q: int, max_k: int, is_causal: bool, rng_state: Tensor, scale: float | None = None,
    window_size: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU kernel of ``torch_attn::_varlen_attn_backward``: ``(grad_query, grad_key, grad_value)`` in
    the layouts of query, key and value."""
    left, right = _window(window_size)
    if query.dtype == torch.float64:
        lse = lse.double()
    dq, dk, dv, _ = varlen_attention_backward(
        grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, int(max_q), int(max_k), bool(is_causal),
        scale, left, right,
    )
    return _like(query, dq), _like(key, dk), _like(value, dv)


_KERNELS = {
    "_varlen_attn": varlen_attn_cpu,
    "_varlen_attn_backward": varlen_attn_backward_cpu,
    "_varlen_attn_out": varlen_attn_out_cpu,
}


def _translatable(name: str) -> bool:
    """Whether torch_attn::<name>'s arguments are those the kernel above takes, in order (a prefix of them:
    the kernel's trailing parameters have defaults). Another torch may define the op otherwise."""
    schema = getattr(torch.ops.torch_attn, name).default._schema
    params = list(inspect.signature(_KERNELS[name]).parameters)
    return [a.name for a in schema.arguments] == params[: len(schema.arguments)]


if AVAILABLE:
    for _name in ("_varlen_attn", "_varlen_attn_backward"):
        if not _translatable(_name):
            AVAILABLE = False
            REASON = f"torch {torch.__version__}'s torch_attn::{_name} takes other arguments"
    if AVAILABLE:
        for _name, _kernel in _KERNELS.items():
            if hasattr(torch.ops.torch_attn, _name) and _translatable(_name):
                torch.library.register_kernel(f"torch_attn::{_name}", "cpu", _kernel)
