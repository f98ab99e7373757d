"""Seeded fuzzing of every attnx op against its spec: ``attnx.attention`` and its backward against
``attnx.reference`` (random shapes, empty dims included, grouped KV heads, strided layouts, every mask form,
causal attention, windows, key lengths, soft-capping, sinks, scales and block-sparse masks); ``attnx.linear``
and its backward against ``F.linear`` in float64 (random leading dims, empty and size-1 ones included, feature
counts from 0, every dtype, full, strided and size-1 biases, and random memory layouts of input and weight:
dims in any memory order, slices with storage offsets, gaps and steps, stride-0 dims, size-1 dims with odd
strides); and ``attnx.ops.mha`` and its backward against ``attnx.reference.mha`` (packed or separate
projections with other kdim/vdim, biases, bias_k/bias_v, add_zero_attn, static_k/static_v, bool and float
masks of every shape, causal, batch_first, the attention weights averaged or per head, every dtype, strided
inputs and weights).

Each case is a pure function of its number (``random.Random`` and a ``torch.Generator`` seeded from it), the
test id ``case-N``: a failure reproduces with its node id, e.g.
``pytest 'tests/test_fuzz.py::test_linear_forward[case-17]'``, and a case past the default ones with
``ATTNX_FUZZ_FIRST_CASE=N``:
``ATTNX_FUZZ_FIRST_CASE=123456 pytest 'tests/test_fuzz.py::test_mha_forward[case-123456]'``.

Environment (unset: the default counts below, cases 0, 1, ...):

- ``ATTNX_FUZZ_CASES``: a number multiplies every test's count (``ATTNX_FUZZ_CASES=100``: 100x the default
  cases; ``0.1``: a tenth, at least one each), or ``name=count`` pairs, comma-separated, set the counts of
  those tests (the others keep theirs), names as in :data:`DEFAULT_CASES`
  (``ATTNX_FUZZ_CASES=linear_forward=5000,mha_backward=0``).
- ``ATTNX_FUZZ_FIRST_CASE``: the first case number (default 0), so that a long run explores new cases:
  ``ATTNX_FUZZ_FIRST_CASE=1000000`` runs cases 1000000, 1000001, ...

A long run, crash-safe: pytest-xdist (``pip install pytest-xdist``) restarts a worker that crashes, a segfault
or an abort, reports the case it was running as an error, with its id, in the summary and the JUnit XML, and
the run goes on (up to ``--max-worker-restart`` crashes; its default, 4 per worker, is too few for a long
run):

    ATTNX_FUZZ_CASES=100 ATTNX_FUZZ_FIRST_CASE=1000000 python -m pytest -q -p no:cacheprovider -n 2 \\
        --max-worker-restart=1000 --junitxml=build/fuzz.xml tests/test_fuzz.py
"""

import contextlib
import itertools
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import attnx
from attnx import ops, reference
from layouts import is_non_overlapping_and_dense

pytestmark = pytest.mark.kernel

DEFAULT_CASES = {
    "attention_forward": 300,
    "attention_backward": 100,
    "linear_forward": 150,
    "linear_backward": 50,
    "mha_forward": 100,
    "mha_backward": 50,
    "varlen_forward": 100,
    "varlen_backward": 50,
}
# The seeds of a test's cases: case N of test T seeds with SEED_BASE[T] + N. attention's are those its cases
# always had (so attention forward case N + 10000 draws the shapes of backward case N, forward's dtype and
# empty dims aside); the others sit 2^32 apart, so that their cases never share a seed.
SEED_BASE = {
    "attention_forward": 0,
    "attention_backward": 10_000,
    "linear_forward": 1 << 32,
    "linear_backward": 2 << 32,
    "mha_forward": 3 << 32,
    "mha_backward": 4 << 32,
    "varlen_forward": 5 << 32,
    "varlen_backward": 6 << 32,
}


def _counts(spec):
    """Each test's case count from ``ATTNX_FUZZ_CASES`` (see the module docstring)."""
    spec = spec.strip()
    if not spec:
        return dict(DEFAULT_CASES)
    if "=" not in spec:
        factor = float(spec)
        return {name: max(1, round(n * factor)) if factor > 0 else 0 for name, n in DEFAULT_CASES.items()}
    counts = dict(DEFAULT_CASES)
    for item in spec.split(","):
        name, _, count = item.partition("=")
        if name.strip() not in counts:
            raise ValueError(f"ATTNX_FUZZ_CASES: unknown test {name.strip()!r}; known: {', '.join(counts)}")
        counts[name.strip()] = int(count)
    return counts


COUNTS = _counts(os.environ.get("ATTNX_FUZZ_CASES", ""))
FIRST_CASE = int(os.environ.get("ATTNX_FUZZ_FIRST_CASE", "0"))


def cases(name):
    """``name``'s case numbers as test parameters, ids ``case-N``."""
    return pytest.mark.parametrize(
        "case", [pytest.param(c, id=f"case-{c}") for c in range(FIRST_CASE, FIRST_CASE + COUNTS[name])]
    )


def _seeded(name, case):
    seed = SEED_BASE[name] + case
    return random.Random(seed), torch.Generator().manual_seed(seed)


def _pick(rng, weighted):
    """One key of ``{choice: weight}``."""
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


@contextlib.contextmanager
def _threads(rng):
    """Now and then another intra-op thread count (the CPU kernels cut their work into per-thread shares by
    it), restored afterwards."""
    n = _pick(rng, {0: 6, 1: 1, 3: 1, 8: 1})
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------------------
# attention


def _tensor(rng, g, shape, dtype, requires_grad=False):
    t = torch.randn(*shape, generator=g, dtype=dtype)
    if rng.random() < 0.3:  # (B, N, H, E) in memory, as a model's projections lay it out
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.requires_grad_(requires_grad)


def _draw_score_options(rng, g, kw, H, dtype, grad):
    """Soft-capping, sinks and the scale, each now and then: into ``kw``, the same draws for attention and
    varlen_attention."""
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([0.5, 5.0])
    if rng.random() < 0.2:
        kw["sinks"] = torch.randn(H, generator=g, dtype=dtype).requires_grad_(grad)
    if rng.random() < 0.2:
        kw["scale"] = rng.choice([0.01, 1.0, 3.0])


def _config(case, dtype, grad):
    """(query, key, value, keyword arguments) of one case; L and S may be 0 in the forward cases."""
    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    B, Hkv = rng.randint(1, 3), rng.randint(1, 3)
    H = Hkv * rng.randint(1, 3)
    low = 1 if grad else 0
    L, S = rng.randint(low, 40), rng.randint(low, 70)
    D, Dv = rng.choice([1, 3, 8, 16, 33, 64]), rng.choice([1, 8, 16, 40])
    q = _tensor(rng, g, (B, H, L, D), dtype, grad)
    k = _tensor(rng, g, (B, Hkv, S, D), dtype, grad)
    v = _tensor(rng, g, (B, Hkv, S, Dv), dtype, grad)
    kw = {}
    if rng.random() < 0.4:
        kw["key_padding_mask"] = torch.rand(B, S, generator=g) < 0.3
    if rng.random() < 0.3:
        kind = rng.choice(["bool 2-D", "float (1, H, L, S)", "bool (B, 1, 1, S)"])
        if kind == "bool 2-D":
            kw["attn_mask"] = torch.rand(L, S, generator=g) < 0.2
        elif kind == "float (1, H, L, S)":
            kw["attn_mask"] = torch.randn(1, H, L, S, generator=g, dtype=dtype).requires_grad_(grad)
        else:
            kw["attn_mask"] = torch.rand(B, 1, 1, S, generator=g) < 0.3
    choice = rng.random()
    if choice < 0.2:
        kw["is_causal"] = True
    elif choice < 0.5:
        kw["window_left"], kw["window_right"] = rng.choice([-1, 0, 2, 7]), rng.choice([-1, 0, 3])
    if rng.random() < 0.3:
        kw["key_lengths"] = torch.randint(0, S + 1, (B,), generator=g)
    _draw_score_options(rng, g, kw, H, dtype, grad)
    if rng.random() < 0.2:
        kw.update(_block_map(rng, g, B, H, L, S))
    return q, k, v, kw


def _block_map(rng, g, B, H, L, S):
    """A random block-sparse mask: block sizes from 1 to past the lengths, B and H broadcast or not, each
    block EMPTY, FULL or PARTIAL with random bits."""
    block_q, block_k = rng.choice([1, 5, 16, 64]), rng.choice([1, 7, 32, 40, 128])
    shape = (rng.choice([1, B]), rng.choice([1, H]), -(-L // block_q), -(-S // block_k))
    kind = torch.randint(0, 3, shape, generator=g)
    P = int((kind == 2).sum())
    block_map = torch.where(kind == 0, -1, -2).to(torch.int32)
    block_map[kind == 2] = torch.randperm(P, generator=g).to(torch.int32)
    bits = torch.randint(-(2**31), 2**31 - 1, (P, block_q, -(-block_k // 32)), generator=g, dtype=torch.int64)
    return {"block_map": block_map, "block_bits": bits.to(torch.int32), "block_q": block_q,
            "block_k": block_k}


def _in_float64(kw):
    return {n: t.detach().double() if torch.is_tensor(t) and t.is_floating_point() else t
            for n, t in kw.items()}


@cases("attention_forward")
def test_attention_forward(case):
    dtype = torch.float64 if case % 2 else torch.float32
    q, k, v, kw = _config(SEED_BASE["attention_forward"] + case, dtype, grad=False)
    out, lse = attnx.attention(q, k, v, **kw)
    expected_out, expected_lse = reference.attention(q.double(), k.double(), v.double(), **_in_float64(kw))
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=tol, atol=tol)


@cases("attention_backward")
def test_attention_backward(case):
    q, k, v, kw = _config(SEED_BASE["attention_backward"] + case, torch.float64, grad=True)
    learned = (kw.get("attn_mask"), kw.get("sinks"))
    inputs = [q, k, v] + [t for t in learned if t is not None and t.requires_grad]
    grad_out = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(case),
                           dtype=torch.float64)
    actual = torch.autograd.grad(attnx.attention(q, k, v, **kw)[0], inputs, grad_out)
    expected = torch.autograd.grad(reference.attention(q, k, v, **kw)[0], inputs, grad_out)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-9)


# ------------------------------------------------------------------------------------------------------------
# random memory layouts


def _strided(rng, g, shape, dtype, *, scale=1.0, any_order=0.15, expand=0.1, odd_size1=0.2):
    """A tensor of logical ``shape`` whose values come from ``g`` (scaled by ``scale``), in a random memory
    layout: its dims in any memory order (leading dims shuffled: B=1 transposes, (L, B, E) views of
    batch-first data; with probability ``any_order`` all of them: transposed weights, column-major features),
    a window of a larger buffer (a storage offset, gaps between rows, steps), dims of size > 1 broadcast from
    size 1 with stride 0 (probability ``expand`` each) and size-1 dims with odd strides (probability
    ``odd_size1``)."""
    n = len(shape)
    if n == 0:
        return (torch.randn((), generator=g, dtype=torch.float64) * scale).to(dtype)
    broadcast = [size > 1 and rng.random() < expand for size in shape]
    base = [1 if b else size for size, b in zip(shape, broadcast, strict=True)]
    order = list(range(n))  # memory order, outermost first
    r = rng.random()
    if r < any_order:
        rng.shuffle(order)
    elif r < 0.5 and n > 2:
        leading = order[:-1]
        rng.shuffle(leading)
        order = leading + order[-1:]
    if rng.random() < 0.5:  # contiguous in that order
        step, pad = [1] * n, [0] * n
    else:
        step = [_pick(rng, {1: 8, 2: 1, 3: 1}) for _ in range(n)]
        pad = [_pick(rng, {0: 4, 1: 2, 3: 1}) for _ in range(n)]
    start = [rng.randint(0, p) for p in pad]
    buffer = torch.randn([base[d] * step[d] + pad[d] for d in order], generator=g, dtype=torch.float64)
    buffer = (buffer * scale).to(dtype)
    window = buffer[tuple(slice(start[d], start[d] + base[d] * step[d], step[d]) for d in order)]
    t = window.permute([order.index(d) for d in range(n)]).expand(shape)
    if rng.random() < odd_size1 and 1 in shape:
        odd = rng.choice([0, 7, 2**40 + 7])
        strides = [odd if size == 1 else st for size, st in zip(t.shape, t.stride(), strict=True)]
        t = t.as_strided(t.shape, strides, t.storage_offset())
    return t


def _relaid(rng, t):
    """``t``'s values in a random (non-broadcast) layout of the same shape."""
    return _strided(rng, None, t.shape, t.dtype, expand=0, odd_size1=0.1).copy_(t)


def _strided_fixed(rng, g, shape, dtype, **kw):
    """:func:`_strided` with the values of ``g`` as a contiguous draw (a relayout never changes them)."""
    values = (torch.randn(shape, generator=g, dtype=torch.float64) * kw.pop("scale", 1.0)).to(dtype)
    return _strided(rng, None, shape, dtype, expand=0, **kw).copy_(values) if values.numel() else values


# ------------------------------------------------------------------------------------------------------------
# linear

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# Absolute slack on top of the bound below, per unit of output magnitude: a few units of the dtype's
# resolution (tests/test_linear.py's, there at |y| ~ sqrt(12)).
LINEAR_ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
FEATURES = {0: 1, 1: 2, 2: 1, 3: 1, 5: 1, 8: 1, 16: 1, 17: 1, 33: 1, 64: 1, 70: 1}


def _linear_config(rng, g, grad):
    """(input, weight, bias) of one case: input ``(*, K)``, weight ``(N, K)``, bias ``(N,)``, ``(1,)`` or
    None."""
    dtype = torch.float64 if grad else _pick(rng, {torch.float64: 2, torch.float32: 2, torch.bfloat16: 1,
                                                   torch.float16: 1})
    if rng.random() < 0.08:  # >= 2^20 multiply-adds, often few rows for many outputs: per-thread shares
        batch = [rng.randint(1, 40)] if rng.random() < 0.7 else [rng.randint(1, 7), rng.randint(1, 7)]
        K, N = rng.randint(200, 600), rng.randint(300, 1100)
    else:
        batch = [_pick(rng, {0: 1, 1: 6, 2: 3, 3: 3, 4: 2, 5: 2, 7: 2}) for _ in range(rng.randint(0, 4))]
        K, N = _pick(rng, FEATURES), _pick(rng, FEATURES)
    x = _strided(rng, g, (*batch, K), dtype)
    w = _strided(rng, g, (N, K), dtype, scale=1 / max(K, 1) ** 0.5, any_order=0.4, odd_size1=0.1)
    kind = _pick(rng, {"none": 3, "full": 3, "strided": 2, "size1": 1})
    b = None if kind == "none" else _strided(rng, g, (1,) if kind == "size1" else (N,), dtype,
                                                odd_size1=0.0, expand=0.0 if kind == "full" else 0.3)
    if kind == "full":
        b = b.contiguous()
    return x, w, b


@cases("linear_forward")
def test_linear_forward(case):
    """Values against F.linear in float64 (attnx's error within 2x F.linear's own in the input's dtype), and
    the output's strides: dense, as the fake kernel says."""
    rng, g = _seeded("linear_forward", case)
    x, w, b = _linear_config(rng, g, grad=False)
    with _threads(rng):
        out = attnx.linear(x, w, b)
    expected64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == expected64.shape and out.dtype == x.dtype
    with FakeTensorMode() as mode:
        fake = attnx.linear(*(None if t is None else mode.from_tensor(t) for t in (x, w, b)))
    assert fake.stride() == out.stride(), (x.shape, x.stride(), out.stride(), fake.stride())
    if out.numel() == 0:
        return
    assert is_non_overlapping_and_dense(out), (x.shape, x.stride(), out.stride())
    err = (out.double() - expected64).abs().max().item()
    own_err = (F.linear(x, w, b).double() - expected64).abs().max().item()
    atol = LINEAR_ATOL[x.dtype] * max(1.0, expected64.abs().max().item() / 12**0.5)
    assert err <= 2 * own_err + atol, f"error {err:.3g} vs F.linear's {own_err:.3g} (+ {atol:.3g})"


@cases("linear_backward")
def test_linear_backward(case):
    """Gradients of input, weight and bias (each asked for or not) against autograd through F.linear, in
    float64, for an output gradient in a random layout."""
    rng, g = _seeded("linear_backward", case)
    x, w, b = _linear_config(rng, g, grad=True)
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None and rng.random() < 0.8]
    leaves = leaves or [x.requires_grad_()]
    grad_out = _strided_fixed(rng, g, (*x.shape[:-1], w.shape[0]), x.dtype)
    with _threads(rng):
        got = torch.autograd.grad(attnx.linear(x, w, b), leaves, grad_out)
    want = torch.autograd.grad(F.linear(x, w, b), leaves, grad_out)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=lambda m, i=i: f"gradient {i}: {m}")


# ------------------------------------------------------------------------------------------------------------
# mha

# mha's argument positions that can require grad (masks excepted): query .. static_v.
MHA_DIFFERENTIABLE = (0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 17, 18)
MHA_ATTN_MASK = 15


def _mask(rng, g, shape, dtype):
    """A bool (True = masked) or float (finite biases, -inf where masked) mask; now and then one that masks
    most keys, so that fully masked rows occur."""
    p = _pick(rng, {0.2: 4, 0.8: 1})
    masked = torch.rand(shape, generator=g) < p
    if rng.random() < 0.5:
        mask = masked
    else:
        mask = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        mask = mask.masked_fill(masked, float("-inf"))
    return _relaid(rng, mask) if rng.random() < 0.3 and mask.numel() else mask


def _mha_config(rng, g, grad):
    """(args, batch_first) of one case: ``ops.mha``'s positional arguments without dropout."""
    dtype = torch.float64 if grad else _pick(rng, {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1,
                                                   torch.float16: 1})
    H = rng.randint(1, 4)
    low = 1 if grad else 0
    if rng.random() < 0.08:  # in-projections of >= 2^20 multiply-adds: shared out among the threads at once
        E = H * rng.choice([24, 32])
        B, L, S = rng.randint(1, 2), rng.randint(1, 48), rng.randint(100, 160)
    else:
        E = H * _pick(rng, {1: 1, 2: 1, 3: 1, 4: 1, 8: 1, 16: 1})
        B = _pick(rng, {0: 0 if grad else 1, 1: 6, 2: 4, 3: 2})
        L, S = rng.randint(low, 9), rng.randint(low, 11)
    batch_first = rng.random() < 0.5
    projection = rng.choice(["self", "kv_shared", "distinct", "separate"])
    kdim, vdim = (rng.randint(1, 20), rng.randint(1, 20)) if projection == "separate" else (E, E)

    def data(n, features):  # (n, B, features) or, with batch_first, (B, n, features), in a random layout
        return _strided(rng, g, (B, n, features) if batch_first else (n, B, features), dtype, expand=0.05)

    def weight(rows, cols):
        return _strided(rng, g, (rows, cols), dtype, scale=1 / max(cols, 1) ** 0.5, any_order=0.3, expand=0.0)

    def vector(n):
        return _strided(rng, g, (n,), dtype, expand=0.0, odd_size1=0.0)

    query = data(L, E)
    if projection == "self":
        S = L
        key = value = query
    elif projection == "kv_shared":
        key = value = data(S, E)
    else:
        key, value = data(S, kdim), data(S, vdim)
    packed = projection != "separate"
    in_proj_weight = weight(3 * E, E) if packed else None
    q_w, k_w, v_w = (None, None, None) if packed else (weight(E, E), weight(E, kdim), weight(E, vdim))
    in_proj_bias = vector(3 * E) if rng.random() < 0.7 else None
    out_proj_weight = weight(E, E)
    out_proj_bias = vector(E) if rng.random() < 0.7 else None
    static_k = static_v = bias_k = bias_v = None
    if rng.random() < 0.15:  # both of one length, or one in place of a projection of S keys
        which = rng.choice(["k", "v", "kv"])
        n = rng.randint(low, 8) if which == "kv" else S
        if "k" in which:
            static_k = _strided(rng, g, (B * H, n, E // H), dtype, expand=0.0)
        if "v" in which:
            static_v = _strided(rng, g, (B * H, n, E // H), dtype, expand=0.0)
        S = n
    elif rng.random() < 0.3:
        bias_k, bias_v = (_strided(rng, g, (1, 1, E), dtype, expand=0.0) for _ in range(2))
    add_zero_attn = rng.random() < 0.25
    key_padding_mask = _mask(rng, g, (B, S), dtype) if rng.random() < 0.4 else None
    attn_mask = None
    if rng.random() < 0.4:
        attn_mask = _mask(rng, g, rng.choice([(L, S), (B * H, L, S)]), dtype)
        if grad and attn_mask.is_floating_point() and rng.random() < 0.5:  # a learned bias
            attn_mask = attn_mask.nan_to_num(neginf=-5.0).requires_grad_()
    is_causal = rng.random() < 0.2
    need_weights = rng.random() < 0.4
    average = rng.random() < 0.5
    args = (query, key, value, H, in_proj_weight, in_proj_bias, q_w, k_w, v_w, bias_k, bias_v, add_zero_attn,
            out_proj_weight, out_proj_bias, key_padding_mask, attn_mask, is_causal, static_k, static_v,
            need_weights, average)
    return args, batch_first


def _upcast(args):
    """args in float64, one tensor passed several times staying one."""
    converted = {id(a): a.detach().double() for a in args if torch.is_tensor(a) and a.is_floating_point()}
    return tuple(converted.get(id(a), a) for a in args)


@cases("mha_forward")
def test_mha_forward(case):
    """out, lse and the weights against reference.mha: in float64 to rounding; in lower precision against the
    reference in float64, within 3x the reference's own error in that dtype plus a few units of the dtype's
    resolution at the result's magnitude (attnx's projections round differently from F.linear's, by up to a
    unit, which the few elements of a small case may not show in the reference's own error)."""
    rng, g = _seeded("mha_forward", case)
    args, batch_first = _mha_config(rng, g, grad=False)
    with _threads(rng):
        got = ops.mha(*args, batch_first=batch_first)
    dtype = args[0].dtype
    if dtype == torch.float64:
        want = reference.mha(*args, batch_first=batch_first)
        for name, a, e in zip(("out", "lse", "weights"), got, want, strict=True):
            assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, e.shape, a.dtype, e.dtype)
            torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10, equal_nan=True,
                                       msg=lambda m, name=name: f"{name}: {m}")
        return
    want = reference.mha(*args, batch_first=batch_first)
    want64 = reference.mha(*_upcast(args), batch_first=batch_first)
    for name, a, e, e64 in zip(("out", "lse", "weights"), got, want, want64, strict=True):
        assert a.shape == e64.shape and a.dtype == e.dtype, (name, a.shape, e64.shape, a.dtype, e.dtype)
        finite = torch.isfinite(e64)
        assert torch.equal(torch.isfinite(a), finite), name
        assert torch.equal(a.isnan(), e64.isnan()), name
        if finite.any():
            err = (a.double() - e64)[finite].abs().max().item()
            own_err = (e.double() - e64)[finite].abs().max().item()
            atol = max(1e-5, 4 * torch.finfo(dtype).eps * (1 + e64[finite].abs().max().item()))
            assert err <= 3 * own_err + atol, f"{name}: error {err:.3g} vs the reference's {own_err:.3g}"


def _mha_grads(fn, args, leaves, batch_first, g):
    """The gradients of a random linear function of fn's out (and weights, when asked for)."""
    out, _, weights = fn(*args, batch_first=batch_first)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if weights.numel():
        w = torch.randn(weights.shape, generator=g, dtype=weights.dtype)
        loss = loss + (weights.nan_to_num(0.0) * w).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True)


@cases("mha_backward")
def test_mha_backward(case):
    """Gradients of a random subset of the differentiable arguments (a float attn_mask included) against
    autograd through reference.mha, in float64."""
    rng, g = _seeded("mha_backward", case)
    args, batch_first = _mha_config(rng, g, grad=True)
    leaves = {}
    for i in MHA_DIFFERENTIABLE:
        t = args[i]
        if torch.is_tensor(t) and id(t) not in leaves and rng.random() < 0.8:
            leaves[id(t)] = t.requires_grad_()
    attn_mask = args[MHA_ATTN_MASK]
    if attn_mask is not None and attn_mask.requires_grad:
        leaves[id(attn_mask)] = attn_mask
    leaves = list(leaves.values()) or [args[0].requires_grad_()]
    state = g.get_state()
    with _threads(rng):
        got = _mha_grads(ops.mha, args, leaves, batch_first, g)
    want = _mha_grads(reference.mha, args, leaves, batch_first, g.set_state(state))
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        if e is None:
            assert a is None or not a.any(), i
            continue
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-9, msg=lambda m, i=i: f"gradient {i}: {m}")


# ------------------------------------------------------------------------------------------------------------
# varlen_attention


def _varlen_config(rng, g, dtype, grad):
    """(query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, keyword arguments) of one case: 0 (1
    with grad) to 5 packed sequences of random lengths (empty ones included), packed or strided, and with
    grad=False, now and then a paged cache of a random page size with its pages shuffled."""
    N, Hkv = rng.randint(1 if grad else 0, 5), rng.randint(1, 3)
    H = Hkv * rng.randint(1, 3)
    D, Dv = rng.choice([1, 3, 8, 16, 33, 64]), rng.choice([1, 8, 16, 40])
    lens_q = [rng.randint(0, 40) for _ in range(N)]
    lens_k = [rng.randint(0, 70) for _ in range(N)]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (lens_q, lens_k))
    max_q, max_k = max(lens_q, default=0), max(lens_k, default=0)

    def make(rows, heads, dim):
        t = torch.randn(rows, heads, dim, generator=g, dtype=dtype)
        if rng.random() < 0.3:  # heads outermost in memory
            t = t.transpose(0, 1).contiguous().transpose(0, 1)
        return t.requires_grad_(grad)

    q, k, v = make(sum(lens_q), H, D), make(sum(lens_k), Hkv, D), make(sum(lens_k), Hkv, Dv)
    kw = {}
    choice = rng.random()
    if choice < 0.3:
        kw["is_causal"] = True
    if choice > 0.6 or rng.random() < 0.2:
        kw["window_left"], kw["window_right"] = rng.choice([-1, 0, 2, 7]), rng.choice([-1, 0, 3])
    if rng.random() < 0.3:
        kw["seqused_k"] = torch.tensor([rng.randint(0, n) for n in lens_k], dtype=torch.int32)
    _draw_score_options(rng, g, kw, H, dtype, grad)
    if not grad and N > 0 and rng.random() < 0.4:
        page_size = rng.choice([1, 3, 7, 16])
        pages = [(n + page_size - 1) // page_size for n in lens_k]
        perm = torch.randperm(sum(pages) + 1, generator=g)
        table = torch.zeros(N, max(max(pages), 1), dtype=torch.int32)
        k_cache = torch.randn(len(perm), page_size, Hkv, D, generator=g, dtype=dtype)
        v_cache = torch.randn(len(perm), page_size, Hkv, Dv, generator=g, dtype=dtype)
        at = 0
        for b, n in enumerate(lens_k):
            table[b, :pages[b]] = perm[at:at + pages[b]].to(torch.int32)
            at += pages[b]
            j = torch.arange(n)
            k_cache[table[b, j // page_size].long(), j % page_size] = k[cu_k[b]:cu_k[b + 1]]
            v_cache[table[b, j // page_size].long(), j % page_size] = v[cu_k[b]:cu_k[b + 1]]
        k, v, kw["block_table"] = k_cache, v_cache, table
    return q, k, v, cu_q, cu_k, max_q, max_k, kw


@cases("varlen_forward")
def test_varlen_forward(case):
    rng, g = _seeded("varlen_forward", case)
    dtype = torch.float64 if case % 2 else torch.float32
    q, k, v, cu_q, cu_k, max_q, max_k, kw = _varlen_config(rng, g, dtype, grad=False)
    with _threads(rng):
        out, lse = attnx.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    expected_out, expected_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                            max_q, max_k, **_in_float64(kw))
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=tol, atol=tol)


@cases("varlen_backward")
def test_varlen_backward(case):
    rng, g = _seeded("varlen_backward", case)
    q, k, v, cu_q, cu_k, max_q, max_k, kw = _varlen_config(rng, g, torch.float64, grad=True)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    grad_out = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=g, dtype=torch.float64)
    with _threads(rng):
        actual = torch.autograd.grad(attnx.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)[0],
                                     inputs, grad_out, allow_unused=True)
    expected = torch.autograd.grad(reference.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)[0],
                                   inputs, grad_out, allow_unused=True)
    for a, e, t in zip(actual, expected, inputs, strict=True):
        a = torch.zeros_like(t) if a is None else a
        e = torch.zeros_like(t) if e is None else e
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-9)
