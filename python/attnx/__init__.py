"""attnx: fast, memory-lean multi-head attention for PyTorch.

Ops live under ``torch.ops.attnx``; ``attnx.ops`` has their typed Python wrappers. Importing attnx loads the
compiled library, which registers every op and its kernels. ``attnx.functional.multi_head_attention_forward``
and ``attnx.nn.MultiheadAttention`` are drop-ins for torch's; ``attnx.convert(model)`` and
``attnx.revert(model)`` swap them into / out of an existing model in place. (``attnx.convert`` is the
function; its module is ``sys.modules["attnx.convert"]``.)
"""

import torch  # noqa: F401  (loads libtorch, which attnx._C links against)

from attnx import _loader  # noqa: F401  (loads attnx._C, which registers torch.ops.attnx.*, or says why not)

# isort: split
# Kept apart from _C's import so that sorting never merges or reorders them: _C must be loaded first,
# since importing these modules registers fakes for its ops.
from attnx import flex, functional, nn, reference, sdpa
from attnx.convert import convert, revert
from attnx.ops import attention, attention_backward, linear, mha, varlen_attention

# isort: split
# PyTorch's own APIs served by attnx's kernels (torch.nn.attention.varlen.varlen_attn on CPU), where the
# running torch has them.
from attnx import pytorch

sdpa._register()

__version__ = "0.1.0"
__all__ = [
    "attention", "attention_backward", "convert", "flex", "functional", "linear", "mha", "nn", "pytorch",
    "reference", "revert", "sdpa", "varlen_attention",
]
