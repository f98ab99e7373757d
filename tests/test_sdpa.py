"""The SDPA takeover (attnx.sdpa, csrc/pytorch/sdpa.cpp): PyTorch's CPU flash-attention op and its backward on
attnx's kernels, with PyTorch's semantics and layouts.

The reference is PyTorch's own kernel of the same op (the takeover off): outputs, logsumexp and gradients in
float64 to 1e-12, the 16-bit and float32 results within the bounds of attention_helpers, and every output's
strides equal to PyTorch's. F.scaled_dot_product_attention's MATH backend checks the semantics a second way.
That attnx's kernels ran, not PyTorch's, is read from the dispatcher's table.
"""

import contextlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import attnx
from attention_helpers import make_in_layout

pytestmark = pytest.mark.kernel

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# The registry with a way back: torch 2.10 has register/activate but no restore_flash_attention_impl.
HAS_REGISTRY = hasattr(torch.nn.attention, "restore_flash_attention_impl")
# Under torch < 2.13 an error raised below a stable-ABI dispatcher call reaches attnx without its message
# (printed to stderr instead; common/compat.h).
ERRORS_CARRY_MESSAGES = torch.__version__ >= "2.13"
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def takeover_off():
    attnx.sdpa.disable()
    yield
    attnx.sdpa.disable()


@contextlib.contextmanager
def attnx_kernels():
    """The takeover with attnx's kernels for every dtype: enable() would leave 16-bit forwards to PyTorch's
    kernel on CPUs with AMX (see test_16bit_forwards_on_amx_cpus)."""
    attnx.sdpa._enable(keep_bf16_forward=False, keep_fp16_forward=False)
    try:
        yield
    finally:
        attnx.sdpa.disable()


def cpu_kernel_source() -> str:
    table = torch._C._dispatch_dump_table("aten::_scaled_dot_product_flash_attention_for_cpu")
    return next(line for line in table.splitlines() if line.startswith("CPU:"))


def make_inputs(B, H, Hkv, L, S, D, dtype, layout="contiguous", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = make_in_layout((B, H, L, D), layout, dtype, gen, which="q")
    k = make_in_layout((B, Hkv, S, D), layout, dtype, gen, which="k")
    v = make_in_layout((B, Hkv, S, D), layout, dtype, gen, which="v")
    return q, k, v


def make_mask(kind, B, H, L, S, dtype, gen):
    """An additive mask as SDPA hands it to the op: in the query's dtype, 2-D or 4-D."""
    if kind is None:
        return None
    shape = {"LS": (L, S), "1S": (1, S), "B1LS": (B, 1, L, S), "1HLS": (1, H, L, S), "BH1S": (B, H, 1, S),
             "BHLS": (B, H, L, S)}[kind]
    mask = torch.randn(shape, generator=gen).to(dtype)
    # Some keys masked out (-inf) too, as a converted bool mask would.
    mask.masked_fill_(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
    return mask


def run_op(q, k, v, grad_out, **kwargs):
    """The forward op, then the backward op: (out, lse, grad_q, grad_k, grad_v)."""
    out, lse = FORWARD(q, k, v, **kwargs)
    dropout_p = kwargs.pop("dropout_p", 0.0)
    is_causal = kwargs.pop("is_causal", False)
    grads = BACKWARD(grad_out, q, k, v, out, lse, dropout_p, is_causal, **kwargs)
    return (out, lse, *grads)


def compare_with_torch(q, k, v, **kwargs):
    """attnx's run of the op pair against PyTorch's, values and strides."""
    gen = torch.Generator().manual_seed(7)
    B, H, L, _ = q.shape
    grad_out = torch.randn(B, H, L, v.shape[-1], generator=gen).to(q.dtype)
    expected = run_op(q, k, v, grad_out, **kwargs)
    with attnx_kernels():
        assert "csrc/pytorch/sdpa.cpp" in cpu_kernel_source()
        actual = run_op(q, k, v, grad_out, **kwargs)
    names = ["out", "lse", "grad_query", "grad_key", "grad_value"]
    for name, a, e in zip(names, actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert a.stride() == e.stride(), f"{name}: strides {a.stride()} != PyTorch's {e.stride()}"
        # Scale the bound by the values' size: gradients of masked long rows are O(10).
        scale = max(1.0, e.double().abs().max().item())
        torch.testing.assert_close(a.double(), e.double(), rtol=0, atol=TOL[q.dtype] * scale, msg=name)
    return actual


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", [None, "LS", "1S", "B1LS", "1HLS", "BH1S", "BHLS"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_kernel(dtype, mask, is_causal):
    B, H, L, S, D = 2, 3, 37, 45, 16
    q, k, v = make_inputs(B, H, H, L, S, D, dtype)
    gen = torch.Generator().manual_seed(1)
    mask_dtype = dtype
    compare_with_torch(q, k, v, is_causal=is_causal, attn_mask=make_mask(mask, B, H, L, S, mask_dtype, gen))


@pytest.mark.parametrize("layout", ["blhd", "lbhd", "packed", "expanded_kv", "strided_last"])
def test_strided_inputs(layout):
    """Values against the MATH backend (torch 2.10's own flash kernel is wrong for a last-dim stride of 2:
    off by 3.2 in float64), output layouts against PyTorch's kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = make_inputs(2, 4, 4, 19, 23, 8, torch.float64, layout=layout)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def run():
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        return (out, *torch.autograd.grad(out.square().sum(), leaves))

    with sdpa_kernel(SDPBackend.MATH):
        expected = run()
    with attnx_kernels():
        actual = run()
        ours = FORWARD(q, k, v, is_causal=True)
    theirs = FORWARD(q, k, v, is_causal=True)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)
    assert [t.stride() for t in ours] == [t.stride() for t in theirs]


@pytest.mark.parametrize("L,S", [(1, 1), (1, 300), (300, 1), (129, 513), (600, 70)])
def test_shapes(L, S):
    q, k, v = make_inputs(1, 2, 2, L, S, 32, torch.float64)
    gen = torch.Generator().manual_seed(3)
    compare_with_torch(q, k, v, is_causal=True, attn_mask=make_mask("LS", 1, 2, L, S, torch.float64, gen))


def test_grouped_kv_heads():
    q, k, v = make_inputs(2, 8, 2, 17, 29, 16, torch.float64)
    compare_with_torch(q, k, v, is_causal=True, scale=0.3)


def test_fully_masked_rows():
    """A row whose every key is masked out: output 0, logsumexp 0 and no gradient, as PyTorch's kernel gives
    (attnx's own op reports logsumexp +inf there)."""
    q, k, v = make_inputs(1, 2, 2, 6, 9, 8, torch.float64)
    mask = torch.zeros(6, 9, dtype=torch.float64)
    mask[2] = float("-inf")
    out, lse, gq, _, _ = compare_with_torch(q, k, v, attn_mask=mask)
    assert (out[:, :, 2] == 0).all() and (lse[:, :, 2] == 0).all() and (gq[:, :, 2] == 0).all()


@pytest.mark.wheel
@pytest.mark.parametrize("mask", ["bool", "none", "causal"])
def test_sdpa_end_to_end_against_math_backend(mask):
    """F.scaled_dot_product_attention under the takeover, autograd included (the autograd engine passes an
    absent mask as an undefined tensor), against its MATH backend: a bool mask (SDPA converts it before the
    op), GQA and 3-D inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 33, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    kwargs = {"is_causal": True} if mask == "causal" else {}
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(33, 40, generator=gen) > 0.3  # True = attend, as SDPA reads a bool
        kwargs["attn_mask"][:, 0] = True

    def run():
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    with sdpa_kernel(SDPBackend.MATH):
        expected = run()
    with attnx.sdpa.enabled():
        actual = run()
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)

    q3 = torch.randn(4, 21, 16, generator=gen, dtype=torch.float64)
    with sdpa_kernel(SDPBackend.MATH):
        expected3 = F.scaled_dot_product_attention(q3, q3, q3, is_causal=True)
    with attnx.sdpa.enabled():
        actual3 = F.scaled_dot_product_attention(q3, q3, q3, is_causal=True)
    torch.testing.assert_close(actual3, expected3, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "case",
    ["dropout", "bool_mask", "three_d", "mask_3d"],
)
def test_what_attnx_does_not_take_goes_to_torch(case):
    """Calls attnx's kernels do not take reach PyTorch's, which computes them or raises its own error."""
    q, k, v = make_inputs(1, 2, 2, 4, 5, 8, torch.float32)
    args, kwargs = (q, k, v), {}
    if case == "dropout":
        args = (q, k, v, 0.1)
    elif case == "bool_mask":
        kwargs = {"attn_mask": torch.ones(4, 5, dtype=torch.bool)}
    elif case == "three_d":
        args = (q[0], k[0], v[0])
    elif case == "mask_3d":
        kwargs = {"attn_mask": torch.zeros(2, 4, 5)}
    with pytest.raises(RuntimeError) as expected:
        FORWARD(*args, **kwargs)
    with attnx.sdpa.enabled(), pytest.raises(RuntimeError) as actual:
        FORWARD(*args, **kwargs)
    if ERRORS_CARRY_MESSAGES:
        assert str(actual.value) == str(expected.value)
    else:  # the message went to stderr; the error names the call
        assert "attnx::_sdpa_for_cpu_fallback" in str(actual.value)


def test_enable_disable_and_context():
    before = cpu_kernel_source()
    assert "sdpa.cpp" not in before and not attnx.sdpa.is_enabled()
    attnx.sdpa.enable()
    attnx.sdpa.enable()  # twice is once
    assert attnx.sdpa.is_enabled() and "csrc/pytorch/sdpa.cpp" in cpu_kernel_source()
    attnx.sdpa.disable()
    assert not attnx.sdpa.is_enabled() and cpu_kernel_source() == before
    with attnx.sdpa.enabled():
        assert attnx.sdpa.is_enabled()
        with attnx.sdpa.enabled():
            pass
        assert attnx.sdpa.is_enabled()  # the inner block leaves it as it found it
    assert not attnx.sdpa.is_enabled() and cpu_kernel_source() == before


@pytest.mark.wheel
@pytest.mark.skipif(
    not HAS_REGISTRY, reason=f"torch {torch.__version__} has no restore_flash_attention_impl in its registry"
)
def test_torch_registry():
    from torch.nn import attention

    assert "attnx" in attention.list_flash_attention_impls()
    assert not attnx.sdpa.is_enabled(), "import attnx must not activate the takeover"
    attention.activate_flash_attention_impl("attnx")
    try:
        assert attention.current_flash_attention_impl() == "attnx"
        assert attnx.sdpa.is_enabled() and "csrc/pytorch/sdpa.cpp" in cpu_kernel_source()
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None and not attnx.sdpa.is_enabled()


@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch < 2.13 prints the override warning to stderr from C++, past Python's warning filters "
    "(docs/integrations.md)",
)
@pytest.mark.slow
def test_no_override_warning_reaches_the_user():
    """PyTorch warns when a kernel is overridden; turning the takeover on is that, asked for: no warning."""
    script = textwrap.dedent("""
        import warnings
        warnings.simplefilter("always")
        import attnx
        with warnings.catch_warnings(record=True) as caught:
            attnx.sdpa.enable()
        print(len([w for w in caught if "Overriding" in str(w.message)]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
    assert "Overriding a previously registered kernel" not in result.stderr


def test_warnings_filter_is_local():
    """enable() leaves the caller's warning filters as they were."""
    filters = list(warnings.filters)
    attnx.sdpa.enable()
    assert warnings.filters == filters


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_forwards_on_amx_cpus(dtype):
    """Where PyTorch's kernel runs a 16-bit dtype's GEMMs on AMX tiles and attnx's does not (float16 with
    AMX-FP16; bfloat16 with AMX where attnx's variant is not amx_bf16), enable() leaves that dtype's forward
    to it (bit for bit PyTorch's output) and still runs attnx's backward on it; elsewhere both are attnx's."""
    if dtype == torch.bfloat16:
        amx = torch.cpu._is_amx_tile_supported() and torch.ops.attnx._cpu_capability() != "amx_bf16"
    else:
        amx = torch.cpu._is_amx_fp16_supported()
    q, k, v = make_inputs(2, 4, 4, 64, 80, 32, dtype)
    grad_out = torch.randn(2, 4, 64, 32).to(dtype)
    expected = run_op(q, k, v, grad_out, is_causal=True)
    with attnx_kernels():
        ours = run_op(q, k, v, grad_out, is_causal=True)
    with attnx.sdpa.enabled():
        actual = run_op(q, k, v, grad_out, is_causal=True)
    for name, a, o in zip(["out", "lse"], actual[:2], ours[:2], strict=True):
        assert torch.equal(a, o) != amx, f"{name}: {'attnx' if not amx else 'PyTorch'}'s forward expected"
    # A decoding step (one query row) is attnx's either way.
    q1 = q[:, :, :1]
    with attnx_kernels():
        ours1 = FORWARD(q1, k, v)
    with attnx.sdpa.enabled():
        assert all(torch.equal(a, o) for a, o in zip(FORWARD(q1, k, v), ours1, strict=True))
    # The backward is attnx's whichever forward ran: from PyTorch's forward it matches PyTorch's gradients
    # within the dtype's bound.
    for a, e in zip(actual[2:], expected[2:], strict=True):
        scale = max(1.0, e.double().abs().max().item())
        torch.testing.assert_close(a.double(), e.double(), rtol=0, atol=TOL[dtype] * scale)
