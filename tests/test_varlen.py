"""attnx.varlen_attention (packed sequences, paged KV cache) against attnx.reference.varlen_attention.

The reference runs attnx.reference.attention on each sequence in turn, in float64 and in the inputs' dtype;
the kernel must stay within K_BOUND times the same-dtype reference's error (tests/attention_helpers.py).
"""

import pytest
import torch

import attnx
from attention_helpers import ATOL, GRAD_ATOL, LSE_ATOL, assert_bounded, assert_grad_bounded, upcast
from attnx import reference

pytestmark = pytest.mark.kernel

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def make_packed(lens_q, lens_k, H, Hkv, D, Dv, dtype, layout="contiguous", seed=0):
    """query (total_q, H, D), key (total_k, Hkv, D), value (total_k, Hkv, Dv); layout "strided" makes each a
    non-contiguous view (rows of a wider buffer, heads and the last dim strided)."""
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)

    def make(rows, heads, dim):
        if layout == "contiguous":
            return torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
        # (heads, rows, 2 * dim) storage, viewed (rows, heads, dim) with last-dim stride 2.
        base = torch.randn(heads, rows, 2 * dim, generator=gen, dtype=torch.float64).to(dtype)
        return base.transpose(0, 1)[..., ::2]

    return make(tq, H, D), make(tk, Hkv, D), make(tk, Hkv, Dv)


def check_forward(q, k, v, cq, ck, **kwargs):
    mq, mk = kwargs.pop("max_q", None), kwargs.pop("max_k", None)
    mq = mq if mq is not None else int((cq[1:] - cq[:-1]).max()) if len(cq) > 1 else 0
    mk = mk if mk is not None else int((ck[1:] - ck[:-1]).max()) if len(ck) > 1 else 0
    out, lse = attnx.varlen_attention(q, k, v, cq, ck, mq, mk, **kwargs)
    ref64 = reference.varlen_attention(upcast(q), upcast(k), upcast(v), cq, ck, mq, mk,
                                       **{n: upcast(a) for n, a in kwargs.items()})
    ref = reference.varlen_attention(q, k, v, cq, ck, mq, mk, **kwargs)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert_bounded(out, ref64[0], ref[0], ATOL[q.dtype], "out")
    assert_bounded(lse, ref64[1], ref[1], LSE_ATOL[q.dtype], "lse")
    return out, lse


# (lens_q, lens_k, H, Hkv, kwargs): empty and length-1 sequences, Lq != Lk in both directions.
CASES = {
    "plain": ([3, 0, 1, 7, 5], [5, 2, 0, 7, 1], 2, 2, {}),
    "causal": ([3, 0, 1, 7, 5], [5, 2, 0, 7, 1], 2, 2, dict(is_causal=True)),
    "window": ([3, 4, 1, 9], [5, 4, 6, 9], 2, 2, dict(window_left=2, window_right=1)),
    "causal window": ([3, 4, 1, 9], [5, 4, 6, 9], 2, 2, dict(is_causal=True, window_left=3)),
    "gqa": ([3, 1, 6], [4, 8, 6], 4, 2, dict(is_causal=True)),
    "mqa": ([3, 1, 6], [4, 8, 6], 4, 1, {}),
    "softcap": ([3, 1, 6], [4, 8, 6], 2, 2, dict(softcap=1.5, scale=2.0)),
    "sinks": ([3, 0, 6], [4, 8, 0], 4, 2, dict(sinks=True)),
    "seqused_k": ([3, 2, 6], [4, 8, 6], 2, 1, dict(seqused_k=[2, 8, 0], is_causal=True)),
    # Several query tiles (128) and key tiles (512) per sequence, next to short ones.
    "long": ([200, 1, 130], [700, 3, 513], 2, 1, dict(is_causal=True)),
}


def case_kwargs(kwargs, H, dtype):
    kwargs = dict(kwargs)
    if kwargs.get("sinks"):
        kwargs["sinks"] = torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(
            dtype)
    if "seqused_k" in kwargs:
        kwargs["seqused_k"] = torch.tensor(kwargs["seqused_k"], dtype=torch.int32)
    return kwargs


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward(case, dtype, layout):
    lens_q, lens_k, H, Hkv, kwargs = CASES[case]
    q, k, v = make_packed(lens_q, lens_k, H, Hkv, 16, 8, dtype, layout)
    check_forward(q, k, v, offsets(lens_q), offsets(lens_k), **case_kwargs(kwargs, H, dtype))


def test_rows_that_see_no_key():
    # Lk = 0, and a window that reaches no key: out 0, lse +inf (FlashAttention-2 reports +inf too).
    q, k, v = make_packed([2, 3], [0, 4], 2, 2, 8, 8, torch.float32)
    out, lse = attnx.varlen_attention(q, k, v, offsets([2, 3]), offsets([0, 4]), 3, 4, window_left=0,
                                      window_right=-1)
    assert (out[:2] == 0).all() and torch.isposinf(lse[:, :2]).all()
    assert torch.isfinite(lse[:, 2:]).all()


def test_rows_outside_every_sequence():
    # cu_seqlens need not start at 0 nor reach the end: rows outside get out 0 and lse +inf, and keys outside
    # get zero gradients.
    q, k, v = (t.requires_grad_() for t in make_packed([6], [7], 2, 2, 8, 8, torch.float64))
    cq, ck = torch.tensor([1, 3, 5], dtype=torch.int32), torch.tensor([2, 4, 6], dtype=torch.int32)
    out, lse = check_forward(q, k, v, cq, ck)
    assert (out[[0, 5]] == 0).all() and torch.isposinf(lse[:, [0, 5]]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq[[0, 5]] == 0).all() and (dk[[0, 1, 6]] == 0).all() and (dv[[0, 1, 6]] == 0).all()


@pytest.mark.wheel
def test_sequences_never_read_each_other():
    # NaN in every key and value outside sequence 0's and past its seqused_k: sequence 0 stays finite, and the
    # tile that covers both sequences never mixes them.
    q, k, v = make_packed([4, 4], [6, 6], 2, 2, 8, 8, torch.float32)
    k, v = k.clone(), v.clone()
    k[3:], v[3:] = float("nan"), float("nan")
    out, lse = attnx.varlen_attention(q, k, v, offsets([4, 4]), offsets([6, 6]), 4, 6,
                                      seqused_k=torch.tensor([3, 6], dtype=torch.int32))
    assert torch.isfinite(out[:4]).all() and torch.isfinite(lse[:, :4]).all()
    assert torch.isnan(out[4:]).all()


def test_many_sequences_match_padded_attention():
    # Against attnx.attention on the same sequences padded to the longest, with key_lengths: the two kernels
    # agree where the padded one has a defined answer (every query row of a sequence with keys).
    lens_q, lens_k = [5, 9, 1, 12], [7, 9, 4, 12]
    q, k, v = make_packed(lens_q, lens_k, 4, 2, 16, 16, torch.float64)
    out, _ = attnx.varlen_attention(q, k, v, offsets(lens_q), offsets(lens_k), 12, 12)
    cq, ck = offsets(lens_q).tolist(), offsets(lens_k).tolist()
    for b in range(4):
        qb, kb, vb = (t[c[b]:c[b + 1]].transpose(0, 1)[None] for t, c in ((q, cq), (k, ck), (v, ck)))
        o, _ = attnx.attention(qb, kb, vb)
        torch.testing.assert_close(out[cq[b]:cq[b + 1]], o[0].transpose(0, 1), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------------------
# Paged KV cache.


def make_paged(lens_k, page_size, Hkv, D, Dv, dtype, spare=3, seed=0):
    """A cache of `spare` more pages than the sequences need, handed out in shuffled order, and its block
    table (entries past a sequence's pages are 0: in range, never read)."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = [(n + page_size - 1) // page_size for n in lens_k]
    total = sum(n_pages) + spare
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens_k), max(max(n_pages), 1), dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    k_cache = torch.randn(total, page_size, Hkv, D, generator=gen, dtype=torch.float64).to(dtype)
    v_cache = torch.randn(total, page_size, Hkv, Dv, generator=gen, dtype=torch.float64).to(dtype)
    return k_cache, v_cache, table


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_paged(page_size, causal, dtype):
    lens_q, lens_k = [1, 4, 0, 3, 1], [9, 20, 3, 0, 600]
    q, _, _ = make_packed(lens_q, lens_k, 4, 2, 16, 8, dtype)
    k_cache, v_cache, table = make_paged(lens_k, page_size, 2, 16, 8, dtype)
    seqused = torch.tensor([5, 20, 3, 0, 599], dtype=torch.int32)
    check_forward(q, k_cache, v_cache, offsets(lens_q), offsets(lens_k), is_causal=causal, seqused_k=seqused,
                  block_table=table)


def test_paged_equals_packed():
    # The same keys paged or packed give the same result, bit for bit where the tiles are the same.
    lens_q, lens_k = [3, 1, 5], [10, 33, 5]
    q, _, _ = make_packed(lens_q, lens_k, 2, 2, 8, 8, torch.float32)
    k_cache, v_cache, table = make_paged(lens_k, 4, 2, 8, 8, torch.float32)
    j = [torch.arange(n) for n in lens_k]
    k = torch.cat([k_cache[table[b, i // 4].long(), i % 4] for b, i in enumerate(j)])
    v = torch.cat([v_cache[table[b, i // 4].long(), i % 4] for b, i in enumerate(j)])
    paged = attnx.varlen_attention(q, k_cache, v_cache, offsets(lens_q), offsets(lens_k), 5, 33,
                                   is_causal=True, block_table=table)
    packed = attnx.varlen_attention(q, k, v, offsets(lens_q), offsets(lens_k), 5, 33, is_causal=True)
    torch.testing.assert_close(paged, packed, rtol=0, atol=0)


def test_paged_strided_cache():
    # A cache viewed with strides (a (pages, Hkv, page_size, D) buffer transposed): read in place.
    lens_q, lens_k = [2, 3], [11, 6]
    q, _, _ = make_packed(lens_q, lens_k, 2, 1, 8, 8, torch.float64)
    k_cache, v_cache, table = make_paged(lens_k, 5, 1, 8, 8, torch.float64)
    k_t = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    v_t = v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    check_forward(q, k_t, v_t, offsets(lens_q), offsets(lens_k), block_table=table)


def test_paged_never_reads_unused_pages():
    lens_q, lens_k = [1, 2], [7, 5]
    q, _, _ = make_packed(lens_q, lens_k, 2, 2, 8, 8, torch.float32)
    k_cache, v_cache, table = make_paged(lens_k, 4, 2, 8, 8, torch.float32, spare=2)
    used = set(table[0, :2].tolist() + table[1, :2].tolist())
    for page in range(k_cache.shape[0]):
        if page not in used:
            k_cache[page], v_cache[page] = float("nan"), float("nan")
    table = table.clone()
    # Past each sequence's pages: entries that must not be read (any value in range).
    out, lse = attnx.varlen_attention(q, k_cache, v_cache, offsets(lens_q), offsets(lens_k), 2, 7,
                                      block_table=table)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ------------------------------------------------------------------------------------------------------------
# Backward (without a block table).


def check_backward(lens_q, lens_k, H, Hkv, dtype, kwargs, layout="contiguous"):
    q, k, v = make_packed(lens_q, lens_k, H, Hkv, 16, 8, dtype, layout)
    kwargs = case_kwargs(kwargs, H, dtype)
    cq, ck = offsets(lens_q), offsets(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    g = torch.randn(q.shape[0], H, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    sinks = kwargs.pop("sinks", None)

    def grads(fn, tensors, sinks):
        leaves = [t.detach().requires_grad_() for t in tensors]
        extra = {} if sinks is None else {"sinks": sinks.detach().requires_grad_()}
        out, _ = fn(*leaves, cq, ck, mq, mk, **kwargs, **extra)
        wrt = leaves + list(extra.values())
        return torch.autograd.grad(out, wrt, g.to(out.dtype))

    ours = grads(attnx.varlen_attention, (q, k, v), sinks)
    ref64 = grads(reference.varlen_attention, [upcast(t) for t in (q, k, v)], upcast(sinks))
    ref = grads(reference.varlen_attention, (q, k, v), sinks)
    for a, r64, r, name in zip(ours, ref64, ref, ["dq", "dk", "dv", "dsinks"], strict=False):
        assert a.dtype == r.dtype
        assert_grad_bounded(a, r64, r, GRAD_ATOL[dtype], name)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c != "long"])
def test_backward(case, dtype, layout):
    lens_q, lens_k, H, Hkv, kwargs = CASES[case]
    check_backward(lens_q, lens_k, H, Hkv, dtype, kwargs, layout)


@pytest.mark.wheel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_backward_long(dtype):
    lens_q, lens_k, H, Hkv, kwargs = CASES["long"]
    check_backward(lens_q, lens_k, H, Hkv, dtype, kwargs)


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(window_left=1, window_right=2, softcap=2.0),
                                    dict(seqused_k=True)], ids=["causal", "window softcap", "seqused_k"])
def test_gradcheck(kwargs):
    lens_q, lens_k = [2, 0, 3], [3, 2, 4]
    q, k, v = (t.requires_grad_() for t in make_packed(lens_q, lens_k, 2, 1, 3, 2, torch.float64))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    kwargs = dict(kwargs)
    if kwargs.pop("seqused_k", False):
        kwargs["seqused_k"] = torch.tensor([1, 2, 4], dtype=torch.int32)

    def fn(q, k, v, sinks):
        cq, ck = offsets(lens_q), offsets(lens_k)
        return attnx.varlen_attention(q, k, v, cq, ck, 3, 4, sinks=sinks, **kwargs)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_deterministic():
    lens_q, lens_k = [130, 7, 64], [600, 7, 200]
    q, k, v = (t.requires_grad_() for t in make_packed(lens_q, lens_k, 4, 2, 32, 32, torch.float32))
    cq, ck = offsets(lens_q), offsets(lens_k)
    g = torch.randn(q.shape[0], 4, 32)

    def run():
        out, lse = attnx.varlen_attention(q, k, v, cq, ck, 130, 600, is_causal=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), g))

    first = run()
    for _ in range(2):
        for a, b in zip(first, run(), strict=True):
            assert torch.equal(a, b)


def test_router_and_no_grad():
    # torch.ops.attnx.varlen_attention: the router gives the same results with and without grad mode.
    lens_q, lens_k = [3, 5], [4, 5]
    q, k, v = make_packed(lens_q, lens_k, 2, 2, 8, 8, torch.float32)
    args = (q, k, v, offsets(lens_q), offsets(lens_k), 5, 5, True)
    with torch.no_grad():
        a = torch.ops.attnx.varlen_attention(*args)
    b = torch.ops.attnx.varlen_attention(*args)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.attnx.varlen_attention(*leaves, *args[3:])
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_backward_refuses_block_table():
    lens_q, lens_k = [1, 2], [5, 3]
    q, _, _ = make_packed(lens_q, lens_k, 2, 2, 8, 8, torch.float32)
    k_cache, v_cache, table = make_paged(lens_k, 4, 2, 8, 8, torch.float32)
    q.requires_grad_()
    out, _ = attnx.varlen_attention(q, k_cache, v_cache, offsets(lens_q), offsets(lens_k), 2, 5,
                                    block_table=table)
    with pytest.raises(RuntimeError, match="block_table .*inference only"):
        out.sum().backward()


# ------------------------------------------------------------------------------------------------------------
# opcheck, fakes, errors.


def _opcheck_cases():
    lens_q, lens_k = [3, 0, 4], [5, 2, 4]
    q, k, v = make_packed(lens_q, lens_k, 4, 2, 8, 4, torch.float32)
    cq, ck = offsets(lens_q), offsets(lens_k)
    k_cache, v_cache, table = make_paged(lens_k, 3, 2, 8, 4, torch.float32)
    return {
        "plain": ((q, k, v, cq, ck, 4, 5), True),
        "causal window seqused": ((q, k, v, cq, ck, 4, 5, True, 0.5, 2, 1, _i32(5, 1, 4), None, 2.0,
                                   torch.randn(4)), True),
        "paged": ((q, k_cache, v_cache, cq, ck, 4, 5, True, None, -1, -1, None, table), False),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    args, backward = _opcheck_cases()[case]
    torch.library.opcheck(torch.ops.attnx.varlen_attention.default, args)
    torch.library.opcheck(torch.ops.attnx._varlen_attention.default, args)
    if backward:
        out, lse = torch.ops.attnx.varlen_attention.default(*args)
        bwd = (torch.randn_like(out), *args[:3], out, lse, *args[3:])
        torch.library.opcheck(torch.ops.attnx.varlen_attention_backward.default, bwd)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    lens_q, lens_k = [3, 4], [5, 4]
    q, k, v = make_packed(lens_q, lens_k, 4, 2, 8, 4, torch.float64)
    cq, ck = offsets(lens_q), offsets(lens_k)
    real = attnx.varlen_attention(q, k, v, cq, ck, 4, 5)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = attnx.varlen_attention(q, k, v, cq, ck, 4, 5)
    for r, f in zip(real, fake, strict=True):
        assert r.shape == f.shape and r.stride() == f.stride() and r.dtype == f.dtype


def test_compile():
    lens_q, lens_k = [3, 4], [5, 4]
    q, k, v = make_packed(lens_q, lens_k, 2, 2, 8, 8, torch.float32)
    cq, ck = offsets(lens_q), offsets(lens_k)
    fn = torch.compile(lambda q, k, v: attnx.varlen_attention(q, k, v, cq, ck, 4, 5, is_causal=True)[0],
                       backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), attnx.varlen_attention(q, k, v, cq, ck, 4, 5, is_causal=True)[0])


ERRORS = {
    "decreasing cu_seqlens_q": (dict(cq=_i32(0, 3, 2)), "cu_seqlens_q to be non-decreasing"),
    "cu_seqlens_q past query": (dict(cq=_i32(0, 3, 9)), r"cu_seqlens_q\[-1\] <= 7"),
    "negative cu_seqlens_k": (dict(ck=_i32(-1, 3, 7)), r"cu_seqlens_k\[0\] >= 0"),
    "cu_seqlens_k past key": (dict(ck=_i32(0, 3, 8)), r"cu_seqlens_k\[-1\] <= 7"),
    "int64 offsets": (dict(cq=torch.tensor([0, 3, 7])), "cu_seqlens_q of dtype int32, got Long"),
    "offsets of other lengths": (dict(ck=_i32(0, 7)), r"cu_seqlens_k of shape \(3,\)"),
    "max_seqlen too small": (dict(max_q=3), "max_seqlen_q and max_seqlen_k to be at least"),
    "seqused_k past the slot": (dict(seqused_k=_i32(3, 5)), r"seqused_k\[1\] in \[0, .*4\], got 5"),
    "heads": (dict(k=torch.randn(7, 3, 8)), "to divide the number of query heads"),
    "2-D query": (dict(q=torch.randn(7, 8)), r"query of shape \(total_q, H, D\)"),
    "key dtype": (dict(k=torch.randn(7, 2, 8, dtype=torch.float64)), "key of query's dtype"),
    "window": (dict(window_left=-2), "window_left and window_right >= -1"),
    "softcap": (dict(softcap=0.0), "softcap to be a finite number > 0"),
    "sinks": (dict(sinks=torch.randn(3)), r"sinks of shape \(H,\)"),
    "block table entry": (dict(paged=True, table_value=5), r"block_table entries in \[0, pages\)"),
    "block table too narrow": (dict(paged=True, table_width=1), "to fit its 1 pages of 2"),
    "block table dtype": (dict(paged=True, table_dtype=torch.int64), "block_table of dtype int32"),
    "3-D key with block_table": (dict(paged=True, flat_key=True), r"key of shape \(pages, page_size"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    c, message = ERRORS[case]
    q = c.get("q", torch.randn(7, 2, 8))
    k, v = c.get("k", torch.randn(7, 2, 8)), torch.randn(7, 2, 8)
    if "k" in c and c["k"].dim() == 3:
        v = torch.randn(7, c["k"].shape[1], 8, dtype=c["k"].dtype)
    cq, ck = c.get("cq", _i32(0, 3, 7)), c.get("ck", _i32(0, 3, 7))
    kwargs = {n: c[n] for n in ("window_left", "softcap", "sinks", "seqused_k") if n in c}
    if c.get("paged"):
        k, v = torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8)
        if c.get("flat_key"):
            k = torch.randn(7, 2, 8)
        table = torch.tensor([[0, 1], [2, c.get("table_value", 3)]], dtype=c.get("table_dtype", torch.int32))
        kwargs["block_table"] = table[:, :c.get("table_width", 2)]
    with pytest.raises(RuntimeError, match=message):
        attnx.varlen_attention(q, k, v, cq, ck, c.get("max_q", 4), 4, **kwargs)
