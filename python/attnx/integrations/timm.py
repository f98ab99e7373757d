"""timm's attention modules on attnx: what :func:`attnx.convert` does to timm models.

:func:`attnx.convert` imports this module only when timm is already imported (a model cannot hold timm's
modules otherwise), and retypes, in place, each module whose type is exactly one of:

- ``timm.layers.attention.Attention`` (the attention of ``VisionTransformer``'s ``Block`` and
  ``ResPostBlock``, and of many other timm models) -> :class:`Attention`;
- ``timm.layers.attention.AttentionRope`` (EVA-style rotary attention, fused or separate q/k/v
  projections, grouped KV heads) -> :class:`AttentionRope`.

The subclasses add no state and override only ``forward``: same objects, Parameters, buffers and
``state_dict``, and :func:`attnx.revert` retypes them back. Their ``forward`` computes q, k and v exactly as
timm's does (the ``qkv`` linear or the separate projections, ``q_norm``/``k_norm``, rotary embeddings, the
output ``norm``, ``gate``, ``proj``, ``proj_drop``) and replaces timm's ``F.scaled_dot_product_attention``
call (or its unfused twin, whichever ``fused_attn`` selects) with one :func:`attnx.attention` on the strided
``(B, H, N, D)`` views of the projection, never copied. The output is that of timm's fused path: scale
``head_dim ** -0.5``; dropout ``attn_drop.p`` on the attention probabilities in training only; timm's
``attn_mask`` with SDPA's meaning (bool ``True`` = attend, which is inverted here into attnx's ``True`` =
masked out, a copy the size of the bool mask; float masks added as they are, and differentiable), broadcast
to ``(B, H, N, N)`` as SDPA broadcasts it; ``is_causal``; and, as SDPA, a ``RuntimeError`` when both
``attn_mask`` and ``is_causal`` are given. Grouped KV heads are read in place, without timm's
``repeat_interleave``. One difference: a row that every mask entry removes gives 0 here, where SDPA may
give NaN.

A module whose attributes are not the ones this forward reads (another timm version) is left as it is.

Left out (they keep timm's own attention):

- attention whose scores are not plain scaled dot products plus a mask: relative position bias tables
  (``beit.Attention``, ``swin_transformer.WindowAttention``, ``vision_transformer_relpos``), ``EvaAttention``
  (its ``rope``, ``qkv_bias_separate`` and bias forms are another forward contract), differential attention
  (``DiffAttention``, ``DiffParallelScalingBlock``), cross-covariance attention (``xcit``), talking heads
  (``cait``), and the 2-D (NCHW) attention layers of ``attention2d``;
- ``vision_transformer.ParallelScalingBlock``, whose attention is inlined in a whole block (fused MLP and
  qkv projection): converting it means re-implementing the block, which would drift from timm's;
- subclasses of the two classes above, which may override ``forward``.
"""

import torch
from timm.layers import attention as timm_attention
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from torch import Tensor

from attnx import ops

__all__ = ["Attention", "AttentionRope", "CONVERSIONS", "accepts"]


def _attention(
    module: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)`` as timm calls it, on
    attnx.

    q ``(B, H, N, D)``, k and v ``(B, Hkv, N, D)`` (any strides); returns ``(B, H, N, D)`` laid out as
    ``(B, N, H, D)``, so the caller's ``transpose(1, 2).reshape(B, N, H * D)`` is a view."""
    if attn_mask is not None:
        if is_causal:
            # SDPA's refusal, word for word: timm's fused path (its default) raises it.
            raise RuntimeError(
                "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True"
            )
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask.logical_not()  # SDPA: True = attend; attnx: True = masked out
        if attn_mask.dim() < 4:
            # SDPA broadcasts masks right-aligned to (B, H, N, N); attnx reads a 3-D mask as
            # nn.MultiheadAttention's (B*H, N, N), so give it SDPA's meaning as a 4-D view.
            attn_mask = attn_mask[(None,) * (4 - attn_mask.dim())]
    dropout_p = module.attn_drop.p if module.training else 0.0
    out, _ = ops.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
    return out


def _output(module: torch.nn.Module, x: Tensor, gate: Tensor | None) -> Tensor:
    """timm's steps after attention: heads merged (a view of attnx's ``(B, N, H, D)`` layout), ``norm``,
    ``gate``, ``proj``, ``proj_drop``."""
    B, _, N, _ = x.shape
    x = x.transpose(1, 2).reshape(B, N, module.attn_dim)
    x = module.norm(x)
    if gate is not None:
        x = x * gate
    return module.proj_drop(module.proj(x))


class Attention(timm_attention.Attention):
    """``timm.layers.attention.Attention`` whose attention is :func:`attnx.attention` (see the module doc).

    ``forward(x, attn_mask=None, is_causal=False)``: x ``(B, N, C)``; attn_mask as SDPA takes it,
    broadcastable to ``(B, num_heads, N, N)``, bool ``True`` = attend or float added. Returns
    ``(B, N, dim_out)``."""

    _ATTRIBUTES = (
        "num_heads", "head_dim", "attn_dim", "qkv", "q_norm", "k_norm", "attn_drop", "norm", "gate", "proj",
        "proj_drop",
    )

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        # Strided views of the projection, as timm makes them; attnx reads them in place.
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        return _output(self, _attention(self, q, k, v, attn_mask, is_causal), gate)


class AttentionRope(timm_attention.AttentionRope):
    """``timm.layers.attention.AttentionRope`` whose attention is :func:`attnx.attention` (see the module
    doc).

    ``forward(x, rope=None, attn_mask=None, is_causal=False)``: x ``(B, N, C)``; rope the concatenated sin/cos
    embedding of the ``N - num_prefix_tokens`` non-prefix tokens; attn_mask as in :class:`Attention`. With
    ``num_kv_heads < num_heads`` the kv heads are read in place (query head ``h`` reads kv head
    ``h // num_kv_groups``, timm's ``repeat_interleave`` mapping). Returns ``(B, N, dim_out)``."""

    _ATTRIBUTES = ("num_heads", "num_kv_heads", "head_dim", "attn_dim", "num_prefix_tokens", "qkv", "q_proj",
                   "k_proj", "v_proj", "q_norm", "k_norm", "attn_drop", "norm", "gate", "proj", "proj_drop")

    def forward(
        self, x: Tensor, rope: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if self.qkv is not None:
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            npt = self.num_prefix_tokens
            half = getattr(self, "rotate_half", False)
            q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], 2).type_as(v)
            k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], 2).type_as(v)
        return _output(self, _attention(self, q, k, v, attn_mask, is_causal), gate)


def accepts(module: torch.nn.Module) -> bool:
    """Whether ``module`` has every attribute its attnx forward reads (a timm version whose class differs is
    left alone rather than run through a forward written for another)."""
    attnx_cls = CONVERSIONS[type(module)]
    return all(hasattr(module, name) for name in attnx_cls._ATTRIBUTES)


# timm class -> attnx class; convert() retypes a module only when accepts(module).
CONVERSIONS = {
    timm_attention.Attention: Attention,
    timm_attention.AttentionRope: AttentionRope,
}
