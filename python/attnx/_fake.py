"""The fake (meta) kernels of attnx's ops, and the Python mirrors of the C++ checks and layout rules.

A fake kernel gives an op's outputs (shapes, strides, dtypes) for fake tensors, without data, so that
torch.compile and export trace the op without running it. For that it repeats two things the C++ side owns:
the argument checks, with identical messages (so that a bad call raises the same error at trace time; the
tests pin both sides together: tests/test_linear.py, test_attention.py, test_mha_op.py), and the rules that
decide the outputs' strides. Each mirror names the C++ function it follows; a change there is made here too.

Fakes are registered on the kernel ops (``_linear``, ``_attention``, ``_mha``, ``mha_forward``, ...); the
public ops route to them (csrc/common/routes.cpp) and need none. They take their arguments by the op's
schema (attnx/_schema.py), trailing defaults left out as the dispatcher does.
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from attnx._compat import register_fake
from attnx._schema import (
    AttentionArgs,
    AttentionBackwardArgs,
    MhaArgs,
    MhaBackwardArgs,
    VarlenAttentionArgs,
    VarlenAttentionBackwardArgs,
)

__all__ = ["MHA_GRADS", "linear_out_strides", "scalar_name"]


# ------------------------------------------------------------------------------------------------------------
# Type names as torch's C++ messages print them (torch's own tables; csrc/common/stable.h prints them so).


def _type_meta_name(dtype: torch.dtype) -> str:
    """c10's TypeMeta name (``float``, ``c10::Half``), as torch's C++ messages print a dtype."""
    return {
        torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
        torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
        torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
        torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>",
    }.get(dtype, str(dtype).removeprefix("torch."))


def scalar_name(dtype: torch.dtype) -> str:
    """c10's ScalarType name (``Float``, ``BFloat16``), as torch's C++ messages print it."""
    return {
        torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
        torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
        torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
        torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype).removeprefix("torch."))


# ------------------------------------------------------------------------------------------------------------
# linear: layout rule and checks (mirror csrc/common/linear.cpp)


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, extent = [0] * len(sizes), 1
    for d in reversed(range(len(sizes))):
        strides[d] = extent
        extent *= max(sizes[d], 1)
    return strides


def linear_out_strides(sizes: Sequence[int], strides: Sequence[int], out_sizes: Sequence[int]) -> list[int]:
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
            lambda: f"self and mat2 must have the same dtype, but got {scalar_name(bias.dtype)} "
            f"and {scalar_name(weight.dtype)}",
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


@register_fake("attnx::_linear")
def _linear_fake(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    _check_linear_args(input, weight, bias)
    out_sizes = [*input.shape[:-1], weight.shape[0]]
    return input.new_empty_strided(out_sizes, linear_out_strides(input.shape, input.stride(), out_sizes))


register_fake("attnx::_linear_autograd")(_linear_fake)


# ------------------------------------------------------------------------------------------------------------
# attention: argument checks (mirror csrc/common/attention.cpp) and fake kernels

_ATTENTION_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_attention_mask(mask: Tensor, name: str, query: Tensor) -> None:
    torch._check(
        mask.dtype == torch.bool or mask.dtype in _ATTENTION_DTYPES,
        lambda: f"attnx::attention: expected {name} of dtype bool (True = masked out) or a floating dtype "
        f"(added to the scores: float16, bfloat16, float32 or float64), got {scalar_name(mask.dtype)}",
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
            f"shape (2,), got a {dropout_seed.device} {scalar_name(dropout_seed.dtype)} tensor of shape "
            f"{list(dropout_seed.shape)}",
        )
    else:
        torch._check(
            dropout_p == 0.0,
            lambda: "attnx::attention: expected dropout_seed, a CPU int64 tensor (seed, offset) of shape "
            "(2,), when dropout_p > 0 (attnx.attention draws one from torch's generator), got None with "
            f"dropout_p = {dropout_p}",
        )


def _check_query_key_value_dtypes(
    op: str, query: Tensor, key: Tensor, value: Tensor, *, devices: bool
) -> None:
    """query of an attention dtype, key and value of its dtype and (with ``devices``) on its device: the
    checks of ``check_query_key_value_dtypes_and_devices`` in csrc/common/attention.cpp, in its order; ``op``
    starts the errors. varlen's fake passes ``devices=False``: it leaves the devices to the kernel."""
    torch._check(
        query.dtype in _ATTENTION_DTYPES,
        lambda: f"{op}: expected query of dtype float32, float64, bfloat16 or float16, got "
        f"{scalar_name(query.dtype)}",
    )
    for t, name in ((key, "key"), (value, "value")):
        torch._check(
            t.dtype == query.dtype,
            lambda t=t, name=name: f"{op}: expected {name} of query's dtype {scalar_name(query.dtype)}, got "
            f"{scalar_name(t.dtype)}",
        )
        if devices:
            torch._check(
                t.device == query.device,
                lambda t=t, name=name: f"{op}: expected {name} on query's device {query.device}, "
                f"got {t.device}",
            )


def _check_kv_heads(op: str, H: int, Hkv: int) -> None:
    """Hkv divides H (H == 0 without key/value heads), as ``check_kv_heads`` in csrc/common/attention.cpp."""
    torch._check(
        H % Hkv == 0 if Hkv > 0 else H == 0,
        lambda: f"{op}: expected the number of key/value heads (Hkv = {Hkv}) to divide the number of query "
        f"heads (H = {H})",
    )


def _check_attention_args(a: AttentionArgs | AttentionBackwardArgs) -> None:
    """The checks of ``check_attention_args`` in csrc/common/attention.cpp, for fake tensors (key_lengths'
    values are not checked here: they are data). ``a``: attention's arguments by name."""
    query, key, value = a.query, a.key, a.value
    for t, name, shape in ((query, "query", "(B, H, L, D)"), (key, "key", "(B, Hkv, S, D)"),
                           (value, "value", "(B, Hkv, S, Dv)")):
        torch._check(
            t.dim() == 4,
            lambda t=t, name=name, shape=shape: f"attnx::attention: expected {name} of shape {shape}, "
            f"got a {t.dim()}-D tensor of shape {list(t.shape)}",
        )
    _check_query_key_value_dtypes("attnx::attention", query, key, value, devices=True)
    B, H, L, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    torch._check(
        key.shape[0] == B and key.shape[3] == D,
        lambda: f"attnx::attention: expected key of shape (B, Hkv, S, D) = ({B}, Hkv, S, {D}) to match "
        f"query's B and D, got {list(key.shape)}",
    )
    _check_kv_heads("attnx::attention", H, Hkv)
    torch._check(
        value.shape[0] == B and value.shape[1] == Hkv and value.shape[2] == S,
        lambda: f"attnx::attention: expected value of shape (B, Hkv, S, Dv) = ({B}, {Hkv}, {S}, Dv) to match "
        f"query's B and key's Hkv and S, got {list(value.shape)}",
    )
    attn_mask, key_padding_mask = a.attn_mask, a.key_padding_mask
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
    _check_dropout_args(a.dropout_p, a.dropout_seed)
    window_left, window_right = a.window_left, a.window_right
    torch._check(
        window_left >= -1 and window_right >= -1,
        lambda: "attnx::attention: expected window_left and window_right >= -1 (-1 = unbounded), got "
        f"({window_left}, {window_right})",
    )
    key_lengths, softcap, sinks = a.key_lengths, a.softcap, a.sinks
    if key_lengths is not None:
        torch._check(
            key_lengths.dtype in (torch.int32, torch.int64),
            lambda: f"attnx::attention: expected key_lengths of dtype int32 or int64, got "
            f"{scalar_name(key_lengths.dtype)}",
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
            f"float64), got {scalar_name(sinks.dtype)}",
        )
        torch._check(
            list(sinks.shape) == [H],
            lambda: f"attnx::attention: expected sinks of shape (H,) = ({H},), got {list(sinks.shape)}",
        )
        torch._check(
            sinks.device == query.device,
            lambda: f"attnx::attention: expected sinks on query's device {query.device}, got {sinks.device}",
        )
    _check_block_mask(a, B, H, L, S)


def _check_block_mask(a, B: int, H: int, L: int, S: int) -> None:
    """check_block_mask's shape, dtype and device checks (common/attention.cpp); the entries are not read."""
    block_map, block_bits, block_q, block_k = a.block_map, a.block_bits, a.block_q, a.block_k
    if block_map is None:
        torch._check(
            block_bits is None,
            lambda: "attnx::attention: expected block_bits only with a block_map, got block_bits and no "
            "block_map",
        )
        return
    torch._check(
        block_q > 0 and block_k > 0,
        lambda: f"attnx::attention: expected block_q and block_k > 0, got ({block_q}, {block_k})",
    )
    q_blocks, k_blocks = -(-L // block_q), -(-S // block_k)
    torch._check(
        block_map.dtype == torch.int32,
        lambda: f"attnx::attention: expected block_map of dtype int32, got {scalar_name(block_map.dtype)}",
    )
    shape = list(block_map.shape)
    torch._check(
        len(shape) == 4 and shape[0] in (B, 1) and shape[1] in (H, 1) and shape[2:] == [q_blocks, k_blocks],
        lambda: "attnx::attention: expected block_map of shape (B or 1, H or 1, ceil(L / block_q), "
        f"ceil(S / block_k)) = ({B} or 1, {H} or 1, {q_blocks}, {k_blocks}), got {shape}",
    )
    torch._check(
        block_map.device == a.query.device,
        lambda: f"attnx::attention: expected block_map on query's device {a.query.device}, "
        f"got {block_map.device}",
    )
    if block_bits is not None:
        words = -(-block_k // 32)
        torch._check(
            block_bits.dtype == torch.int32,
            lambda: "attnx::attention: expected block_bits of dtype int32, "
            f"got {scalar_name(block_bits.dtype)}",
        )
        torch._check(
            block_bits.dim() == 3 and list(block_bits.shape[1:]) == [block_q, words],
            lambda: f"attnx::attention: expected block_bits of shape (P, block_q, ceil(block_k / 32)) = (P, "
            f"{block_q}, {words}), got {list(block_bits.shape)}",
        )
        torch._check(
            block_bits.device == a.query.device,
            lambda: f"attnx::attention: expected block_bits on query's device {a.query.device}, "
            f"got {block_bits.device}",
        )


def _lse_dtype(query: Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


@register_fake("attnx::_attention")
def _attention_fake(*args, **kwargs) -> tuple[Tensor, Tensor]:
    a = AttentionArgs(*args, **kwargs)
    _check_attention_args(a)
    query = a.query
    B, H, L, _ = query.shape
    Dv = a.value.shape[3]
    # The kernel's layout: out in memory order (B, L, H, Dv), lse contiguous.
    out = query.new_empty((B, L, H, Dv)).transpose(1, 2)
    return out, query.new_empty((B, H, L), dtype=_lse_dtype(query))


register_fake("attnx::_attention_autograd")(_attention_fake)


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
        lambda: f"attnx::attention_backward: expected {name} of dtype {scalar_name(dtype)}, "
        f"got {scalar_name(t.dtype)}",
    )
    torch._check(
        t.device == query.device,
        lambda: f"attnx::attention_backward: expected {name} on query's device {query.device}, "
        f"got {t.device}",
    )


@register_fake("attnx::attention_backward")
def _attention_backward_fake(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    a = AttentionBackwardArgs(*args, **kwargs)
    _check_attention_args(a)
    query, attn_mask, sinks = a.query, a.attn_mask, a.sinks
    B, H, L, D = query.shape
    Hkv, S, Dv = a.key.shape[1], a.key.shape[2], a.value.shape[3]
    for t, name, shape, shape_name, dtype in (
        (a.grad_out, "grad_out", [B, H, L, Dv], "(B, H, L, Dv)", query.dtype),
        (a.out, "out", [B, H, L, Dv], "(B, H, L, Dv)", query.dtype),
        (a.lse, "lse", [B, H, L], "(B, H, L)", _lse_dtype(query)),
    ):
        _check_attention_backward_tensor(t, name, shape, shape_name, dtype, query)
    # The kernel's layout: out's, memory order (B, N, H, E); the mask's gradient contiguous in its shape.
    want_mask_grad = a.grad_attn_mask and attn_mask is not None and attn_mask.dtype != torch.bool
    return (
        query.new_empty((B, L, H, D)).transpose(1, 2),
        query.new_empty((B, S, Hkv, D)).transpose(1, 2),
        query.new_empty((B, S, Hkv, Dv)).transpose(1, 2),
        attn_mask.new_empty(attn_mask.shape) if want_mask_grad else query.new_empty(0),
        sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0),
    )


# ------------------------------------------------------------------------------------------------------------
# varlen_attention: the shape checks of check_and_describe in csrc/common/varlen_attention.cpp (the offsets',
# seqused_k's and the block table's values are data, checked by the kernel).


def _check_varlen_args(a: VarlenAttentionArgs | VarlenAttentionBackwardArgs) -> None:
    op = "attnx::varlen_attention"
    query, key, value = a.query, a.key, a.value
    paged = a.block_table is not None
    kv_dims = 4 if paged else 3
    k_shape = "(pages, page_size, Hkv, D) with block_table" if paged else "(total_k, Hkv, D)"
    v_shape = "(pages, page_size, Hkv, Dv) with block_table" if paged else "(total_k, Hkv, Dv)"
    torch._check(
        query.dim() == 3,
        lambda: f"{op}: expected query of shape (total_q, H, D), got a {query.dim()}-D tensor of shape "
        f"{list(query.shape)}",
    )
    for t, name, shape in ((key, "key", k_shape), (value, "value", v_shape)):
        torch._check(
            t.dim() == kv_dims,
            lambda t=t, name=name, shape=shape: f"{op}: expected {name} of shape {shape}, got a {t.dim()}-D "
            f"tensor of shape {list(t.shape)}",
        )
    _check_query_key_value_dtypes(op, query, key, value, devices=False)
    H, Hkv = query.shape[1], key.shape[kv_dims - 2]
    _check_kv_heads(op, H, Hkv)
    for t, name in ((a.cu_seqlens_q, "cu_seqlens_q"), (a.cu_seqlens_k, "cu_seqlens_k")):
        torch._check(
            t.dtype == torch.int32,
            lambda t=t, name=name: f"{op}: expected {name} of dtype int32, got {scalar_name(t.dtype)}",
        )


@register_fake("attnx::_varlen_attention")
def _varlen_attention_fake(*args, **kwargs) -> tuple[Tensor, Tensor]:
    a = VarlenAttentionArgs(*args, **kwargs)
    _check_varlen_args(a)
    total_q, H, _ = a.query.shape
    return a.query.new_empty((total_q, H, a.value.shape[-1])), a.query.new_empty(
        (H, total_q), dtype=_lse_dtype(a.query)
    )


register_fake("attnx::_varlen_attention_autograd")(_varlen_attention_fake)


@register_fake("attnx::varlen_attention_backward")
def _varlen_attention_backward_fake(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a = VarlenAttentionBackwardArgs(*args, **kwargs)
    _check_varlen_args(a)
    query, key, value, sinks = a.query, a.key, a.value, a.sinks
    return (
        query.new_empty(query.shape),
        query.new_empty(key.shape),
        query.new_empty(value.shape),
        sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(0),
    )


# ------------------------------------------------------------------------------------------------------------
# mha: fake kernels (the checks that shape the outputs; the kernel checks the rest), mirroring
# csrc/common/mha.cpp


def _mha_out_fake(query: Tensor, a: MhaArgs, key_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """mha's (out, lse, weights) for fake tensors; ``query`` is (L, B, E), ``key_len`` counts the appended
    keys."""
    L, B, E = query.shape
    H = a.num_heads
    # The out projection reads the attention output, laid out (B, L, H, D), through its (L, B, E) view: the
    # output's strides follow linear's layout rule for that view.
    out_sizes = (L, B, E)
    out = query.new_empty_strided(out_sizes, linear_out_strides(out_sizes, (E, L * E, 1), out_sizes))
    lse = query.new_empty((B, H, L), dtype=_lse_dtype(query))
    if not a.need_weights:
        weights = query.new_empty(0)
    else:
        weights = query.new_empty((B, L, key_len) if a.average_attn_weights else (B, H, L, key_len))
    return (out.transpose(0, 1) if a.batch_first else out), lse, weights


def _check_mha_fake_args(a: MhaArgs | MhaBackwardArgs) -> None:
    query, num_heads = a.query, a.num_heads
    torch._check(
        query.dim() == 3,
        lambda: f"attnx::mha: expected query of shape {'(B, L, E)' if a.batch_first else '(L, B, E)'}, "
        f"got {list(query.shape)}",
    )
    E = query.shape[2]
    torch._check(
        num_heads > 0 and E % num_heads == 0,
        lambda: f"attnx::mha: expected embed_dim ({E}) divisible by num_heads ({num_heads})",
    )


def _key_len(a: MhaArgs, key: Tensor) -> int:
    """S': the keys attention sees, appended ones included (``key`` is (S, B, kdim))."""
    appended = int(a.bias_k is not None) + int(a.add_zero_attn)
    return (key.shape[0] if a.static_k is None else a.static_k.shape[1]) + appended


@register_fake("attnx::_mha")
def _mha_fake(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    a = MhaArgs(*args, **kwargs)
    _check_mha_fake_args(a)
    query, key, _ = _seq_first(a.query, a.key, a.value, a.batch_first)
    return _mha_out_fake(query, a, _key_len(a, key))


def _seq_first(query, key, value, batch_first):
    """``seq_first`` in csrc/common/mha.cpp: (N, B, F) views of batch_first (B, N, F) arguments, one tensor
    passed as several staying one."""
    if not batch_first:
        return query, key, value
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = k if value is key else q if value is query else value.transpose(0, 1)
    return q, k, v


@register_fake("attnx::mha_forward")
def _mha_forward_fake(*args, **kwargs) -> tuple[Tensor, ...]:
    # The layouts of mha_forward_impl in csrc/common/mha.cpp: the same projections (run as linear's fake), the
    # same views and appended keys.
    a = MhaArgs(*args, **kwargs)
    _check_mha_fake_args(a)
    query, key, value = _seq_first(a.query, a.key, a.value, a.batch_first)
    bias_k, static_k, static_v = a.bias_k, a.static_k, a.static_v
    L, B, E = query.shape
    H = a.num_heads

    def project(x, rows):
        w = x.new_empty((rows, x.shape[2]))
        return _linear_fake(x, w, None)

    # in_projections in csrc/common/mha.cpp: one output per projection, whatever the device.
    q = project(query, E)
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
    if a.add_zero_attn:
        k4 = torch.constant_pad_nd(k4, (0, 0, 0, 1))
        v4 = torch.constant_pad_nd(v4, (0, 0, 0, 1))
    else:  # static_k / static_v used as they are: not returned (outputs never alias inputs)
        k4 = query.new_empty(0) if static_k is not None else k4
        v4 = query.new_empty(0) if static_v is not None else v4
    attn = query.new_empty((B, L, H, E // H)).transpose(1, 2)
    return (*_mha_out_fake(query, a, _key_len(a, key)), q4, k4, v4, attn)


# Positions of mha_backward's gradients (and of its output_mask entries); mirrors MhaGrad in
# csrc/common/mha.cpp.
MHA_GRADS = (
    "query", "key", "value", "in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "bias_k", "bias_v", "out_proj_weight", "out_proj_bias", "static_k", "static_v",
    "attn_mask",
)


@register_fake("attnx::mha_backward")
def _mha_backward_fake(*args, **kwargs) -> list[Tensor]:
    a = MhaBackwardArgs(*args, **kwargs)
    _check_mha_fake_args(a)
    output_mask, query = a.output_mask, a.query
    torch._check(
        len(output_mask) == len(MHA_GRADS),
        lambda: f"attnx::mha_backward: expected output_mask of {len(MHA_GRADS)} entries, "
        f"got {len(output_mask)}",
    )
    wanted = dict(zip(MHA_GRADS, output_mask, strict=True))
    if query is a.key and a.key is a.value:  # one tensor as query, key and value: one gradient, grad_query
        wanted["query"] = wanted["query"] or wanted["key"] or wanted["value"]
        wanted["key"] = wanted["value"] = False
    grads = []
    for name in MHA_GRADS:
        t = getattr(a, name)
        if name == "attn_mask" and t is not None and t.dtype == torch.bool:
            t = None  # a bool mask has no gradient
        if t is None or not wanted[name]:
            grads.append(query.new_empty(0))
        elif name in ("query", "key", "value"):  # memory order (B, N, F), as the GEMM writes it
            if a.batch_first:  # t is (B, N, F)
                grads.append(t.new_empty(t.shape))
            else:
                grads.append(t.new_empty((t.shape[1], t.shape[0], t.shape[2])).transpose(0, 1))
        else:
            grads.append(t.new_empty(t.shape))
    return grads
