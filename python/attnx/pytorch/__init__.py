"""attnx behind PyTorch's own attention APIs: CPU kernels registered under PyTorch's op names.

- :mod:`attnx.pytorch.varlen`: the CPU kernels of ``torch.nn.attention.varlen.varlen_attn``
  (``torch_attn::_varlen_attn``, its ``_out`` variant and its backward), which PyTorch has only for CUDA.

Each module translates PyTorch's conventions (layouts, window and causal flags, output dtypes) onto attnx's
ops; no kernel logic lives here, and attnx's core modules never import these. ``import attnx`` registers
them where the running torch has the API, and skips them otherwise (``AVAILABLE`` says which).
"""

from attnx.pytorch import varlen

__all__ = ["varlen"]
