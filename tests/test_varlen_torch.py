"""torch.nn.attention.varlen.varlen_attn on CPU tensors, served by attnx (attnx.pytorch.varlen).

Checked against F.scaled_dot_product_attention run sequence by sequence, with the bottom-right causal /
window mask built explicitly (SDPA's is_causal is top-left), forward and backward; PyTorch's layouts
(out like query, lse (H, T_q) float32, rng_state) checked as its fake kernels state them.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import attnx
from attnx.pytorch import varlen as attnx_varlen

pytestmark = [pytest.mark.kernel,
              pytest.mark.skipif(not attnx_varlen.AVAILABLE, reason=attnx_varlen.REASON or "unavailable")]

if attnx_varlen.AVAILABLE:
    import inspect

    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    API = set(inspect.signature(varlen_attn).parameters)


def require(*names):
    """Skip, saying why, where this torch's varlen_attn predates an argument the test passes (torch 2.10's
    takes no window_size, scale, enable_gqa, seqused_k or block_table)."""
    missing = sorted(set(names) - API)
    if missing:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no {', '.join(missing)}")


def call_varlen(*args, **kwargs):
    """varlen_attn(*args, **kwargs), skipped where this torch's varlen_attn lacks one of kwargs."""
    require(*kwargs)
    return varlen_attn(*args, **kwargs)


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def sdpa_per_sequence(q, k, v, lens_q, lens_k, window=(-1, -1), scale=None):
    """out (T_q, H, D) and lse (H, T_q): SDPA on each sequence, the window aligned bottom-right."""
    H, Hkv = q.shape[1], k.shape[1]
    cq, ck = offsets(lens_q).tolist(), offsets(lens_k).tolist()
    outs, lses = [], []
    for b in range(len(lens_q)):
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        vb = v[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        Lq, Lk = qb.shape[1], kb.shape[1]
        i, j = torch.arange(Lq).view(Lq, 1), torch.arange(Lk).view(1, Lk)
        diag = i + Lk - Lq
        seen = torch.ones(Lq, Lk, dtype=torch.bool)
        if window[0] >= 0:
            seen &= j >= diag - window[0]
        if window[1] >= 0:
            seen &= j <= diag + window[1]
        s = scale if scale is not None else q.shape[-1] ** -0.5
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=seen, scale=s).transpose(0, 1))
        scores = (qb.double() @ kb.double().transpose(-1, -2)) * s
        lses.append(scores.masked_fill(~seen, float("-inf")).logsumexp(-1))
    return torch.cat(outs), torch.cat(lses, dim=1)


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}

CASES = {
    "plain": ([3, 7, 1, 12], [5, 7, 4, 12], 2, 2, dict()),
    "causal": ([3, 7, 1, 12], [5, 7, 4, 12], 2, 2, dict(window_size=(-1, 0))),
    "window": ([3, 7, 1, 12], [5, 7, 4, 12], 2, 2, dict(window_size=(2, 1))),
    "causal window": ([3, 7, 1, 12], [5, 7, 4, 12], 2, 2, dict(window_size=(3, 0))),
    "gqa": ([4, 9], [6, 9], 4, 2, dict(enable_gqa=True, window_size=(-1, 0))),
    "scale": ([4, 9], [6, 9], 2, 2, dict(scale=0.3)),
    "long": ([150, 20], [600, 20], 2, 1, dict(enable_gqa=True, window_size=(-1, 0))),
}


def make(lens_q, lens_k, H, Hkv, dtype, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(lens_q), H, D, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(sum(lens_k), Hkv, D, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(sum(lens_k), Hkv, D, generator=gen, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward(case, dtype):
    lens_q, lens_k, H, Hkv, kwargs = CASES[case]
    q, k, v = make(lens_q, lens_k, H, Hkv, dtype)
    out, lse = call_varlen(q, k, v, offsets(lens_q), offsets(lens_k), max(lens_q), max(lens_k),
                           return_aux=AuxRequest(lse=True), **kwargs)
    window = kwargs.get("window_size", (-1, -1))
    ref_out, ref_lse = sdpa_per_sequence(q.double(), k.double(), v.double(), lens_q, lens_k, window,
                                         kwargs.get("scale"))
    assert out.shape == q.shape and out.dtype == dtype and out.stride() == q.stride()
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32  # PyTorch's fake kernel's
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=max(TOL[dtype], 2e-6))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["plain", "causal", "window", "gqa", "long"])
def test_backward(case, dtype):
    lens_q, lens_k, H, Hkv, kwargs = CASES[case]
    leaves = [t.requires_grad_() for t in make(lens_q, lens_k, H, Hkv, dtype)]
    out = call_varlen(*leaves, offsets(lens_q), offsets(lens_k), max(lens_q), max(lens_k), **kwargs)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, _ = sdpa_per_sequence(*ref_leaves, lens_q, lens_k, kwargs.get("window_size", (-1, -1)))
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, g.double())
    # float64 gradients carry PyTorch's float32 lse (~1e-7 relative).
    atol = 1e-5 if dtype == torch.float64 else 1e-4
    for a, r, t in zip(grads, ref_grads, leaves, strict=True):
        assert a.shape == t.shape and a.dtype == dtype
        torch.testing.assert_close(a.double(), r, rtol=0, atol=atol)


def test_seqused_k():
    lens_q, lens_k, used = [2, 3], [6, 5], [4, 5]
    q, k, v = make(lens_q, lens_k, 2, 2, torch.float64)
    out = call_varlen(q, k, v, offsets(lens_q), offsets(lens_k), 3, 6, window_size=(-1, 0),
                      seqused_k=torch.tensor(used, dtype=torch.int32))
    keep = torch.cat([torch.arange(0, 4), torch.arange(6, 11)])
    ref, _ = sdpa_per_sequence(q, k[keep], v[keep], lens_q, used, (-1, 0))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("with_cu_seq_k", [True, False])
@pytest.mark.parametrize("page_size", [1, 16, 7])
def test_paged(page_size, with_cu_seq_k):
    lens_q, lens_k = [1, 3, 2], [9, 20, 33]
    q, k, v = make(lens_q, lens_k, 4, 2, torch.float64)
    gen = torch.Generator().manual_seed(1)
    n_pages = [(n + page_size - 1) // page_size for n in lens_k]
    perm = torch.randperm(sum(n_pages) + 2, generator=gen)
    k_cache = torch.randn(len(perm), page_size, 2, 16, dtype=torch.float64)
    v_cache = torch.randn(len(perm), page_size, 2, 16, dtype=torch.float64)
    table = torch.zeros(3, max(n_pages), dtype=torch.int32)
    ck = offsets(lens_k).tolist()
    at = 0
    for b, n in enumerate(lens_k):
        pages = perm[at:at + n_pages[b]]
        at += n_pages[b]
        table[b, :len(pages)] = pages.to(torch.int32)
        j = torch.arange(n)
        k_cache[pages[j // page_size], j % page_size] = k[ck[b]:ck[b] + n]
        v_cache[pages[j // page_size], j % page_size] = v[ck[b]:ck[b] + n]
    seqused = torch.tensor(lens_k, dtype=torch.int32)
    out = call_varlen(q, k_cache, v_cache, offsets(lens_q), offsets(lens_k) if with_cu_seq_k else None,
                      max(lens_q), max(lens_k), window_size=(-1, 0), enable_gqa=True, seqused_k=seqused,
                      block_table=table)
    ref, _ = sdpa_per_sequence(q, k, v, lens_q, lens_k, (-1, 0))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_rows_that_see_no_key():
    # An empty key sequence: out 0 and lse +inf (FlashAttention-2's value too).
    q, k, v = make([2, 2], [0, 3], 2, 2, torch.float32)
    out, lse = call_varlen(q, k, v, offsets([2, 2]), offsets([0, 3]), 2, 3, return_aux=AuxRequest(lse=True))
    assert (out[:2] == 0).all() and torch.isposinf(lse[:, :2]).all() and torch.isfinite(lse[:, 2:]).all()


def test_raw_op_outputs():
    q, k, v = make([3, 4], [3, 4], 2, 2, torch.float64)
    cu = offsets([3, 4])
    out, lse, rng = torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, 4, 4, True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert rng.dtype == torch.uint64 and rng.shape == (2,)
    # A non-contiguous query: out takes its layout, as torch.empty_like(query) (PyTorch's fake kernel).
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    out_t, _, _ = torch.ops.torch_attn._varlen_attn(qt, k, v, cu, cu, 4, 4, True)
    assert out_t.stride() == qt.stride()
    torch.testing.assert_close(out_t, out, rtol=0, atol=0)


@pytest.mark.wheel
def test_opcheck():
    require("window_size")
    q, k, v = make([3, 4], [5, 4], 2, 2, torch.float32)
    args = (q, k, v, offsets([3, 4]), offsets([5, 4]), 4, 5, True, None, [-1, 0])
    torch.library.opcheck(torch.ops.torch_attn._varlen_attn.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_out_variant():
    if not hasattr(torch.ops.torch_attn, "_varlen_attn_out"):
        pytest.skip(f"torch {torch.__version__} has no torch_attn::_varlen_attn_out")
    from torch.nn.attention.varlen import varlen_attn_out

    q, k, v = make([3, 4], [5, 4], 2, 2, torch.float32)
    out = torch.empty_like(q)
    result = varlen_attn_out(out, q, k, v, offsets([3, 4]), offsets([5, 4]), 4, 5, window_size=(-1, 0))
    torch.testing.assert_close(result, call_varlen(q, k, v, offsets([3, 4]), offsets([5, 4]), 4, 5,
                                                   window_size=(-1, 0)))


def test_batch_invariant():
    # A sequence's output does not depend on the other sequences of the batch (what num_splits=1 asks for).
    q, k, v = make([5, 300, 2], [40, 700, 9], 2, 2, torch.float32)
    together = call_varlen(q, k, v, offsets([5, 300, 2]), offsets([40, 700, 9]), 300, 700, num_splits=1)
    alone = call_varlen(q[:5], k[:40], v[:40], offsets([5]), offsets([40]), 5, 40, num_splits=1)
    assert torch.equal(together[:5], alone)


def test_backward_refuses_seqused_k():
    q, k, v = (t.requires_grad_() for t in make([2], [3], 2, 2, torch.float32))
    with pytest.raises(RuntimeError, match="seqused_k is an inference-only parameter"):
        call_varlen(q, k, v, offsets([2]), offsets([3]), 2, 3, seqused_k=torch.tensor([3], dtype=torch.int32))


def test_errors_are_attnx_checks():
    q, k, v = make([3, 4], [3, 4], 2, 2, torch.float32)
    with pytest.raises(RuntimeError, match="cu_seqlens_q to be non-decreasing"):
        call_varlen(q, k, v, torch.tensor([0, 4, 3], dtype=torch.int32), offsets([3, 4]), 4, 4)


def test_attnx_import_registers():
    # The registration comes from `import attnx`, and attnx's kernel runs (not a fallback).
    assert attnx.pytorch.varlen.AVAILABLE
    q, k, v = make([3], [3], 2, 2, torch.float32)
    with pytest.raises(RuntimeError, match="attnx::varlen_attention: expected max_seqlen_q"):
        call_varlen(q, k, v, offsets([3]), offsets([3]), 1, 3)


@pytest.mark.slow  # a fresh interpreter each
@pytest.mark.parametrize("first", ["attnx", "torch.nn.attention.varlen"])
def test_registered_whichever_is_imported_first(first):
    # `import attnx` leaves torch.nn.attention.varlen (and the torch._dynamo it imports, seconds) unimported;
    # the kernels are registered when it is imported, before or after attnx.
    code = f"""
import sys, torch
import {first}
import attnx
assert ("torch._dynamo" in sys.modules) == ({first!r} != "attnx"), "import attnx imported torch._dynamo"
from torch.nn.attention.varlen import varlen_attn
cu = torch.tensor([0, 3], dtype=torch.int32)
q = torch.randn(3, 2, 8)
try:
    varlen_attn(q, q, q, cu, cu, 1, 3)
except RuntimeError as error:
    assert "attnx::varlen_attention: expected max_seqlen_q" in str(error), error
else:
    raise AssertionError("attnx's kernel did not run")
assert attnx.pytorch.varlen.AVAILABLE
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_compile():
    # torch.compile traces PyTorch's fake kernel and runs attnx's CPU kernel, forward and backward.
    require("window_size")
    lens = [3, 5]
    leaves = [t.requires_grad_() for t in make(lens, lens, 2, 2, torch.float32)]
    cu = offsets(lens)

    def fn(q, k, v):
        return varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    ref_leaves = [t.detach().requires_grad_() for t in leaves]
    ref = fn(*ref_leaves)
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
