"""open_clip's attention on attnx: what :func:`attnx.convert` does to open_clip models.

open_clip's towers are stacks of ``ResidualAttentionBlock``, whose ``attn`` is a
``torch.nn.MultiheadAttention(batch_first=True)`` called with ``need_weights=False``. :func:`attnx.convert`
retypes those (and ``AttentionalPooler.attn``) to :class:`attnx.nn.MultiheadAttention` as in any model. What
this module adds is the text tower's mask: ``CLIP.encode_text`` and ``TextTransformer`` pass their causal
``attn_mask`` buffer (``build_causal_mask``: a float ``(L, L)`` tensor, ``-inf`` above the diagonal, 0
elsewhere) to every block, and every block would add it to its scores. A converted stack runs causal
attention instead: no mask tensor is read, and the key tiles above the diagonal are skipped.

:func:`attnx.convert` imports this module only when open_clip is already imported, and retypes, in place,
each module whose type is exactly one of:

- ``open_clip.transformer.Transformer`` -> :class:`Transformer`: ``forward`` and ``forward_intermediates``
  look at ``attn_mask`` once per call; when it is a float ``(L, L)`` tensor (``L`` the sequence length) equal
  to the causal mask and does not require grad, the blocks get a :class:`CausalMask` instead, provided
  every block is one of the two below (else they get the mask unchanged). The comparison is made once per
  mask tensor and in-place version (cached by identity, a weak reference), so the buffer that
  ``encode_text`` passes on each call costs one check (on a GPU, one synchronisation) in the model's life.
  Any other mask, such as the ``(B*heads, L, L)`` padding-and-causal mask that ``TextTransformer`` builds
  with ``_build_additive_mask``, reaches the blocks unchanged and is added as open_clip adds it.
- ``open_clip.transformer.ResidualAttentionBlock`` -> :class:`ResidualAttentionBlock`: given a
  :class:`CausalMask`, calls ``attn(..., need_weights=False, attn_mask=<the mask>, is_causal=True)``, which
  :class:`attnx.nn.MultiheadAttention` (as torch's module without weights) runs as causal attention without
  reading the mask; any other mask as open_clip does.
- ``open_clip.transformer.CustomResidualAttentionBlock`` -> :class:`CustomResidualAttentionBlock`: hands a
  :class:`CausalMask` on to its ``attn`` when that is attnx's :class:`Attention`, else the mask tensor.
- ``open_clip.transformer.Attention`` (the ``attn`` of ``CustomResidualAttentionBlock``, used with
  ``qk_norm``, ``scale_heads``, ``inner_norm``...) -> :class:`Attention`: open_clip's projections, norms and
  head scaling around one :func:`attnx.attention` on strided ``(N, H, L, D)`` views, with its masks (3-D
  ``(N*heads, L, L)`` or 2-D; bool ``True`` = masked out, as attnx reads it; float cast to q's dtype and
  added) and ``attn_drop.p`` in training. Instances with ``scaled_cosine`` are left as they are: open_clip
  3.3's own forward fails on that path (``torch.bmm`` on 4-D tensors), so there is nothing to match.

The subclasses add no state and override only ``forward`` / ``attention``: same objects, Parameters,
buffers (the causal buffer included: it stays registered and is still passed, only not read) and
``state_dict``; :func:`attnx.revert` retypes them back, and the model adds the mask again. Outputs are those
of the unconverted model, except that a query row that every mask entry removes gives 0 here and NaN there.

Left out: ``MultimodalTransformer`` (CoCa's decoder, a subclass of ``Transformer``) passes a fresh slice of
its causal buffer to each block; its blocks are converted, and add that mask as open_clip does.
``CustomTransformer`` (unused by open_clip's own models) is not retyped; its blocks are, and add masks.
"""

import torch
import torch.nn.functional as F
from open_clip import transformer as oc
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from attnx import ops

__all__ = [
    "Attention", "CONVERSIONS", "CausalMask", "CustomResidualAttentionBlock", "ResidualAttentionBlock",
    "Transformer", "accepts", "is_causal_mask",
]


class CausalMask:
    """What a converted :class:`Transformer` hands its blocks in place of a causal float mask. ``mask`` is
    that mask, for a block that needs a tensor after all."""

    __slots__ = ("mask",)

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask


# mask tensor -> (its _version when checked, whether it was causal). Weak by identity: entries go with
# their tensors, and tensors are never compared with == (which would be elementwise).
_CHECKED = WeakIdKeyDictionary()


def is_causal_mask(mask: object, length: int) -> bool:
    """Whether ``mask`` is a float ``(length, length)`` tensor equal to ``build_causal_mask``'s: ``-inf``
    strictly above the diagonal, 0 elsewhere. A mask that requires grad is never causal here: adding it is
    what gives it its gradient."""
    if not isinstance(mask, Tensor) or mask.shape != (length, length) or not mask.is_floating_point():
        return False
    if mask.requires_grad:
        return False
    try:
        version = mask._version
    except RuntimeError:  # inference tensors have no version counter: check each time
        version = None
    seen = _CHECKED.get(mask) if version is not None else None
    if seen is not None and seen[0] == version:
        return seen[1]
    causal = torch.equal(mask, torch.full_like(mask, float("-inf")).triu_(1))
    if version is not None:
        _CHECKED[mask] = (version, causal)
    return causal


class ResidualAttentionBlock(oc.ResidualAttentionBlock):
    """``open_clip.transformer.ResidualAttentionBlock`` that takes a :class:`CausalMask` as ``attn_mask``."""

    def attention(
        self,
        q_x: Tensor,
        k_x: Tensor | None = None,
        v_x: Tensor | None = None,
        attn_mask: Tensor | CausalMask | None = None,
    ) -> Tensor:
        if not isinstance(attn_mask, CausalMask):
            return super().attention(q_x, k_x=k_x, v_x=v_x, attn_mask=attn_mask)
        k_x = k_x if k_x is not None else q_x
        v_x = v_x if v_x is not None else q_x
        # torch's hint: with need_weights=False and no key_padding_mask, the module runs causal attention
        # and does not read the mask (attnx's module and torch's alike).
        return self.attn(q_x, k_x, v_x, need_weights=False, attn_mask=attn_mask.mask, is_causal=True)[0]


class Attention(oc.Attention):
    """``open_clip.transformer.Attention`` whose attention is :func:`attnx.attention`.

    ``forward(x, attn_mask=None)``: x ``(N, L, C)``; attn_mask ``(L, L)``, ``(N*num_heads, L, L)`` or
    ``(N, num_heads, L, L)``, bool ``True`` = masked out or float added, or a :class:`CausalMask`.
    Returns ``(N, L, C)``."""

    def forward(self, x: Tensor, attn_mask: Tensor | CausalMask | None = None) -> Tensor:
        N, L, C = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        # (N, H, L, D) views of the projection, read in place by attnx.
        q = q.reshape(N, L, self.num_heads, -1).transpose(1, 2)
        k = k.reshape(N, L, self.num_heads, -1).transpose(1, 2)
        v = v.reshape(N, L, self.num_heads, -1).transpose(1, 2)

        is_causal = isinstance(attn_mask, CausalMask)
        if is_causal:
            attn_mask = None
        elif attn_mask is not None:
            if attn_mask.ndim == 3:
                attn_mask = attn_mask.reshape(N, self.num_heads, L, L)  # open_clip's reading of 3-D masks
            if attn_mask.dtype != torch.bool:
                attn_mask = attn_mask.to(dtype=q.dtype)
            # A bool mask stays bool: open_clip's True = masked out is attnx's meaning.

        q = self.ln_q(q)
        k = self.ln_k(k)
        dropout_p = self.attn_drop.p if self.training else 0.0
        x, _ = ops.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)

        if self.head_scale is not None:
            x = x * self.head_scale
        x = x.transpose(1, 2).reshape(N, L, C)
        x = self.ln_inner(x)
        x = self.out_proj(x)
        x = self.out_drop(x)
        return x


class CustomResidualAttentionBlock(oc.CustomResidualAttentionBlock):
    """``open_clip.transformer.CustomResidualAttentionBlock`` that takes a :class:`CausalMask` as
    ``attn_mask``."""

    def forward(self, x: Tensor, attn_mask: Tensor | CausalMask | None = None) -> Tensor:
        if isinstance(attn_mask, CausalMask) and not isinstance(self.attn, Attention):
            attn_mask = attn_mask.mask  # an attn that was not converted adds the mask itself
        return super().forward(x, attn_mask=attn_mask)


_CAUSAL_BLOCKS = (ResidualAttentionBlock, CustomResidualAttentionBlock)


class Transformer(oc.Transformer):
    """``open_clip.transformer.Transformer`` that runs a causal float mask as causal attention (see the
    module doc); otherwise open_clip's."""

    def _blocks_mask(self, x: Tensor, attn_mask: Tensor | None) -> Tensor | CausalMask | None:
        if attn_mask is None or x.dim() != 3:
            return attn_mask
        if not all(type(block) in _CAUSAL_BLOCKS for block in self.resblocks):
            return attn_mask
        # x is (N, L, D) here whatever batch_first: open_clip's stack transposes it afterwards.
        return CausalMask(attn_mask) if is_causal_mask(attn_mask, x.shape[1]) else attn_mask

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        return super().forward(x, attn_mask=self._blocks_mask(x, attn_mask))

    def forward_intermediates(
        self, x: Tensor, attn_mask: Tensor | None = None, indices=None, stop_early: bool = False
    ):
        return super().forward_intermediates(
            x, attn_mask=self._blocks_mask(x, attn_mask), indices=indices, stop_early=stop_early
        )


def accepts(module: torch.nn.Module) -> bool:
    """Whether ``convert`` retypes ``module`` (whose type is a key of :data:`CONVERSIONS`): all but
    ``Attention`` with ``scaled_cosine``."""
    if type(module) is oc.Attention:
        return getattr(module, "logit_scale", None) is None and hasattr(module, "ln_inner")
    return True


# open_clip class -> attnx class; convert() retypes a module only when accepts(module).
CONVERSIONS = {
    oc.Transformer: Transformer,
    oc.ResidualAttentionBlock: ResidualAttentionBlock,
    oc.CustomResidualAttentionBlock: CustomResidualAttentionBlock,
    oc.Attention: Attention,
}
