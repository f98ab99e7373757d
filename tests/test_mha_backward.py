"""attnx::mha's autograd (mha_forward + mha_backward) against autograd through its spec, reference.mha: every
differentiable argument, strided inputs, appended keys, masks, the attention weights output, gradcheck,
dispatch counts and memory; and on every device (the ``device`` fixture), through that backend's attention
backward."""

import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attnx import _fake, ops, reference
from dispatch_helpers import DispatchRecorder
from layouts import to_device
from mha_helpers import (
    MASK_CASES,
    B,
    E,
    H,
    L,
    S,
    attention_kernel_or_skip,
    batch_first_masked_args,
    inputs_and_masks,
    key_count,
    make_inputs,
    make_inputs_batch_first,
    make_masks,
    mha_args,
    transposed_args,
)

pytestmark = pytest.mark.kernel

# mha's argument positions that can require grad (masks excepted): query .. static_v.
DIFFERENTIABLE = (0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 17, 18)


def _leaves(args):
    """args with every floating tensor argument but the masks a fresh leaf requiring grad (one tensor passed
    several times stays one leaf)."""
    args, leaves = list(args), {}
    for i in DIFFERENTIABLE:
        t = args[i]
        if isinstance(t, torch.Tensor):
            if id(t) not in leaves:
                leaves[id(t)] = t.detach().clone().requires_grad_()
            args[i] = leaves[id(t)]
    return args, list(leaves.values())


def _grads(fn, args, seed=0, **kwargs):
    """The gradients of a random linear function of fn's out (and weights, when asked for) w.r.t. the
    leaves."""
    args, leaves = _leaves(args)
    out, _, weights = fn(*args, **kwargs)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)).sum()
    if weights.numel():
        w = torch.randn(weights.shape, generator=g, dtype=weights.dtype).to(weights.device)
        loss = loss + (weights.nan_to_num(0.0) * w).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _check_grads(args, **kwargs):
    got = _grads(ops.mha, args, **kwargs)
    want = _grads(reference.mha, args, **kwargs)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None or not a.any(), i
            continue
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "sliced"])
@pytest.mark.parametrize("projection", ["self", "kv_shared", "distinct", "separate"])
@pytest.mark.parametrize("extras", ["none", "bias_kv", "zero_attn", "bias_kv+zero_attn", "static_kv"])
def test_gradients_of_every_argument(projection, layout, extras):
    inputs, mask_args = inputs_and_masks(projection, layout, extras)
    for bias in (True, False):
        _check_grads(mha_args(*inputs, bias=bias, extras=extras, **mask_args))


@pytest.mark.wheel
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("masks", MASK_CASES)
def test_masks_and_weights(masks, need_weights, average):
    """Including gradients that flow back through the attention weights output."""
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", masks=masks)
    _check_grads(mha_args(*inputs, **mask_args, need_weights=need_weights, average=average))


def test_fully_masked_rows_get_no_gradient():
    query, key, value, w = make_inputs("kv_shared", "seq_first", torch.float64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # every key of batch 1
    args, leaves = _leaves(mha_args(query, key, value, w, kpm=kpm))
    out, _, _ = ops.mha(*args)
    out.sum().backward()
    query_grad, key_grad = args[0].grad, args[1].grad
    assert query_grad[:, 1].eq(0).all() and key_grad[:, 1].eq(0).all()
    assert all(leaf.grad.isfinite().all() for leaf in leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision(dtype):
    """Within a few times the error of the reference's own gradients in that dtype (both against float64)."""
    inputs, mask_args = inputs_and_masks("self", "batch_first", masks="both_float")
    args64 = mha_args(*inputs, **mask_args)
    converted = {id(a): a.to(dtype) for a in args64 if isinstance(a, torch.Tensor) and a.is_floating_point()}
    args = [converted.get(id(a), a) for a in args64]  # one tensor passed three times stays one
    want64 = _grads(reference.mha, args64)
    for got, want, ref64 in zip(_grads(ops.mha, args), _grads(reference.mha, args), want64, strict=True):
        err = (got.double() - ref64).abs().max().item()
        ref_err = (want.double() - ref64).abs().max().item()
        assert err <= 4 * ref_err + 1e-5, (err, ref_err)


@pytest.mark.parametrize("extras, masks, need_weights", [("none", "both_float", False),
                                                         ("bias_kv+zero_attn", "causal", True)])
def test_on_device(device, extras, masks, need_weights):
    """float32 gradients on the device's attention backward (Metal has no float64), within a few times the
    error of the reference's own float32 gradients (both against float64)."""
    attention_kernel_or_skip(device, torch.float32, backward=True)
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", extras, masks)
    args64 = mha_args(*inputs, extras=extras, **mask_args, need_weights=need_weights)
    converted = {id(a): a.float() for a in args64 if isinstance(a, torch.Tensor) and a.is_floating_point()}
    args = [converted.get(id(a), a) for a in args64]
    want64 = _grads(reference.mha, args64)
    moved = {}  # one tensor passed several times stays one on the device
    on_device = [moved.setdefault(id(a), to_device(a, device)) if isinstance(a, torch.Tensor) else a
                 for a in args]
    got = _grads(ops.mha, on_device)
    for i, (g, want, ref64) in enumerate(zip(got, _grads(reference.mha, args), want64, strict=True)):
        assert g.device.type == torch.device(device).type, i
        err = (g.cpu().double() - ref64).abs().max().item()
        ref_err = (want.double() - ref64).abs().max().item()
        assert err <= 4 * ref_err + 1e-5, (i, err, ref_err)


@pytest.mark.slow
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck(extras, need_weights, batch_first):
    b, n = 2, 3
    if batch_first:
        query, key, value, w = make_inputs_batch_first("distinct", "transposed", torch.float64, b, n, 4)
    else:
        query, key, value, w = make_inputs("distinct", "batch_first", torch.float64, b, n, 4)
    s = 5 if extras == "static_kv" else 4
    # Finite float masks: no row is fully masked, so every output is finite for the finite differences.
    kpm, am = (m.nan_to_num(neginf=-3.0) for m in make_masks("both_float", b, H, n, s, torch.float64)[:2])
    args, leaves = _leaves(mha_args(query, key, value, w, extras=extras, kpm=kpm, am=am,
                                    need_weights=need_weights, average=False, batch_first=batch_first))
    positions = [i for i, a in enumerate(args) if any(a is leaf for leaf in leaves)]

    def fn(*xs):
        full = list(args)
        for i, x in zip(positions, xs, strict=True):
            full[i] = x
        out, _, weights = ops.mha(*full, batch_first=batch_first)
        assert out.shape == ((b, n, E) if batch_first else (n, b, E))
        return (out, weights) if need_weights else out

    assert torch.autograd.gradcheck(fn, [args[i] for i in positions])


def test_one_layer_forward_and_backward_in_two_dispatches():
    query, key, value, w = make_inputs("self", "batch_first", torch.float32)
    args, leaves = _leaves(mha_args(query, key, value, w))
    grad = torch.randn(L, B, E)
    with DispatchRecorder() as counter:
        out, _, _ = ops.mha(*args)
        out.backward(grad)
    # Besides the two ops, autograd's AccumulateGrad detaches each leaf's new .grad: one dispatch per leaf.
    assert dict(counter.counts) == {
        "attnx::mha_forward": 1, "attnx::mha_backward": 1, "aten::detach": len(leaves)
    }
    assert all(leaf.grad is not None for leaf in leaves)


def test_no_grad_runs_mha_and_keeps_nothing():
    query, key, value, w = make_inputs("self", "batch_first", torch.float32)
    args, _ = _leaves(mha_args(query, key, value, w))
    with DispatchRecorder() as counter, torch.no_grad():
        out, _, _ = ops.mha(*args)
    assert dict(counter.counts) == {"attnx::_mha": 1} and out.grad_fn is None


def test_backward_has_no_attention_sized_memory():
    """Nothing near [B, H, L, S] is allocated in the forward or the backward (no weights asked for); the
    kernels' per-thread tile buffers are a fixed size, small against it at this length."""
    b, h, n = 2, 4, 512
    query, key, value, w = make_inputs("self", "batch_first", torch.float32, b, n, n)
    kpm, am, _ = make_masks("both_float", b, h, n, n, torch.float32)
    args, _ = _leaves(mha_args(query, key, value, w, kpm=kpm, am=am))
    attention_bytes = b * h * n * n * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
        out, _, _ = ops.mha(*args)
        out.sum().backward()
    largest = max(p.events(), key=lambda e: e.cpu_memory_usage)
    assert largest.cpu_memory_usage < attention_bytes / 4, (largest.name, largest.cpu_memory_usage)


@pytest.mark.parametrize("projection,layout", [("self", "batch_first"), ("separate", "seq_first")])
@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_fake_kernels_match(projection, layout, extras):
    inputs, mask_args = inputs_and_masks(projection, layout, extras, dtype=torch.float32)
    args = mha_args(*inputs, extras=extras, **mask_args, need_weights=True)
    real = torch.ops.attnx.mha_forward(*args)
    grad_out = torch.randn(L, B, E)
    mask = [1] * len(_fake.MHA_GRADS)
    real_grads = torch.ops.attnx.mha_backward(grad_out, None, *args, 0.0, None, *real[3:], real[1], mask)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.attnx.mha_forward(*fake_args)
        fake_grads = torch.ops.attnx.mha_backward(mode.from_tensor(grad_out), None, *fake_args, 0.0, None,
                                                  *fake[3:], fake[1], mask)
    for r, f in zip([*real, *real_grads], [*fake, *fake_grads], strict=True):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_opcheck(extras):
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", extras, dtype=torch.float32)
    args, _ = _leaves(mha_args(*inputs, extras=extras, **mask_args))
    torch.library.opcheck(torch.ops.attnx.mha.default, args)
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(torch.ops.attnx.mha_forward.default, detached)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn"])
@pytest.mark.parametrize("mask_rank", [2, 3])
def test_float_mask_gradient(mask_rank, extras, need_weights):
    # A learned bias passed as attn_mask, (L, S) or (B*H, L, S): its gradient from the fused backward, plus
    # what flows back through the weights output when it is used; appended keys' columns are not the mask's.
    query, key, value, w = make_inputs("kv_shared", "batch_first", torch.float64)
    shape = (L, S) if mask_rank == 2 else (B * H, L, S)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kpm, _, _ = make_masks("kpm_bool", B, H, L, S, torch.float64)
    got, want = [], []
    base = mha_args(query, key, value, w, kpm=kpm, am=bias, extras=extras, need_weights=need_weights,
                    average=False)
    for fn, out_list in ((ops.mha, got), (reference.mha, want)):
        leaf = bias.clone().requires_grad_()
        args, leaves = _leaves([leaf if a is bias else a for a in base])
        out, _, weights = fn(*args)
        g = torch.Generator().manual_seed(5)
        loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
        if need_weights:
            loss = loss + (weights.nan_to_num(0.0) * weights.new_ones(weights.shape).cumsum(-1)).sum()
        out_list.extend(torch.autograd.grad(loss, [leaf, *leaves]))
    assert got[0].shape == bias.shape
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m, i=i: f"gradient {i}: {m}")


def test_float_key_padding_mask_requiring_grad_is_a_clear_error():
    query, key, value, w = make_inputs("kv_shared", "seq_first", torch.float64)
    kpm, _, _ = make_masks("kpm_float", B, H, L, S, torch.float64)
    args, _ = _leaves(mha_args(query, key, value, w, kpm=kpm.nan_to_num(neginf=-3.0).requires_grad_()))
    out, _, _ = ops.mha(*args)
    with pytest.raises(RuntimeError, match="attnx.mha: no gradient for a float key_padding_mask"):
        out.sum().backward()


def test_no_python_runs_without_grad():
    # mha routes by grad mode (csrc/common/routes.cpp): without it to attnx::_mha, which has no autograd
    # kernel, so no Python runs below torch.ops (a Python autograd kernel costs ~10 us per call, grad or not).
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::_mha", "Autograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("attnx::mha_backward", "Autograd")
    query, key, value, w = make_inputs("self", "batch_first", torch.float32)
    args = mha_args(query, key, value, w)
    op = torch.ops.attnx.mha.default
    ran = []

    def profile(frame, event, arg):
        if event == "call" and not frame.f_code.co_filename.endswith(os.path.join("torch", "_ops.py")):
            ran.append(frame.f_code.co_name)

    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            sys.setprofile(profile)
            try:
                op(*args)
            finally:
                sys.setprofile(None)
    assert ran == []


def test_double_backward_is_a_clear_error():
    query, key, value, w = make_inputs("self", "seq_first", torch.float64)
    args, leaves = _leaves(mha_args(query, key, value, w))
    out, _, _ = ops.mha(*args)
    (grad,) = torch.autograd.grad(out.sum(), [args[0]], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not implemented"):
        grad.sum().backward()


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
@pytest.mark.parametrize("masks", ["none", "both_bool", "causal_float_kpm"])
def test_dropout_forward_and_gradients_match_the_reference(extras, masks):
    """The fused dropout's mask is reference.dropout_keep_mask of the seed, in the forward and in the
    backward."""
    inputs, mask_args = inputs_and_masks("kv_shared", "batch_first", extras, masks)
    seed = torch.tensor([1234, 5], dtype=torch.int64)
    args = (*mha_args(*inputs, extras=extras, **mask_args), 0.4, seed)
    out, lse, _ = ops.mha(*args)
    want_out, want_lse, _ = reference.mha(*args)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)
    assert not torch.equal(out, ops.mha(*args[:-2])[0])  # the dropout did something
    _check_grads(args)


def test_dropout_draws_a_seed_from_torch_s_generator():
    query, key, value, w = make_inputs("self", "batch_first", torch.float64)
    args = mha_args(query, key, value, w)
    torch.manual_seed(0)
    first = ops.mha(*args, dropout_p=0.3)[0]
    torch.manual_seed(0)
    assert torch.equal(ops.mha(*args, dropout_p=0.3)[0], first)
    assert not torch.equal(ops.mha(*args, dropout_p=0.3)[0], first)


def test_dropout_with_weights_is_a_clear_error():
    query, key, value, w = make_inputs("self", "batch_first", torch.float64)
    with pytest.raises(RuntimeError, match="attnx::mha: need_weights with dropout_p > 0 is not supported"):
        ops.mha(*mha_args(query, key, value, w, need_weights=True), dropout_p=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_unbatched_through_the_functional_layer(causal):
    """An unbatched (L, E) call of attnx.functional.multi_head_attention_forward (which runs attnx::mha as
    B = 1 views) with both masks, differentiated in its input and every parameter."""
    from attnx import functional

    n, s = 3, 4
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5).requires_grad_()

    query, key = randn(n, E), randn(s, E)
    params = [randn(3 * E, E), randn(3 * E), randn(E, E), randn(E)]
    # Float like am: mixed mask types would draw torch's deprecation warning.
    kpm = torch.tensor([0.0, 0.0, float("-inf"), 0.0], dtype=torch.float64)
    am = torch.randn(n, s, generator=g, dtype=torch.float64)
    if causal:
        am = am.masked_fill(torch.ones(n, s, dtype=torch.bool).triu(1), float("-inf"))

    def fn(query, key, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias):
        out, _ = functional.multi_head_attention_forward(
            query, key, key, E, H, in_proj_weight, in_proj_bias, None, None, False, 0.0, out_proj_weight,
            out_proj_bias, training=True, key_padding_mask=kpm, need_weights=False, attn_mask=am,
        )
        assert out.shape == (n, E)
        return out

    assert torch.autograd.gradcheck(fn, [query, key, *params])


# ------------------------------------------------------------------------------------------------------------
# batch_first: (B, L, E) arguments, gradients in their shape, no transposes on either side of the op


@pytest.mark.parametrize("batch", [B, 1])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "expanded", "size1_huge_stride",
                                    "last_dim_strided"])
@pytest.mark.parametrize("projection", ["self", "kv_shared", "distinct", "separate"])
def test_batch_first_gradients(projection, layout, batch):
    """Against autograd through reference.mha(batch_first=True) in float64, and bitwise the gradients of the
    sequence-first call on the transposed views."""
    query, key, value, w = make_inputs_batch_first(projection, layout, torch.float64, batch)
    cases = [("none", "both_bool", False), ("bias_kv+zero_attn", "causal_float_kpm", True),
             ("static_kv", "am3_float", False)]
    for extras, masks, need_weights in cases:
        kpm, am, is_causal = make_masks(masks, batch, H, L, key_count(projection, extras), torch.float64)
        args = mha_args(query, key, value, w, extras=extras, kpm=kpm, am=am, is_causal=is_causal,
                        need_weights=need_weights, batch_first=True)
        _check_grads(args, batch_first=True)
        got = _grads(ops.mha, args, batch_first=True)
        for i, (a, b) in enumerate(zip(got, _grads(_mha_on_transposed_views, args), strict=True)):
            assert a.shape == b.shape and torch.equal(a, b), i


def _mha_on_transposed_views(*args):
    """What a batch_first module ran before the op took batch_first: the sequence-first op on (L, B, E) views,
    its out transposed back."""
    out, lse, weights = ops.mha(*transposed_args(args))
    return out.transpose(0, 1), lse, weights


@pytest.mark.parametrize("projection", ["self", "separate"])
@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_batch_first_fake_kernels_match(projection, extras):
    for batch, length in [(B, L), (1, L), (B, 1)]:
        query, key, value, w = make_inputs_batch_first(projection, "contiguous", torch.float32, batch, length)
        kpm, am, _ = make_masks("both_bool", batch, H, length, key_count(projection, extras, length),
                                torch.float32)
        args = mha_args(query, key, value, w, extras=extras, kpm=kpm, am=am, need_weights=True,
                        batch_first=True)
        tail = (0.0, None, True)  # dropout_p, dropout_seed, batch_first
        real = torch.ops.attnx.mha_forward(*args, *tail)
        grad_out = torch.randn(batch, length, E)
        mask = [1] * len(_fake.MHA_GRADS)
        real_grads = torch.ops.attnx.mha_backward(grad_out, None, *args, 0.0, None, *real[3:], real[1], mask,
                                                  True)
        inputs = args[:1] if projection == "self" else args[:3]  # one tensor as all three: one gradient
        assert [g.shape for g in real_grads[: len(inputs)]] == [t.shape for t in inputs]
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = torch.ops.attnx.mha_forward(*fake_args, *tail)
            fake_grads = torch.ops.attnx.mha_backward(mode.from_tensor(grad_out), None, *fake_args, 0.0, None,
                                                      *fake[3:], fake[1], mask, True)
        for i, (r, f) in enumerate(zip([*real, *real_grads], [*fake, *fake_grads], strict=True)):
            assert r.shape == f.shape and r.dtype == f.dtype, i
            assert _significant_strides(r) == _significant_strides(f), i


def _significant_strides(t):
    """The strides of t's dims of size > 1: those that locate elements. At B=1 or L=1 the views of
    mha_forward's q, k, v (unflatten of a size-1 dim) get a size-1 stride in eager that torch's own meta
    functions compute differently; like opcheck's fake-tensor check, compare the strides that matter."""
    return tuple(st for size, st in zip(t.shape, t.stride(), strict=True) if size > 1)


@pytest.mark.parametrize("extras", ["none", "bias_kv+zero_attn", "static_kv"])
def test_batch_first_opcheck(extras):
    args, _ = _leaves(batch_first_masked_args(extras))
    torch.library.opcheck(torch.ops.attnx.mha.default, (*args, 0.0, None, True))
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(torch.ops.attnx.mha_forward.default, (*detached, 0.0, None, True))


def test_batch_first_forward_and_backward_in_two_dispatches():
    """No transposes around the op: the two ops and autograd's one detach per leaf, and the input's gradient
    in the input's (B, L, E) layout (so AccumulateGrad keeps it as it is, without a copy)."""
    query, key, value, w = make_inputs_batch_first("self", "contiguous", torch.float32)
    args, leaves = _leaves(mha_args(query, key, value, w, batch_first=True))
    grad = torch.randn(B, L, E)
    with DispatchRecorder() as counter:
        out, _, _ = ops.mha(*args, batch_first=True)
        out.backward(grad)
    assert dict(counter.counts) == {
        "attnx::mha_forward": 1, "attnx::mha_backward": 1, "aten::detach": len(leaves)
    }
    assert args[0].grad.shape == (B, L, E) and args[0].grad.stride() == args[0].stride()
