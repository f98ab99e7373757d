"""attnx's CUDA kernels on a real GPU: attention, linear and mha against the references, opcheck, memory.

Every test takes the ``cuda`` device param of conftest.DEVICES, so without a GPU (or without CUDA kernels in
the build) they show as skipped. Inputs are built on the CPU by the same factories as the CPU tests and moved
to the GPU with their exact layout (strides, storage offset, stride-0 dims): see ``layouts.to_device``.

On a GPU machine, `make gpu-check` (tools/gpu_check.py) runs this file with tests/test_linear.py, and
compute-sanitizer on tools/gpu_sanitize_cases.py. Run it without CUDA_LAUNCH_BLOCKING=1: that would serialise
the launches test_attention_runs_on_the_current_stream races against (it skips then).
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attnx
from attention_helpers import (
    ATTN_MASK_KINDS,
    DTYPES,
    GRAD_ATOL,
    KEY_PADDING_MASK_KINDS,
    QKV_LAYOUTS,
    assert_fully_masked_rows,
    assert_grad_bounded,
    assert_matches_reference,
    assert_unseen_rows_empty,
    attention_opcheck_cases,
    check_forward,
    fully_masked_rows_case,
    make_attn_mask,
    make_feature_masks,
    make_gqa,
    make_key_padding_mask,
    make_qkv,
    make_sinks,
    nan_rows_case,
    run_python,
)
from attnx import reference
from conftest import DEVICES, require_kernel
from layouts import to_device
from mha_helpers import check_mha, make_inputs, make_masks, mha_args

CUDA = [p for p in DEVICES if p.id == "cuda"]

pytestmark = pytest.mark.parametrize("device", CUDA)


@pytest.fixture(autouse=True)
def _kernels(device):
    require_kernel("attnx::attention", device)
    require_kernel("attnx::linear", device)


def qkv(device, *args, **kwargs):
    return to_device(make_qkv(*args, **kwargs), device)


def gqa(device, *args, **kwargs):
    """make_gqa's query (B, H, L, D) and key/value with Hkv heads, on `device`."""
    return to_device(make_gqa(*args, **kwargs), device)


# ------------------------------------------------------------------------------------------------------------
# attnx.attention


SHAPES = [
    (2, 3, 37, 53, 24, 24),  # odd sizes, partial query blocks and key tiles
    (1, 2, 16, 16, 32, 8),  # Dv < D
    (2, 1, 9, 70, 8, 40),  # Dv > D
    (1, 1, 1, 1, 4, 4),
    (3, 2, 1, 33, 16, 16),  # one query
    (1, 1, 45, 1, 16, 16),  # one key
    (1, 2, 20, 30, 64, 64),
    (1, 2, 20, 30, 128, 100),
    (1, 1, 20, 30, 256, 256),  # the largest bucket (fp64: 2 rows per warp, 147 KiB of shared memory)
]


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_shapes_dtypes_layouts(device, shape, dtype, layout):
    check_forward(*qkv(device, *shape, dtype=dtype, layout=layout))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 300, 600, 64, 64), (1, 2, 1030, 1000, 128, 128)], ids=str)
def test_attention_big(device, shape, is_causal, dtype):
    q, k, v = qkv(device, *shape, dtype=dtype, layout="blhd")
    B, _, L, S, _, _ = shape
    kpm = torch.rand(B, S, device=device) < 0.2
    kpm[:, :100] = True  # whole key tiles removed by padding
    mask = torch.randn(L, S, device=device)
    check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("attn_mask", ATTN_MASK_KINDS)
def test_attention_masks(device, attn_mask, is_causal):
    mask = to_device(make_attn_mask(attn_mask, torch.Generator().manual_seed(1)), device)
    check_forward(*qkv(device, 2, 3, 19, 41, 16, 16, layout="blhd"), attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padding", KEY_PADDING_MASK_KINDS)
@pytest.mark.parametrize("attn_mask", [None, "bool_ls", "float_bhls", "float_1h1s"], ids=str)
def test_attention_padding_and_mask(device, attn_mask, padding, is_causal):
    gen = torch.Generator().manual_seed(2)
    mask = None if attn_mask is None else to_device(make_attn_mask(attn_mask, gen), device)
    kpm = to_device(make_key_padding_mask(padding, gen), device)
    check_forward(*qkv(device, 2, 3, 19, 41, 16, 16), attn_mask=mask, key_padding_mask=kpm,
                  is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_fully_masked_rows_and_scale(device, dtype):
    inputs, masks = fully_masked_rows_case(dtype=dtype)  # query 2 sees no key; batch 1 none at all
    out, lse = check_forward(*to_device(inputs, device), **to_device(masks, device), scale=0.3)
    assert_fully_masked_rows(out, lse)


def test_attention_nan_and_empty(device):
    inputs, masks = nan_rows_case()
    out, lse = check_forward(*to_device(inputs, device), **to_device(masks, device))
    assert out[0, 1, 2].isnan().all() and out[0, :, 4].isnan().all()
    for sizes in [(0, 2, 3, 4, 8, 8), (2, 2, 0, 4, 8, 8), (2, 2, 3, 0, 8, 8), (2, 2, 3, 4, 0, 8),
                  (2, 2, 3, 4, 8, 0)]:
        check_forward(*qkv(device, *sizes))


def test_attention_many_heads(device):
    # B*H = 70000 blocks of one query block each: past grid.y's 65535 (the grid is 1-D).
    check_forward(*qkv(device, 700, 100, 3, 5, 8, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("dims", [(288, 288), (264, 64), (64, 320)], ids=str)
def test_attention_head_dim_above_256_falls_back(device, dims, dtype):
    D, Dv = dims
    q, k, v = qkv(device, 2, 2, 37, 50, D, Dv, dtype=dtype, layout="blhd")
    kpm = torch.rand(2, 50, device=device) < 0.3
    kpm[1] = True  # fully masked rows in the fallback too
    mask = torch.randn(4, 37, 50, device=device)
    check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=True)


def test_attention_head_dim_above_256_chunks(device):
    # Scores of (B, H, L, S) = 1 x 1 x 1200 x 70000 fp32 are 336 MB: the fallback takes two chunks of queries.
    q, k, v = (torch.randn(1, 1, n, 272, device=device) for n in (1200, 70000, 70000))
    kpm = torch.rand(1, 70000, device=device) < 0.5
    check_forward(q, k, v, key_padding_mask=kpm, is_causal=True)


def test_attention_side_stream_and_device_guard(device):
    q, k, v = qkv(device, 2, 2, 40, 50, 32, 32)
    want = attnx.attention(q, k, v, is_causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = attnx.attention(q, k, v, is_causal=True)
    stream.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if torch.cuda.device_count() > 1:
        q1, k1, v1 = (t.to("cuda:1") for t in (q, k, v))
        got1 = attnx.attention(q1, k1, v1, is_causal=True)  # launched on cuda:1 while cuda:0 is current
        assert got1[0].device == q1.device
        torch.testing.assert_close(got1[0].cpu(), want[0].cpu(), rtol=0, atol=0)


def test_attention_mixed_devices_is_an_error(device):
    q, k, v = qkv(device, 1, 1, 3, 4, 8, 8)
    with pytest.raises(RuntimeError, match="expected key on query's device"):
        attnx.attention(q, k.cpu(), v)
    with pytest.raises(RuntimeError, match="expected attn_mask on query's device"):
        attnx.attention(q, k, v, attn_mask=torch.zeros(3, 4))


def test_attention_no_quadratic_memory(device):
    B, H, L, S, D = 2, 4, 4096, 4096, 64
    q, k, v = (torch.randn(B, H, n, D, device=device) for n in (L, S, S))
    mask = torch.rand(L, S, device=device) < 0.1
    kpm = torch.zeros(B, S, dtype=torch.bool, device=device)
    kpm[:, -100:] = True
    attnx.attention(q[:, :, :8], k, v, mask[:8], kpm)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    attnx.attention(q, k, v, mask, kpm, is_causal=True)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    outputs = B * H * L * D * 4 + B * H * L * 4
    assert grown <= outputs + 2**20, f"peak grew {grown / 2**20:.1f} MiB, outputs are {outputs / 2**20:.1f}"


@pytest.mark.parametrize("case", range(4))
def test_attention_opcheck(device, case):
    pytest.importorskip("expecttest")
    args = to_device(attention_opcheck_cases()[case], device)
    torch.library.opcheck(torch.ops.attnx.attention.default, args)


def test_attention_fake_matches_kernel(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = qkv(device, 2, 3, 5, 7, 8, 4, layout="blhd")
    real = attnx.attention(q, k, v)
    with FakeTensorMode() as mode:
        fake = attnx.attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v))
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.stride(), r.dtype, r.device) == (f.shape, f.stride(), f.dtype, f.device)


def test_attention_compile_fullgraph(device):
    q, k, v = qkv(device, 2, 2, 5, 7, 8, 8)
    fn = torch.compile(lambda q, k, v: attnx.attention(q, k, v, is_causal=True)[0] * 2, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), attnx.attention(q, k, v, is_causal=True)[0] * 2)


_MMA_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from attention_helpers import check_forward, make_qkv
    from layouts import to_device
    for dtype in (torch.float16, torch.bfloat16):
        for shape in [(2, 3, 37, 53, 64, 64), (1, 2, 300, 600, 128, 128), (1, 1, 70, 90, 32, 32)]:
            for layout in ("contiguous", "blhd", "strided_last", "expanded_kv"):
                q, k, v = to_device(make_qkv(*shape, dtype=dtype, layout=layout), "cuda")
                kpm = torch.rand(shape[0], shape[3], device="cuda") < 0.3
                mask = torch.randn(shape[2], shape[3], device="cuda")
                check_forward(q, k, v)
                check_forward(q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
    # Grouped KV heads, a window with key lengths, soft-capping, sinks and masks, on the kernel chosen.
    for dtype in (torch.float16, torch.bfloat16):
        q = to_device(make_qkv(2, 6, 100, 150, 64, 64, dtype=dtype, layout="blhd")[0], "cuda")
        _, k, v = to_device(make_qkv(2, 2, 100, 150, 64, 64, dtype=dtype, layout="blhd", seed=1), "cuda")
        kpm = torch.rand(2, 150, device="cuda") < 0.3
        lengths = torch.tensor([150, 80], device="cuda")
        sinks = torch.linspace(-1.0, 2.0, 6, device="cuda")
        for window in ((-1, 0), (20, 3), (-1, -1)):
            check_forward(q, k, v, key_padding_mask=kpm, window_left=window[0], window_right=window[1],
                          key_lengths=lengths, softcap=5.0, sinks=sinks)
    # float32 takes it too (3xTF32) up to head dim 64; past that, and fp16 past 128, the SIMT kernel.
    check_forward(*to_device(make_qkv(2, 3, 37, 53, 64, 64, dtype=torch.float32), "cuda"), is_causal=True)
    check_forward(*to_device(make_qkv(2, 3, 37, 53, 96, 96, dtype=torch.float32), "cuda"), is_causal=True)
    check_forward(*to_device(make_qkv(1, 2, 37, 53, 256, 256, dtype=torch.float16), "cuda"), is_causal=True)
    print("ok")
    """
)


@pytest.mark.parametrize("mma", ["1", "0"])
def test_attention_kernel_choice(device, mma):
    # fp16/bf16 take the tensor-core kernel by default on sm80+ (as every other test here does);
    # ATTNX_CUDA_MMA=0 selects the SIMT kernel for them. Each setting in a fresh process (read once).
    if mma == "1" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the mma kernel needs sm80+")
    env = dict(os.environ, ATTNX_CUDA_MMA=mma)
    script = _MMA_SCRIPT.format(tests=os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


# ------------------------------------------------------------------------------------------------------------
# attnx.attention with dropout: the SIMT kernel draws the CPU kernels' mask (the same Philox stream).


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_dropout(device, dtype):
    seed = torch.tensor([17, 3])
    q, k, v = make_qkv(2, 3, 37, 53, 24, 24, dtype=dtype, layout="blhd")
    check_forward(*to_device((q, k, v), device), is_causal=True, dropout_p=0.3, dropout_seed=seed)
    if dtype == torch.float64:
        cpu, _ = attnx.attention(q, k, v, is_causal=True, dropout_p=0.3, dropout_seed=seed)
        q, k, v = to_device((q, k, v), device)
        gpu, _ = attnx.attention(q, k, v, is_causal=True, dropout_p=0.3, dropout_seed=seed)
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-12)


def test_attention_dropout_seeding_and_errors(device):
    q, k, v = qkv(device, 1, 2, 16, 24, 8, 8)
    torch.manual_seed(1)
    a, _ = attnx.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    b, _ = attnx.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="expected dropout_seed to be a CPU int64 tensor"):
        attnx.attention(q, k, v, dropout_p=0.5, dropout_seed=torch.tensor([1, 2], device=device))
    q, k, v = qkv(device, 1, 1, 3, 5, 264, 8)  # above the kernel's head dims: the composite has no dropout
    with pytest.raises(RuntimeError, match="expected head dims up to 256 on CUDA with dropout_p > 0"):
        attnx.attention(q, k, v, dropout_p=0.5)


# ------------------------------------------------------------------------------------------------------------
# attnx.attention with grouped KV heads, key ranges (windows, per-batch key lengths), soft-capping and sinks:
# parameters of both kernels (fp16/bf16 take the mma kernel here; test_attention_kernel_choice runs them on
# the SIMT kernel too) and of the composite above head dim 256.

WINDOWS = [(-1, 0), (3, 0), (2, 2), (0, -1), (-1, -1)]


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 3)], ids=str)
def test_attention_grouped_kv_heads(device, heads, dtype, layout):
    H, Hkv = heads
    q, k, v = gqa(device, 2, H, Hkv, 37, 70, 64, 64, dtype=dtype, layout=layout)
    check_forward(q, k, v)
    check_forward(q, k, v, is_causal=True, key_padding_mask=torch.rand(2, 70, device=device) < 0.3)


@pytest.mark.parametrize("lengths", [None, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_windows_and_key_lengths(device, dtype, window, lengths):
    # Batch 1 sees no key; batch 2 has fewer keys than queries (its first rows see nothing under a bounded
    # right side). Several query blocks and key tiles of either kernel.
    B, L, S = 3, 150, 230
    key_lengths = None if lengths is None else torch.tensor([S, 0, 100], dtype=lengths, device=device)
    kwargs = {"window_left": window[0], "window_right": window[1], "key_lengths": key_lengths}
    for is_causal in (False, True):
        q, k, v = gqa(device, B, 4, 2, L, S, 64, 64, dtype=dtype, layout="blhd")
        out, lse = check_forward(q, k, v, is_causal=is_causal, **kwargs)
        assert_unseen_rows_empty(out, lse, S, is_causal=is_causal, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_decoding_and_chunked_prefill(device, dtype):
    S = 300
    key_lengths = torch.tensor([S, 7, 0, 129], dtype=torch.int64, device=device)
    for L in (1, 16, 100):
        for window in ((-1, 0), (64, 0), (-1, -1)):
            q, k, v = gqa(device, 4, 8, 2, L, S, 128, 128, dtype=dtype, layout="blhd")
            out, lse = check_forward(q, k, v, window_left=window[0], window_right=window[1],
                                     key_lengths=key_lengths)
            assert (out[2] == 0).all() and torch.isposinf(lse[2]).all()


def test_attention_key_lengths_clamped_and_never_read_past(device):
    # On a GPU the lengths are not read on the host: a value past S is clamped to S. Keys past a batch's
    # length (a KV cache's unwritten slots) are never read: NaN there does not reach the output.
    q, k, v = gqa(device, 2, 4, 1, 40, 90, 32, 32)
    want = attnx.attention(q, k, v, key_lengths=torch.tensor([90, 90], device=device))
    got = attnx.attention(q, k, v, key_lengths=torch.tensor([500, 90], device=device))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    lengths = torch.tensor([70, 11], dtype=torch.int32, device=device)
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[0, :, 70:] = dirty_v[0, :, 70:] = float("nan")
    dirty_k[1, :, 11:] = dirty_v[1, :, 11:] = float("nan")
    for window in ((-1, 0), (5, 0), (-1, -1)):
        kwargs = {"window_left": window[0], "window_right": window[1], "key_lengths": lengths}
        torch.testing.assert_close(attnx.attention(q, dirty_k, dirty_v, **kwargs),
                                   attnx.attention(q, k, v, **kwargs), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_softcap(device, dtype):
    gen = torch.Generator().manual_seed(4)
    L, S = 70, 130
    cap = 10 / 3 if dtype == torch.float64 else 2.5
    q, k, v = gqa(device, 2, 3, 3, L, S, 64, 64, dtype=dtype, layout="blhd")
    check_forward(q, k, v, softcap=cap, scale=1.0)
    mask = to_device(torch.rand(L, S, generator=gen) < 0.3, device)
    kpm = to_device(torch.randn(2, S, generator=gen), device)
    check_forward(q, k, v, softcap=cap, scale=1.0, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
    bias = to_device(torch.randn(L, S, generator=gen).to(dtype), device)
    check_forward(q, k, v, softcap=50.0, attn_mask=bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_sinks(device, dtype):
    L, S = 70, 130
    q, k, v = gqa(device, 2, 4, 2, L, S, 64, 64, dtype=dtype, layout="blhd")
    sinks = make_sinks(4, dtype, device)
    check_forward(q, k, v, sinks=sinks)
    sinks[1], sinks[2] = 40.0, -math.inf  # far above every score; no sink at all
    check_forward(q, k, v, sinks=sinks)
    # Sinks in another floating dtype are converted by the glue.
    check_forward(q, k, v, sinks=sinks.to(dtype) if dtype != torch.float64 else sinks.float())
    mask = torch.zeros(L, S, dtype=torch.bool, device=device)
    mask[3] = True  # query 3 sees no key: out 0, lse +inf, sink or not
    kpm = torch.zeros(2, S, device=device)
    kpm[1] = -math.inf  # batch 1 sees no key
    out, lse = check_forward(q, k, v, sinks=sinks, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
    assert (out[:, :, 3] == 0).all() and torch.isposinf(lse[:, :, 3]).all()
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


@pytest.mark.parametrize("head_dim", [64, 288], ids=str)
@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_all_features_together(device, dtype, mask, head_dim):
    # Head dim 288 runs the composite (no kernel above 256); 64 the kernels.
    gen = torch.Generator().manual_seed(5)
    B, H, L, S = 3, 6, 90, 140
    q, k, v = gqa(device, B, H, 3, L, S, head_dim, 48, dtype=dtype, layout="lbhd")
    attn_mask, kpm = make_feature_masks(mask, B, H, L, S, dtype, gen)
    kwargs = {"attn_mask": to_device(attn_mask, device), "key_padding_mask": to_device(kpm, device),
              "window_left": 30, "window_right": 2,
              "key_lengths": torch.tensor([S, 0, L - 4], device=device), "softcap": 4.0,
              "sinks": make_sinks(H, dtype, device), "scale": 0.2}
    for is_causal in (False, True):
        out, lse = check_forward(q, k, v, is_causal=is_causal, **kwargs)
        assert_unseen_rows_empty(out, lse, S, is_causal=is_causal, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_all_features_with_dropout(device, dtype):
    q, k, v = gqa(device, 2, 4, 2, 37, 53, 24, 24, dtype=dtype)
    check_forward(q, k, v, window_left=6, window_right=0, key_lengths=torch.tensor([53, 30], device=device),
                  softcap=3.0, sinks=make_sinks(4, dtype, device), dropout_p=0.3,
                  dropout_seed=torch.tensor([11, 5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_attention_big_window(device, dtype):
    # A sliding window over long sequences: each query block visits only the key tiles its window reaches.
    B, H, L, S = 2, 4, 1030, 1500
    q, k, v = gqa(device, B, H, 2, L, S, 128, 128, dtype=dtype, layout="blhd")
    key_lengths = torch.tensor([S, 1200], device=device)
    check_forward(q, k, v, window_left=127, window_right=0, key_lengths=key_lengths, softcap=30.0,
                  sinks=make_sinks(H, dtype, device))


# ------------------------------------------------------------------------------------------------------------
# attnx.linear (test_linear.py also runs its parametrised tests on the cuda param)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_layouts(device, dtype):
    w = torch.randn(48, 32, dtype=dtype, device=device)
    b = torch.randn(48, dtype=dtype, device=device)
    x = torch.randn(1, 20, 32, dtype=dtype, device=device)
    packed = torch.randn(4, 20, 96, dtype=dtype, device=device)
    for inp in (x, x.transpose(0, 1), packed[..., 32:64].transpose(0, 1), x.expand(3, 20, 32)):
        got = attnx.linear(inp, w, b)
        want = reference.linear(inp.double(), w.double(), b.double())
        tol = {torch.float64: 1e-12, torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 2e-1}[dtype]
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_linear_gradients_and_opcheck(device):
    x = torch.randn(3, 5, 8, device=device, dtype=torch.float64).transpose(0, 1).requires_grad_()
    w = torch.randn(6, 8, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device=device, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(attnx.linear, (x, w, b))
    torch.library.opcheck(torch.ops.attnx.linear.default, (x.detach(), w.detach(), b.detach()))


# ------------------------------------------------------------------------------------------------------------
# attnx.mha and the module


@pytest.mark.parametrize("masks", ["none", "both_bool", "both_float", "causal", "am3_float"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_matches_reference(device, masks, need_weights):
    query, key, value, w = make_inputs("kv_shared", "batch_first", torch.float64)
    kpm, am, is_causal = make_masks(masks, 2, 4, 6, 9, torch.float64)
    args = mha_args(query, key, value, w, kpm=kpm, am=am, is_causal=is_causal, need_weights=need_weights)
    check_mha(to_device(args, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_mha_low_precision_and_extras(device, dtype, extras):
    query, key, value, w = make_inputs("separate" if extras == "none" else "kv_shared", "sliced", dtype)
    s = 5 if extras == "static_kv" else 9
    kpm, am, _ = make_masks("both_float", 2, 4, 6, s, dtype)
    check_mha(to_device(mha_args(query, key, value, w, extras=extras, kpm=kpm, am=am), device), dtype)


def test_mha_opcheck(device):
    query, key, value, w = make_inputs("kv_shared", "batch_first", torch.float32)
    kpm, am, _ = make_masks("both_bool", 2, 4, 6, 9, torch.float32)
    args = mha_args(query, key, value, w, kpm=kpm, am=am, need_weights=True)
    torch.library.opcheck(torch.ops.attnx.mha.default, to_device(args, device))


@pytest.mark.parametrize("batch_first", [False, True])
def test_module_matches_torch(device, batch_first):
    E, H, B, L = 64, 4, 3, 50
    ref = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, device=device).eval()
    ours = attnx.nn.MultiheadAttention(E, H, batch_first=batch_first, device=device).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E, device=device) if batch_first else torch.randn(L, B, E, device=device)
    kpm = torch.rand(B, L, device=device) < 0.2
    mask = torch.rand(L, L, device=device) < 0.2
    mask.fill_diagonal_(False)
    with torch.no_grad():
        for fast in (True, False):
            torch.backends.mha.set_fastpath_enabled(fast)
            want = ref(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]
            got = ours(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.backends.mha.set_fastpath_enabled(True)


# ------------------------------------------------------------------------------------------------------------
# The glue on a GPU: the stream it launches on, CUDA graphs, device synchronisation, the kernel it picks,
# and the backward (attention_math.cpp on CUDA tensors).

# ~0.1 s of spinning on a stream at H100 clocks (torch.cuda._sleep counts GPU clock cycles).
SLEEP_CYCLES = 200_000_000


def _features(device, B, H, S, dtype):
    """Every key-range feature and both extras, as attnx.attention's keyword arguments."""
    return {"window_left": 30, "window_right": 2, "key_lengths": torch.tensor([S, S // 2][:B], device=device),
            "softcap": 4.0, "sinks": make_sinks(H, dtype, device)}


@pytest.mark.parametrize("case", ["mma", "simt", "composite"])
def test_attention_runs_on_the_current_stream(device, case):
    # The inputs are written on a side stream (non-blocking: it never waits for the legacy default stream,
    # nor that stream for it) after a long spin, and the output is read there. Launched on the current stream,
    # the kernel runs after the copies; launched on any other stream, it runs at once, during the spin, on
    # the zeros the inputs held before, and the copy of the output taken on the side stream differs.
    if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        pytest.skip("CUDA_LAUNCH_BLOCKING=1 serialises every launch: no race to detect")
    dtype, D = {"mma": (torch.float16, 64), "simt": (torch.float32, 96),
                "composite": (torch.float32, 288)}[case]
    q, k, v = gqa(device, 2, 4, 2, 200, 256, D, D, dtype=dtype)
    mask = torch.rand(2, 256, device=device) < 0.2
    inputs = [torch.zeros_like(t) for t in (q, k, v)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for dst, src in zip(inputs, (q, k, v), strict=True):
            dst.copy_(src)
        out, lse = attnx.attention(*inputs, key_padding_mask=mask, is_causal=True)
        out_seen, lse_seen = out.clone(), lse.clone()
    side.synchronize()
    assert_matches_reference(out_seen, lse_seen, q, k, v, key_padding_mask=mask, is_causal=True)


def _capture(fn, *static):
    """A CUDA graph of fn(*static) after two warm-up calls on a side stream (as torch's docs do); returns the
    graph and the captured call's outputs."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*static)
    return graph, outputs


@pytest.mark.parametrize("case", ["mma", "simt"])
def test_attention_cuda_graph(device, case):
    dtype, D = (torch.float16, 64) if case == "mma" else (torch.float32, 96)
    B, H, L, S = 2, 4, 100, 150
    static = [t.clone() for t in gqa(device, B, H, 2, L, S, D, D, dtype=dtype, layout="blhd")]
    kwargs = {"attn_mask": torch.randn(L, S, device=device),
              "key_padding_mask": torch.rand(B, S, device=device) < 0.2, "is_causal": case == "simt",
              **_features(device, B, H, S, dtype)}
    with torch.no_grad():
        graph, (out, lse) = _capture(lambda q, k, v: attnx.attention(q, k, v, **kwargs), *static)
        for _ in range(2):  # each replay computes on what the static inputs hold now
            new = [torch.randn_like(t) for t in static]
            for dst, src in zip(static, new, strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert_matches_reference(out, lse, *new, **kwargs)


def test_module_cuda_graph(device):
    E, H, B, L = 64, 4, 3, 50
    module = attnx.nn.MultiheadAttention(E, H, batch_first=True, device=device).eval()
    x = torch.randn(B, L, E, device=device)
    kpm = torch.rand(B, L, device=device) < 0.2
    mask = torch.rand(L, L, device=device) < 0.2
    mask.fill_diagonal_(False)

    def forward(x):
        return module(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]

    with torch.no_grad():
        graph, out = _capture(forward, x)
        new = torch.randn_like(x)
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, forward(new), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["mma", "simt", "composite", "dropout", "module"])
def test_forward_does_not_synchronize(device, case):
    # torch raises on a synchronising call (a copy to the host, .item(), a pageable copy to the device) while
    # the sync debug mode is "error". Everything is made on the device beforehand.
    dtype, D = {"mma": (torch.float16, 64), "simt": (torch.float32, 96),
                "composite": (torch.float32, 288)}.get(case, (torch.float32, 64))
    B, H, L, S = 2, 4, 60, 90
    q, k, v = gqa(device, B, H, 2, L, S, D, D, dtype=dtype, layout="blhd")
    kwargs = {"attn_mask": torch.randn(L, S, device=device),
              "key_padding_mask": torch.rand(B, S, device=device) < 0.2, **_features(device, B, H, S, dtype)}
    if case == "dropout":  # the SIMT kernel; the seed is a CPU tensor the launch reads on the host
        kwargs.update(dropout_p=0.2, dropout_seed=torch.tensor([3, 4]))
    module = attnx.nn.MultiheadAttention(64, 4, batch_first=True, device=device).eval()
    x = torch.randn(B, L, 64, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            if case == "module":
                module(x, x, x, key_padding_mask=kwargs["key_padding_mask"][:, :L], need_weights=False)
            else:
                attnx.attention(q, k, v, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_backward_does_not_synchronize_and_is_captured(device):
    # The backward's math fallback builds its key ranges (window, causal, key lengths) on the device
    # (common/key_range_mask.h): no host-built (L, S) grid copied over, so no sync, and a CUDA graph captures
    # it; every replay recomputes the gradients of what the inputs hold then.
    B, H, L, S, D = 2, 4, 60, 90, 64
    q, k, v = gqa(device, B, H, 2, L, S, D, D, dtype=torch.float32, layout="blhd")
    kwargs = {"attn_mask": torch.randn(L, S, device=device), "is_causal": True,
              "key_padding_mask": torch.rand(B, S, device=device) < 0.2,
              **_features(device, B, H, S, torch.float32)}
    out, lse = attnx.attention(q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    args = [grad_out, q, k, v, out, lse]

    def backward(grad_out, q, k, v, out, lse):
        return attnx.attention_backward(grad_out, q, k, v, out, lse, **kwargs)[:3]

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backward(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = [t.clone() for t in args]
    graph, grads = _capture(backward, *static)
    for seed in range(2):
        torch.manual_seed(seed)
        static[0].copy_(torch.randn_like(grad_out))
        graph.replay()
        want = backward(*static)
        for got, expected in zip(grads, want, strict=True):  # cuBLAS on two streams: not bit for bit
            torch.testing.assert_close(got, expected)


def test_dropout_seed_is_drawn_without_synchronizing(device):
    # A training step's forward with dropout and no dropout_seed draws one: ops.draw_dropout_seed draws it
    # from the CPU generator, so nothing waits for the device.
    q, k, v = qkv(device, 2, 4, 60, 90, 64, 64, dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            attnx.attention(q, k, v, dropout_p=0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.manual_seed(11)
    out, lse = attnx.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(11)
    seed = attnx.ops.draw_dropout_seed(device)
    assert_matches_reference(out, lse, q, k, v, dropout_p=0.3, dropout_seed=seed)


def test_dropout_cuda_graph(device):
    # Capture with dropout and no seed: the draw refuses (a seed frozen into the graph would repeat one mask
    # on every replay). With the caller's seed the forward is captured (read on the host, no sync), and every
    # replay applies that seed's mask to what the inputs hold then.
    B, H, L, S = 2, 4, 60, 90
    static = [t.clone() for t in qkv(device, B, H, L, S, 64, 64, dtype=torch.float32)]
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="CUDA graph is captured"):
            _capture(lambda q, k, v: attnx.attention(q, k, v, dropout_p=0.25), *static)
        seed = torch.tensor([21, 5])
        graph, (out, lse) = _capture(
            lambda q, k, v: attnx.attention(q, k, v, dropout_p=0.25, dropout_seed=seed), *static
        )
        for _ in range(2):
            new = [torch.randn_like(t) for t in static]
            for dst, src in zip(static, new, strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert_matches_reference(out, lse, *new, dropout_p=0.25, dropout_seed=seed)


def _attnx_kernels(fn):
    """Names of the attnx kernels that fn launches, from torch's profiler (None: it recorded no kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        return None
    kinds = ("attention_forward_mma", "attention_forward_simt")
    return {kind for kind in kinds if any(kind in n for n in names)}


def test_attention_kernel_dispatch(device):
    # Which kernel runs, not only that the result is right: every other test would pass if fp16/bf16 never
    # reached the tensor-core kernel.
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the mma kernel needs sm80+")
    if os.environ.get("ATTNX_CUDA_MMA") == "0":
        pytest.skip("ATTNX_CUDA_MMA=0 is set")
    mma, simt = {"attention_forward_mma"}, {"attention_forward_simt"}
    cases = [((torch.float16, 64, 64), {}, mma), ((torch.bfloat16, 128, 128), {"is_causal": True}, mma),
             ((torch.float16, 128, 96), {"sinks": make_sinks(4, torch.float16, device)}, mma),
             ((torch.float32, 64, 64), {}, mma), ((torch.float32, 32, 24), {"is_causal": True}, mma),
             ((torch.float16, 256, 256), {}, simt), ((torch.float32, 96, 96), {}, simt),
             ((torch.float64, 32, 32), {}, simt),
             ((torch.float16, 64, 64), {"dropout_p": 0.2, "dropout_seed": torch.tensor([1, 2])}, simt),
             ((torch.float32, 288, 288), {}, set())]
    for (dtype, D, Dv), kwargs, want in cases:
        q, k, v = qkv(device, 2, 4, 40, 50, D, Dv, dtype=dtype)
        got = _attnx_kernels(lambda q=q, k=k, v=v, kw=kwargs: attnx.attention(q, k, v, **kw))
        if got is None:
            pytest.skip("the profiler recorded no CUDA kernel (CUPTI unavailable)")
        assert got == want, f"{dtype} D={D} Dv={Dv} {sorted(kwargs)}: ran {sorted(got)}, want {sorted(want)}"


@pytest.mark.parametrize("head_dim", [64, 288], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
def test_attention_backward_every_feature(device, dtype, head_dim):
    # The math backward on CUDA tensors (through the kernels' forward, or the composite's above head dim 256)
    # against the reference's gradients, for q, k, v, a learned float mask and sinks. Every row sees keys
    # (is_causal, which would empty some rows here, is in test_attention_gradcheck).
    gen = torch.Generator().manual_seed(8)
    B, H, Hkv, L, S = 2, 4, 2, 37, 53
    q, k, v = (t.detach().requires_grad_() for t in gqa(device, B, H, Hkv, L, S, head_dim, 40, dtype=dtype))
    mask = to_device(torch.randn(L, S, generator=gen).to(dtype), device).requires_grad_()
    sinks = make_sinks(H, dtype, device).requires_grad_()
    kpm = to_device(torch.rand(B, S, generator=gen) < 0.2, device)
    grad_out = to_device(torch.randn(B, H, L, 40, generator=gen).to(dtype), device)
    kwargs = {"key_padding_mask": kpm, "scale": 0.2, "window_left": 20, "window_right": 3,
              "key_lengths": torch.tensor([S, 45], device=device), "softcap": 5.0}
    leaves = (q, k, v, mask, sinks)
    out, _ = attnx.attention(q, k, v, attn_mask=mask, sinks=sinks, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref64 = [t.detach().double().requires_grad_() for t in leaves]
    out64, _ = reference.attention(*ref64[:3], attn_mask=ref64[3], sinks=ref64[4], **kwargs)
    want64 = torch.autograd.grad(out64, ref64, grad_out.double())
    same = [t.detach().clone().requires_grad_() for t in leaves]
    out_same, _ = reference.attention(*same[:3], attn_mask=same[3], sinks=same[4], **kwargs)
    want_same = torch.autograd.grad(out_same, same, grad_out)
    for name, g, r64, rs, leaf in zip(["q", "k", "v", "mask", "sinks"], grads, want64, want_same, leaves,
                                      strict=True):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype and g.device == leaf.device, name
        assert_grad_bounded(g, r64, rs, GRAD_ATOL[dtype], f"grad {name}")


@pytest.mark.parametrize("head_dim", [8, 264], ids=str)
def test_attention_gradcheck(device, head_dim):
    # float64 on CUDA: the SIMT kernel's forward (the composite's at 264) and the math backward, with grouped
    # heads, a learned float mask, padding, causal, a window, key lengths, soft-capping and learned sinks.
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device).requires_grad_()

    q, k, v = leaf(1, 4, 6, head_dim), leaf(1, 2, 9, head_dim), leaf(1, 2, 9, 5)
    mask, sinks = leaf(6, 9), leaf(4)
    kpm = torch.tensor([[False] * 8 + [True]], device=device)
    lengths = torch.tensor([8], device=device)

    def f(q, k, v, mask, sinks):
        return attnx.attention(q, k, v, attn_mask=mask, key_padding_mask=kpm, is_causal=True, window_left=4,
                               window_right=1, key_lengths=lengths, softcap=3.0, sinks=sinks)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, mask, sinks), atol=1e-6, rtol=1e-4,
                                    fast_mode=head_dim > 256)


# The fused backward (cuda/attention_backward_kernel.cu) runs with ATTNX_CUDA_FUSED_BACKWARD=1, read once per
# process: a fresh interpreter runs it against the CPU fused backward on the same forward, over every
# feature, the mask's gradient in several broadcast patterns, dropout, every dtype and tile size, twice (for
# determinism), and mha's training step.
_FUSED_BACKWARD_SCRIPT = """
import torch, attnx
torch.manual_seed(0)
dev = "cuda"
TOL = {torch.float64: 1e-10, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}

def case(dtype, B, H, Hkv, L, S, D, Dv, mask_shape=None, grad_mask=False, **kw):
    q = torch.randn(B, L, H, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, dtype=dtype)
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype).transpose(1, 2)
    if mask_shape is not None:
        kw["attn_mask"] = torch.randn(*mask_shape, dtype=dtype)
    if kw.get("sinks") is True:
        kw["sinks"] = torch.randn(H, dtype=dtype)
    out, lse = attnx.attention(q, k, v, **kw)
    go = torch.randn_like(out)
    want = attnx.attention_backward(go, q, k, v, out, lse, grad_attn_mask=grad_mask, **kw)
    on = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t
    args = [on(t) for t in (go, q, k, v, out, lse)]
    kwd = {n: on(a) for n, a in kw.items()}
    got = attnx.attention_backward(*args, grad_attn_mask=grad_mask, **kwd)
    again = attnx.attention_backward(*args, grad_attn_mask=grad_mask, **kwd)
    for name, g, w, g2 in zip(("q", "k", "v", "mask", "sinks"), got, want, again):
        assert torch.equal(g, g2), f"{name}: not deterministic"
        scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
        err = (g.cpu().double() - w.double()).abs().max().item() if w.numel() else 0.0
        assert err <= TOL[dtype] * scale, f"{dtype} {name}: {err} > {TOL[dtype] * scale}"

for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
    for D in (16, 64, 128, 256):
        case(dtype, 2, 4, 2, 70, 45, D, D, is_causal=True)
    case(dtype, 2, 4, 2, 37, 53, 24, 16, mask_shape=(37, 53), grad_mask=True, softcap=3.0, sinks=True,
         window_left=20, window_right=3, key_lengths=torch.tensor([53, 30]))
    case(dtype, 2, 3, 3, 40, 40, 32, 32, mask_shape=(2, 1, 40, 40), grad_mask=True,
         key_padding_mask=torch.rand(2, 40) < 0.2, dropout_p=0.2, dropout_seed=torch.tensor([3, 4]))
    case(dtype, 2, 3, 1, 40, 33, 32, 32, mask_shape=(1, 3, 1, 33), grad_mask=True)
# mha's training step through it: one mha_backward dispatch, gradients as the CPU's
m = attnx.nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.float64)
x = torch.randn(2, 50, 64, dtype=torch.float64)
grads = []
for module, inp in ((m, x), (m.to(dev), x.to(dev))):
    module.zero_grad()
    module(inp, inp, inp, need_weights=False)[0].square().sum().backward()
    grads.append([p.grad.cpu() for p in module.parameters()])
for a, b in zip(*grads):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
print("ok")
"""


def test_fused_backward_matches_the_cpu_kernel(device):
    env = {**os.environ, "ATTNX_CUDA_FUSED_BACKWARD": "1"}
    assert run_python(_FUSED_BACKWARD_SCRIPT, env=env, timeout=600).strip().endswith("ok")
