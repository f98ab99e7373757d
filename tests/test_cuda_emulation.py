"""What only the CUDA emulation can check: the kernels' launch plans and the launchers' refusals, and data
races under ThreadSanitizer.

The kernels are csrc/cuda/*.cu compiled by g++ against tests/emulation/cuda_shim.h (one std::thread per CUDA
thread, __syncthreads as a barrier, warp shuffles through exchange slots). Their values, on every feature, are
checked through attnx's own ops on the ``cuda-emu`` and ``cuda-emu-sm75`` devices of the test matrix
(tests/emulation/backends.py, the ``device`` fixture); here, C++ programs drive the launchers directly: with
parameters the glue never sends (tests/emulation/launch_check.cpp), and under ThreadSanitizer
(tests/emulation/race_check.cpp).
"""

import os
import subprocess

import pytest
import torch

import attnx
from emulation import emulator

pytestmark = pytest.mark.kernel


def _run(exe, timeout, env=None):
    return subprocess.run([exe], capture_output=True, text=True, timeout=timeout, env=env)


def test_launch_plans_and_refusals():
    """launch_check.cpp: shared memory within the 163 KiB an sm80 block may opt into for every dtype and
    head-dim bucket of both kernels; B * H past grid.y's 65535 on a 1-D grid; the launchers refuse
    (cudaErrorInvalidValue) kv_heads that do not divide heads, key_lengths or sinks without a pointer, windows
    below -1, and head dims above 256 (the glue runs the composite there, which the matrix tests on
    cuda-emu)."""
    try:
        exe = emulator.check_program(os.path.join(emulator.HERE, "launch_check.cpp"))
    except emulator.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    result = _run(exe, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout + result.stderr[-4000:])


# Both kernels and the backward under ThreadSanitizer. The emulated barriers and warp exchanges are atomics
# TSan follows, so a shared-memory access that no __syncthreads/__syncwarp orders is reported whatever the
# interleaving.


@pytest.mark.slow
def test_no_data_races_under_thread_sanitizer():
    if not emulator.has_thread_sanitizer():
        pytest.skip("the C++ compiler cannot build -fsanitize=thread programs (no libtsan)")
    try:
        exe = emulator.build(extra_flags=["-fsanitize=thread", "-g1"], sources=emulator.RACE_CHECK_SOURCES,
                             shared=False)
    except emulator.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    # Without a preloaded AddressSanitizer runtime (`make sanitize` preloads one), which TSan cannot share a
    # process with.
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    result = _run(exe, timeout=900, env=env)
    if "FATAL: ThreadSanitizer" in result.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in result.stderr, result.stderr[-8000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


# torch's flash kernel (choose_kernel's kTorchFlash) on the emulated sm_90 device: which calls it takes, and
# its stand-in (cuda/attention.cpp: attnx's tensor-core kernel given FlashAttention-2's arguments and writing
# its results) checked against the reference, so that the window each call is given and the adoption or copy
# of the results are tested here; tests/test_cuda.py calls the real one on a GPU.


@pytest.fixture
def flash_emulation():
    from emulation import backends

    try:
        backends.load("cuda-emu-flash")
    except backends.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    with backends.enabled("cuda-emu-flash"):
        yield


def _flash_qkv(dtype, B=2, H=4, Hkv=4, L=40, S=40, D=64, Dv=None, layout="contiguous", seed=0):
    from attention_helpers import make_in_layout

    gen = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    return (make_in_layout((B, H, L, D), layout, dtype, gen, which="q"),
            make_in_layout((B, Hkv, S, D), layout, dtype, gen, which="k"),
            make_in_layout((B, Hkv, S, Dv), layout, dtype, gen, which="v"))


# (dtype, shape, layout, options): calls torch's flash kernel computes as attnx does.
FLASH_CASES = [
    (torch.float16, {}, "contiguous", {}),
    (torch.bfloat16, {}, "blhd", {"is_causal": True}),
    (torch.float16, {"L": 56, "S": 24}, "blhd", {"is_causal": True}),  # top-left: right edge at L - S
    (torch.float16, {"L": 24, "S": 56}, "contiguous", {"window_left": 8, "window_right": 0}),
    (torch.float16, {"L": 48, "S": 32}, "packed", {"is_causal": True, "window_left": 5, "window_right": 30}),
    (torch.bfloat16, {"H": 8, "Hkv": 2, "D": 128}, "blhd", {"scale": 0.3}),
    (torch.float16, {"L": 1, "S": 70, "H": 6, "Hkv": 3, "D": 256}, "contiguous", {}),  # decoding
]


@pytest.mark.parametrize("dtype,shape,layout,options", FLASH_CASES)
def test_torch_flash_takes_calls_it_computes_as_attnx_does(flash_emulation, dtype, shape, layout, options):
    from attention_helpers import assert_matches_reference

    q, k, v = _flash_qkv(dtype, layout=layout, **shape)
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    assert torch.ops.attnx._attention_kernel(q, k, v, **options) == f"torch flash {name}"
    out, lse = attnx.attention(q, k, v, **options)
    assert_matches_reference(out, lse, q, k, v, **options)
    # attention's layout either way: adopted where FlashAttention-2 wrote it so, copied otherwise.
    B, H, L, Dv = out.shape
    assert out.stride() == (L * H * Dv, Dv, H * Dv, 1) and lse.is_contiguous()


# Calls it does not take, each for one reason (torch_flash_supports), with what takes them instead.
def _misaligned(dtype):
    q, k, v = _flash_qkv(dtype)
    buffer = torch.randn(q.numel() + 4).to(dtype)
    return buffer[4:].view(q.shape), k, v  # an 8-byte offset: FlashAttention-2 reads rows as 16-byte vectors


NOT_FLASH_CASES = {
    "float32": (lambda: _flash_qkv(torch.float32), {}),
    "head dim 36": (lambda: _flash_qkv(torch.float16, D=36), {}),
    "D != Dv": (lambda: _flash_qkv(torch.float16, D=64, Dv=32), {}),
    "causal with L < S": (lambda: _flash_qkv(torch.float16, L=24, S=40), {"is_causal": True}),
    "key padding mask": (lambda: _flash_qkv(torch.float16), {"key_padding_mask": torch.rand(2, 40) < 0.2}),
    "attn_mask": (lambda: _flash_qkv(torch.float16), {"attn_mask": torch.rand(40, 40) < 0.2}),
    "key lengths": (lambda: _flash_qkv(torch.float16), {"key_lengths": torch.tensor([40, 30])}),
    "soft-cap": (lambda: _flash_qkv(torch.float16), {"softcap": 20.0}),
    "sinks": (lambda: _flash_qkv(torch.float16), {"sinks": torch.zeros(4)}),
    "dropout": (lambda: _flash_qkv(torch.float16), {"dropout_p": 0.1, "dropout_seed": torch.tensor([1, 2])}),
    "negative scale": (lambda: _flash_qkv(torch.float16), {"scale": -0.125}),
    "misaligned rows": (lambda: _misaligned(torch.float16), {}),
    "no batch": (lambda: _flash_qkv(torch.float16, B=0), {}),  # nothing to compute, nothing to refuse
}


@pytest.mark.parametrize("case", NOT_FLASH_CASES)
def test_torch_flash_leaves_other_calls_to_attnx(flash_emulation, case):
    make, options = NOT_FLASH_CASES[case]
    q, k, v = make()
    assert not torch.ops.attnx._attention_kernel(q, k, v, **options).startswith("torch flash")


@pytest.mark.parametrize("capability,kernel", [(90, "cuda mma fp32 bucket 128"),
                                               (80, "cuda simt fp32 bucket 128"),
                                               (89, "cuda simt fp32 bucket 128")])
def test_the_kernel_choice_fits_the_device_shared_memory(capability, kernel):
    # float32 at bucket 128 stages Q beside two K and V stages: 165 KiB a block, which sm_90 has (227 KiB)
    # and sm_80 (163 KiB) and sm_89 (99 KiB) do not; the others run it on the SIMT kernel. Bucket 64 fits all.
    from attention_helpers import make_qkv
    from emulation import backends

    try:
        backends.load("cuda-emu")
    except backends.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    q, k, v = make_qkv(1, 2, 20, 30, 128, 128)
    with backends.enabled("cuda-emu", capability=capability):
        assert torch.ops.attnx._attention_kernel(q, k, v) == kernel
        assert torch.ops.attnx._attention_kernel(q[..., :64], k[..., :64], v[..., :64]).startswith("cuda mma")


@pytest.mark.parametrize("capability,kernel", [(90, "cuda fused mma fp16 bucket 128"),
                                               (89, "cuda fused mma fp16 bucket 128"),
                                               (75, "cuda fused simt fp16 bucket 128")])
def test_the_backward_choice_fits_the_device(capability, kernel):
    # The tensor-core backward's largest block (bucket 128, attn_mask's gradient asked for) takes 77 KiB,
    # within the 99 KiB of sm_86/89/120; sm_75 has no tensor cores attnx uses and runs the SIMT backward.
    from attention_helpers import make_qkv
    from emulation import backends

    try:
        backends.load("cuda-emu")
    except backends.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    q, k, v = make_qkv(1, 2, 20, 30, 128, 128, dtype=torch.float16)
    with backends.enabled("cuda-emu", capability=capability):
        assert torch.ops.attnx._attention_kernel(q, k, v, backward=True) == kernel


# float32's tensor-core backward (3xTF32) is its plain instantiation up to bucket 64: calls with a mask, a
# soft-cap or dropout, or larger head dims, take the SIMT backward (mma_backward_supports).
@pytest.mark.parametrize("D,options,kernel", [
    (64, {}, "cuda fused mma fp32 bucket 64"),
    (24, {"is_causal": True}, "cuda fused mma fp32 bucket 32"),
    (128, {}, "cuda fused simt fp32 bucket 128"),
    (64, {"attn_mask": torch.ones(20, 30, dtype=torch.bool)}, "cuda fused simt fp32 bucket 64"),
    (64, {"softcap": 30.0}, "cuda fused simt fp32 bucket 64"),
    (64, {"dropout_p": 0.1, "dropout_seed": torch.tensor([1, 2])}, "cuda fused simt fp32 bucket 64"),
])
def test_the_float32_backward_on_tensor_cores_is_the_unmasked_one(D, options, kernel):
    from attention_helpers import make_qkv

    backends = _emulated_cuda()
    q, k, v = make_qkv(1, 2, 20, 30, D, D)
    with backends.enabled("cuda-emu"):
        assert torch.ops.attnx._attention_kernel(q, k, v, backward=True, **options) == kernel


# The tensor-core forward's tile-shape family (cuda/attention_plan.h, MmaShape): the unmasked instantiation in
# every shape the emulation builds (all of them, as the run-time compiled library does), chosen by the shape
# asked for (attnx::_cuda_mma_shape; here the emulated device's), checked against the reference. L and S
# leave partial tiles at both ends, S spans more tiles than the deepest pipeline holds, and the heads are
# grouped, the keys' lengths and the window cut rows short, so that every path of the loop runs.
SHAPES = [f"{rows}x{keys} w{warps} s{stages}" for rows in (16, 32) for keys in (64, 128) for warps in (4, 8)
          for stages in (2, 3)]
DEFAULT_SHAPES = {(torch.float16, 32): "32x64 w4 s2", (torch.float16, 64): "32x64 w4 s2",
                  (torch.float16, 128): "16x64 w4 s2", (torch.float32, 64): "16x64 w4 s2"}


def _family_cases():
    # every shape at fp16 bucket 64 where it has it; then another dtype and bucket: 32 rows a warp or 128 keys
    # a tile (16-bit types up to bucket 64 only) at bf16 bucket 32, 16 x 64 at bf16 bucket 128 and float32
    for shape in SHAPES:
        if shape.startswith("32x128"):
            continue  # spills: not in the family (test_shapes_outside_the_family_run_the_default)
        yield shape, torch.float16, 64
        if shape.startswith("32x") or "x128 " in shape:
            yield shape, torch.bfloat16, 32
        else:
            yield shape, torch.bfloat16, 128
            yield shape, torch.float32, 64


def _emulated_cuda():
    from emulation import backends

    try:
        backends.load("cuda-emu")
    except backends.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    return backends


@pytest.mark.parametrize("shape,dtype,bucket", list(_family_cases()))
def test_every_tile_shape_of_the_unmasked_forward(shape, dtype, bucket):
    from attention_helpers import assert_matches_reference, make_gqa

    backends = _emulated_cuda()
    D = {32: 24, 64: 64, 128: 72}[bucket]
    q, k, v = make_gqa(2, 4, 2, 37, 299, D, D, dtype=dtype, layout="blhd")
    cases = [{}, {"is_causal": True, "key_lengths": torch.tensor([299, 150])},
             {"window_left": 100, "window_right": 20, "sinks": torch.linspace(-1.0, 1.0, 4)}]
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    expected = f"cuda mma {name} bucket {bucket}"
    if shape != DEFAULT_SHAPES.get((torch.float16 if dtype == torch.bfloat16 else dtype, bucket)):
        expected += f" {shape}"
    with backends.enabled("cuda-emu", mma_shape=shape):
        for options in cases:
            assert torch.ops.attnx._attention_kernel(q, k, v, **options) == expected
            out, lse = attnx.attention(q, k, v, **options)
            assert_matches_reference(out, lse, q, k, v, **options)
        # a masked call takes the default shape: its tile classes are 16 x 64 (the name has no shape)
        mask = torch.rand(37, 299, generator=torch.Generator().manual_seed(0)) < 0.3
        masked = torch.ops.attnx._attention_kernel(q, k, v, attn_mask=mask)
        assert masked == f"cuda mma {name} bucket {bucket} bits"


def test_the_instantiation_follows_the_masks_and_the_soft_cap():
    """plan_attention_mma's instantiations: plain without masks or soft-cap, bits for bool masks, general for
    a float one, capped for every soft-capped call whatever its masks (no other loop applies or tests the
    cap); each matches the reference."""
    from attention_helpers import assert_matches_reference, make_qkv

    backends = _emulated_cuda()
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(2, 2, 40, 150, 64, 64, dtype=torch.float16)
    bool_mask = torch.rand(40, 150, generator=gen) < 0.3
    float_mask = torch.randn(40, 150, generator=gen).half()
    kpm = torch.rand(2, 150, generator=gen) < 0.2
    cases = [({}, ""), ({"attn_mask": bool_mask, "key_padding_mask": kpm}, " bits"),
             ({"attn_mask": float_mask}, " general"), ({"softcap": 2.0, "scale": 1.0}, " capped"),
             ({"softcap": 2.0, "scale": 1.0, "attn_mask": bool_mask, "key_padding_mask": kpm}, " capped"),
             ({"softcap": 5.0, "attn_mask": float_mask, "is_causal": True}, " capped")]
    with backends.enabled("cuda-emu"):
        for options, suffix in cases:
            assert torch.ops.attnx._attention_kernel(q, k, v, **options) == f"cuda mma fp16 bucket 64{suffix}"
            out, lse = attnx.attention(q, k, v, **options)
            assert_matches_reference(out, lse, q, k, v, **options)


def test_the_tile_shape_is_one_of_the_family():
    backends = _emulated_cuda()
    with pytest.raises(RuntimeError, match='no tile shape "32x64 w2 s2"'):
        with backends.enabled("cuda-emu", mma_shape="32x64 w2 s2"):
            pass


@pytest.mark.parametrize("shape,dtype,D,capability", [
    ("32x128 w4 s2", torch.float16, 64, 90),   # two row groups of 128-key tiles: not in the family (spills)
    ("16x128 w8 s3", torch.float16, 128, 90),  # 128-key tiles above bucket 64: likewise
    ("32x64 w8 s2", torch.float32, 64, 90),    # two row groups: 16-bit types only
    ("16x64 w4 s3", torch.float32, 128, 90),   # 231 KiB of shared memory: more than any device has
    ("16x64 w4 s3", torch.float16, 128, 86),   # 102 KiB: more than sm_86's 99 KiB
])
def test_shapes_outside_the_family_run_the_default(shape, dtype, D, capability):
    from attention_helpers import make_qkv

    backends = _emulated_cuda()
    q, k, v = make_qkv(1, 2, 20, 30, D, D, dtype=dtype)
    name = {torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    with backends.enabled("cuda-emu", capability=capability, mma_shape=shape):
        assert torch.ops.attnx._attention_kernel(q, k, v) == f"cuda mma {name} bucket {D}"
