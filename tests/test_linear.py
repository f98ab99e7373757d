"""attnx.linear against reference.linear (float64) and F.linear: values, layouts, copies, gradients,
errors."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import attnx
from attnx import reference
from conftest import DEVICES, FLOAT_DTYPES, require_kernel
from layouts import FOLDABLE, LAYOUTS, is_non_overlapping_and_dense, make

K, N = 12, 10  # in/out features differ, so an input-sized copy is distinguishable from an output-sized one
BATCH_SHAPES = [(), (7,), (1,), (5, 1), (1, 5), (3, 4), (2, 1, 3), (0, 3)]
# Absolute slack on top of the bound below: a few units of the dtype's resolution at |y| ~ sqrt(K).
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _assert_close_to_reference(out, x, w, b):
    """FlashAttention-style bound: attnx's error vs float64 is within 2x torch's own error in the same
    dtype."""
    ref64 = reference.linear(x.double(), w.double(), None if b is None else b.double())
    ref = reference.linear(x, w, b)
    assert out.shape == ref64.shape and out.dtype == x.dtype
    if out.numel() == 0:
        return
    err = (out.double() - ref64).abs().max().item()
    ref_err = (ref.double() - ref64).abs().max().item()
    assert err <= 2 * ref_err + ATOL[x.dtype], f"error {err:.3g} vs torch's {ref_err:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", BATCH_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_reference(device, dtype, layout, batch, bias):
    require_kernel("attnx::linear", device)
    x = make((*batch, K), layout, dtype, device)
    w = torch.randn(N, K, dtype=dtype, device=device)
    b = torch.randn(N, dtype=dtype, device=device) if bias else None
    _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_layout", ["contiguous", "transposed_storage", "sliced_rows", "expanded"])
def test_weight_layouts(device, weight_layout):
    """Non-contiguous weights: w.t() storage, rows of a packed in_proj_weight, a stride-0 weight."""
    require_kernel("attnx::linear", device)
    x = torch.randn(4, 3, K, device=device)
    w = {
        "contiguous": lambda: torch.randn(N, K, device=device),
        "transposed_storage": lambda: torch.randn(K, N, device=device).t(),
        "sliced_rows": lambda: torch.randn(3 * N, K, device=device)[N : 2 * N],
        "expanded": lambda: torch.randn(1, K, device=device).expand(N, K),
    }[weight_layout]()
    b = torch.randn(3 * N, device=device)[1::3]  # a strided bias
    _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)


def test_size1_bias_broadcasts():
    x, w, b = torch.randn(3, K), torch.randn(N, K), torch.randn(1)
    torch.testing.assert_close(attnx.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("bias", ["full", "strided", "size1", "none"])
def test_few_rows_run_in_column_shares(threads, layout, bias, intra_op_threads):
    """On the CPU (with MKL under OpenMP) a GEMM with few rows for its outputs (>= 2^20 multiply-adds, rows
    <= half the outputs) runs as one column share of the weight per thread (csrc/cpu/linear.cpp): every
    column computed, the bias cut with the columns (or broadcast, when it has one element)."""
    intra_op_threads(threads)
    x = make((3, 5, 256), layout, torch.float64)
    w = torch.randn(1000, 256, dtype=torch.float64)
    b = {
        "full": torch.randn(1000, dtype=torch.float64),
        "strided": torch.randn(2000, dtype=torch.float64)[::2],
        "size1": torch.randn(1, dtype=torch.float64),
        "none": None,
    }[bias]
    _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_layout(layout):
    """Output is dense, in input's row order; exactly torch's contiguous strides when rows are in logical
    order, so a B=1 transpose never leaves the (D, B*D, 1) strides behind, and the fake kernel agrees."""
    for batch in [(5, 1), (1, 5), (3, 4), (2, 3, 4)]:
        x = make((*batch, K), layout)
        w = torch.randn(N, K)
        out = attnx.linear(x, w)
        with FakeTensorMode() as mode:
            fake = attnx.linear(mode.from_tensor(x), mode.from_tensor(w))
        assert fake.shape == out.shape and fake.stride() == out.stride(), (batch, out.stride(), fake.stride())
        assert is_non_overlapping_and_dense(out)
        leading = [st for sz, st in zip(x.shape[:-1], x.stride()[:-1], strict=True) if sz != 1]
        rows_in_order = leading == sorted(leading, reverse=True)
        if rows_in_order or layout in ("gapped", "expanded"):
            assert out.stride() == torch.empty(out.shape).stride(), (batch, out.stride())


def _copies(fn):
    """Copy kernels the call dispatches, with their destination shapes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::copy_"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copies_at_most_once(layout):
    """Foldable layouts run one GEMM without any copy; the others copy exactly once (input or output)."""
    x = make((4, 6, K), layout)
    w = torch.randn(N, K)
    copies = _copies(lambda: attnx.linear(x, w))
    if layout in FOLDABLE:
        assert copies == []
    elif layout == "expanded":
        assert copies == [(4, 6, N)]  # distinct rows computed once, then broadcast into the output
    else:
        assert len(copies) == 1 and copies[0] in ((4, 6, K), (24, K)), copies
    # A bias adds at most torch's own bias fill of the output (as addmm does; attnx's kernel for small fp32
    # problems adds the bias as it writes each output), nothing else.
    if layout in FOLDABLE:
        assert _copies(lambda: attnx.linear(x, w, torch.randn(N))) in ([], [(24, N)])
        xb, wb, bb = x.to(torch.bfloat16), w.to(torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
        assert _copies(lambda: attnx.linear(xb, wb, bb)) == [(24, N)]


def test_b1_transposed_is_one_gemm_on_the_original_storage():
    """The upstream report's layout: (B, L, D).transpose(0, 1) at B=1. No copy, contiguous output."""
    q = torch.randn(1, 32, K)
    x = q.transpose(0, 1)
    assert x.stride() == (K, 32 * K, 1) and x.is_contiguous()
    w = torch.randn(N, K)
    assert _copies(lambda: attnx.linear(x, w)) == []
    out = attnx.linear(x, w)
    assert out.stride() == (N, N, 1)
    torch.testing.assert_close(out, F.linear(x, w))


# ------------------------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", [(), (5,), (3, 4), (4, 1, 2)], ids=str)
def test_gradients_match_reference(device, layout, batch):
    require_kernel("attnx::linear", device)
    x = make((*batch, K), layout, torch.float64, device).requires_grad_()
    w = torch.randn(N, K, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(N, dtype=torch.float64, device=device, requires_grad=True)
    out = attnx.linear(x, w, b)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, b), grad)
    want = torch.autograd.grad(reference.linear(x, w, b), (x, w, b), grad)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "column_major", "sliced"])
def test_gradcheck(layout):
    x = make((3, 2, 5), layout, torch.float64).requires_grad_()
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attnx.linear, (x, w, b))
    assert torch.autograd.gradgradcheck(attnx.linear, (x, w, b))


def test_gradcheck_expanded_input_and_size1_bias():
    base = torch.randn(1, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w, b: attnx.linear(t.expand(3, 4, 5), w, b), (base, w, b))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded", "column_major"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_opcheck(layout, bias):
    x = make((3, 4, 5), layout, torch.float64).requires_grad_()
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.attnx.linear.default, (x, w, b))


def test_compile_fullgraph_matches_eager():
    def f(x, w, b):
        return attnx.linear(x.transpose(0, 1), w, b).relu()

    x, w, b = torch.randn(1, 7, K), torch.randn(N, K), torch.randn(N)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w, b), f(x, w, b))


# ------------------------------------------------------------------------------------------------------------
# bad input: the exception type and message F.linear gives for the same mistake


def _error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.type, str(info.value).splitlines()[0]


BAD_INPUTS = {
    "0-d input": lambda: (torch.tensor(1.0), torch.randn(N, 1), None),
    "in_features 2-D": lambda: (torch.randn(3, K), torch.randn(N, K + 1), None),
    "in_features 3-D": lambda: (torch.randn(2, 3, K), torch.randn(N, K + 1), None),
    "in_features 1-D": lambda: (torch.randn(K), torch.randn(N, K + 1), None),
    "dtype": lambda: (torch.randn(3, K), torch.randn(N, K, dtype=torch.float64), None),
    "bias dtype": lambda: (torch.randn(3, K), torch.randn(N, K), torch.randn(N, dtype=torch.float64)),
    "bias size": lambda: (torch.randn(3, K), torch.randn(N, K), torch.randn(N + 1)),
    "bias size 3-D input": lambda: (torch.randn(2, 3, K), torch.randn(N, K), torch.randn(N + 1)),
    "bool": lambda: (torch.ones(3, K, dtype=torch.bool), torch.ones(N, K, dtype=torch.bool), None),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_errors_like_f_linear(case):
    args = BAD_INPUTS[case]()
    want_type, want_msg = _error(lambda: F.linear(*args))
    got_type, got_msg = _error(lambda: attnx.linear(*args))
    # torch's GEMM rejects the dtype (bool) inside the kernel, whose call of it crosses torch's stable C API:
    # the error keeps its message and arrives as a RuntimeError, which NotImplementedError subclasses.
    assert got_type is (RuntimeError if want_type is NotImplementedError else want_type)
    if case == "bool" and not attnx._compat.torch_passes_errors_through():
        # torch 2.10 to 2.12 log the message of an error raised inside their own kernel to stderr, and their C
        # API hands attnx only the failure (csrc/common/stable.h): the op says which call failed.
        want_msg = "attnx::linear: aten::mm.out failed (torch < 2.13 logs the error to stderr)"
    assert got_msg == want_msg
    # The same through the public op (and its router, csrc/common/routes.cpp).
    assert _error(lambda: torch.ops.attnx.linear(*args)) == (got_type, got_msg)


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c != "bool"])
def test_fake_kernel_raises_the_same_errors(case):
    args = BAD_INPUTS[case]()
    want_type, want_msg = _error(lambda: attnx.linear(*args))
    with FakeTensorMode() as mode:
        fake_args = [None if a is None else mode.from_tensor(a) for a in args]
        got_type, got_msg = _error(lambda: attnx.linear(*fake_args))
    assert (got_type, got_msg) == (want_type, want_msg)


def test_mismatched_devices():
    msg = "Expected all tensors to be on the same device, but found at least two devices, cpu and meta!"
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        attnx.linear(torch.randn(3, K), torch.randn(N, K, device="meta"))
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        attnx.linear(torch.randn(3, K), torch.randn(N, K), torch.randn(N, device="meta"))


@pytest.mark.parametrize("shape", [(K,), (2, N, K)], ids=["1-D", "3-D"])
def test_weight_must_be_2d(shape):
    with pytest.raises(
        RuntimeError, match=r"attnx::linear: expected weight of shape \(out_features, in_features\)"
    ):
        attnx.linear(torch.randn(3, K), torch.randn(shape))


def test_bias_must_be_1d():
    with pytest.raises(
        RuntimeError, match=r"attnx::linear: expected bias of shape \(out_features,\) = \(10,\)"
    ):
        attnx.linear(torch.randn(3, K), torch.randn(N, K), torch.randn(3, N))
