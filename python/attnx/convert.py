"""``convert(model)`` / ``revert(model)``: run a model's ``nn.MultiheadAttention`` on attnx, and back.

Conversion retypes modules in place (``module.__class__ = ...``, as ``torch.nn.utils.parametrize`` does):
attnx's classes subclass torch's and add no state, so a converted module is the same object with the same
Parameters, buffers, hooks and ``state_dict``, and ``revert`` is the reverse retyping. Only modules whose type
is exactly torch's class are converted: a subclass may override ``forward``, and retyping would drop it.

Swapping ``self_attn`` alone is not enough, because torch has two eval fast paths that never call it:
- ``nn.TransformerEncoderLayer.forward`` may call ``torch._transformer_encoder_layer_fwd`` with
  ``self_attn``'s weights. Converted layers become :class:`attnx.nn.TransformerEncoderLayer`, whose
  ``forward`` is torch's slow path, so ``self_attn`` always runs. (Flipping one of the attributes torch's
  fast-path test reads, such as ``activation_relu_or_gelu``, would also work, but would lie about the layer
  and silently stop working when torch changes the test.)
- ``nn.TransformerEncoder.forward`` may turn padded input into a nested tensor that the layers then get,
  and which attnx's attention does not take. ``use_nested_tensor`` is torch's switch for exactly this path;
  ``convert`` sets it to False on encoders with converted layers and ``revert`` restores its value.

Other libraries' attention modules are converted the same way, by retyping to attnx subclasses, when the
library is imported (checked in ``sys.modules``; attnx never imports it first: a model cannot hold a module of
a library that is not imported): timm's (:mod:`attnx.integrations.timm`) and open_clip's
(:mod:`attnx.integrations.open_clip`, which also runs the text tower's causal mask as causal attention).
Each integration module gives ``CONVERSIONS`` (library class -> attnx class) and ``accepts(module)``, the
modules of those types it can run.
"""

import importlib
import sys

import torch

from attnx import nn as attnx_nn

__all__ = ["convert", "revert"]

# torch class -> attnx class, retyped in both directions.
_CONVERSIONS = {
    torch.nn.MultiheadAttention: attnx_nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer: attnx_nn.TransformerEncoderLayer,
}
_REVERSIONS = {attnx_cls: torch_cls for torch_cls, attnx_cls in _CONVERSIONS.items()}

# Where convert() keeps an encoder's own use_nested_tensor, for revert().
_SAVED_NESTED = "_attnx_saved_use_nested_tensor"

# Library (top-level module name) -> the attnx module that converts its attention modules.
_INTEGRATIONS = {"timm": "attnx.integrations.timm", "open_clip": "attnx.integrations.open_clip"}


def _integrations(loaded_only: bool) -> list:
    """The integration modules that apply: for ``convert``, those of the libraries imported now (importing
    the integration then); for ``revert``, those already imported, the only ones whose classes a model can
    hold (unpickling a converted model imports them too)."""
    found = []
    for library, name in _INTEGRATIONS.items():
        if name in sys.modules:
            found.append(sys.modules[name])
        elif not loaded_only and library in sys.modules:
            found.append(importlib.import_module(name))
    return found


def convert(model: torch.nn.Module) -> torch.nn.Module:
    """Make every ``nn.MultiheadAttention`` in ``model`` (``model`` itself included) run attnx's ops.

    In place: each ``torch.nn.MultiheadAttention`` becomes :class:`attnx.nn.MultiheadAttention` and each
    ``torch.nn.TransformerEncoderLayer`` :class:`attnx.nn.TransformerEncoderLayer` (same objects, same
    Parameters), and ``nn.TransformerEncoder`` stops converting input to nested tensors. Outputs are those of
    torch's slow path, in train and eval. timm's and open_clip's attention modules are converted too when that
    library is imported (see the module doc, :mod:`attnx.integrations.timm` and
    :mod:`attnx.integrations.open_clip`). Modules whose type is a subclass of torch's are left alone.
    Idempotent.

    Args:
        model: any module; converted in place.

    Returns:
        ``model`` itself.
    """
    integrations = _integrations(loaded_only=False)
    for module in model.modules():
        target = _CONVERSIONS.get(type(module))
        if target is not None:
            module.__class__ = target
            continue
        for integration in integrations:
            target = integration.CONVERSIONS.get(type(module))
            if target is not None and integration.accepts(module):
                module.__class__ = target
    for module in model.modules():
        if isinstance(module, torch.nn.TransformerEncoder) and not hasattr(module, _SAVED_NESTED):
            if any(isinstance(layer, attnx_nn.TransformerEncoderLayer) for layer in module.layers):
                setattr(module, _SAVED_NESTED, getattr(module, "use_nested_tensor", None))
                module.use_nested_tensor = False
    return model


def revert(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`convert`: torch's classes again, for the same objects and Parameters.

    Torch's behaviour comes back, fast paths and nested tensors included, and timm's and open_clip's modules
    get their own classes back.

    Args:
        model: any module; each attnx module in it (converted, or built as one) is retyped in place.

    Returns:
        ``model`` itself.
    """
    reversions = dict(_REVERSIONS)
    for integration in _integrations(loaded_only=True):
        reversions.update({attnx_cls: cls for cls, attnx_cls in integration.CONVERSIONS.items()})
    for module in model.modules():
        target = reversions.get(type(module))
        if target is not None:
            module.__class__ = target
        if isinstance(module, torch.nn.TransformerEncoder) and hasattr(module, _SAVED_NESTED):
            saved = getattr(module, _SAVED_NESTED)
            delattr(module, _SAVED_NESTED)
            if saved is None:
                del module.use_nested_tensor  # an old pickle without the attribute: leave it absent again
            else:
                module.use_nested_tensor = saved
    return model
