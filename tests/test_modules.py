"""attnx.nn.MultiheadAttention against torch.nn.MultiheadAttention: outputs, weights, state, errors; and on
every device (the ``device`` fixture), where its forward runs that backend's kernels."""

import itertools
import warnings

import pytest
import torch

import attnx
from attnx import ops
from dispatch_helpers import DispatchRecorder
from mha_helpers import (
    MASK_CASES,
    assert_close,
    attention_kernel_or_skip,
    make_masks,
    same_error,
    torch_fastpath,
    warning_messages,
)

E, H = 8, 2
EXTRAS = {  # module options beyond the projection layout
    "plain": {},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv_zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
}
WEIGHTS = [(False, True), (True, True), (True, False)]  # (need_weights, average_attn_weights)


def module_pair(dtype, **kwargs):
    reference = torch.nn.MultiheadAttention(E, H, dtype=dtype, **kwargs)
    module = attnx.nn.MultiheadAttention(E, H, dtype=dtype, **kwargs)
    module.load_state_dict(reference.state_dict())
    return reference, module


def inputs(attn, batch, batch_first, dtype):
    """query/key/value for an attention kind ("self": one tensor; "cross": key is value; "kv_dims": distinct
    key and value with kdim=5, vdim=3), batch None (unbatched) or B, in the module's layout."""
    L, S = (5, 5) if attn == "self" else (4, 6)
    kdim, vdim = (5, 3) if attn == "kv_dims" else (E, E)

    def make(n, d):
        if batch is None:
            return torch.randn(n, d, dtype=dtype)
        return torch.randn(batch, n, d, dtype=dtype) if batch_first else torch.randn(n, batch, d, dtype=dtype)

    query = make(L, E)
    if attn == "self":
        return query, query, query, L, S
    key = make(S, kdim)
    value = key if attn == "cross" else make(S, vdim)
    return query, key, value, L, S


pytestmark = pytest.mark.kernel


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "batch, batch_first",
    [(None, False), (1, False), (1, True), (3, False), (3, True)],
    ids=["unbatched", "B1", "B1-batch_first", "B3", "B3-batch_first"],
)
@pytest.mark.parametrize("attn", ["self", "cross", "kv_dims"])
def test_matches_torch_slow_path(dtype, batch, batch_first, attn):
    """The grid: every module option x every mask form, in eval, need_weights/average_attn_weights cycling so
    that each of its three settings meets every mask form and every option within one test."""
    kdims = {"kdim": 5, "vdim": 3} if attn == "kv_dims" else {}
    weights = itertools.cycle(WEIGHTS)
    with torch_fastpath(False):
        for bias, extra in itertools.product([True, False], EXTRAS):
            reference, module = module_pair(
                dtype, bias=bias, batch_first=batch_first, **kdims, **EXTRAS[extra]
            )
            reference.eval(), module.eval()
            query, key, value, L, S = inputs(attn, batch, batch_first, dtype)
            # weights is an endless cycle: strict=False lets zip stop at the end of MASK_CASES.
            for case, (need_weights, average) in zip(MASK_CASES, weights, strict=False):
                kpm, am, is_causal = make_masks(case, batch or 1, H, L, S, dtype, batched=batch is not None)
                kwargs = dict(key_padding_mask=kpm, attn_mask=am, is_causal=is_causal,
                              need_weights=need_weights, average_attn_weights=average)
                expected = reference(query, key, value, **kwargs)
                actual = module(query, key, value, **kwargs)
                msg = f"bias={bias} {extra} {case} need_weights={need_weights} average={average}"
                assert_close(actual[0], expected[0], dtype, msg)
                assert_close(actual[1], expected[1], dtype, msg)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["none", "kpm_bool", "both_float", "causal", "causal_float_kpm"])
def test_train_mode_without_dropout(dtype, case):
    for batch_first, extra in itertools.product([False, True], EXTRAS):
        reference, module = module_pair(dtype, batch_first=batch_first, **EXTRAS[extra])
        query, key, value, L, S = inputs("cross", 2, batch_first, dtype)
        kpm, am, is_causal = make_masks(case, 2, H, L, S, dtype)
        for need_weights in (False, True):
            kwargs = dict(key_padding_mask=kpm, attn_mask=am, is_causal=is_causal, need_weights=need_weights)
            expected, actual = reference(query, key, value, **kwargs), module(query, key, value, **kwargs)
            assert_close(actual[0], expected[0], dtype, f"{batch_first} {extra}")
            assert_close(actual[1], expected[1], dtype, f"{batch_first} {extra}")


@pytest.mark.wheel
@pytest.mark.parametrize("case", ["none", "kpm_bool", "am2_bool", "am3_bool", "both_bool"])
def test_matches_torch_fast_path(case):
    """Where torch takes its eval fast path (batch_first self-attention, no grad), the outputs agree too;
    inputs keep every row attendable (the fast path's fully masked rows are its own business)."""
    reference, module = module_pair(torch.float64, batch_first=True)
    reference.eval(), module.eval()
    x = torch.randn(3, 6, E, dtype=torch.float64)
    kpm, am, _ = make_masks(case, 3, H, 6, 6, torch.float64)
    kpm = None if kpm is None else kpm.index_fill(-1, torch.tensor([0]), False)
    am = None if am is None else am.index_fill(-1, torch.tensor([0]), False)
    with torch.no_grad():
        for need_weights in (False, True):
            expected = reference(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
            actual = module(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
            assert_close(actual[0], expected[0], torch.float32)
            if need_weights:
                assert_close(actual[1], expected[1], torch.float32)


@pytest.mark.parametrize("batch_first", [False, True])
def test_fully_masked_rows(batch_first):
    """Torch's slow path: need_weights=False gives attention 0 (out = out_proj.bias) for a row whose keys
    are all masked; need_weights=True gives NaN weights and NaN output there. attnx does the same, eval and
    train."""
    reference, module = module_pair(torch.float64, batch_first=batch_first)
    torch.nn.init.normal_(module.out_proj.bias)
    reference.load_state_dict(module.state_dict())
    query, key, value, L, S = inputs("cross", 3, batch_first, torch.float64)
    kpm = torch.zeros(3, S, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key padded
    am = torch.zeros(L, S, dtype=torch.bool)
    am[2] = True  # query 2: every key masked
    for train, need_weights, masks in itertools.product(
        [False, True],
        [False, True],
        [{"key_padding_mask": kpm}, {"attn_mask": am}, {"key_padding_mask": kpm, "attn_mask": am}],
    ):
        reference.train(train), module.train(train)
        expected = reference(query, key, value, need_weights=need_weights, **masks)
        actual = module(query, key, value, need_weights=need_weights, **masks)
        assert_close(actual[0], expected[0], torch.float64, f"train={train} {need_weights} {list(masks)}")
        assert_close(actual[1], expected[1], torch.float64)
        if "key_padding_mask" in masks:
            rows = actual[0][1] if batch_first else actual[0][:, 1]
            if need_weights:
                assert rows.isnan().all() and actual[1][1].isnan().all()
            else:
                torch.testing.assert_close(rows, module.out_proj.bias.expand_as(rows).detach())


def test_is_causal_hint_applies_the_same_mask_as_torch():
    """is_causal with a NON-causal attn_mask shows which mask torch really applies: the causal one if there is
    no key_padding_mask and need_weights=False, attn_mask otherwise. attnx applies the same in each case."""
    reference, module = module_pair(torch.float64)
    query, key, value, L, S = inputs("cross", 2, False, torch.float64)
    not_causal = torch.zeros(L, S, dtype=torch.bool)
    not_causal[:, 0] = True
    for kpm, need_weights in itertools.product([None, torch.zeros(2, S, dtype=torch.bool)], [False, True]):
        kwargs = dict(attn_mask=not_causal, is_causal=True, key_padding_mask=kpm, need_weights=need_weights)
        expected, actual = reference(query, key, value, **kwargs), module(query, key, value, **kwargs)
        assert_close(
            actual[0], expected[0], torch.float64, f"kpm={kpm is not None} need_weights={need_weights}"
        )
        assert_close(actual[1], expected[1], torch.float64)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_shape", ["2d", "3d"])
def test_learned_attn_mask_gets_torch_s_gradient(mask_shape, need_weights):
    """A float attn_mask that requires grad (a learned position bias) gets the gradient torch's module gives
    it, from attnx's fused backward."""
    reference, module = module_pair(torch.float64, add_bias_kv=True, batch_first=True)
    query, key, value, L, S = inputs("cross", 3, True, torch.float64)
    shape = (L, S) if mask_shape == "2d" else (3 * H, L, S)
    bias = torch.randn(shape, dtype=torch.float64)
    grads = []
    for m in (reference, module):
        am = bias.clone().requires_grad_()
        out, weights = m(query, key, value, attn_mask=am, need_weights=need_weights)
        loss = out.square().sum() + (weights.square().sum() if need_weights else 0)
        loss.backward()
        grads.append(am.grad)
    assert_close(grads[1], grads[0], torch.float64)


@pytest.mark.wheel
@pytest.mark.parametrize("batch_first", [False, True])
def test_gradients_match_torch(batch_first):
    """The drop-in is differentiable like torch's: same gradients for inputs and every parameter."""
    reference, module = module_pair(torch.float64, add_bias_kv=True, batch_first=batch_first)
    query, key, value, L, S = inputs("cross", 3, batch_first, torch.float64)
    kpm, am, _ = make_masks("both_float", 3, H, L, S, torch.float64)
    kpm[:, 0] = 0.0  # keep every row attendable: a NaN row would make every gradient NaN
    grads = []
    for m in (reference, module):
        x = query.clone().requires_grad_()
        out, weights = m(x, key, value, key_padding_mask=kpm, attn_mask=am)
        (out.square().sum() + weights.sum()).backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    for actual, expected in zip(*reversed(grads), strict=True):
        assert_close(actual, expected, torch.float64)


def test_batch_first_passes_inputs_to_the_op_as_they_are(monkeypatch):
    """batch_first inputs reach the op as the caller's (B, L, E) tensors themselves, `is` kept, with
    batch_first=True: no transposed views in between."""
    seen = []
    real_mha = ops.mha

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real_mha(*args, **kwargs)

    monkeypatch.setattr(ops, "mha", spy)
    module = attnx.nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(1, 5, E)  # B = 1
    kv = torch.randn(1, 7, E)
    module(x, x, x)
    module(x, kv, kv, need_weights=False)
    ((q, k, v, *_), kwargs), ((q2, k2, v2, *_), kwargs2) = seen
    assert q is k is v is x and kwargs["batch_first"]
    assert q2 is x and k2 is v2 is kv and kwargs2["batch_first"]
    out, _ = module(x, kv, kv, need_weights=False)
    assert out.shape == (1, 5, E)
    unbatched = attnx.nn.MultiheadAttention(E, H, batch_first=True)(x[0], kv[0], kv[0])[0]
    assert unbatched.shape == (5, E) and not seen[-1][1]["batch_first"]  # batch_first is for 3-D inputs


def _training_step_dispatches(module, x, grad_out):
    """The dispatches of one training step (forward + backward) after zero_grad(set_to_none=True)."""
    def step():
        module(x, x, x, need_weights=False)[0].backward(grad_out)

    step()  # warm-up: lazy initialisation stays out of the count
    module.zero_grad(set_to_none=True)
    x.grad = None
    with DispatchRecorder() as recorder:
        step()
    return dict(recorder.counts)


def test_training_step_dispatches():
    """Two attnx ops and autograd's one detach per leaf that receives a gradient, nothing else: a
    batch_first module whose input requires grad takes 2 + 5 (x, in_proj_weight, in_proj_bias,
    out_proj.weight, out_proj.bias) = 7; a sequence-first one fed an input without grad 2 + 4 = 6."""
    module = attnx.nn.MultiheadAttention(E, H, batch_first=True).train()
    x = torch.randn(3, 5, E, requires_grad=True)
    counts = _training_step_dispatches(module, x, torch.randn(3, 5, E))
    leaves = 1 + len(list(module.parameters()))
    assert leaves == 5
    assert counts == {"attnx::mha_forward": 1, "attnx::mha_backward": 1, "aten::detach": leaves}
    assert x.grad.stride() == x.stride()  # in x's own layout: AccumulateGrad keeps it without a copy

    module = attnx.nn.MultiheadAttention(E, H).train()
    x = torch.randn(5, 3, E)
    counts = _training_step_dispatches(module, x, torch.randn(5, 3, E))
    assert counts == {"attnx::mha_forward": 1, "attnx::mha_backward": 1, "aten::detach": 4}


def test_dropout_in_training():
    """Dropout acts on the attention probabilities as torch's: with need_weights (the composition with
    torch's F.dropout) one seed gives torch's outputs and weights, the dropped-out ones; without, the fused
    op draws its own mask (tested against the reference in test_mha_backward) and is unbiased; eval ignores
    dropout."""
    for dtype, batch_first in itertools.product([torch.float32, torch.float64], [False, True]):
        need_weights = True
        reference, module = module_pair(dtype, dropout=0.5, batch_first=batch_first)
        query, key, value, L, S = inputs("cross", 2, batch_first, dtype)
        kpm, am, _ = make_masks("both_bool", 2, H, L, S, dtype)
        kwargs = dict(
            key_padding_mask=kpm, attn_mask=am, need_weights=need_weights, average_attn_weights=False
        )
        torch.manual_seed(7)
        expected = reference(query, key, value, **kwargs)
        torch.manual_seed(7)
        actual = module(query, key, value, **kwargs)
        assert_close(actual[0], expected[0], dtype)
        assert_close(actual[1], expected[1], dtype)

    _, module = module_pair(torch.float64, dropout=0.5)
    _, plain = module_pair(torch.float64)
    plain.load_state_dict(module.state_dict())
    query, key, value, L, S = inputs("cross", 4, False, torch.float64)
    eval_out = module.eval()(query, key, value, average_attn_weights=False)
    plain_out = plain.eval()(query, key, value, average_attn_weights=False)
    assert_close(eval_out[0], plain_out[0], torch.float64)
    assert_close(eval_out[1], plain_out[1], torch.float64)

    module.train()
    probs = plain_out[1]
    dropped = module(query, key, value, average_attn_weights=False)[1]
    assert dropped.shape == probs.shape == (4, H, L, S)
    kept = dropped != 0
    assert 0.35 < kept.double().mean() < 0.65  # p = 0.5 over 192 probabilities
    torch.testing.assert_close(dropped[kept], 2 * probs[kept])  # survivors scaled by 1 / (1 - p)
    mean = torch.stack([module(query, key, value, need_weights=False)[0] for _ in range(100)]).mean(0)
    assert (mean - plain_out[0]).abs().max() < 0.3  # dropout is unbiased: E[out] = out without dropout


def test_state_dict_round_trips_both_ways():
    for kwargs in [{}, {"kdim": 5, "vdim": 3}, {"bias": False, "add_bias_kv": True}, {"add_zero_attn": True}]:
        torch.manual_seed(1)
        reference = torch.nn.MultiheadAttention(E, H, **kwargs)
        torch.manual_seed(1)
        module = attnx.nn.MultiheadAttention(E, H, **kwargs)
        # Same names, same registration order, same initialisation (same RNG draws).
        assert [n for n, _ in module.named_parameters()] == [n for n, _ in reference.named_parameters()]
        assert list(module.state_dict()) == list(reference.state_dict())
        for (name, p), (_, q) in zip(
            module.state_dict().items(), reference.state_dict().items(), strict=True
        ):
            assert torch.equal(p, q), name
        assert type(module.out_proj) is type(reference.out_proj)
        other = torch.nn.MultiheadAttention(E, H, **kwargs)
        other.load_state_dict(module.state_dict(), strict=True)
        mine = attnx.nn.MultiheadAttention(E, H, **kwargs)
        mine.load_state_dict(reference.state_dict(), strict=True)
        for a, b in zip(mine.state_dict().values(), reference.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert isinstance(module, torch.nn.MultiheadAttention)


# ------------------------------------------------------------------------------------------------------------
# Bad input: torch's exception types and messages


def _both(kwargs=None, **forward):
    kwargs = kwargs or {}
    torch.manual_seed(0)
    reference, module = module_pair(torch.float32, **kwargs)
    return (lambda: reference(**forward)), (lambda: module(**forward))


q3, k3 = torch.randn(4, 2, E), torch.randn(6, 2, E)
q2, k2 = torch.randn(4, E), torch.randn(6, E)
BAD_INPUTS = {
    "query_4d": dict(query=q3[None], key=k3[None], value=k3[None]),
    "query_1d": dict(query=q2[0], key=k2[0], value=k2[0]),
    "batched_query_2d_key": dict(query=q3, key=k2, value=k2),
    "unbatched_query_3d_key": dict(query=q2, key=k3, value=k3),
    "batched_kpm_3d": dict(
        query=q3, key=k3, value=k3, key_padding_mask=torch.zeros(2, 6, 1, dtype=torch.bool)
    ),
    "unbatched_kpm_2d": dict(
        query=q2, key=k2, value=k2, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool)
    ),
    "batched_am_4d": dict(query=q3, key=k3, value=k3, attn_mask=torch.zeros(1, 4, 4, 6, dtype=torch.bool)),
    "unbatched_am_4d": dict(query=q2, key=k2, value=k2, attn_mask=torch.zeros(1, 2, 4, 6)),
    "unbatched_am_3d_shape": dict(query=q2, key=k2, value=k2, attn_mask=torch.zeros(3, 4, 6)),
    "am_2d_shape": dict(query=q3, key=k3, value=k3, attn_mask=torch.zeros(4, 5, dtype=torch.bool)),
    "am_3d_shape": dict(query=q3, key=k3, value=k3, attn_mask=torch.zeros(2, 4, 6)),
    "kpm_batch": dict(query=q3, key=k3, value=k3, key_padding_mask=torch.zeros(3, 6, dtype=torch.bool)),
    "kpm_keys": dict(query=q3, key=k3, value=k3, key_padding_mask=torch.zeros(2, 5)),
    "kpm_uint8": dict(query=q3, key=k3, value=k3, key_padding_mask=torch.zeros(2, 6, dtype=torch.uint8)),
    "kpm_int64": dict(query=q3, key=k3, value=k3, key_padding_mask=torch.zeros(2, 6, dtype=torch.int64)),
    "am_uint8": dict(query=q3, key=k3, value=k3, attn_mask=torch.zeros(4, 6, dtype=torch.uint8)),
    "am_int64_causal": dict(
        query=q3,
        key=k3,
        value=k3,
        attn_mask=torch.zeros(4, 6, dtype=torch.int64),
        is_causal=True,
        need_weights=False,
    ),
    "is_causal_without_mask": dict(query=q3, key=k3, value=k3, is_causal=True),
    "key_value_shapes": dict(query=q3, key=k3, value=torch.randn(5, 2, E)),
    "embed_dim": dict(query=torch.randn(4, 2, 6), key=torch.randn(6, 2, 6), value=torch.randn(6, 2, 6)),
    "nested": None,  # built in the test, where torch's prototype warning is filtered
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_like_torch(case):
    if case != "nested":
        same_error(*_both(**BAD_INPUTS[case]))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype stage"
        nested = torch.nested.nested_tensor([q2, q2])
    # Torch's message ends with its own reason for not taking its fast path; attnx names its own.
    for fn in _both(query=nested, key=nested, value=nested):
        with pytest.raises(AssertionError, match="MultiheadAttention does not support NestedTensor outside"):
            fn()


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c != "nested"])
def test_bad_input_raises_like_torch_batch_first(case):
    """The same cases for batch_first modules, 3-D query/key/value given batch-first (so that torch's
    module, transposing them, checks the shapes above): attnx checks the same shapes without the views."""
    forward = {
        name: x.transpose(0, 1) if name in ("query", "key", "value") and x.dim() == 3 else x
        for name, x in BAD_INPUTS[case].items()
    }
    same_error(*_both({"batch_first": True}, **forward))


def test_bad_input_with_bias_kv_and_separate_weights():
    kpm = torch.zeros(2, 7, dtype=torch.bool)  # one key too many: torch checks it after appending bias_k
    same_error(*_both({"add_bias_kv": True}, query=q3, key=k3, value=k3, key_padding_mask=kpm))
    same_error(*_both({"kdim": 5, "vdim": 3}, query=q3, key=torch.randn(6, 2, 5), value=torch.randn(5, 2, 3)))
    same_error(*_both({"kdim": 5, "vdim": 3}, query=q3, key=torch.randn(6, 2, 4), value=torch.randn(6, 2, 3)))


def test_constructor_errors_are_torch_s():
    same_error(lambda: torch.nn.MultiheadAttention(8, 3), lambda: attnx.nn.MultiheadAttention(8, 3))
    same_error(lambda: torch.nn.MultiheadAttention(0, 2), lambda: attnx.nn.MultiheadAttention(0, 2))


def test_mismatched_mask_types_warn_once_like_torch():
    torch_fn, attnx_fn = _both(
        query=q3,
        key=k3,
        value=k3,
        key_padding_mask=torch.zeros(2, 6, dtype=torch.bool),
        attn_mask=torch.zeros(4, 6),
    )
    expected = warning_messages(torch_fn)
    assert expected and warning_messages(attnx_fn) == expected


# ------------------------------------------------------------------------------------------------------------
# On every device: the module's forward on that backend's kernels against torch's module on the same device,
# through torch's fast path and its slow path.


@pytest.mark.parametrize("batch_first", [False, True])
def test_on_device_matches_torch(device, batch_first):
    E, H, B, L = 64, 4, 2, 24
    attention_kernel_or_skip(device, torch.float32, batch=B, heads=H, length=L, source=L, head_dim=E // H)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, device=device).eval()
    ours = attnx.nn.MultiheadAttention(E, H, batch_first=batch_first, device=device).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E, device=device) if batch_first else torch.randn(L, B, E, device=device)
    kpm = torch.rand(B, L, device=device) < 0.2
    mask = torch.rand(L, L, device=device) < 0.2
    mask.fill_diagonal_(False)
    with torch.no_grad():
        for fast in (True, False):
            with torch_fastpath(fast):
                want = ref(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]
                got = ours(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lq, lkv", [(20, 40), (1, 30)])
def test_on_device_b1_batch_first_matches_torch(device, lq, lkv):
    """batch_first at B=1: the (1, L, E) inputs reach the op with a stride on the size-1 batch dim that is not
    the contiguous one once transposed (the upstream report's layout); a decoding step among them."""
    E, H = 64, 4
    attention_kernel_or_skip(device, torch.float32, batch=1, heads=H, length=lq, source=lkv, head_dim=E // H)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = attnx.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    q, mem = torch.randn(1, lq, E), torch.randn(1, lkv, E)
    with torch.no_grad():
        want = ref(q, mem, mem, need_weights=False)[0]
        got = ours.to(device)(q.to(device), mem.to(device), mem.to(device), need_weights=False)[0].cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
