"""Typed wrappers, fake kernels and autograd for the ops under ``torch.ops.attnx``.

This is the only module that touches ``torch.ops.attnx``. Fakes let torch.compile and export trace the ops
without running them. Autograd is registered on the ops themselves, so compiled graphs see one op: here with
``torch.library.register_autograd``, or in C++ (csrc/autograd/) for ops cheap enough that a Python autograd
kernel would cost as much as the op (linear).
"""

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from attnx import reference

__all__ = ["linear", "mha"]


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` that takes every input layout without a detour.

    input ``(*, K)``, weight ``(N, K)``, bias ``(N,)`` or None; returns ``(*, N)``, equal to
    ``F.linear(input, weight, bias)``. Leading dims that form one dense block of rows, in any memory order
    (a B=1 transpose, ``(L, B, E)`` views of batch-first data, slices with a storage offset, size-1 dims with any
    stride), run as one GEMM without a copy, and the output keeps the memory order of input's leading dims
    (contiguous whenever input's rows are in logical order). Rows repeated by stride-0 dims are computed once.
    Any other layout is copied exactly once. Differentiable in input, weight and bias.
    """
    return torch.ops.attnx.linear.default(input, weight, bias)


def mha(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    num_heads: int,
    in_proj_weight: Optional[Tensor],
    in_proj_bias: Optional[Tensor],
    q_proj_weight: Optional[Tensor],
    k_proj_weight: Optional[Tensor],
    v_proj_weight: Optional[Tensor],
    bias_k: Optional[Tensor],
    bias_v: Optional[Tensor],
    add_zero_attn: bool,
    out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    attn_mask: Optional[Tensor],
    is_causal: bool,
    static_k: Optional[Tensor],
    static_v: Optional[Tensor],
    need_weights: bool,
    average_attn_weights: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole ``nn.MultiheadAttention`` forward in one dispatch; returns ``(out, lse, weights)``.

    Batched and sequence-first, any strides (a batch-first caller passes ``x.transpose(0, 1)`` views): query
    ``(L, B, E)``, key ``(S, B, kdim)``, value ``(S, B, vdim)``. Exactly one of in_proj_weight ``(3E, E)`` or
    q/k/v_proj_weight ``(E, E)``, ``(E, kdim)``, ``(E, vdim)``; in_proj_bias ``(3E,)`` applies in both cases.
    bias_k, bias_v ``(1, 1, E)``; static_k, static_v ``(B*H, S, E/H)``; add_zero_attn appends a zero key.
    key_padding_mask ``(B, S)`` and attn_mask ``(L, S)`` or ``(B*H, L, S)``, each bool (``True`` = masked out)
    or float (added), read in place, never merged; appended keys extend them by one unmasked column.
    ``is_causal`` applies a causal mask. No dropout.

    Returns out ``(L, B, E)``; lse ``(B, H, L)`` in float32 (float64 for float64 inputs), ``+inf`` for a
    fully masked row, whose out is 0; weights ``(B, L, S')`` if average_attn_weights else ``(B, H, L, S')``
    when need_weights (NaN for a fully masked row), else an empty ``(0,)`` tensor. The semantics are
    :func:`attnx.reference.mha`.
    """
    # Temporary: the fused C++ op torch.ops.attnx.mha replaces this body once it is registered.
    return reference.mha(
        query, key, value, num_heads, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight,
        v_proj_weight, bias_k, bias_v, add_zero_attn, out_proj_weight, out_proj_bias, key_padding_mask,
        attn_mask, is_causal, static_k, static_v, need_weights, average_attn_weights,
    )


# ---------------------------------------------------------------------------------------------------------------
# linear: layout rule (mirrors csrc/common/linear.cpp) and fake kernel; autograd is csrc/autograd/linear_autograd.cpp


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, extent = [0] * len(sizes), 1
    for d in reversed(range(len(sizes))):
        strides[d] = extent
        extent *= max(sizes[d], 1)
    return strides


def _linear_out_strides(sizes: Sequence[int], strides: Sequence[int], out_sizes: Sequence[int]) -> list[int]:
    """Strides of linear's output; the same rule as ``fold_rows``/``output_strides`` in csrc/common/linear.cpp."""
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


def _check_linear_args(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
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
            lambda: f"The expanded size of the tensor ({n}) must match the existing size ({bias.shape[0]}) at "
            f"non-singleton dimension 1.  Target sizes: [{m}, {n}].  Tensor sizes: [{bias.shape[0]}]",
        )


def _type_meta_name(dtype: torch.dtype) -> str:
    """c10's TypeMeta name (``float``, ``c10::Half``), as torch's C++ messages print a dtype."""
    return {
        torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
        torch.int64: "long int", torch.int32: "int", torch.int16: "short int", torch.int8: "signed char",
        torch.uint8: "unsigned char", torch.bool: "bool", torch.complex64: "c10::complex<float>",
        torch.complex128: "c10::complex<double>",
    }.get(dtype, str(dtype).removeprefix("torch."))


def _scalar_name(dtype: torch.dtype) -> str:
    """c10's ScalarType name (``Float``, ``BFloat16``), as torch's C++ messages print it."""
    return {
        torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
        torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
        torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype).removeprefix("torch."))


@torch.library.register_fake("attnx::linear")
def _linear_fake(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    _check_linear_args(input, weight, bias)
    out_sizes = [*input.shape[:-1], weight.shape[0]]
    return input.new_empty_strided(out_sizes, _linear_out_strides(input.shape, input.stride(), out_sizes))
