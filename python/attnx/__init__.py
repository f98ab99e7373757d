"""attnx: fast, memory-lean multi-head attention for PyTorch.

Ops live under ``torch.ops.attnx``; ``attnx.ops`` has their typed Python wrappers. Importing attnx loads the
compiled library, which registers every op and its kernels.
"""

import torch  # noqa: F401  (loads libtorch, which attnx._C links against)

from attnx import _C  # noqa: F401  (loads the library: registers torch.ops.attnx.*)
from attnx import reference
from attnx.ops import attention, linear

__version__ = "0.1.0"
__all__ = ["attention", "linear", "reference"]
