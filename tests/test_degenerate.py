"""Non-finite and degenerate inputs against the spec, attnx.reference: NaN and +-inf in query, key, value and
in float masks, empty dims, one head, one feature, extreme scales, fully masked rows; for attention and its
backward, linear and mha.

The reference's answers are taken as they come out of it (in float64, gradients by autograd through it),
non-finite entries compared position by position. Where the spec's own text and its arithmetic disagree the
test says so and follows the text (a fully masked row's output is 0). Where the spec allows two answers (a NaN
that reaches a row only through positions the row does not see) each element must be one of them.

Every op also runs twice on memory poisoned with different values (freed blocks full of NaN, then of -3e38,
which the allocator hands out again as the outputs' storage): an output element that the kernel never writes
shows up as a difference between the two runs, or as a non-finite value where the reference is finite.
"""

import pytest
import torch

import attnx
from attnx import ops, reference

pytestmark = pytest.mark.kernel

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
# The kernel in the inputs' dtype against the reference in float64 on the same values, at small shapes with
# values of order 1: float32 rounding (a few ulp of sums over at most a dozen terms) and float64's.
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-9, "atol": 1e-10}}
B, H, L, S, D = 2, 2, 5, 7, 4
GRADS = ("out", "lse", "grad_query", "grad_key", "grad_value", "grad_attn_mask")

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ------------------------------------------------------------------------------------------------------------
# Helpers


def _poison_memory(value):
    """Fill freed heap blocks of many sizes with ``value``: the allocator reuses them for the next outputs."""
    blocks = [torch.full((n,), value) for n in (2**i for i in range(4, 16)) for _ in range(3)]
    del blocks


def _same_bits(a, b):
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        a, b = a.view(_INT_OF_SIZE[a.element_size()]), b.view(_INT_OF_SIZE[b.element_size()])
    return torch.equal(a, b)


def _run_poisoned(fn):
    """``fn()`` (a tuple of tensors or None) after poisoning the heap with NaN, then with -3e38; the two
    results must agree to the bit. Returns the first."""
    results = []
    for poison in (NAN, -3e38):
        _poison_memory(poison)
        results.append(fn())
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert _same_bits(a, b), f"output {i} depends on the memory it was allocated in (unwritten elements?)"
    return results[0]


def _assert_matches(got, want, dtype, names=GRADS):
    """Each of ``got`` against ``want`` (float64): NaN, +inf and -inf at the same positions, finite values
    within TOL."""
    for name, g, w in zip(names, got, want, strict=True):
        if w is None:
            assert g is None or g.numel() == 0, name
            continue
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        g = g.double()
        for pred, label in ((torch.isnan, "NaN"), (torch.isposinf, "+inf"), (torch.isneginf, "-inf")):
            differ = pred(g) != pred(w)
            if differ.any():
                first = tuple(differ.nonzero()[0].tolist())
                raise AssertionError(
                    f"{name}: {label} at {int(differ.sum())} positions where the reference has none, or the "
                    f"reverse; first at {first}: got {g[first].item()}, reference {w[first].item()}"
                )
        torch.testing.assert_close(g, w, equal_nan=True, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


def _float_mask_grad(kwargs):
    mask = kwargs.get("attn_mask")
    return mask is not None and mask.is_floating_point()


def _reference(q, k, v, grad_out, read_unseen=True, **kwargs):
    """reference.attention on float64 copies and its gradients by autograd with respect to query, key, value
    and a float attn_mask: (out, lse, dq, dk, dv, d_attn_mask or None)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    kw = dict(kwargs)
    if _float_mask_grad(kwargs):
        kw["attn_mask"] = kwargs["attn_mask"].detach().double().requires_grad_()
        leaves.append(kw["attn_mask"])
    kpm = kw.get("key_padding_mask")
    if kpm is not None and kpm.is_floating_point():
        kw["key_padding_mask"] = kpm.double()
    out, lse = reference.attention(*leaves[:3], **kw, read_unseen=read_unseen)
    grads = torch.autograd.grad(out, leaves, grad_out.double(), allow_unused=True, materialize_grads=True)
    return (out.detach(), lse.detach(), *grads[:3], grads[3] if len(grads) > 3 else None)


def _kernel(q, k, v, grad_out, **kwargs):
    """attnx.attention and attnx.attention_backward, each run on poisoned memory: the same tuple."""
    out, lse = _run_poisoned(lambda: ops.attention(q, k, v, **kwargs))
    want_mask = _float_mask_grad(kwargs)
    dq, dk, dv, dmask, _ = _run_poisoned(
        lambda: ops.attention_backward(grad_out, q, k, v, out, lse, **kwargs, grad_attn_mask=want_mask)
    )
    return out, lse, dq, dk, dv, dmask if want_mask else None


def _qkv(dtype, b=B, h=H, l=L, s=S, d=D, dv=D, seed=0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
               for shape in ((b, h, l, d), (b, h, s, d), (b, h, s, dv)))
    return q, k, v, torch.randn(b, h, l, dv, generator=gen, dtype=torch.float64).to(dtype)


def _either(got, read, unread):
    """The spec's answer for each element of ``got``: where a NaN reaches it only through positions its row
    does not see (``read`` NaN, ``unread`` not), either NaN or the unread value, whichever ``got`` has;
    elsewhere the two answers agree."""
    if read is None:
        return None
    return torch.where(torch.isnan(read) & ~torch.isnan(unread) & ~torch.isnan(got.double()), unread, read)


def _check(q, k, v, grad_out, **kwargs):
    got = _kernel(q, k, v, grad_out, **kwargs)
    read = _reference(q, k, v, grad_out, **kwargs)
    unread = _reference(q, k, v, grad_out, read_unseen=False, **kwargs)
    _assert_matches(got, tuple(map(_either, got, read, unread)), q.dtype)
    return got


# ------------------------------------------------------------------------------------------------------------
# NaN and +-inf in query, key, value


def _partial_masks():
    """Bool masks that mask key 2 for some rows (never a whole row): a masked key's value still meets a
    probability of exactly 0 (0 * NaN = NaN, as the reference's probs @ value gives)."""
    attn_mask = torch.zeros(L, S, dtype=torch.bool)
    attn_mask[::2, 2] = True
    attn_mask[1, 5:] = True
    key_padding_mask = torch.zeros(B, S, dtype=torch.bool)
    key_padding_mask[0, 6] = True
    return {"attn_mask": attn_mask, "key_padding_mask": key_padding_mask}


MASKINGS = {"none": dict, "partial_bool": _partial_masks}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_nonfinite_inputs(where, value, masking, dtype):
    q, k, v, grad_out = _qkv(dtype)
    # query: one row of (b=1, h=0); key/value: key 2 of (b=1, h=0), whose column every row of that head reads
    {"query": q, "key": k, "value": v}[where][1, 0, 2, 1] = value
    out, lse, *_ = _check(q, k, v, grad_out, **MASKINGS[masking]())
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, 1]).all()  # no other head is touched


# ------------------------------------------------------------------------------------------------------------
# NaN and +-inf in float masks


def _float_mask(kind, value, dtype):
    """A float mask of ``kind`` with finite values and one ``value`` at (batch 1,) query 2, key 3."""
    gen = torch.Generator().manual_seed(3)
    if kind == "attn_mask_2d":
        mask = torch.randn(L, S, generator=gen)
        mask[2, 3] = value
    elif kind == "attn_mask_3d":
        mask = torch.randn(B * H, L, S, generator=gen)
        mask[H + 1, 2, 3] = value  # (b=1, h=1)
    elif kind == "attn_mask_4d_broadcast":
        mask = torch.randn(1, H, 1, S, generator=gen)
        mask[0, 1, 0, 3] = value  # every row of head 1
    else:
        mask = torch.randn(B, S, generator=gen)
        mask[1, 3] = value  # every row of batch 1
    name = "key_padding_mask" if kind == "key_padding_mask" else "attn_mask"
    return {name: mask.to(dtype)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize(
    "kind", ["attn_mask_2d", "attn_mask_3d", "attn_mask_4d_broadcast", "key_padding_mask"]
)
def test_nonfinite_float_masks(kind, value, dtype):
    q, k, v, grad_out = _qkv(dtype)
    masks = _float_mask(kind, value, dtype)
    out, lse, *_ = _check(q, k, v, grad_out, **masks)
    if value != value:  # a NaN score: its row's out and lse are NaN
        assert out.isnan().any() and lse.isnan().any()
    elif value == INF:  # +inf: the row's lse is +inf and its probabilities exp(inf - inf) NaN
        assert out.isnan().any() and torch.isposinf(lse).any() and not lse.isnan().any()
    else:  # -inf masks that key: everything finite
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "+inf"])
def test_nonfinite_float_mask_where_the_other_mask_masks(value, dtype):
    """-inf + NaN is NaN: a NaN in a float key_padding_mask still poisons a key that a bool attn_mask masks,
    and a NaN in a float attn_mask one that a bool key_padding_mask masks (the masks add, as the spec
    says)."""
    q, k, v, grad_out = _qkv(dtype)
    kpm = torch.zeros(B, S, dtype=dtype)
    kpm[1, 3] = value
    attn_mask = torch.zeros(L, S, dtype=torch.bool)
    attn_mask[:, 3] = True
    _check(q, k, v, grad_out, attn_mask=attn_mask, key_padding_mask=kpm)
    float_mask = torch.zeros(L, S, dtype=dtype)
    float_mask[2, 4] = value
    bool_kpm = torch.zeros(B, S, dtype=torch.bool)
    bool_kpm[:, 4] = True
    _check(q, k, v, grad_out, attn_mask=float_mask, key_padding_mask=bool_kpm)


# ------------------------------------------------------------------------------------------------------------
# Fully masked rows: out 0, lse +inf, no gradient (ARCHITECTURE.md, reference.attention)


def _fully_masked(how, dtype):
    """Masks under which query 3 of every head (for the attn_masks; all of batch 1 for the padding masks)
    sees no key, or (causal_and_mask) query 0."""
    if how == "causal_and_mask":  # is_causal, and a bool mask that removes the one key (0) query 0 may see
        mask = torch.zeros(L, S, dtype=torch.bool)
        mask[0, 0] = True
        return {"attn_mask": mask, "is_causal": True}
    name, shape, row = ("attn_mask", (L, S), 3) if "attn_mask" in how else ("key_padding_mask", (B, S), 1)
    if how.startswith("bool"):
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[row] = True
    else:  # -inf over the row; a float attn_mask holds random biases elsewhere
        mask = torch.randn(shape, dtype=dtype) if name == "attn_mask" else torch.zeros(shape, dtype=dtype)
        mask[row] = -INF
    return {name: mask}


FULLY_MASKED = ["bool_attn_mask", "float_attn_mask_neginf", "bool_key_padding_mask",
                "float_key_padding_mask_neginf", "causal_and_mask"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("how", FULLY_MASKED)
def test_fully_masked_rows(how, dtype):
    q, k, v, grad_out = _qkv(dtype)
    masks = _fully_masked(how, dtype)
    out, lse, dq, dk, dv, _ = _check(q, k, v, grad_out, **masks)
    every_head = (slice(None), slice(None))
    rows = {"bool_attn_mask": (*every_head, 3), "float_attn_mask_neginf": (*every_head, 3),
            "causal_and_mask": (*every_head, 0)}.get(how, (1,))
    assert (out[rows] == 0).all() and torch.isposinf(lse[rows]).all()
    assert (dq[rows] == 0).all()
    if "key_padding" in how:  # batch 1 sees nothing: its keys and values get no gradient
        assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "+inf"])
def test_fully_masked_row_with_nonfinite_values(value, dtype):
    """A row that sees no key has out 0 and lse +inf whatever the values hold (ARCHITECTURE.md and the
    reference's docstring). The reference's arithmetic says otherwise here: its ``probs @ value`` multiplies
    the row's zero probabilities by the NaN/inf value (0 * NaN = NaN), so its out is NaN in that feature; the
    test follows the documented answer for that row and the reference's for every other."""
    q, k, v, grad_out = _qkv(dtype)
    v[1, 0, 2, 1] = value
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[3] = True
    out, lse = _run_poisoned(lambda: ops.attention(q, k, v, attn_mask=mask))
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()
    ref_out, ref_lse = reference.attention(q.double(), k.double(), v.double(), attn_mask=mask)
    ref_out[:, :, 3] = 0
    _assert_matches((out, lse), (ref_out, ref_lse), dtype, names=("out", "lse"))


# ------------------------------------------------------------------------------------------------------------
# Non-finite values that only unseen positions hold: NaN or the unread answer, as the spec allows


@pytest.mark.parametrize("case", ["float_mask_above_diagonal", "query_row_backward"])
def test_nonfinite_outside_the_causal_range(case):
    """The CPU kernels never read scores above is_causal's diagonal (the unread answer); the same mask passed
    as a bool attn_mask is read in a partly masked tile (NaN). The spec allows both."""
    q, k, v, grad_out = _qkv(torch.float64)
    if case == "float_mask_above_diagonal":  # (query 1, key 4), unseen under is_causal
        mask = torch.zeros(L, S, dtype=torch.float64)
        mask[1, 4] = NAN
        _check(q, k, v, grad_out, attn_mask=mask, is_causal=True)
    else:  # NaN query row 2: only dK and dV of keys 3.. see it through unseen pairs
        q[1, 0, 2, 1] = NAN
        got = _check(q, k, v, grad_out, is_causal=True)
        assert got[0][1, 0, 2].isnan().all() and not got[0][1, 0, :2].isnan().any()


@pytest.mark.parametrize("masked_keys", [(600, 601), (512, 1024)], ids=["key_600_only", "whole_key_tile"])
@pytest.mark.parametrize("where", ["key", "value"])
def test_nonfinite_at_masked_keys(where, masked_keys):
    """A NaN at key 600, masked for every row: inside a partly masked tile (the kernel reads it: NaN) or in a
    key tile the masks remove entirely (keys 512-1023 of the forward's 512-key tiles: skipped, unread)."""
    q, k, v, grad_out = _qkv(torch.float32, b=1, h=1, l=3, s=1100)
    {"key": k, "value": v}[where][0, 0, 600, 1] = NAN
    mask = torch.zeros(3, 1100, dtype=torch.bool)
    mask[:, masked_keys[0]:masked_keys[1]] = True
    _check(q, k, v, grad_out, attn_mask=mask)


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"attn_mask": "float", "key_padding_mask": "bool"},
        {"attn_mask": "bool", "softcap": 2.0},
        {"window_left": 2, "window_right": 1, "key_lengths": [7, 5]},
        {"sinks": True, "is_causal": True},
        {"dropout_p": 0.3, "attn_mask": "float"},
    ],
    ids=["causal", "masks", "softcap", "window_key_lengths", "sinks", "dropout"],
)
def test_the_two_answers_agree_on_finite_input(options):
    """read_unseen=False is the same function as the default wherever no unseen position holds a non-finite
    value: outputs and every gradient, with grouped KV heads, on finite random input."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64)
               for shape in ((B, 4, L, D), (B, 2, S, D), (B, 2, S, D)))
    kwargs = dict(options)
    if kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(L, S, generator=gen, dtype=torch.float64)
        kwargs["attn_mask"][0, 3] = -INF
    elif kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(L, S, generator=gen) < 0.3
    if "key_padding_mask" in kwargs:
        kwargs["key_padding_mask"] = torch.rand(B, S, generator=gen) < 0.3
    if "key_lengths" in kwargs:
        kwargs["key_lengths"] = torch.tensor(kwargs["key_lengths"])
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.randn(4, generator=gen, dtype=torch.float64)
    if "dropout_p" in kwargs:
        kwargs["dropout_seed"] = torch.tensor([3, 4])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    leaves += [t.requires_grad_() for t in (kwargs.get("attn_mask"), kwargs.get("sinks"))
               if t is not None and t.is_floating_point()]
    grad_out = torch.randn(B, 4, L, D, generator=gen, dtype=torch.float64)
    results = []
    for read_unseen in (True, False):
        out, lse = reference.attention(q, k, v, **kwargs, read_unseen=read_unseen)
        results.append((out, lse, *torch.autograd.grad(out, leaves, grad_out)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_either_answer_is_checked():
    """The relaxed comparison still fails a wrong finite value where NaN may or may not appear, and a NaN
    where both answers are finite."""
    q, k, v, grad_out = _qkv(torch.float64)
    k[0, 0, 4, 0] = NAN  # unseen by rows 0-3 of (batch 0, head 0) under is_causal; row 4 sees it
    kwargs = {"is_causal": True}
    read, unread = (_reference(q, k, v, grad_out, read_unseen=r, **kwargs) for r in (True, False))
    assert read[0][0, 0, :4].isnan().all() and not unread[0][0, 0, :4].isnan().any()
    wrong = unread[0].clone()
    wrong[0, 0, 1, 0] += 1e-3
    with pytest.raises(AssertionError):
        _assert_matches([wrong], [_either(wrong, read[0], unread[0])], torch.float64, names=("out",))
    stray = unread[0].clone()
    stray[1, 0, 0, 0] = NAN
    with pytest.raises(AssertionError):
        _assert_matches([stray], [_either(stray, read[0], unread[0])], torch.float64, names=("out",))
    _assert_matches([unread[0]], [_either(unread[0], read[0], unread[0])], torch.float64, names=("out",))
    _assert_matches([read[0]], [_either(read[0], read[0], unread[0])], torch.float64, names=("out",))


# ------------------------------------------------------------------------------------------------------------
# Extreme scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masking", ["none", "fully_masked_row"])
@pytest.mark.parametrize("scale", [1e30, -1e30, 1e-30, 0.0], ids=str)
def test_extreme_scale_forward(scale, masking, dtype):
    """Scores of +-1e31 (a one-hot softmax; lse is the largest score) and of 1e-30 or 0 (uniform)."""
    q, k, v, _ = _qkv(dtype, d=64, dv=64)
    masks = {} if masking == "none" else _fully_masked("bool_attn_mask", dtype)
    out, lse = _run_poisoned(lambda: ops.attention(q, k, v, scale=scale, **masks))
    ref = reference.attention(q.double(), k.double(), v.double(), scale=scale, **masks)
    _assert_matches((out, lse), ref, dtype, names=("out", "lse"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1e-30, 0.0], ids=str)
def test_tiny_scale_backward(scale, dtype):
    q, k, v, grad_out = _qkv(dtype, d=64, dv=64)
    _check(q, k, v, grad_out, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1e30, -1e30, 1e4], ids=str)
def test_huge_scale_backward(scale, dtype):
    """A (nearly) one-hot softmax. out, lse and dV match the reference; dQ and dK, whose exact values are 0 or
    tiny, are held to the backward's error bound (ops.attention_backward): dS = P (dP - delta) takes dP = dO .
    v_s and delta = dO . out in different summation orders, so dS carries up to (D + S) eps P (|dO| . |v_s| +
    |dO| . |out|) of rounding, which the scale multiplies into dQ = scale dS K and dK = scale dS^T Q."""
    q, k, v, grad_out = _qkv(dtype, d=64, dv=64)
    got = _kernel(q, k, v, grad_out, scale=scale)
    want = _reference(q, k, v, grad_out, scale=scale)
    _assert_matches(got[:2] + got[4:5], want[:2] + want[4:5], dtype, names=("out", "lse", "grad_value"))

    q64, k64, v64, do64 = (t.double() for t in (q, k, v, grad_out))
    probs = torch.softmax(q64 @ k64.transpose(-2, -1) * scale, dim=-1)
    absolute_out = probs @ v64.abs()
    rounding = (D + S) * torch.finfo(dtype).eps * probs * (
        do64.abs() @ v64.abs().transpose(-2, -1) + (do64.abs() * absolute_out).sum(-1, keepdim=True)
    )
    bounds = (abs(scale) * rounding @ k64.abs(), abs(scale) * rounding.transpose(-2, -1) @ q64.abs())
    for name, g, w, bound in zip(("grad_query", "grad_key"), got[2:4], want[2:4], bounds, strict=True):
        assert g.isfinite().all(), name
        excess = (g.double() - w).abs() - bound - TOL[dtype]["atol"]
        assert (excess <= 0).all(), f"{name}: {excess.max().item():.3g} past the error bound"


# ------------------------------------------------------------------------------------------------------------
# Empty dims, one head, one feature


EMPTY_SIZES = {  # (B, H, L, S, D, Dv)
    "B=0": (0, 2, 3, 4, 8, 8),
    "H=0": (2, 0, 3, 4, 8, 8),
    "L=0": (2, 2, 0, 4, 8, 8),
    "S=0": (2, 2, 3, 0, 8, 8),
    "D=0": (2, 2, 3, 4, 0, 8),
    "Dv=0": (2, 2, 3, 4, 8, 0),
    "L=S=0": (2, 2, 0, 0, 8, 8),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masking", ["none", "masks"])
@pytest.mark.parametrize("sizes", EMPTY_SIZES.values(), ids=EMPTY_SIZES.keys())
def test_empty_dims(sizes, masking, dtype):
    """Forward and backward: S == 0 gives out 0, lse +inf and dQ 0; L == 0 gives dK, dV and the mask's
    gradient 0; D == 0 scores 0 (uniform attention) whatever the scale. Outputs that are not empty must be
    written, every element (see _run_poisoned)."""
    b, h, l, s, d, dv = sizes  # noqa: E741
    q, k, v, grad_out = _qkv(dtype, b, h, l, s, d, dv)
    masks = {}
    if masking == "masks":
        masks = {"attn_mask": torch.randn(l, s, dtype=dtype),
                 "key_padding_mask": torch.zeros(b, s, dtype=torch.bool)}
    out, lse, dq, dk, dv_, dmask = _check(q, k, v, grad_out, **masks)
    if s == 0:
        assert (out == 0).all() and torch.isposinf(lse).all() and (dq == 0).all()
    if l == 0:
        assert (dk == 0).all() and (dv_ == 0).all() and (dmask is None or (dmask == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_head_one_feature(is_causal, dtype):
    q, k, v, grad_out = _qkv(dtype, b=2, h=1, l=6, s=9, d=1, dv=1)
    mask = torch.randn(6, 9, dtype=dtype)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, ::3] = True
    _check(q, k, v, grad_out, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal)


def test_errors_where_the_reference_refuses():
    """The spec refuses Hkv == 0 (H // Hkv) and mha's num_heads == 0 (E // H) with ZeroDivisionError; the ops
    raise torch's RuntimeError for a shape they cannot take (as F.scaled_dot_product_attention does when
    Hkv does not divide H), and the drop-ins the types torch's own functional and module raise."""
    q, k, v, _ = _qkv(torch.float32, h=4)
    with pytest.raises(ZeroDivisionError):
        reference.attention(q, k[:, :0], v[:, :0])
    with pytest.raises(RuntimeError, match=r"attnx::attention: expected the number of key/value heads"):
        ops.attention(q, k[:, :0], v[:, :0])
    x = torch.randn(3, 2, 8)
    args = (x, x, x, 0, torch.randn(24, 8), torch.randn(24), None, None, None, None, None, False,
            torch.randn(8, 8), torch.randn(8), None, None, False, None, None, False, True)
    with pytest.raises(ZeroDivisionError):
        reference.mha(*args)
    with pytest.raises(RuntimeError, match=r"attnx::mha: expected embed_dim \(8\) divisible by num_heads"):
        ops.mha(*args)
    functional_args = (x, x, x, 8, 0, torch.randn(24, 8), torch.randn(24), None, None, False, 0.0,
                       torch.randn(8, 8), torch.randn(8))
    for forward in (torch.nn.functional.multi_head_attention_forward,
                    attnx.functional.multi_head_attention_forward):
        with pytest.raises(ZeroDivisionError):
            forward(*functional_args, need_weights=False)
    for module in (torch.nn.MultiheadAttention, attnx.nn.MultiheadAttention):
        for embed_dim, num_heads in ((8, 0), (0, 1)):
            with pytest.raises(ValueError, match="embed_dim and num_heads must be greater than 0"):
                module(embed_dim, num_heads)


# ------------------------------------------------------------------------------------------------------------
# linear


LINEAR_SIZES = [  # (leading dims, in_features, out_features)
    pytest.param((3, 2), 0, 5, id="in_features=0"),
    pytest.param((3, 2), 4, 0, id="out_features=0"),
    pytest.param((0, 2), 4, 5, id="rows=0"),
    pytest.param((3,), 0, 0, id="in=out=0"),
    pytest.param((3, 2), 1, 1, id="one_feature"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("leading,k,n", LINEAR_SIZES)
def test_linear_empty_dims(leading, k, n, bias, dtype):
    """Forward and backward against reference.linear: in_features == 0 gives the bias (or 0) in every row;
    no rows give a weight and bias gradient of 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*leading, k, generator=gen, dtype=dtype)
    w = torch.randn(n, k, generator=gen, dtype=dtype)
    b = torch.randn(n, generator=gen, dtype=dtype) if bias else None
    grad_y = torch.randn(*leading, n, generator=gen, dtype=dtype)

    def run(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
        y = fn(*leaves)
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], grad_y.to(y.dtype),
                                    allow_unused=True, materialize_grads=True)
        return (y.detach(), *grads)

    got = _run_poisoned(lambda: run(ops.linear, x, w, b))
    want = run(reference.linear, x.double(), w.double(), b.double() if bias else None)
    _assert_matches(got, want, dtype, names=("out", "grad_input", "grad_weight", "grad_bias")[: len(want)])
    if k == 0:
        assert torch.equal(got[0], (b if bias else torch.zeros(n, dtype=dtype)).expand(*leading, n))


def test_linear_empty_dims_forward():
    """The forward alone, which works where the backward above does not: in_features == 0 gives the bias in
    every row, out_features == 0 an empty output."""
    b = torch.randn(5)
    for leading in ((3, 2), (0,)):
        got = _run_poisoned(lambda lead=leading: (ops.linear(torch.randn(*lead, 0), torch.randn(5, 0), b),
                                                  ops.linear(torch.randn(*lead, 0), torch.randn(5, 0)),
                                                  ops.linear(torch.randn(*lead, 4), torch.randn(0, 4))))
        assert torch.equal(got[0], b.expand(*leading, 5)) and torch.equal(got[1], torch.zeros(*leading, 5))
        assert got[2].shape == (*leading, 0)


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", ["input", "weight", "bias"])
def test_linear_nonfinite(where, value):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, 6, generator=gen), torch.randn(5, 6, generator=gen)
    b = torch.randn(5, generator=gen)
    {"input": x[2, 1], "weight": w[3], "bias": b}[where][1 if where != "bias" else 3] = value
    got = _run_poisoned(lambda: (ops.linear(x, w, b),))
    want = (reference.linear(x.double(), w.double(), b.double()),)
    _assert_matches(got, want, torch.float32, names=("out",))
    assert torch.equal(got[0].isnan(), torch.nn.functional.linear(x, w, b).isnan())


# ------------------------------------------------------------------------------------------------------------
# mha


def _mha_args(L_, B_, S_, E_, H_, dtype, kpm=None, attn_mask=None, need_weights=False):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return [randn(L_, B_, E_), randn(S_, B_, E_), randn(S_, B_, E_), H_, randn(3 * E_, E_), randn(3 * E_),
            None, None, None, None, None, False, randn(E_, E_), randn(E_), kpm, attn_mask, False, None,
            None, need_weights, True]


MHA_SIZES = [  # (L, B, S, E, H)
    pytest.param((0, 2, 4, 8, 2), id="L=0"),
    pytest.param((3, 0, 4, 8, 2), id="B=0"),
    pytest.param((3, 2, 0, 8, 2), id="S=0"),
    pytest.param((3, 2, 4, 0, 1), id="E=0"),
    pytest.param((3, 2, 4, 1, 1), id="H=1_D=1"),
]
_DIFFERENTIABLE = (0, 1, 2, 4, 5, 12, 13)  # query, key, value, in_proj_weight/bias, out_proj_weight/bias


def _mha_fwd_bwd(fn, args):
    args = list(args)
    leaves = []
    for i in _DIFFERENTIABLE:
        args[i] = args[i].detach().clone().requires_grad_()
        leaves.append(args[i])
    out, lse, weights = fn(*args)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True, materialize_grads=True)
    return (out.detach(), lse, weights.detach(), *grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("sizes", MHA_SIZES)
def test_mha_empty_dims(sizes, need_weights, dtype):
    """ops.mha forward and backward against reference.mha: no keys gives the out-projection bias and lse
    +inf (and NaN weights, as torch's softmax)."""
    if need_weights and sizes[3] == 0:
        pytest.skip("no weights at embed_dim 0: the reference scales them by E**-0.5, a ZeroDivisionError, "
                    "as torch's F.multi_head_attention_forward does")
    args = _mha_args(*sizes, dtype, need_weights=need_weights)
    got = _run_poisoned(lambda: _mha_fwd_bwd(ops.mha, args))
    args64 = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    want = _mha_fwd_bwd(reference.mha, args64)
    names = ("out", "lse", "weights", "grad_query", "grad_key", "grad_value", "grad_in_proj_weight",
             "grad_in_proj_bias", "grad_out_proj_weight", "grad_out_proj_bias")
    _assert_matches(got, want, dtype, names=names)
    if sizes[2] == 0:
        assert torch.equal(got[0], args[13].expand_as(got[0])) and torch.isposinf(got[1]).all()


def test_mha_zero_embed_dim_forward():
    """The forward alone at E == 0: an empty output. (Not with need_weights: the reference's weights scale by
    E**-0.5, ZeroDivisionError, as torch's functional.)"""
    args = _mha_args(3, 2, 4, 0, 1, torch.float32)
    got = _run_poisoned(lambda: ops.mha(*args))
    want = reference.mha(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    _assert_matches(got, want, torch.float32, names=("out", "lse", "weights"))
    assert got[0].shape == (3, 2, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["query", "key", "float_kpm", "float_attn_mask"])
def test_mha_nonfinite(where, dtype):
    L_, B_, S_, E_, H_ = 4, 2, 5, 8, 2
    kpm = torch.zeros(B_, S_, dtype=dtype) if where == "float_kpm" else None
    attn_mask = torch.zeros(L_, S_, dtype=dtype) if where == "float_attn_mask" else None
    args = _mha_args(L_, B_, S_, E_, H_, dtype, kpm=kpm, attn_mask=attn_mask, need_weights=True)
    if where == "query":
        args[0][1, 0, 3] = NAN
    elif where == "key":
        args[1][2, 1, 0] = INF
    elif where == "float_kpm":
        kpm[1, 2] = NAN
    else:
        attn_mask[2, 1] = NAN
    got = _run_poisoned(lambda: ops.mha(*args))
    want = reference.mha(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    _assert_matches(got, want, dtype, names=("out", "lse", "weights"))
    assert got[0].isnan().any()  # the non-finite entry reaches the output
