"""attnx.linear against reference.linear (float64) and F.linear: values, layouts, copies, gradients,
errors.

The value, layout, copy and gradient tests take the ``device`` fixture (tests/conftest.py): the CPU, a CUDA
GPU and an MPS device where there is one, and the emulated MPS backend (``metal-emu``: csrc/mps/glue.h's
metal_linear launching the Metal kernels compiled for the CPU). The emulated CUDA backends have no linear of
their own: CUDA's linear is torch's GEMM behind common/linear.cpp's layout handling (linear_via_gemm), which
the CPU and a GPU run; they skip.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import attnx
from attnx import reference
from layouts import FOLDABLE, LAYOUTS, is_non_overlapping_and_dense, make

pytestmark = pytest.mark.kernel

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
K, N = 12, 10  # in/out features differ, so an input-sized copy is distinguishable from an output-sized one
BATCH_SHAPES = [(), (7,), (1,), (5, 1), (1, 5), (3, 4), (2, 1, 3), (0, 3)]
# Absolute slack on top of the bound below: a few units of the dtype's resolution at |y| ~ sqrt(K).
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _metal(device):
    return device.backend in ("mps", "metal-emu")


def require_linear(device, dtype=None):
    """Skips where ``device``'s backend has no linear of its own, or no kernel for ``dtype``: the emulated
    CUDA backends (a GPU's linear is torch's GEMM, which they do not emulate), and float64 on Metal (which has
    no double; test_metal_refuses_float64 checks the error)."""
    if device.backend.startswith("cuda-emu"):
        pytest.skip("CUDA's linear is torch's GEMM (common/linear.cpp, linear_via_gemm): no emulated kernel")
    if dtype == torch.float64 and _metal(device):
        pytest.skip("Metal has no float64")


def _assert_close_to_reference(out, x, w, b):
    """FlashAttention-style bound: attnx's error vs float64 is within 2x torch's own error in the same
    dtype (both references on the CPU)."""
    out, x, w, b = (None if t is None else t.cpu() for t in (out, x, w, b))
    ref64 = reference.linear(x.double(), w.double(), None if b is None else b.double())
    ref = reference.linear(x, w, b)
    assert out.shape == ref64.shape and out.dtype == x.dtype
    if out.numel() == 0:
        return
    err = (out.double() - ref64).abs().max().item()
    ref_err = (ref.double() - ref64).abs().max().item()
    assert err <= 2 * ref_err + ATOL[x.dtype], f"error {err:.3g} vs torch's {ref_err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", BATCH_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_reference(device, dtype, layout, batch, bias):
    require_linear(device, dtype)
    x = make((*batch, K), layout, dtype, device)
    w = torch.randn(N, K, dtype=dtype, device=device)
    b = torch.randn(N, dtype=dtype, device=device) if bias else None
    _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)


# (batch dims, K, N): rows on either side of the few-rows kernels (Metal's GEMV takes up to 8), partial tiles
# of 32 in rows, K and N.
TILE_SHAPES = [((5, 1), 40, 37), ((1, 8), 70, 9), ((9, 4), 45, 70), ((40, 1), 33, 20)]


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", TILE_SHAPES, ids=str)
def test_rows_and_tiles(device, shape, layout, dtype):
    require_linear(device, dtype)
    batch, k, n = shape
    x = make((*batch, k), layout, dtype, device)
    w, b = (torch.randn(*size).to(dtype=dtype, device=device) for size in ((n, k), (n,)))
    _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)


@pytest.mark.wheel
@pytest.mark.parametrize("weight_layout", ["contiguous", "transposed_storage", "sliced_rows", "expanded"])
@pytest.mark.parametrize("batch", [(3,), (4, 5)], ids=str)
def test_weight_and_bias_layouts(device, batch, weight_layout):
    """Non-contiguous weights: w.t() storage, rows of a packed in_proj_weight, a stride-0 weight; a strided
    bias, and a size-1 bias that broadcasts."""
    require_linear(device)
    x = torch.randn(*batch, K, device=device)
    w = {
        "contiguous": lambda: torch.randn(N, K, device=device),
        "transposed_storage": lambda: torch.randn(K, N, device=device).t(),
        "sliced_rows": lambda: torch.randn(3 * N, K, device=device)[N : 2 * N],
        "expanded": lambda: torch.randn(1, K, device=device).expand(N, K),
    }[weight_layout]()
    for b in (torch.randn(3 * N, device=device)[1::3], torch.randn(1, device=device)):
        _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)
        torch.testing.assert_close(attnx.linear(x, w, b).cpu(), F.linear(x.cpu(), w.cpu(), b.cpu()))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (5,), (40, 0), (0, 3, 4)], ids=str)
def test_edge_sizes(device, shape):
    """No rows, no input features (the output is the bias), a 1-D input; and no output features."""
    require_linear(device)
    x = torch.randn(shape, device=device)
    k = shape[-1]
    for w, b in ((torch.randn(6, k, device=device), torch.randn(6, device=device)),
                 (torch.randn(0, k, device=device), None)):
        _assert_close_to_reference(attnx.linear(x, w, b), x, w, b)


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
def test_copies_at_most_once(device, layout):
    """The copies each backend's layout handling documents, and no other. common/linear.cpp (the CPU, CUDA):
    foldable layouts run one GEMM without any copy; the others copy exactly once (the input, or the output
    of repeated rows). Metal (glue.h's metal_linear): the kernels read any input whose leading dims form at
    most two groups of rows, at any feature stride, in place (every layout here); more groups are copied
    once."""
    require_linear(device)
    x = make((4, 6, K), layout, device=device)
    w = torch.randn(N, K, device=device)
    copies = _copies(lambda: attnx.linear(x, w))
    if _metal(device) or layout in FOLDABLE:
        assert copies == []
    elif layout == "expanded":
        assert copies == [(4, 6, N)]  # distinct rows computed once, then broadcast into the output
    else:
        assert len(copies) == 1 and copies[0] in ((4, 6, K), (24, K)), copies
    # Three groups of rows that no stride merges: one copy of the input on every backend.
    x = torch.randn(2, 6, 4, 10, 5, device=device)[:, ::2, :, ::3]
    w = torch.randn(3, 5, device=device)
    copies = _copies(lambda: attnx.linear(x, w))
    assert len(copies) == 1 and copies[0] in (tuple(x.shape), (x.shape[:-1].numel(), 5)), copies
    _assert_close_to_reference(attnx.linear(x, w), x, w, None)


def test_bias_adds_at_most_torch_s_fill():
    """On the CPU a bias adds at most torch's own bias fill of the output (as addmm does; attnx's kernel for
    small fp32 problems adds the bias as it writes each output), nothing else."""
    for layout in FOLDABLE:
        x = make((4, 6, K), layout)
        w = torch.randn(N, K)
        assert _copies(lambda x=x, w=w: attnx.linear(x, w, torch.randn(N))) in ([], [(24, N)])
        xb, wb, bb = x.to(torch.bfloat16), w.to(torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
        assert _copies(lambda xb=xb, wb=wb, bb=bb: attnx.linear(xb, wb, bb)) == [(24, N)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 8, 32, 100])
def test_b1_transposed_is_read_in_place(device, rows, dtype):
    """The upstream report's layout: (B, L, E).transpose(0, 1) at B=1, strides (E, L * E, 1) with a stride on
    the size-1 dim that is not the contiguous one. One GEMM on the original storage, no copy, contiguous
    output."""
    require_linear(device, dtype)
    x = torch.randn(1, rows, 64, dtype=dtype, device=device).transpose(0, 1)
    assert x.stride() == (64, rows * 64, 1)
    w = torch.randn(40, 64, dtype=dtype, device=device)
    b = torch.randn(40, dtype=dtype, device=device)
    assert _copies(lambda: attnx.linear(x, w, b)) in ([], [(rows, 40)])  # at most torch's bias fill
    assert _copies(lambda: attnx.linear(x, w)) == []
    out = attnx.linear(x, w, b)
    assert out.stride() == (40, 40, 1)
    _assert_close_to_reference(out, x, w, b)


# ------------------------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", [(), (5,), (3, 4), (4, 1, 2)], ids=str)
def test_gradients_match_reference(device, layout, batch, dtype):
    require_linear(device, dtype)
    x = make((*batch, K), layout, dtype, device).requires_grad_()
    w = torch.randn(N, K, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(N, dtype=dtype, device=device, requires_grad=True)
    out = attnx.linear(x, w, b)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, b), grad)
    want = torch.autograd.grad(reference.linear(x, w, b), (x, w, b), grad)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.wheel
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "column_major", "sliced"])
def test_gradcheck(device, layout):
    require_linear(device, torch.float64)
    x = make((3, 2, 5), layout, torch.float64, device).requires_grad_()
    w = torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(attnx.linear, (x, w, b))
    assert torch.autograd.gradgradcheck(attnx.linear, (x, w, b))


def test_gradcheck_expanded_input_and_size1_bias():
    base = torch.randn(1, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w, b: attnx.linear(t.expand(3, 4, 5), w, b), (base, w, b))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded", "column_major"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_opcheck(device, layout, bias):
    # float32 on Metal (no float64), within opcheck's float32 tolerances.
    dtype = torch.float32 if _metal(device) else torch.float64
    require_linear(device, dtype)
    x = make((3, 4, 5), layout, dtype, device).requires_grad_()
    w = torch.randn(6, 5, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(6, dtype=dtype, device=device, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.attnx.linear.default, (x, w, b))


def test_metal_refuses_float64(device):
    if not _metal(device):
        pytest.skip(f"{device.backend} takes float64")
    x, w = torch.randn(3, K, dtype=torch.float64, device="cpu"), torch.randn(N, K, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64|Double"):
        attnx.linear(x.to(device), w.to(device))


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
