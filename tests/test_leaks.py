"""10,000 calls of each op leave the process's resident memory flat: no buffer, tensor or autograd node is
kept per call.

Resident set size comes from /proc/self/statm (Linux), read after a warm-up (the first calls grow torch's and
glibc's pools, the dispatcher's caches) and again after 10,000 more calls, each time after a garbage
collection and glibc's malloc_trim(0). The trim matters both ways: without it, memory that earlier tests freed
but glibc kept resident would absorb a leak unseen (measured: a 1 KiB-per-call leak after a test that freed
40 MB grew RSS by nothing), and chunks freed during the 10,000 calls but kept in an arena would count as
growth. With it, what is left is live memory. The threshold, 4 MiB, sits between what a real leak costs and
what remains as noise: a leak of one 4 KiB buffer per call grows RSS by 40 MB (its pages are written, so they
are resident: measured 43.6 MiB), 1 KiB per call (a small tensor's storage, or an autograd node with its saved
tensors) by 10 MB and more (measured 14 MiB); both fail. Measured here, the ops below change it by -8 to +4
KiB. Leaks below ~400 bytes per call go
unseen: the price of a test that does not flake on fragmentation (a few partly used pages per arena).

The shapes are small and the ops run on one intra-op thread, so each op's 10,000 calls take a second or two
even on a busy machine (with two OpenMP threads on two shared cores, a tiny op can wait milliseconds at a
barrier); a leak does not depend on the thread count. These tests run in the normal suite (no marker
deselects them).
"""

import ctypes
import gc
import inspect
import os

import pytest
import torch

import attnx
from attnx import ops

CALLS = 10_000
WARMUP = 1_000
THRESHOLD = 4 * 2**20  # bytes; see the module docstring

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                reason="resident memory is read from /proc/self/statm (Linux only)")


try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: freed memory may then stay resident, which only hides leaks
    _malloc_trim = None


def _rss_bytes():
    """Resident memory after a garbage collection, freed heap memory given back to the system."""
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _one_thread(intra_op_threads):
    intra_op_threads(1)


def _assert_flat(call):
    for _ in range(WARMUP):
        call()
    before = _rss_bytes()
    for _ in range(CALLS):
        call()
    growth = _rss_bytes() - before
    assert growth < THRESHOLD, (
        f"resident memory grew by {growth / 2**20:.1f} MiB over {CALLS} calls "
        f"({growth / CALLS:.0f} bytes per call)"
    )


def _attention_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=gen) for _ in range(3))
    masks = {
        "attn_mask": torch.rand(8, 8, generator=gen) < 0.2,
        "key_padding_mask": torch.randn(2, 8, generator=gen),
    }
    return q, k, v, masks


def test_linear():
    x, w, b = torch.randn(4, 3, 32), torch.randn(24, 32), torch.randn(24)
    _assert_flat(lambda: ops.linear(x, w, b))


def test_attention_forward():
    q, k, v, masks = _attention_inputs()
    _assert_flat(lambda: ops.attention(q, k, v, **masks))


def test_attention_backward():
    q, k, v, masks = _attention_inputs()
    masks["attn_mask"] = torch.randn(8, 8)  # a float mask, so that its gradient is computed too
    out, lse = ops.attention(q, k, v, **masks)
    grad_out = torch.randn_like(out)
    _assert_flat(lambda: ops.attention_backward(grad_out, q, k, v, out, lse, **masks, grad_attn_mask=True))


def test_mha():
    E, H = 16, 2
    x = torch.randn(6, 2, E)
    args = (x, x, x, H, torch.randn(3 * E, E), torch.randn(3 * E), None, None, None, None, None, False,
            torch.randn(E, E), torch.randn(E), torch.rand(2, 6) < 0.2, None, False, None, None, True, True)
    _assert_flat(lambda: ops.mha(*args))


def test_module_forward_and_backward():
    """Autograd through attnx.nn.MultiheadAttention: the graph, its saved tensors and the gradients of each
    call are freed (the parameters' .grad is reset, not accumulated into new tensors)."""
    module = attnx.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    kpm = torch.rand(2, 6) < 0.2

    def call():
        module.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
        out.sum().backward()

    _assert_flat(call)


def _varlen_inputs():
    gen = torch.Generator().manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = (torch.randn(n, 2, 16, generator=gen) for n in (8, 11, 11))
    return q, k, v, cu_q, cu_k, dict(is_causal=True, sinks=torch.randn(2, generator=gen))


def test_varlen_attention_forward_paged():
    q, _, _, cu_q, cu_k, kwargs = _varlen_inputs()
    k_cache, v_cache = torch.randn(6, 3, 2, 16), torch.randn(6, 3, 2, 16)
    table = torch.tensor([[5, 1], [0, 0], [2, 4]], dtype=torch.int32)
    seqused = torch.tensor([4, 1, 5], dtype=torch.int32)
    _assert_flat(lambda: ops.varlen_attention(q, k_cache, v_cache, cu_q, cu_k, 5, 5, seqused_k=seqused,
                                              block_table=table, **kwargs))


def test_varlen_attention_autograd():
    q, k, v, cu_q, cu_k, kwargs = _varlen_inputs()
    q.requires_grad_()

    def call():
        q.grad = None
        out, _ = ops.varlen_attention(q, k, v, cu_q, cu_k, 5, 5, **kwargs)
        out.sum().backward()

    _assert_flat(call)


def test_torch_varlen_attn():
    from attnx.pytorch import varlen

    if not varlen.AVAILABLE:
        pytest.skip(varlen.REASON)
    from torch.nn.attention.varlen import varlen_attn

    q, k, v, cu_q, cu_k, _ = _varlen_inputs()
    q.requires_grad_()
    # torch 2.10's varlen_attn takes is_causal, not window_size: the same causal attention either way.
    newer = "window_size" in inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if newer else {"is_causal": True}

    def call():
        q.grad = None
        varlen_attn(q, k, v, cu_q, cu_k, 5, 5, **causal).sum().backward()

    _assert_flat(call)
