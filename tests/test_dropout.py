"""Fused dropout in attnx.attention and its backward, on every device that has it (conftest.py's ``device``).

The RNG is checked on its own first: reference.philox4x32_10 against Random123's known-answer vectors, and
reference.dropout_keep_mask against the element -> (counter, word) mapping that csrc/include/attnx/philox.h
documents. With the mask pinned down, each device's kernels are compared exactly (float64) against the
reference run with the same dropout_seed, forward and backward, over layouts, masks, causality, blocks and
tiles: the mask of element (b, h, l, s) is a pure function of the seed, so the CPU kernel, the CUDA SIMT
kernel and the fused backward draw the same one. The statistical tests then read the mask back out of the
kernel (uniform probabilities times an identity value matrix make out the mask itself) and check its keep rate
and the expectation of out over many seeds.

Where a backend has no dropout (Metal; CUDA above head dim 256) the call is refused, and its tests skip
(attention_helpers.kernel_or_skip). The CPU kernel's own tiles and thread plans, allocations, fakes, compile
and the op's argument checks are tested on the CPU alone (the end of the file).
"""

import math
import re

import pytest
import torch

import attnx
from attention_helpers import (
    CPU_VARIANTS,
    DTYPES,
    assert_matches_reference,
    check_backward,
    check_forward,
    kernel_or_skip,
    make_gqa,
    make_leaves,
    make_qkv,
    make_sinks,
    run_under_cpu_capability,
    seed_of,
    views,
)
from attnx import reference
from layouts import to_device

pytestmark = pytest.mark.kernel


def on(device, x):
    """layouts.to_device, skipping where the device cannot hold a float64 tensor (MPS)."""
    tensors = x if isinstance(x, (tuple, list)) else [x]
    if device == "mps" and any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tensors):
        pytest.skip("MPS tensors cannot be float64")
    return to_device(x, device)


def to_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def check(q, k, v, **kwargs):
    """attnx.attention on the inputs' device against the reference on CPU copies (check_forward's bound);
    returns (out, lse) on the CPU."""
    out, lse = attnx.attention(q, k, v, **kwargs)
    return assert_matches_reference(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(),
                                    **{n: to_cpu(a) for n, a in kwargs.items()})


def backward_kernel_or_skip(device, q, k, v, **kwargs):
    """kernel_or_skip for the backward of the call, also skipping where the device refuses its forward (the
    gradient needs one)."""
    try:
        torch.ops.attnx._attention_kernel(q, k, v, **kwargs)
    except RuntimeError as e:
        pytest.skip(f"{device.backend} does not take the forward: {str(e).splitlines()[0]}")
    return kernel_or_skip(device, q, k, v, backward=True, **kwargs)


def grad_out_for(leaves, layout):
    """check_backward's upstream gradient, on the leaves' device."""
    q, _, v = views(leaves, layout)
    B, H, L, _ = q.shape
    gen = torch.Generator().manual_seed(7)
    return torch.randn(B, H, L, v.shape[3], generator=gen).to(q.dtype).to(q.device)


# ------------------------------------------------------------------------------------------------------------
# The RNG.

# Random123's known-answer vectors for Philox4x32-10 (kat_vectors): counter, key, output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    words = reference.philox4x32_10([torch.tensor(c) for c in counter], key)
    assert tuple(int(w) for w in words) == expected


def test_philox_is_vectorised_over_counters():
    # A batch of counters gives what each counter gives alone.
    xs = torch.tensor([0, 1, 0xFFFFFFFF, 12345])
    batch = reference.philox4x32_10((xs, xs * 3 & 0xFFFFFFFF, torch.tensor(7), torch.tensor(0)), (11, 13))
    for i, x in enumerate(xs.tolist()):
        alone = reference.philox4x32_10(
            (torch.tensor(x), torch.tensor(x * 3 & 0xFFFFFFFF), torch.tensor(7), torch.tensor(0)), (11, 13)
        )
        assert [int(w[i]) for w in batch] == [int(w) for w in alone]


@pytest.mark.parametrize("seed,offset", [(0, 0), (123456789123, 5), (-1, 2**40 + 3), (-(2**63), 2**63 - 1)])
def test_keep_mask_element_mapping(seed, offset):
    """Element (b, h, l, s) is word e % 4 of the block at counter (e // 4, offset), key seed (philox.h)."""
    B, H, L, S, p = 2, 3, 5, 7, 0.4
    mask = reference.dropout_keep_mask(seed_of(seed, offset), B, H, L, S, p)
    assert mask.shape == (B, H, L, S) and mask.dtype == torch.bool
    seed_u, offset_u = seed & (2**64 - 1), offset & (2**64 - 1)
    threshold = int((1 - p) * 2**32)
    for b, h, i, j in [(0, 0, 0, 0), (0, 0, 0, 3), (0, 0, 1, 0), (1, 2, 4, 6), (1, 0, 3, 5), (0, 1, 2, 2)]:
        e = ((b * H + h) * L + i) * S + j
        g = e // 4
        counter = [torch.tensor(x) for x in (g % 2**32, g >> 32, offset_u % 2**32, offset_u >> 32)]
        words = reference.philox4x32_10(counter, (seed_u % 2**32, seed_u >> 32))
        assert bool(mask[b, h, i, j]) == (int(words[e % 4]) < threshold)


def test_keep_mask_depends_on_seed_and_offset():
    seeds = [seed_of(1, 0), seed_of(2, 0), seed_of(1, 1)]
    masks = [reference.dropout_keep_mask(s, 1, 2, 16, 16, 0.5) for s in seeds]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    assert torch.equal(masks[0], reference.dropout_keep_mask(seed_of(1, 0), 1, 2, 16, 16, 0.5))


# ------------------------------------------------------------------------------------------------------------
# The forward against the reference with the same seed.

LAYOUTS = ["contiguous", "blhd", "packed", "expanded_kv", "strided_last"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_reference(device, dtype, layout):
    # Two query blocks and two key tiles of the SIMT kernel, both partial; causal on the sequence-first one.
    q, k, v = on(device, make_qkv(2, 2, 20, 37, 24, 20, dtype=dtype, layout=layout))
    kwargs = {"is_causal": layout == "blhd", "dropout_p": 0.3, "dropout_seed": seed_of(17, 3)}
    kernel_or_skip(device, q, k, v, **kwargs)
    check(q, k, v, **kwargs)


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.5, 0.9, 0.999])
def test_forward_probabilities(device, p):
    q, k, v = on(device, make_qkv(2, 2, 19, 41, 16, 16, dtype=torch.float64))
    kernel_or_skip(device, q, k, v, dropout_p=p, dropout_seed=seed_of(5))
    check(q, k, v, dropout_p=p, dropout_seed=seed_of(5))


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_blocks_and_tiles(device, is_causal):
    # Four query blocks (the causal ordering reverses them) and three key tiles of the SIMT kernel.
    q, k, v = on(device, make_qkv(1, 1, 50, 70, 16, 16, dtype=torch.float64))
    kernel_or_skip(device, q, k, v, is_causal=is_causal, dropout_p=0.2, dropout_seed=seed_of(5))
    check(q, k, v, is_causal=is_causal, dropout_p=0.2, dropout_seed=seed_of(5))


def test_forward_masks(device):
    gen = torch.Generator().manual_seed(3)
    B, H, L, S = 2, 3, 19, 41
    q, k, v = on(device, make_qkv(B, H, L, S, 16, 16, dtype=torch.float64, layout="blhd"))
    mask = torch.randn(B * H, L + 5, S, generator=gen, dtype=torch.float64)[:, 5:]
    mask[:, 2] = float("-inf")  # fully masked rows: out 0, lse +inf, whatever is dropped
    mask, kpm = on(device, (mask, torch.rand(B, S, generator=gen) < 0.3))
    kernel_or_skip(device, q, k, v, attn_mask=mask, dropout_p=0.4, dropout_seed=seed_of(8))
    for kwargs in ({"attn_mask": mask, "dropout_seed": seed_of(8)},
                   {"key_padding_mask": kpm, "is_causal": True, "dropout_seed": seed_of(-3, 2**33)},
                   {"attn_mask": mask, "key_padding_mask": kpm, "is_causal": True,
                    "dropout_seed": seed_of(8)}):
        out, lse = check(q, k, v, dropout_p=0.4, **kwargs)
        if "attn_mask" in kwargs:
            assert (out[:, :, 2] == 0).all() and torch.isposinf(lse[:, :, 2]).all()


@pytest.mark.parametrize("p", [0.1, 0.6, 1.0])
def test_same_mask_on_every_device(device, p):
    # The mask is the reference's to float64 rounding, on every device; a GPU's result is also the CPU
    # kernel's.
    q, k, v = make_qkv(2, 3, 21, 45, 16, 16, dtype=torch.float64, layout="blhd")
    kwargs = {"is_causal": True, "dropout_p": p, "dropout_seed": seed_of(2024, 1)}
    dq, dk, dv = on(device, (q, k, v))
    kernel_or_skip(device, dq, dk, dv, **kwargs)
    out, lse = attnx.attention(dq, dk, dv, **kwargs)
    ref_out, ref_lse = reference.attention(q, k, v, **kwargs)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=0, atol=1e-12)
    if torch.device(device).type != "cpu":
        cpu_out, cpu_lse = attnx.attention(q, k, v, **kwargs)
        torch.testing.assert_close(out.cpu(), cpu_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse.cpu(), cpu_lse, rtol=0, atol=1e-12)


def test_lse_is_undropped(device):
    # Bit for bit, given the same kernel instantiation: a zero mask keeps the call without dropout off the
    # CUDA tensor-core kernel's plain instantiation (the scale folded into the exponent: another rounding).
    q, k, v = on(device, make_qkv(2, 2, 9, 13, 8, 8))
    zero = torch.zeros(9, 13, device=q.device, dtype=q.dtype)
    kernel_or_skip(device, q, k, v, attn_mask=zero, dropout_p=0.5, dropout_seed=seed_of(1))
    _, lse = attnx.attention(q, k, v, attn_mask=zero)
    _, lse_dropped = attnx.attention(q, k, v, attn_mask=zero, dropout_p=0.5, dropout_seed=seed_of(1))
    assert torch.equal(lse, lse_dropped)


def test_p_zero_ignores_the_seed(device):
    q, k, v = on(device, make_qkv(2, 2, 9, 13, 8, 8))
    kernel_or_skip(device, q, k, v, dropout_p=0.0, dropout_seed=seed_of(1))
    out, lse = attnx.attention(q, k, v)
    out0, lse0 = attnx.attention(q, k, v, dropout_p=0.0, dropout_seed=seed_of(1))
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_p_one_drops_everything(device):
    # As F.dropout(p=1): every probability is dropped, out is 0; lse is the undropped one.
    q, k, v = on(device, make_qkv(2, 2, 9, 13, 8, 8, dtype=torch.float64))
    kernel_or_skip(device, q, k, v, dropout_p=1.0, dropout_seed=seed_of(1))
    out, lse = attnx.attention(q, k, v, dropout_p=1.0, dropout_seed=seed_of(1))
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, attnx.attention(q, k, v)[1])


def test_p_one_has_zero_gradients(device):
    leaves = on(device, make_leaves(2, 2, 9, 13, 8, 8, dtype=torch.float64))
    backward_kernel_or_skip(device, *leaves, dropout_p=1.0, dropout_seed=seed_of(1))
    leaves = [t.requires_grad_() for t in leaves]
    out, _ = attnx.attention(*leaves, dropout_p=1.0)
    out.backward(torch.randn_like(out))
    for leaf in leaves:
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.wheel
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_features_with_dropout(device, dtype):
    # Grouped heads, a window, key lengths, soft-capping and sinks: the mask is drawn by (b, h, l, s) of the
    # query head, the reference's.
    q, k, v = on(device, make_gqa(2, 4, 2, 20, 45, 16, 16, dtype=dtype))
    kwargs = {"window_left": 6, "window_right": 0, "key_lengths": on(device, torch.tensor([45, 30])),
              "softcap": 3.0, "sinks": on(device, make_sinks(4, dtype)), "dropout_p": 0.3,
              "dropout_seed": seed_of(11, 5)}
    kernel_or_skip(device, q, k, v, **kwargs)
    check(q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Statistics: the mask read back from the kernel.


def _kernel_mask(device, B, H, L, S, p, dropout_seed, dtype=torch.float64):
    """The kernel's keep mask (B, H, L, S) on the CPU: zero queries make every probability 1/S, and value =
    I (S, S) makes out[b, h, l, s] = keep / (S (1 - p))."""
    q, k = torch.zeros(B, H, L, 4, dtype=dtype), torch.randn(B, H, S, 4).to(dtype)
    q, k, v = on(device, (q, k, torch.eye(S, dtype=dtype).expand(B, H, S, S)))
    kernel_or_skip(device, q, k, v, dropout_p=p, dropout_seed=dropout_seed)
    out = attnx.attention(q, k, v, dropout_p=p, dropout_seed=dropout_seed)[0].cpu().double()
    kept = out != 0
    # 16-bit kernels round the kept probability 1 / (1 - p) to the input type before P V.
    rtol = {torch.float64: 1e-12, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (S * (1 - p))), rtol=rtol, atol=0)
    return kept


# float64 takes the CUDA SIMT kernel, the 16-bit types its tensor-core kernel (S = 96: bucket 128; S = 45:
# bucket 64, and pairs of adjacent keys that straddle two Philox blocks).
@pytest.mark.parametrize("S", [96, 45])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(device, p, dtype, S):
    B, H, L = 2, 2, 48
    kept = _kernel_mask(device, B, H, L, S, p, seed_of(2024, 7), dtype)
    assert torch.equal(kept, reference.dropout_keep_mask(seed_of(2024, 7), B, H, L, S, p))
    n = kept.numel()
    rate, sigma = 1 - p, math.sqrt(p * (1 - p) / n)
    assert abs(kept.double().mean().item() - rate) < 6 * sigma
    # No visible structure: the rate holds per row, per key and per head too (each with its own bound).
    for dims in ((0, 1, 2), (0, 1, 3), (0, 2, 3)):
        m = kept.double().mean(dims)
        per = n // m.numel()
        assert (m - rate).abs().max().item() < 6 * math.sqrt(p * (1 - p) / per)


# ------------------------------------------------------------------------------------------------------------
# Seeding: torch.manual_seed makes runs reproducible; different seeds differ. The seed is drawn on the host
# from the CPU generator whatever the device.


def test_deterministic_under_manual_seed(device):
    q, k, v = on(device, make_qkv(2, 2, 16, 24, 8, 8))
    kernel_or_skip(device, q, k, v, dropout_p=0.5, dropout_seed=seed_of(1))
    torch.manual_seed(123)
    a, _ = attnx.attention(q, k, v, dropout_p=0.5)
    b, _ = attnx.attention(q, k, v, dropout_p=0.5)  # the generator moved on: another mask
    torch.manual_seed(123)
    a2, _ = attnx.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, a2) and not torch.equal(a, b)
    # The seed drawn is the generator's: the same as an explicit draw after the same manual_seed.
    torch.manual_seed(123)
    explicit, _ = attnx.attention(q, k, v, dropout_p=0.5, dropout_seed=attnx.ops.draw_dropout_seed(q.device))
    assert torch.equal(a, explicit)


def test_different_seeds_differ(device):
    q, k, v = on(device, make_qkv(1, 2, 16, 24, 8, 8))
    kernel_or_skip(device, q, k, v, dropout_p=0.2, dropout_seed=seed_of(1))
    outs = [attnx.attention(q, k, v, dropout_p=0.2, dropout_seed=s)[0]
            for s in (seed_of(1), seed_of(2), seed_of(1, 1))]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_dropout_seed_on_the_device_is_an_error(device):
    # The seed is read on the host, so that a launch needs no device sync: it must be a CPU tensor.
    if torch.device(device).type == "cpu":
        pytest.skip("the device's tensors are CPU tensors")
    q, k, v = on(device, make_qkv(1, 2, 16, 24, 8, 8))
    kernel_or_skip(device, q, k, v, dropout_p=0.5, dropout_seed=seed_of(1))
    with pytest.raises(RuntimeError, match="expected dropout_seed to be a CPU int64 tensor"):
        attnx.attention(q, k, v, dropout_p=0.5, dropout_seed=seed_of(1).to(device))


def test_refused_where_a_backend_has_no_dropout(device):
    # Metal has no dropout; CUDA's composite above head dim 256 has none either. Refused, never ignored.
    q, k, v = on(device, make_qkv(1, 1, 3, 5, 264, 8))
    if device.cuda_like:
        message = "expected head dims up to 256 on CUDA with dropout_p > 0"
    elif device.backend in ("mps", "metal-emu"):
        message = "dropout is not implemented on MPS"
        q, k, v = on(device, make_qkv(1, 1, 3, 5, 8, 8))
    else:
        pytest.skip(f"{device.backend} has dropout at every head dim")
    with pytest.raises(RuntimeError, match=message):
        attnx.attention(q, k, v, dropout_p=0.5)


# ------------------------------------------------------------------------------------------------------------
# The backward: gradients of the forward's mask.

BACKWARD_LAYOUTS = ["contiguous", "blhd", "sliced", "expanded_kv", "strided_last"]


@pytest.mark.parametrize("layout", BACKWARD_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_matches_reference(device, dtype, layout):
    leaves = on(device, make_leaves(2, 2, 20, 37, 24, 20, dtype=dtype, layout=layout))
    kwargs = {"dropout_p": 0.3, "dropout_seed": seed_of(17, 3)}
    backward_kernel_or_skip(device, *views(leaves, layout), **kwargs)
    check_backward(leaves, layout, grad_out=grad_out_for(leaves, layout), **kwargs)


def test_backward_masks(device):
    gen = torch.Generator().manual_seed(3)
    B, H, L, S = 2, 3, 19, 41
    mask = torch.randn(B * H, L, S, generator=gen, dtype=torch.float64)
    mask[:, 2] = float("-inf")
    kpm = torch.rand(B, S, generator=gen) < 0.3
    leaves = on(device, make_leaves(B, H, L, S, 16, 16, dtype=torch.float64, layout="blhd"))
    mask, kpm = on(device, (mask, kpm))
    backward_kernel_or_skip(device, *views(leaves, "blhd"), attn_mask=mask, dropout_p=0.4,
                            dropout_seed=seed_of(8))
    for kwargs in ({"attn_mask": mask}, {"key_padding_mask": kpm, "is_causal": True},
                   {"attn_mask": mask[:1].expand(B * H, L, S), "key_padding_mask": kpm}):
        check_backward(leaves, "blhd", grad_out=grad_out_for(leaves, "blhd"), dropout_p=0.4,
                       dropout_seed=seed_of(8), **kwargs)


def test_backward_uses_the_forwards_drawn_seed(device):
    # attnx.attention draws the seed itself; autograd hands it to the backward, which regenerates the mask.
    leaves = make_leaves(2, 2, 20, 30, 8, 8, dtype=torch.float64)
    device_leaves = on(device, leaves)
    backward_kernel_or_skip(device, *device_leaves, dropout_p=0.5, dropout_seed=seed_of(1))
    device_leaves = [t.requires_grad_() for t in device_leaves]
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    grad_out = torch.randn(2, 2, 20, 8, dtype=torch.float64)
    torch.manual_seed(77)
    out, _ = attnx.attention(*device_leaves, dropout_p=0.5)
    grads = torch.autograd.grad(out, device_leaves, grad_out.to(out.device))
    torch.manual_seed(77)
    dropout_seed = attnx.ops.draw_dropout_seed(torch.device("cpu"))
    ref_out, _ = reference.attention(*leaves, dropout_p=0.5, dropout_seed=dropout_seed)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad_out)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.cpu(), r, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------------------
# The CPU kernel's own tiles (128 query rows and 512 keys forward, 128 x 128 backward) and thread plans, and
# statistics over hundreds of calls: shapes and call counts beyond what the emulators afford.


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 300, 600, 32, 32), (2, 1, 520, 1030, 16, 24)], ids=str)
def test_forward_cpu_tile_boundaries(shape, is_causal):
    q, k, v = make_qkv(*shape, dtype=torch.float64, layout="blhd")
    check_forward(q, k, v, is_causal=is_causal, dropout_p=0.25, dropout_seed=seed_of(99, 1))


def test_forward_single_thread_plan():
    # One thread plans larger query blocks: the mask of each element must not move.
    q, k, v = make_qkv(1, 2, 700, 600, 16, 16, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = attnx.attention(q, k, v, is_causal=True, dropout_p=0.3, dropout_seed=seed_of(4))
    finally:
        torch.set_num_threads(threads)
    many, _ = attnx.attention(q, k, v, is_causal=True, dropout_p=0.3, dropout_seed=seed_of(4))
    torch.testing.assert_close(one, many, rtol=0, atol=1e-12)
    check_forward(q, k, v, is_causal=True, dropout_p=0.3, dropout_seed=seed_of(4))


@pytest.mark.parametrize("threads", [1, None])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_cpu_tile_boundaries(is_causal, threads):
    # 130 x 300: partial 128-wide tiles both ways; with several threads the keys of a head split in chunks.
    saved = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        check_backward(make_leaves(1, 2, 130, 300, 16, 16, dtype=torch.float64, layout="blhd"), "blhd",
                       is_causal=is_causal, dropout_p=0.2, dropout_seed=seed_of(3, 9))
    finally:
        torch.set_num_threads(saved)


def test_expectation_over_seeds():
    # E[out] over the mask is the undropped out: each element's mean over n seeds stays within 6 sigma,
    # sigma^2 = p / (1 - p) * sum_s P_ls^2 V_sd^2 / n.
    B, H, L, S, D, p, n = 1, 2, 6, 40, 8, 0.3, 400
    q, k, v = make_qkv(B, H, L, S, D, D, dtype=torch.float64)
    exact, lse = attnx.attention(q, k, v)
    mean = sum(attnx.attention(q, k, v, dropout_p=p, dropout_seed=seed_of(i, i))[0] for i in range(n)) / n
    probs = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(D) - lse.unsqueeze(-1))
    sigma = torch.sqrt(p / (1 - p) * (probs**2) @ (v**2) / n)
    assert ((mean - exact).abs() <= 6 * sigma + 1e-12).all()


# ------------------------------------------------------------------------------------------------------------
# The seed drawn on the host, gradcheck, the mask never stored: the autograd function's, not a kernel's.


def test_draw_dropout_seed():
    torch.manual_seed(0)
    s = attnx.ops.draw_dropout_seed(torch.device("cpu"))
    assert s.dtype == torch.int64 and s.shape == (2,) and s.device.type == "cpu"
    torch.manual_seed(0)
    assert torch.equal(s, attnx.ops.draw_dropout_seed(torch.device("cpu")))
    assert not torch.equal(s, attnx.ops.draw_dropout_seed(torch.device("cpu")))


def test_draw_dropout_seed_is_the_cpu_generators_whatever_the_device():
    # Drawn on the host from the CPU generator for every device (no accelerator touched, so no device sync):
    # after the same torch.manual_seed, a CPU, CUDA or MPS call gets the same seed, hence the same mask.
    torch.manual_seed(0)
    expected = torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64)
    for device in (torch.device("cpu"), torch.device("cuda"), "mps", torch.device("meta"), None):
        torch.manual_seed(0)
        with torch.device("meta"):  # nor the default device
            seed = attnx.ops.draw_dropout_seed(device)
        assert seed.device.type == "cpu" and torch.equal(seed, expected), device


def test_no_seed_drawn_without_dropout():
    torch.manual_seed(5)
    q, k, v = make_qkv(1, 1, 4, 4, 4, 4)
    attnx.attention(q, k, v)
    attnx.attention(q, k, v, dropout_p=0.0)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("case", ["plain", "causal_masks", "strided"])
def test_gradcheck(case):
    # Given its seed, the function is deterministic: finite differences see the same mask every time.
    gen = torch.Generator().manual_seed(4)
    B, H, L, S, D = 2, 2, 5, 7, 4
    layout = "blhd" if case == "strided" else "contiguous"
    kwargs = {"dropout_p": 0.35, "dropout_seed": seed_of(11, 2)}
    if case == "causal_masks":
        kwargs.update(is_causal=True, attn_mask=torch.randn(L, S, generator=gen, dtype=torch.float64),
                      key_padding_mask=torch.rand(B, S, generator=gen) < 0.2)
    leaves = [t.requires_grad_() for t in make_leaves(B, H, L, S, D, 3, dtype=torch.float64, layout=layout)]
    assert torch.autograd.gradcheck(lambda *ls: attnx.attention(*views(ls, layout), **kwargs)[0], leaves)


def test_saves_no_attention_sized_tensor():
    B, H, L, S, D = 2, 2, 64, 96, 8
    q, k, v = (t.requires_grad_() for t in make_leaves(B, H, L, S, D, D))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attnx.attention(q, k, v, dropout_p=0.3)
    # The inputs, out, lse and the (seed, offset) pair: no mask.
    assert {tuple(t.shape) for t in saved} == {(B, H, L, D), (B, H, S, D), (B, H, L), (2,)}


def test_no_attention_sized_allocation():
    B, H, L, S, D = 2, 4, 512, 512, 16
    # Even a bool mask of (B, H, L, S) would show; per-thread buffers are O(L).
    attention_bytes = B * H * L * S
    q, k, v = (t.requires_grad_() for t in make_leaves(B, H, L, S, D, D, layout="blhd"))
    dropout_seed = seed_of(1)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        out, _ = attnx.attention(*views((q, k, v), "blhd"), is_causal=True, dropout_p=0.3,
                                 dropout_seed=dropout_seed)
        out.backward(torch.randn_like(out))
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < attention_bytes / 2, largest
    # The control: the reference materialises the mask.
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        reference.attention(*views((q, k, v), "blhd"), dropout_p=0.3, dropout_seed=dropout_seed)
    assert max(e.cpu_memory_usage for e in prof.events()) >= attention_bytes


# ------------------------------------------------------------------------------------------------------------
# Fakes, opcheck, torch.compile.


# attention and attention_backward with dropout: opcheck in test_attention_backward.py (its _opcheck_cases).


def test_fake_matches_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_qkv(2, 3, 5, 7, 8, 4, layout="blhd")
    real = attnx.attention(q, k, v, dropout_p=0.3, dropout_seed=seed_of(1))
    with FakeTensorMode() as mode:
        fake = attnx.attention(*(mode.from_tensor(t) for t in (q, k, v)), dropout_p=0.3,
                               dropout_seed=mode.from_tensor(seed_of(1)))
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.slow
def test_compile_fullgraph():
    q, k, v = (t.requires_grad_() for t in make_leaves(2, 2, 5, 7, 8, 8))

    def loss(q, k, v, dropout_seed):
        out, _ = attnx.attention(q, k, v, is_causal=True, dropout_p=0.4, dropout_seed=dropout_seed)
        return out.square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    for s in (seed_of(1), seed_of(2)):  # a new seed value is a new input, not a recompile
        got = torch.autograd.grad(compiled(q, k, v, s), (q, k, v))
        expected = torch.autograd.grad(loss(q, k, v, s), (q, k, v))
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)


def test_compile_draws_the_seed_in_graph():
    q, k, v = make_qkv(2, 2, 5, 7, 8, 8)
    fn = torch.compile(lambda q, k, v: attnx.attention(q, k, v, dropout_p=0.5)[0], fullgraph=True)
    torch.manual_seed(3)
    a = fn(q, k, v)
    torch.manual_seed(3)
    assert torch.equal(a, fn(q, k, v))


# ------------------------------------------------------------------------------------------------------------
# Errors, from the kernel and from the fake kernel alike.


def _bad_cases():
    q, k, v = make_qkv(1, 2, 4, 5, 8, 8)
    return {
        "p negative": ((q, k, v, None, None, False, None, -0.1, seed_of(1)),
                       "attnx::attention: expected dropout_p in [0, 1], got -0.1"),
        "p above one": ((q, k, v, None, None, False, None, 1.5, seed_of(1)),
                        "attnx::attention: expected dropout_p in [0, 1], got 1.5"),
        "p nan": ((q, k, v, None, None, False, None, float("nan"), seed_of(1)),
                  "attnx::attention: expected dropout_p in [0, 1], got nan"),
        "no seed": ((q, k, v, None, None, False, None, 0.5, None),
                    "attnx::attention: expected dropout_seed, a CPU int64 tensor (seed, offset) of shape "
                    "(2,), when dropout_p > 0"),
        "seed dtype": ((q, k, v, None, None, False, None, 0.5, seed_of(1).int()),
                       "attnx::attention: expected dropout_seed to be a CPU int64 tensor (seed, offset) of "
                       "shape (2,), got a cpu Int tensor of shape [2]"),
        "seed shape": ((q, k, v, None, None, False, None, 0.5, torch.tensor([1, 2, 3])),
                       "attnx::attention: expected dropout_seed to be a CPU int64 tensor (seed, offset) of "
                       "shape (2,), got a cpu Long tensor of shape [3]"),
    }


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs(case, fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, message = _bad_cases()[case]
    q, k, v, *rest = args
    grad_out, out, lse = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4)
    backward_args = (grad_out, q, k, v, out, lse, *rest)
    for op, op_args in ((torch.ops.attnx.attention.default, args),
                        (torch.ops.attnx.attention_backward.default, backward_args)):
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True):
                with pytest.raises(RuntimeError, match=re.escape(message)):
                    op(*op_args)
        else:
            with pytest.raises(RuntimeError, match=re.escape(message)):
                op(*op_args)


# ------------------------------------------------------------------------------------------------------------
# Every ISA variant of the CPU kernels draws the same mask.

_ISA_SCRIPT = """
    from attention_helpers import check_backward, check_forward, make_leaves, make_qkv, seed_of
    for dtype in (torch.float32, torch.float64):
        check_forward(*make_qkv(2, 3, 150, 140, 24, 20, dtype=dtype, layout="strided_last"), is_causal=True,
                      dropout_p=0.3, dropout_seed=seed_of(6))
        leaves = make_leaves(2, 3, 150, 140, 24, 20, dtype=dtype, layout="strided_last")
        check_backward(leaves, "strided_last", is_causal=True, dropout_p=0.3, dropout_seed=seed_of(6))
    """


@pytest.mark.slow
@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_isa_variants(variant):
    run_under_cpu_capability(_ISA_SCRIPT, variant)
