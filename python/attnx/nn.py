"""Drop-in modules: ``MultiheadAttention``, and the encoder layer that :func:`attnx.convert` gives models.

``attnx.nn.MultiheadAttention`` subclasses ``torch.nn.MultiheadAttention`` and overrides only ``forward``.
Inheriting ``__init__`` gives, by construction, torch's constructor arguments, parameter names and
registration order (in_proj_weight or q/k/v_proj_weight, in_proj_bias, out_proj as
``NonDynamicallyQuantizableLinear``, bias_k, bias_v), initialisation and ``state_dict`` keys, for whichever
torch is installed; ``isinstance(m, torch.nn.MultiheadAttention)`` stays true, so torch's Transformer
layers, weight-init loops and wrapping policies that test for it keep working; and :func:`attnx.convert`
can retype a torch module in place (same object, same Parameters) instead of rebuilding it.
"""


import torch
import torch.nn.functional as F
from torch import Tensor

from attnx import _mha_checks
from attnx import functional as attnx_functional
from attnx._schema import MhaArgs

__all__ = ["MultiheadAttention", "TransformerEncoderLayer"]


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose forward is one :func:`attnx.ops.mha` call.

    Same constructor (``embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
    kdim=None, vdim=None, batch_first=False, device=None, dtype=None``), parameters and state_dict as torch's,
    so state dicts load strictly both ways. ``forward`` gives what torch's slow path gives, in train and in
    eval; there is no separate fast path (torch's eval fast path merges both masks into a ``(B, H, L, S)``
    tensor, which is what attnx exists to avoid). Masks are validated as torch's module validates them but
    never converted or merged: bool stays bool and each mask is read in place by the op.
    """

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of query over key/value; returns ``(attn_output, attn_output_weights)``.

        One :func:`attnx.mha` call, forward and backward.

        Args:
            query: ``(L, E)``, ``(L, B, E)``, or ``(B, L, E)`` with ``batch_first``.
            key: ``(S, kdim)``, ``(S, B, kdim)``, or ``(B, S, kdim)`` with ``batch_first``.
            value: likewise, with vdim.
            key_padding_mask: ``(B, S)`` or ``(S,)``, bool or float, as in :func:`attnx.attention`.
            need_weights: whether to return the attention weights.
            attn_mask: ``(L, S)`` or ``(B*num_heads, L, S)``, bool or float, as in :func:`attnx.attention`.
            average_attn_weights: whether the weights are averaged over heads.
            is_causal: torch's hint that attn_mask is causal (it requires attn_mask).

        Returns:
            ``attn_output``: query's layout (``(B, L, E)`` with ``batch_first``).

            ``attn_output_weights``: when need_weights, ``(B, L, S)`` averaged over heads or
            ``(B, num_heads, L, S)`` (``(L, S)`` / ``(num_heads, L, S)`` unbatched), else ``None``.

        Raises:
            AssertionError, RuntimeError: torch's module's, with its messages; it warns as torch's does for
                masks of mismatched dtypes.
        """
        # Torch's module checks both masks (and warns on mismatched dtypes) before anything else.
        _mha_checks.check_mask(
            key_padding_mask,
            "key_padding_mask",
            _mha_checks.none_or_dtype(attn_mask),
            "attn_mask",
            stacklevel=2,
        )
        _mha_checks.check_mask(attn_mask, "attn_mask", None, "", check_other=False)
        if query.is_nested or key.is_nested or value.is_nested:
            raise AssertionError(
                "MultiheadAttention does not support NestedTensor outside of its fast path. "
                "The fast path was not hit because attnx.nn.MultiheadAttention has no fast path"
            )

        call = MhaArgs(
            query=query, key=key, value=value, num_heads=self.num_heads,
            in_proj_weight=self.in_proj_weight, in_proj_bias=self.in_proj_bias,
            q_proj_weight=self.q_proj_weight, k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight,
            bias_k=self.bias_k, bias_v=self.bias_v, add_zero_attn=self.add_zero_attn,
            out_proj_weight=self.out_proj.weight, out_proj_bias=self.out_proj.bias,
            key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal, static_k=None,
            static_v=None, need_weights=need_weights, average_attn_weights=average_attn_weights,
            dropout_p=self.dropout,
            # Torch's module transposes batch_first inputs to (L, B, E) views and its output back; here the op
            # takes (B, L, E) as it is, which saves those transposes and their backward twins.
            batch_first=self.batch_first and query.dim() == 3,
        )
        return attnx_functional._forward(
            call, self.embed_dim, self.training, not self._qkv_same_embed_dim, check_mask_dtypes=False
        )


class TransformerEncoderLayer(torch.nn.TransformerEncoderLayer):
    """``torch.nn.TransformerEncoderLayer`` with attnx self-attention and without torch's fused fast path.

    In eval, torch's ``forward`` may skip ``self_attn`` altogether and call
    ``torch._transformer_encoder_layer_fwd`` with its weights (merging the masks into a ``(B, H, L, S)``
    tensor). This subclass's ``forward`` is torch's slow path: the same masks checks, the same blocks
    (``_sa_block``, ``_ff_block``, norms, ``norm_first``), so ``self_attn`` always runs. Being a subclass
    keeps ``isinstance`` checks (``nn.TransformerEncoder``'s) true. :func:`attnx.convert` retypes torch's
    layers to this class in place; constructed directly, it builds torch's layer and retypes its
    ``self_attn``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.self_attn.__class__ = MultiheadAttention

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Torch's slow-path forward, in train and eval: ``self_attn`` always runs.

        The masks are canonicalised to float of src's dtype, as torch's layer does, and stay ``(S, S)`` /
        ``(B, S)``, never merged.

        Args:
            src: ``(S, E)``, ``(S, B, E)``, or ``(B, S, E)`` with ``batch_first``.
            src_mask: ``(S, S)`` or ``(B*nhead, S, S)``, bool or float, as in :func:`attnx.attention`, or
                None.
            src_key_padding_mask: ``(B, S)``, bool or float, as in :func:`attnx.attention`, or None.
            is_causal: torch's hint that src_mask is causal, handed to ``self_attn``.

        Returns:
            A tensor of src's shape.
        """
        # torch's layer canonicalises the masks exactly so (same checks, warnings, bool -> float of src's
        # dtype); they stay (S, S) / (B, S): small, and never merged. Torch's own _canonical_mask: attnx has
        # no equivalent (_mha_checks.check_mask checks without converting).
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask,
            mask_name="src_key_padding_mask",
            other_type=_mha_checks.none_or_dtype(src_mask),
            other_name="src_mask",
            target_type=src.dtype,
        )
        src_mask = F._canonical_mask(
            mask=src_mask,
            mask_name="src_mask",
            other_type=None,
            other_name="",
            target_type=src.dtype,
            check_other=False,
        )
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x
