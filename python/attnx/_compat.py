"""torch 2.10 to 2.12: the bridge that carries a fake kernel's error message past torch's C API.

========================================================================================================
REMOVE when setup.py's ``MIN_TORCH`` reaches (2, 13): tests/test_compat.py fails from then on while this
file exists. Its C++ half goes in the same commit (``attnx_note_error`` in csrc/schemas.cpp, the message
bridge in csrc/common/stable.h), as does the torch < 2.13 branch of tests/test_linear.py; the fake kernels
then register with ``torch.library.register_fake`` directly (they import ``register_fake`` from here).
========================================================================================================

Under torch 2.10 to 2.12, an error raised below a dispatcher call made through torch's stable C API loses
its message (torch logs it to stderr and the caller sees only a failure). A fake kernel that raises under a
C++ op (a router, mha) would therefore surface as "<op> failed". :func:`register_fake` wraps each fake so that
it hands its error's message to attnx's library (``attnx_note_error``, through ctypes) before raising it; the
C++ op above it then raises it with that message (csrc/common/stable.h, ``dispatch``).
"""

import ctypes
import functools

import torch

import attnx._C
from attnx._loader import _release

__all__ = ["register_fake", "torch_passes_errors_through"]


def torch_passes_errors_through() -> bool:
    """Whether torch's C API passes an error's message back to the caller (torch >= 2.13)."""
    return _release(torch.__version__) >= (2, 13)


def register_fake(name: str):
    """``torch.library.register_fake(name)``; under torch 2.10 to 2.12, the registered fake also notes its
    error's message in attnx's library before raising it. Returns the decorator, which returns the function
    undecorated (so that it can be registered under a second name)."""
    if torch_passes_errors_through():
        return torch.library.register_fake(name)
    note_error = ctypes.CDLL(attnx._C.__file__).attnx_note_error
    note_error.argtypes = [ctypes.c_char_p]

    def register(fn):
        @functools.wraps(fn)
        def fake(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                note_error(str(error).encode())
                raise

        torch.library.register_fake(name)(fake)
        return fn

    return register
