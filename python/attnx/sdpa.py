"""PyTorch's ``F.scaled_dot_product_attention`` on attnx's CPU kernels: the SDPA takeover, opt-in.

While the takeover is on, every CPU call that SDPA sends to its FLASH backend (almost all of them: float32,
float64, bfloat16 and float16, with or without a mask, ``is_causal``, grouped KV heads; not dropout) runs on
attnx's kernels, forward and backward, with PyTorch's semantics and output layouts. PyTorch's backend
selection, derivative formula and meta kernels stay as they are, so models need no change: transformers'
``sdpa``, diffusers, timm, torchvision and anything else calling SDPA. What attnx does not take (dropout,
inputs PyTorch's kernel itself refuses) goes to PyTorch's kernel. The kernels are C++ registrations
(csrc/pytorch/sdpa.cpp): no Python runs per call.

Turn it on in any of three ways; each is process-wide::

    torch.nn.attention.activate_flash_attention_impl("attnx")   # through PyTorch's registry
    torch.nn.attention.restore_flash_attention_impl()           # ... and off

    attnx.sdpa.enable()                                         # without the registry
    attnx.sdpa.disable()

    with attnx.sdpa.enabled():                                  # for a block
        model(x)

``import attnx`` registers the name ``"attnx"`` with PyTorch's registry where it exists, without activating
it, as the registry asks of providers.

Covered: CPU only (the op above is CPU's; CUDA's SDPA kernels are not replaced). Not covered: ahead-of-time
compiled code (AOTInductor, ``cpp_wrapper``) calls PyTorch's kernel directly, not through the dispatcher.
"""

import warnings

import torch

from attnx import _switch

__all__ = ["enable", "disable", "enabled", "is_enabled"]

_FORWARD = "aten::_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"

# The library that holds the fallback ops' kernels: PyTorch's own, taken from the dispatcher at import (see
# csrc/pytorch/sdpa.cpp).
_fallback_library = None


def _register_fallbacks() -> None:
    """attnx::_sdpa_for_cpu_fallback (and its backward) as PyTorch's CPU kernels of the two aten ops. Taken
    while they are still PyTorch's: the aten op called from inside attnx's kernel would call attnx's again."""
    global _fallback_library
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    library = torch.library.Library("attnx", "IMPL")
    fallbacks = {"_sdpa_for_cpu_fallback": _FORWARD, "_sdpa_for_cpu_backward_fallback": _BACKWARD}
    for name, aten_op in fallbacks.items():
        kernel = torch.library.get_kernel(aten_op, "CPU")

        def call(*args, _kernel=kernel, **kwargs):
            return _kernel.call_boxed(keys, *args, **kwargs)

        library.impl(name, call, "CPU")
    _fallback_library = library


def enable() -> None:
    """Turn the takeover on (nothing happens when it is on already).

    On CPUs where PyTorch's kernel runs 16-bit GEMMs on AMX tiles and attnx's does not, the forward of
    that dtype stays PyTorch's: float16 on CPUs with AMX-FP16 (attnx's float16 kernels compute in float32;
    not measured on such a CPU), and bfloat16 on CPUs with AMX when attnx was asked for a
    variant below ``amx_bf16`` (``ATTNX_CPU_CAPABILITY``). Decoding steps (one query row) are attnx's
    either way, and so is the backward. With its own bfloat16 products on AMX tiles, attnx's forward
    measured 0.86-0.98x PyTorch's time and forward + backward 0.39-0.45x (``python -m benchmarks --only
    sdpa``, a 2-core Xeon with AMX).

    PyTorch warns once per process that a kernel is being overridden; attnx silences that warning for its own
    registration only, since overriding is what was asked for.
    """
    # PyTorch's kernel has AMX where torch says so; attnx's bfloat16 kernels have it where their variant is
    # amx_bf16 (and float16's never).
    amx_bf16 = torch.ops.attnx._cpu_capability() == "amx_bf16"
    _enable(torch.cpu._is_amx_tile_supported() and not amx_bf16, torch.cpu._is_amx_fp16_supported())


def _enable(keep_bf16_forward: bool, keep_fp16_forward: bool) -> None:
    """enable(), with the 16-bit forwards left to PyTorch's kernel given (the tests take attnx's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        torch.ops.attnx._sdpa_takeover(True, keep_bf16_forward, keep_fp16_forward)


def disable() -> None:
    """Turn the takeover off: PyTorch's kernels again (nothing happens when it is off)."""
    torch.ops.attnx._sdpa_takeover(False)


def enabled():
    """The takeover on for a ``with`` block, then back to how it was."""
    return _switch.while_on(is_enabled, enable, disable)


def is_enabled() -> bool:
    """Whether the takeover is on."""
    return torch.ops.attnx._sdpa_takeover(None)


class _Handle:
    """What PyTorch's registry keeps for an active implementation: ``remove()`` turns it off."""

    def remove(self) -> None:
        disable()


def _activate() -> _Handle:
    enable()
    return _Handle()


def _register() -> None:
    """At import: the fallbacks, and the name "attnx" in PyTorch's flash-attention registry, not activated."""
    _register_fallbacks()
    register = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if register is not None:
        register("attnx", register_fn=_activate)
