"""CPU kernels of ``torch.nn.attention.varlen.varlen_attn``, on :func:`attnx.varlen_attention`.

PyTorch defines ``torch_attn::_varlen_attn`` (and ``_varlen_attn_out`` and ``_varlen_attn_backward``) as
Python custom ops (``torch.library.custom_op``) whose only kernels run FlashAttention or cuDNN on CUDA; their
fake and autograd kernels are PyTorch's. Once this module is imported (``import attnx`` does), a ``"cpu"``
kernel is added to each through ``torch.library.register_kernel`` when ``torch.nn.attention.varlen`` is
(the module defines the ops; importing it takes seconds, as it imports ``torch._dynamo``, so ``import attnx``
does not import it for users who never call ``varlen_attn``). ``varlen_attn`` then works on CPU tensors,
forward and backward, with PyTorch's layouts exactly: out ``(T_q, H, D)`` in query's layout, lse ``(H, T_q)``
float32 (whatever the input dtype, as PyTorch's fake kernel says), and a zero ``rng_state`` (no dropout).
Nothing is overridden: PyTorch has no CPU kernel for these ops.

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

import importlib
import importlib.abc
import inspect
import sys

import torch
from torch import Tensor

from attnx.ops import varlen_attention, varlen_attention_backward

__all__ = ["AVAILABLE", "REASON"]  # noqa: F822  (the module's __getattr__ answers them)

# The module that defines the torch_attn ops.
_MODULE = "torch.nn.attention.varlen"

# (AVAILABLE, REASON) once registration was tried; None before torch.nn.attention.varlen was imported.
_status: tuple[bool, str] | None = None


def __getattr__(name: str):
    """``AVAILABLE`` (whether the kernels are registered under this torch) and ``REASON`` (if not, why):
    asking imports torch.nn.attention.varlen, which registers them, when nothing imported it yet."""
    if name not in ("AVAILABLE", "REASON"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global _status
    if _status is None:
        try:
            importlib.import_module(_MODULE)
        except Exception as error:  # absent (ImportError), or a version whose module fails here: never fatal
            _status = False, f"torch {torch.__version__} has no usable {_MODULE} ({error!r})"
    available, reason = _status if _status is not None else (False, f"{_MODULE} did not register")
    return available if name == "AVAILABLE" else reason


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


def _register() -> None:
    """Registers the kernels on the ops torch.nn.attention.varlen defined (once), or records why not."""
    global _status
    if _status is not None:
        return
    missing = [n for n in ("_varlen_attn", "_varlen_attn_backward") if not hasattr(torch.ops.torch_attn, n)]
    if missing:
        _status = False, f"torch {torch.__version__} defines no torch_attn::{', '.join(missing)}"
        return
    for name in ("_varlen_attn", "_varlen_attn_backward"):
        if not _translatable(name):
            _status = False, f"torch {torch.__version__}'s torch_attn::{name} takes other arguments"
            return
    for name, kernel in _KERNELS.items():
        if hasattr(torch.ops.torch_attn, name) and _translatable(name):
            torch.library.register_kernel(f"torch_attn::{name}", "cpu", kernel)
    _status = True, ""


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds torch.nn.attention.varlen through the other finders and registers the kernels once its module has
    run (the import machinery holds the module's lock meanwhile, so no call sees the ops without them)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        specs = (f.find_spec(fullname, path, target) for f in sys.meta_path if hasattr(f, "find_spec"))
        spec = next((s for s in specs if s is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


if _MODULE in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterOnImport())
