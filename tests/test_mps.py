"""attnx on a real MPS device: what only a Mac shows. The launches' order on torch's MPS stream, the Metal
library compiled by Apple's compiler at first use from several threads at once, and device checks.

Everything the Metal kernels compute (attention and its features, linear, mha, the module) is checked on the
``mps`` device of the test matrix (the ``device`` fixture of tests/conftest.py), where the same tests run on
the emulated Metal kernels everywhere (``metal-emu``); tests/test_metal_emulation.py checks the launch plans
and the shim. Without an MPS device, or without MPS kernels in the build, every test here shows as skipped.
"""

import os

import pytest
import torch

import attnx
from attention_helpers import assert_matches_reference, make_qkv, run_python

pytestmark = [
    pytest.mark.mps,
    pytest.mark.kernel,
    pytest.mark.skipif(not torch.backends.mps.is_available(), reason="no MPS device"),
    pytest.mark.skipif(not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::_attention", "MPS"),
                       reason="this build of attnx has no MPS kernels"),
]


def test_launches_are_ordered_on_torch_s_stream():
    # Torch's ops and attnx's kernels in one chain, with no synchronisation between them: each reads what the
    # one before wrote only if attnx encodes on torch's MPS stream, in order.
    q, k, v = make_qkv(2, 4, 70, 90, 64, 64)
    w = torch.randn(64, 64)
    x = [t.to("mps") for t in (q, k, v)]
    for _ in range(3):
        x[0] = attnx.linear(x[0] * 0.5, w.to("mps"))  # torch's multiply, then attnx's kernel, on the stream
        out, _ = attnx.attention(*x, is_causal=True)
        x[0] = out + 1.0  # torch's add reads attnx's output
    got = x[0].cpu()
    want = q
    for _ in range(3):
        want = attnx.linear(want * 0.5, w)
        want = attnx.attention(want, k, v, is_causal=True)[0] + 1.0
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


_FIRST_USE_FROM_THREADS = """
import sys, threading, torch, attnx
sys.path.insert(0, {tests!r})
from attention_helpers import assert_matches_reference, make_qkv
dtypes = (torch.float32, torch.float16)
inputs = [make_qkv(1, 2, n, 40, 64, 64, dtype=dtype) for n in (1, 40) for dtype in dtypes]
results, errors = [None] * 16, []
barrier = threading.Barrier(16)

def run(i):
    try:
        q, k, v = (t.to("mps") for t in inputs[i % 4])
        barrier.wait()  # every thread's first call at once: one library build, one pipeline per kernel
        out, lse = attnx.attention(q, k, v)
        torch.mps.synchronize()
        results[i] = (out.cpu(), lse.cpu())
    except Exception as e:
        errors.append(repr(e))

threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for i, (out, lse) in enumerate(results):
    assert_matches_reference(out, lse, *inputs[i % 4])
print("ok")
"""


def test_first_use_from_threads():
    # A fresh process: the Metal library is compiled at the first call (mps/metal_library.mm), here made by 16
    # threads at once on both attention kernels and two dtypes (tests/emulation/metal/pipeline_cache_check.cpp
    # checks the cache itself under ThreadSanitizer).
    script = _FIRST_USE_FROM_THREADS.format(tests=os.path.dirname(os.path.abspath(__file__)))
    assert run_python(script, timeout=600).strip().endswith("ok")


def test_mixed_devices_is_an_error():
    q, k, v = (t.to("mps") for t in make_qkv(1, 1, 3, 4, 8, 8))
    with pytest.raises(RuntimeError, match="expected key on query's device"):
        attnx.attention(q, k.cpu(), v)
    with pytest.raises(RuntimeError, match="expected attn_mask on query's device"):
        attnx.attention(q, k, v, attn_mask=torch.zeros(3, 4))
    out, lse = attnx.attention(q, k, v)
    assert_matches_reference(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu())
