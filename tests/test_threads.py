"""Every op called from several Python threads at once gives the bits it gives when called alone; changing
torch's intra-op thread count between calls changes no result beyond what the algorithm allows; the
process-wide state that the first call initialises survives concurrent first calls.

torch.ops calls release the GIL, so the threads below really run the C++ kernels at the same time (each
with its own OpenMP team).

Thread counts and determinism (CPU), as the kernels are written:
- attention forward: a query row is computed by exactly one work item, over the key tiles in a fixed order,
  with tile shapes that do not depend on the thread count (csrc/cpu/attention_kernel_impl.h: the count
  only groups query tiles into items). Bitwise the same for every thread count.
- attention_backward: an item owns its keys, so dK, dV and the attn_mask gradient are summed in a fixed order
  (query heads, then query tiles) whatever the count: bitwise. dQ is not: with few (batch, kv head) slots per
  thread the keys of each head are split into chunks (BackwardPlan::chunks, a function of
  at::get_num_threads()), each chunk sums its key tiles into its own dQ slot and the slots are added at the
  end, so ``(g0 + g1 + g2) + (g3 + g4)`` replaces ``(((g0 + g1) + g2) + g3) + g4``: equal to rounding only.
- linear (and so mha and the module, whose projections are linear): MKL's GEMM, which does not promise the
  same bits for different thread counts (its conditional-numerical-reproducibility mode is off in torch).
  Equal to rounding only.
For a fixed thread count every op gives the same bits call after call, which is what the concurrent test
relies on (it compares bitwise): attnx's sums have fixed orders (work items own their outputs, no atomics),
and MKL takes the same path for the same shapes, thread count and alignment (torch's CPU buffers are 64-byte
aligned).

Concurrent first use: the process-wide state in csrc is the CPU kernel choice (``static const ... =
select_kernel()`` in cpu/attention.cpp and cpu/attention_backward.cpp) and the dispatcher handles cached in
function-local statics (csrc/common/mha.cpp, csrc/autograd/*.cpp), all C++11 magic statics;
test_concurrent_first_use races them in a fresh interpreter. The CUDA kernel choice
(``static const bool requested`` in csrc/cuda/attention.cpp) needs a GPU and is not run here. The Metal
pipeline cache (csrc/mps/metal_library.mm, a mutex-guarded map) is compiled only on macOS, and the Metal
emulation in tests/emulation cannot stand in for it: it does not compile metal_library.mm (its kernels are
found in a registry filled by static initialisers when the library loads, with no lazy cache), and its
launcher runs a threadgroup's threads as fibers through process-global scheduler state
(tests/emulation/metal/metal_runtime.cpp: ``scheduler``, ``current_state``), so it is single-threaded by
design and two concurrent launches would corrupt each other. Concurrent first use of the Metal pipeline
cache is therefore untested here.
"""

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import attnx
import layouts
from attnx import ops

pytestmark = pytest.mark.kernel

WORKERS = 6
ROUNDS = 6  # each worker makes its 5 calls ROUNDS times: 30 calls per thread
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float32, torch.float16, torch.float32]


def _worker_calls(worker):
    """The calls of one worker, each a (name, function returning a tuple of tensors): varlen_attention and
    its backward, linear, attention, attention_backward, mha and nn.MultiheadAttention forward + backward,
    with this worker's own shapes, dtype, layouts and masks. Worker 3 has 700 keys, six of the backward's
    128-key tiles: from two threads on the backward splits them into chunks of three or fewer (see the module
    docstring)."""
    gen = torch.Generator().manual_seed(100 + worker)
    dtype = DTYPES[worker]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    B, H = 1 + worker % 2, 1 + worker % 3
    L = 5 + 3 * worker
    S = 700 if worker == 3 else 7 + 5 * worker
    D = 8 * (1 + worker % 2)
    E = H * D

    # linear, in one of the layouts it reads in place (or copies once)
    x = layouts.make((L, B, E), layouts.LAYOUTS[worker % len(layouts.LAYOUTS)], dtype)
    w, b = randn(2 * E, E, scale=E**-0.5), randn(2 * E)

    # attention: masks differ per worker
    q, k, v = randn(B, H, L, D), randn(B, H, S, D), randn(B, H, S, D)
    masks = {}
    kind = worker % 4
    if kind == 1:
        masks["attn_mask"] = torch.rand(L, S, generator=gen) < 0.3
        masks["key_padding_mask"] = torch.rand(B, S, generator=gen) < 0.2
    elif kind == 2:
        masks["attn_mask"] = randn(B * H, L, S).masked_fill(torch.rand(B * H, L, S, generator=gen) < 0.3,
                                                           float("-inf"))
        masks["is_causal"] = True
    elif kind == 3:
        masks["key_padding_mask"] = randn(B, S).masked_fill(torch.rand(B, S, generator=gen) < 0.2,
                                                            float("-inf"))
    out0, lse0 = ops.attention(q, k, v, **masks)
    grad_out = randn(B, H, L, D)

    # mha: packed in-projection, sequence-first; weights returned by some workers
    in_w, in_b = randn(3 * E, E, scale=E**-0.5), randn(3 * E)
    out_w, out_b = randn(E, E, scale=E**-0.5), randn(E)
    query, memory = randn(L, B, E), randn(S, B, E)
    kpm = torch.rand(B, S, generator=gen) < 0.25
    mha_args = (query, memory, memory, H, in_w, in_b, None, None, None, None, None, worker % 2 == 1,
                out_w, out_b, kpm, None, False, None, None, worker % 3 == 0, worker % 2 == 0)

    # the module, forward and backward through autograd (torch.autograd.grad: nothing accumulates in .grad,
    # so threads can share the module)
    torch.manual_seed(worker)
    module = attnx.nn.MultiheadAttention(E, H, batch_first=worker % 2 == 0, dtype=dtype)
    m_query = randn(*((B, L, E) if worker % 2 == 0 else (L, B, E))).requires_grad_()
    m_key = randn(*((B, S, E) if worker % 2 == 0 else (S, B, E)))
    m_grad = randn(*m_query.shape)
    params = list(module.parameters())

    def module_call():
        out, weights = module(m_query, m_key, m_key, key_padding_mask=kpm, need_weights=worker % 2 == 1)
        grads = torch.autograd.grad(out, [m_query, *params], m_grad)
        return (out.detach(), *(() if weights is None else (weights.detach(),)), *grads)

    # varlen_attention: packed sequences of this worker's lengths (one empty), causal for odd workers; even
    # workers read the keys from a paged cache of 5-key pages in shuffled order.
    lens_q, lens_k = [L, 0, 2 + worker], [S, 3, 4 + worker]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lens_q, lens_k))
    vq, vk, vv = randn(sum(lens_q), H, D), randn(sum(lens_k), H, D), randn(sum(lens_k), H, D)
    varlen_kwargs = dict(is_causal=worker % 2 == 1, sinks=randn(H))
    vout, vlse = ops.varlen_attention(vq, vk, vv, cu_q, cu_k, L, S, **varlen_kwargs)
    vgrad = randn(*vout.shape)
    paged_kwargs = {}
    pk, pv = vk, vv
    if worker % 2 == 0:
        pages = [(n + 4) // 5 for n in lens_k]
        perm = torch.randperm(sum(pages), generator=gen).to(torch.int32)
        table = torch.zeros(len(lens_k), max(pages), dtype=torch.int32)
        pk, pv = randn(sum(pages), 5, H, D), randn(sum(pages), 5, H, D)
        at = 0
        for i, n in enumerate(pages):
            table[i, :n] = perm[at:at + n]
            at += n
        paged_kwargs["block_table"] = table

    return [
        ("varlen_attention",
         lambda: ops.varlen_attention(vq, pk, pv, cu_q, cu_k, L, S, **varlen_kwargs, **paged_kwargs)),
        ("varlen_attention_backward",
         lambda: ops.varlen_attention_backward(vgrad, vq, vk, vv, vout, vlse, cu_q, cu_k, L, S,
                                               **varlen_kwargs)),
        ("linear", lambda: (ops.linear(x, w, b),)),
        ("attention", lambda: ops.attention(q, k, v, **masks)),
        ("attention_backward",
         lambda: ops.attention_backward(grad_out, q, k, v, out0, lse0, **masks, grad_attn_mask=True)),
        ("mha", lambda: ops.mha(*mha_args)),
        ("module", module_call),
    ]


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _assert_same_bits(got, want, what):
    """The same tensors to the bit (NaN payloads and signed zeros included)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), f"{what}[{i}]"
        if g.is_floating_point():
            g, w = g.view(_INT_OF_SIZE[g.element_size()]), w.view(_INT_OF_SIZE[w.element_size()])
        if not torch.equal(g, w):
            mismatched = int((g != w).sum())
            raise AssertionError(f"{what}[{i}]: {mismatched} of {g.numel()} elements differ in their bits")


def test_concurrent_calls_match_serial_calls(intra_op_threads):
    # Set explicitly: a Python thread's OpenMP thread count is initialised from torch's global count at its
    # first op, so the workers run with the main thread's count (and the backward with its plan).
    intra_op_threads(2)
    calls = [_worker_calls(worker) for worker in range(WORKERS)]
    serial = [[fn() for _, fn in worker_calls] for worker_calls in calls]

    start = threading.Barrier(WORKERS)

    def run(worker):
        start.wait()  # every thread starts at once
        return [[fn() for _, fn in calls[worker]] for _ in range(ROUNDS)]

    with ThreadPoolExecutor(WORKERS) as pool:
        concurrent = list(pool.map(run, range(WORKERS)))

    for worker, rounds in enumerate(concurrent):
        for round_, results in enumerate(rounds):
            for (name, _), got, want in zip(calls[worker], results, serial[worker], strict=True):
                _assert_same_bits(got, want, f"worker {worker} round {round_} {name}")


# Which outputs keep their bits when the thread count changes (see the module docstring): the others are
# compared to rounding.
_BITWISE_ACROSS_THREAD_COUNTS = {
    "linear": (),
    "attention": (0, 1),  # out, lse
    "attention_backward": (1, 2, 3, 4),  # dK, dV, the attn_mask gradient, the (empty) sinks gradient
    "varlen_attention": (0, 1),  # out, lse
    "varlen_attention_backward": (1, 2),  # dK, dV
    "mha": (),
    "module": (),
}


def test_thread_count_changes_between_calls(intra_op_threads):
    calls = [_worker_calls(worker) for worker in range(WORKERS)]
    intra_op_threads(1)
    baseline = [[fn() for _, fn in worker_calls] for worker_calls in calls]
    counts = [2, 1, 3, 4, 2]
    i = 0
    for rep in range(2):
        for worker, worker_calls in enumerate(calls):
            for (name, fn), want in zip(worker_calls, baseline[worker], strict=True):
                n = counts[i % len(counts)]  # a different count from one call to the next
                i += 1
                intra_op_threads(n)
                got = fn()
                what = f"rep {rep} worker {worker} {name} at {n} threads"
                assert len(got) == len(want), what
                bitwise = _BITWISE_ACROSS_THREAD_COUNTS[name]
                for j, (g, w) in enumerate(zip(got, want, strict=True)):
                    if j in bitwise:
                        _assert_same_bits((g,), (w,), f"{what} [{j}]")
                    else:
                        # torch's default tolerances for the dtype: a few ulps of summation order
                        torch.testing.assert_close(
                            g, w, equal_nan=True, msg=lambda m, s=f"{what} [{j}]": f"{s}: {m}"
                        )


_FIRST_USE = textwrap.dedent(
    """
    import threading
    import torch
    import attnx
    from attnx import ops

    # Nothing has called an attnx op in this process yet: the threads below make the first calls, together.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=gen) for _ in range(3))
    mask = torch.randn(40, 40, generator=gen)
    x, w = torch.randn(12, 48, generator=gen), torch.randn(32, 48, generator=gen)
    b = torch.randn(32, generator=gen)
    query = torch.randn(10, 2, 48, generator=gen)
    in_w, in_b = torch.randn(144, 48, generator=gen), torch.randn(144, generator=gen)
    out_w, out_b = torch.randn(48, 48, generator=gen), torch.randn(48, generator=gen)

    def attention_autograd():
        qg = q.clone().requires_grad_()
        out, lse = ops.attention(qg, k, v, attn_mask=mask)
        return (out.detach(), lse, *torch.autograd.grad(out, qg, torch.ones_like(out)))

    def attention_backward():
        out, lse = ops.attention(q, k, v, is_causal=True)
        return ops.attention_backward(torch.ones_like(out), q, k, v, out, lse, is_causal=True)

    def mha_autograd():
        qg = query.clone().requires_grad_()
        out, lse, _ = ops.mha(qg, qg, qg, 4, in_w, in_b, None, None, None, None, None, False, out_w, out_b,
                              None, None, False, None, None, False, True)
        return (out.detach(), lse, *torch.autograd.grad(out, qg, torch.ones_like(out)))

    def linear_autograd():
        xg = x.clone().requires_grad_()
        y = ops.linear(xg, w, b)
        return (y.detach(), *torch.autograd.grad(y, xg, torch.ones_like(y)))

    kinds = [attention_autograd, attention_backward, mha_autograd, linear_autograd]
    THREADS = 8
    start = threading.Barrier(THREADS)
    results = [None] * THREADS

    def run(i):
        start.wait()
        # each thread starts with its own kind (two threads race for each), then makes the others
        order = kinds[i % 4:] + kinds[:i % 4]
        results[i] = {fn.__name__: fn() for fn in order}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fn in kinds:
        want = fn()
        for i in range(THREADS):
            got = results[i][fn.__name__]
            assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True)), (i, fn.__name__)
    print("first use ok")
    """
)


@pytest.mark.slow
def test_concurrent_first_use():
    """Eight threads make the process's first attnx calls at once (a fresh interpreter, so that the statics
    are still uninitialised): no crash, and each gets what a later, lone call gets."""
    result = subprocess.run([sys.executable, "-c", _FIRST_USE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "first use ok" in result.stdout
