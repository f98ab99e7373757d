"""attnx on a real CUDA GPU: what only a GPU shows. The launch's stream and device, CUDA graphs, that nothing
synchronises with the host, which kernel the profiler sees launched, memory, and sizes past what the emulated
kernels can run.

Everything a backend computes (attention and its features, backward, dropout, linear, mha, the module) is
checked on the ``cuda`` device of the test matrix (the ``device`` fixture of tests/conftest.py), where the
same tests run on the emulated CUDA kernels everywhere (``cuda-emu``, ``cuda-emu-sm75``). Inputs are built on
the CPU by the same factories and moved to the GPU with their exact layout (``layouts.to_device``). Without a
GPU, or without CUDA kernels in the build, every test here shows as skipped.

On a GPU machine, `make gpu-check` (tools/gpu_check.py) runs the ``cuda`` tests and compute-sanitizer on
tools/gpu_sanitize_cases.py. Run it without CUDA_LAUNCH_BLOCKING=1: that would serialise the launches
test_attention_runs_on_the_current_stream races against (it skips then).
"""

import os

import pytest
import torch

import attnx
from attention_helpers import (
    DTYPES,
    assert_matches_reference,
    check_forward,
    make_gqa,
    make_qkv,
    make_sinks,
    run_python,
)
from layouts import to_device

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.kernel,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::_attention", "CUDA"),
                       reason="this build of attnx has no CUDA kernels"),
]


@pytest.fixture
def device():
    return "cuda"


def qkv(device, *args, **kwargs):
    return to_device(make_qkv(*args, **kwargs), device)


def gqa(device, *args, **kwargs):
    """make_gqa's query (B, H, L, D) and key/value with Hkv heads, on `device`."""
    return to_device(make_gqa(*args, **kwargs), device)


def _features(device, B, H, S, dtype):
    """Every key-range feature and both extras, as attnx.attention's keyword arguments."""
    return {"window_left": 30, "window_right": 2, "key_lengths": torch.tensor([S, S // 2][:B], device=device),
            "softcap": 4.0, "sinks": make_sinks(H, dtype, device)}


# (dtype, head dim) tried in turn for a test that needs a given kernel: the op says which kernel each takes on
# this GPU (attnx::_attention_kernel), so no test restates the choice.
CANDIDATES = [(torch.float16, 64), (torch.bfloat16, 128), (torch.float32, 64), (torch.float32, 96),
              (torch.float16, 256), (torch.float64, 64), (torch.float32, 288)]


def taking(kernel, device, B, H, Hkv, L, S, kwargs_of=lambda dtype: {}):
    """(q, k, v, kwargs): gqa inputs in (B, L, H, D) memory order with the first CANDIDATES dtype and head dim
    whose call, with ``kwargs_of(dtype)``, takes ``kernel`` ("mma", "simt" or "composite"); skips where none
    does on this GPU."""
    for dtype, D in CANDIDATES:
        q, k, v = gqa(device, B, H, Hkv, L, S, D, D, dtype=dtype, layout="blhd")
        kwargs = kwargs_of(dtype)
        if torch.ops.attnx._attention_kernel(q, k, v, **kwargs).startswith(f"cuda {kernel}"):
            return q, k, v, kwargs
    pytest.skip(f"no call here takes the {kernel} kernel on this GPU")


# ------------------------------------------------------------------------------------------------------------
# The launch: the device and stream it runs on, devices it refuses, the memory it takes, grid limits.

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


def test_attention_many_heads(device):
    # B*H = 70000 blocks of one query block each: past grid.y's 65535 (the grid is 1-D).
    check_forward(*qkv(device, 700, 100, 3, 5, 8, 8))


# Sizes past what the emulated kernels can run (each emulated block is 128 OS threads): many query blocks and
# key tiles of every kernel, whole tiles skipped by padding and windows, the composite's query chunks.

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_attention_big_window(device, dtype):
    # A sliding window over long sequences: each query block visits only the key tiles its window reaches.
    B, H, L, S = 2, 4, 1030, 1500
    q, k, v = gqa(device, B, H, 2, L, S, 128, 128, dtype=dtype, layout="blhd")
    key_lengths = torch.tensor([S, 1200], device=device)
    check_forward(q, k, v, window_left=127, window_right=0, key_lengths=key_lengths, softcap=30.0,
                  sinks=make_sinks(H, dtype, device))


def test_attention_head_dim_above_256_chunks(device):
    # Scores of (B, H, L, S) = 1 x 1 x 1200 x 70000 fp32 are 336 MB: the fallback takes two chunks of queries.
    q, k, v = (torch.randn(1, 1, n, 272, device=device) for n in (1200, 70000, 70000))
    kpm = torch.rand(1, 70000, device=device) < 0.5
    check_forward(q, k, v, key_padding_mask=kpm, is_causal=True)


# ------------------------------------------------------------------------------------------------------------
# The glue on a GPU: the stream it launches on, CUDA graphs, device synchronisation, the kernel it launches.

# ~0.1 s of spinning on a stream at H100 clocks (torch.cuda._sleep counts GPU clock cycles).
SLEEP_CYCLES = 200_000_000


@pytest.mark.parametrize("case", ["mma", "simt", "composite"])
def test_attention_runs_on_the_current_stream(device, case):
    # The inputs are written on a side stream (non-blocking: it never waits for the legacy default stream,
    # nor that stream for it) after a long spin, and the output is read there. Launched on the current stream,
    # the kernel runs after the copies; launched on any other stream, it runs at once, during the spin, on
    # the zeros the inputs held before, and the copy of the output taken on the side stream differs.
    if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        pytest.skip("CUDA_LAUNCH_BLOCKING=1 serialises every launch: no race to detect")
    mask = torch.rand(2, 256, device=device) < 0.2
    q, k, v, _ = taking(case, device, 2, 4, 2, 200, 256,
                        lambda dtype: {"key_padding_mask": mask, "is_causal": True})
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
    B, H, L, S = 2, 4, 100, 150
    masks = {"attn_mask": torch.randn(L, S, device=device),
             "key_padding_mask": torch.rand(B, S, device=device) < 0.2, "is_causal": case == "simt"}
    *inputs, kwargs = taking(case, device, B, H, 2, L, S,
                             lambda dtype: {**masks, **_features(device, B, H, S, dtype)})
    static = [t.clone() for t in inputs]
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


@pytest.mark.parametrize("case", ["mma", "simt", "composite", "mma-dropout", "simt-dropout", "module"])
def test_forward_does_not_synchronize(device, case):
    # torch raises on a synchronising call (a copy to the host, .item(), a pageable copy to the device) while
    # the sync debug mode is "error". Everything is made on the device beforehand.
    B, H, L, S = 2, 4, 60, 90
    masks = {"attn_mask": torch.randn(L, S, device=device),
             "key_padding_mask": torch.rand(B, S, device=device) < 0.2}
    # dropout: the seed is a CPU tensor the launch reads on the host.
    dropout = {"dropout_p": 0.2, "dropout_seed": torch.tensor([3, 4])} if case.endswith("dropout") else {}
    if case != "module":
        q, k, v, _ = taking(case.removesuffix("-dropout"), device, B, H, 2, L, S,
                            lambda dtype: {**masks, **_features(device, B, H, S, dtype), **dropout})
        kwargs = {**masks, **_features(device, B, H, S, q.dtype), **dropout}
    module = attnx.nn.MultiheadAttention(64, 4, batch_first=True, device=device).eval()
    x = torch.randn(B, L, 64, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            if case == "module":
                module(x, x, x, key_padding_mask=masks["key_padding_mask"][:, :L], need_weights=False)
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
    # Which kernel runs, not only that the result is right: every other test would pass if no call ever
    # reached the tensor-core kernel. The kernel the profiler sees launched is the one that
    # attnx::_attention_kernel names for the call (the composite launches neither kernel).
    launched = {"cuda mma": {"attention_forward_mma"}, "cuda simt": {"attention_forward_simt"},
                "cuda composite": set(), "torch flash": set()}
    cases = [((torch.float16, 64, 64), {}), ((torch.bfloat16, 128, 128), {"is_causal": True}),
             ((torch.float16, 128, 96), {"sinks": make_sinks(4, torch.float16, device)}),
             ((torch.float32, 64, 64), {}), ((torch.float32, 32, 24), {"is_causal": True}),
             ((torch.float16, 256, 256), {}), ((torch.float32, 96, 96), {}), ((torch.float64, 32, 32), {}),
             ((torch.float16, 64, 64), {"dropout_p": 0.2, "dropout_seed": torch.tensor([1, 2])}),
             ((torch.float32, 288, 288), {})]
    named = set()
    for (dtype, D, Dv), kwargs in cases:
        q, k, v = qkv(device, 2, 4, 40, 50, D, Dv, dtype=dtype)
        kernel = torch.ops.attnx._attention_kernel(q, k, v, **kwargs)
        kind = " ".join(kernel.split()[:2])
        named.add(kind)
        got = _attnx_kernels(lambda q=q, k=k, v=v, kw=kwargs: attnx.attention(q, k, v, **kw))
        if got is None:
            pytest.skip("the profiler recorded no CUDA kernel (CUPTI unavailable)")
        assert got == launched[kind], f"{dtype} D={D} Dv={Dv} {sorted(kwargs)}: {kernel}, ran {sorted(got)}"
    assert len(named) > 1, named  # the cases reach more than one kernel on any GPU


_TENSOR_CORES_OFF = """
import sys, torch
sys.path.insert(0, {tests!r})
from attention_helpers import check_forward, make_qkv
from layouts import to_device
assert not torch.ops.attnx._cuda_torch_flash()
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    q, k, v = to_device(make_qkv(2, 3, 53, 53, 64, 64, dtype=dtype, layout="blhd"), "cuda")
    kernel = torch.ops.attnx._attention_kernel(q, k, v, is_causal=True)
    assert kernel.startswith("cuda simt"), kernel
    check_forward(q, k, v, is_causal=True)
print("ok")
"""


def test_tensor_cores_and_torch_flash_off():
    # ATTNX_CUDA_MMA=0 and ATTNX_CUDA_TORCH_FLASH=0 (read once per process: a fresh interpreter) turn the
    # tensor-core kernel and torch's flash kernel off: the calls they would take name the SIMT kernel, and
    # run it right.
    script = _TENSOR_CORES_OFF.format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "ATTNX_CUDA_MMA": "0", "ATTNX_CUDA_TORCH_FLASH": "0"}
    assert run_python(script, env=env).strip().endswith("ok")


def test_torch_flash_runs_the_calls_it_computes_as_attnx_does(device):
    # The calls choose_kernel sends to torch's flash kernel (torch_flash_supports) give SDPA's flash results
    # bit for bit, in attention's layout, and the reference's; with the route off (attnx::_cuda_torch_flash)
    # attnx's own kernel runs them. tests/test_cuda_emulation.py checks the choice and the windows.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = [(torch.float16, 4, False, "blhd"), (torch.bfloat16, 4, True, "contiguous"),
             (torch.float16, 2, True, "blhd")]  # grouped KV heads: against the reference only
    for dtype, Hkv, causal, layout in cases:
        q, k, v = gqa(device, 2, 4, Hkv, 200, 200, 64, 64, dtype=dtype, layout=layout)
        assert torch.ops.attnx._attention_kernel(q, k, v, is_causal=causal).startswith("torch flash")
        out, lse = attnx.attention(q, k, v, is_causal=causal)
        B, H, L, Dv = out.shape
        assert out.stride() == (L * H * Dv, Dv, H * Dv, 1)
        assert_matches_reference(out, lse, q, k, v, is_causal=causal)
        if Hkv == 4:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert torch.ops.attnx._cuda_torch_flash()
        torch.ops.attnx._cuda_torch_flash(False)
        try:
            assert torch.ops.attnx._attention_kernel(q, k, v, is_causal=causal).startswith("cuda mma")
            check_forward(q, k, v, is_causal=causal)
        finally:
            torch.ops.attnx._cuda_torch_flash(True)


def test_dropout_seed_must_be_on_the_cpu(device):
    # The seed is read on the host when the kernel is launched: a device tensor would need a sync.
    q, k, v = qkv(device, 1, 2, 16, 24, 8, 8)
    with pytest.raises(RuntimeError, match="expected dropout_seed to be a CPU int64 tensor"):
        attnx.attention(q, k, v, dropout_p=0.5, dropout_seed=torch.tensor([1, 2], device=device))


def test_key_lengths_past_the_keys_are_clamped(device):
    # On a GPU the lengths are not read on the host (that would synchronise): a value past S is clamped to S.
    q, k, v = gqa(device, 2, 4, 1, 40, 90, 32, 32)
    want = attnx.attention(q, k, v, key_lengths=torch.tensor([90, 90], device=device))
    got = attnx.attention(q, k, v, key_lengths=torch.tensor([500, 90], device=device))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
