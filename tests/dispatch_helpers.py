"""Dispatch counting: which ops a piece of code sends to the dispatcher, for the tests that prove attnx's ops
run (and torch's fused paths do not): test_convert.py, test_convert_timm.py, test_mha_backward.py,
test_modules.py and test_distributed.py."""

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchRecorder(TorchDispatchMode):
    """Counts every op that reaches the dispatcher below autograd, by name (``aten::addmm``, ``attnx::_mha``):
    attnx's routed ops show as the kernel op they chose (``attnx::_mha`` without grad, ``attnx::mha_forward``
    in grad mode; see csrc/schemas.cpp)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))
