"""attnx.functional.multi_head_attention_forward against torch's, and attnx.reference.mha (the op's spec)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from attnx import functional, ops, reference
from mha_helpers import MASK_CASES, assert_close, make_masks, same_error, warning_messages

pytestmark = pytest.mark.kernel

E, H, D = 8, 2, 4
WEIGHTS = [(False, True), (True, True), (True, False)]  # (need_weights, average_attn_weights)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def params(dtype, separate=False, bias=True, bias_kv=False, kdim=E, vdim=E):
    """The parameters of an nn.MultiheadAttention, as F.multi_head_attention_forward's keyword arguments."""

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype) / shape[-1] ** 0.5

    return dict(
        in_proj_weight=None if separate else rand(3 * E, E),
        in_proj_bias=rand(3 * E) if bias else None,
        bias_k=rand(1, 1, E) if bias_kv else None,
        bias_v=rand(1, 1, E) if bias_kv else None,
        out_proj_weight=rand(E, E),
        out_proj_bias=rand(E) if bias else None,
        use_separate_proj_weight=separate,
        q_proj_weight=rand(E, E) if separate else None,
        k_proj_weight=rand(E, kdim) if separate else None,
        v_proj_weight=rand(E, vdim) if separate else None,
    )


def strided(x, layout):
    """x with the same values in another memory layout: "contiguous", "transposed" (a batch-first tensor's
    (L, B, E) view) or "sliced" (every other feature of a wider tensor, with a storage offset)."""
    if layout == "contiguous" or x.dim() < 3:
        return x
    if layout == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1] + 1, dtype=x.dtype)
    wide[..., 1::2] = x
    return wide[..., 1::2]


def both(query, key, value, add_zero_attn=False, dropout_p=0.0, **kwargs):
    """(torch's result, attnx's result) of F.multi_head_attention_forward(query, key, value, E, H, ...) with
    the same arguments: no zero attention key and no dropout unless asked for."""
    args = (query, key, value, E, H)
    kwargs = dict(add_zero_attn=add_zero_attn, dropout_p=dropout_p, **kwargs)
    expected = F.multi_head_attention_forward(*args, **kwargs)
    actual = functional.multi_head_attention_forward(*args, **kwargs)
    return expected, actual


def op_args(query, key, value, p, *, zero_attn=False, kpm=None, am=None, is_causal=False, need_weights=True,
            average=True):
    """attnx::mha's positional arguments (reference.mha's, ops.mha's) for the parameters ``p`` of params(),
    without static keys."""
    return (query, key, value, H, p["in_proj_weight"], p["in_proj_bias"], p["q_proj_weight"],
            p["k_proj_weight"], p["v_proj_weight"], p["bias_k"], p["bias_v"], zero_attn, p["out_proj_weight"],
            p["out_proj_bias"], kpm, am, is_causal, None, None, need_weights, average)


@pytest.mark.wheel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch", [None, 1, 3], ids=["unbatched", "B1", "B3"])
@pytest.mark.parametrize("separate", [False, True], ids=["packed", "separate"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_functional_matches_torch(dtype, batch, separate, layout):
    kdim, vdim = (5, 3) if separate else (E, E)
    L, S = 4, 6
    weights = itertools.cycle(WEIGHTS)
    for bias, bias_kv, zero_attn, training in itertools.product([True, False], repeat=4):
        p = params(dtype, separate, bias, bias_kv, kdim, vdim)
        shape = (lambda n, d: (n, d)) if batch is None else (lambda n, d: (n, batch, d))
        query = strided(torch.randn(*shape(L, E), dtype=dtype), layout)
        key = strided(torch.randn(*shape(S, kdim), dtype=dtype), layout)
        value = key if not separate else strided(torch.randn(*shape(S, vdim), dtype=dtype), layout)
        # weights is an endless cycle: strict=False lets zip stop at the end of MASK_CASES.
        for case, (need_weights, average) in zip(MASK_CASES, weights, strict=False):
            kpm, am, is_causal = make_masks(case, batch or 1, H, L, S, dtype, batched=batch is not None)
            expected, actual = both(query, key, value, add_zero_attn=zero_attn, training=training,
                                    key_padding_mask=kpm, attn_mask=am, is_causal=is_causal,
                                    need_weights=need_weights, average_attn_weights=average, **p)
            msg = f"bias={bias} bias_kv={bias_kv} zero_attn={zero_attn} {case} {need_weights} {average}"
            assert_close(actual[0], expected[0], dtype, msg)
            assert_close(actual[1], expected[1], dtype, msg)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("zero_attn", [False, True])
@pytest.mark.parametrize("static", ["k", "v", "kv"])
def test_static_k_v_match_torch(dtype, zero_attn, static):
    B, L, S, S_static = 2, 4, 6, 5 if static == "kv" else 6
    p = params(dtype)
    query, key = torch.randn(L, B, E, dtype=dtype), torch.randn(S, B, E, dtype=dtype)
    static_k = torch.randn(B * H, S_static, D, dtype=dtype) if "k" in static else None
    static_v = torch.randn(B * H, S_static, D, dtype=dtype) if "v" in static else None
    kpm = torch.rand(B, S_static) < 0.3
    for need_weights, average in WEIGHTS:
        expected, actual = both(query, key, key, add_zero_attn=zero_attn, static_k=static_k,
                                static_v=static_v, key_padding_mask=kpm, need_weights=need_weights,
                                average_attn_weights=average, **p)
        assert_close(actual[0], expected[0], dtype)
        assert_close(actual[1], expected[1], dtype)


def test_dropout_path_matches_torch_and_eval_ignores_it():
    """training with dropout_p > 0: with need_weights, the composition with torch's F.dropout, so one seed
    gives torch's mask; without, the fused op, whose mask is attnx's (from a seed drawn from torch's
    generator), so the result is reference.mha's with that seed."""
    for dtype, need_weights, case in itertools.product(
        [torch.float32, torch.float64], [True, False], ["none", "both_bool", "causal"]
    ):
        p = params(dtype, bias_kv=True)
        query, key = torch.randn(4, 3, E, dtype=dtype), torch.randn(6, 3, E, dtype=dtype)
        kpm, am, is_causal = make_masks(case, 3, H, 4, 6, dtype)
        args = (query, key, key, E, H)
        kwargs = dict(
            add_zero_attn=True,
            dropout_p=0.3,
            key_padding_mask=kpm,
            attn_mask=am,
            is_causal=is_causal,
            need_weights=need_weights,
            average_attn_weights=False,
            **p,
        )
        torch.manual_seed(3)
        actual = functional.multi_head_attention_forward(*args, **kwargs)
        torch.manual_seed(3)
        if need_weights:
            expected = F.multi_head_attention_forward(*args, **kwargs)
            assert_close(actual[1], expected[1], dtype, f"{need_weights} {case}")
        else:
            seed = ops.draw_dropout_seed(query.device)  # what the fused path drew
            spec_args = op_args(query, key, key, p, zero_attn=True, kpm=kpm, am=am, is_causal=is_causal,
                                need_weights=False, average=False)
            expected = reference.mha(*spec_args, 0.3, seed)
            assert actual[1] is None
        assert_close(actual[0], expected[0], dtype, f"{need_weights} {case}")
        eval_out = functional.multi_head_attention_forward(*args, training=False, **kwargs)
        no_dropout = functional.multi_head_attention_forward(*args, **{**kwargs, "dropout_p": 0.0})
        assert_close(eval_out[0], no_dropout[0], dtype)


def test_is_causal_hint_drops_attn_mask_unchecked_like_torch():
    """Where torch hands the hint to SDPA it drops attn_mask unchecked: even an int64 mask passes."""
    p = params(torch.float64)
    query, key = torch.randn(4, 3, E, dtype=torch.float64), torch.randn(6, 3, E, dtype=torch.float64)
    int_mask = torch.zeros(4, 6, dtype=torch.int64)
    expected, actual = both(query, key, key, attn_mask=int_mask, is_causal=True, need_weights=False, **p)
    assert_close(actual[0], expected[0], torch.float64)


def test_masks_reach_the_op_unmerged_and_unconverted(monkeypatch):
    """The functional layer only validates: each mask goes to ops.mha as the very tensor given (bool stays
    bool), never merged into a (B*H, L, S) tensor; the is_causal hint picks the mask torch would apply."""
    seen = []
    real_mha = ops.mha
    monkeypatch.setattr(ops, "mha", lambda *args, **kwargs: seen.append(args) or real_mha(*args, **kwargs))
    p = params(torch.float32)
    query, key = torch.randn(4, 3, E), torch.randn(6, 3, E)
    kpm, am = torch.rand(3, 6) < 0.3, torch.ones(4, 6, dtype=torch.bool).triu(1)

    def call(**kwargs):
        functional.multi_head_attention_forward(
            query, key, key, E, H, add_zero_attn=False, dropout_p=0.0, **p, **kwargs
        )

    call(key_padding_mask=kpm, attn_mask=am)
    call(key_padding_mask=kpm, attn_mask=am, is_causal=True, need_weights=False)
    call(attn_mask=am, is_causal=True, need_weights=False)
    call(attn_mask=am, is_causal=True, need_weights=True)
    # (key_padding_mask, attn_mask, is_causal) as the op received them: args 14, 15, 16 of its schema.
    received = [(args[14], args[15], args[16]) for args in seen]
    assert received[0][0] is kpm and received[0][1] is am and received[0][2] is False
    assert received[1][0] is kpm and received[1][1] is am and received[1][2] is False  # kpm: the mask wins
    assert received[2][0] is None and received[2][1] is None and received[2][2] is True  # the hint wins
    assert received[3][1] is am and received[3][2] is False  # need_weights: the mask wins
    assert all(m is None or m.dtype == torch.bool for r in received for m in r[:2])


# ------------------------------------------------------------------------------------------------------------
# reference.mha: the spec of attnx::mha


def test_reference_mha_outputs():
    B, L, S = 2, 4, 6
    p = params(torch.float64, bias_kv=True)
    query, key = torch.randn(L, B, E, dtype=torch.float64), torch.randn(S, B, E, dtype=torch.float64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # batch 1: all real keys padded, only the bias_k key remains
    am = torch.zeros(L, S, dtype=torch.bool)
    am[0] = True
    kpm_copy, am_copy = kpm.clone(), am.clone()

    def run(need_weights, average, kpm=kpm, am=am, zero_attn=False, bias_kv=True):
        params = p if bias_kv else {**p, "bias_k": None, "bias_v": None}
        return reference.mha(*op_args(query, key, key, params, zero_attn=zero_attn, kpm=kpm, am=am,
                                      need_weights=need_weights, average=average))

    # Without bias_k: batch 1 (all keys padded) and query 0 (attn_mask row all True) see no key at all.
    out, lse, weights = run(True, False, bias_kv=False)
    assert out.shape == (L, B, E) and lse.shape == (B, H, L) and weights.shape == (B, H, L, S)
    assert torch.equal(kpm, kpm_copy) and torch.equal(am, am_copy)  # masks are read, never written
    fully_masked = torch.zeros(B, H, L, dtype=torch.bool)
    fully_masked[1], fully_masked[:, :, 0] = True, True
    assert torch.equal(torch.isposinf(lse), fully_masked)
    assert weights[fully_masked].isnan().all() and weights[~fully_masked].isfinite().all()
    torch.testing.assert_close(weights.sum(-1)[~fully_masked], torch.ones_like(lse)[~fully_masked])
    # 0 attention where fully masked: out = out_proj_bias there.
    torch.testing.assert_close(out[0], p["out_proj_bias"].expand(B, E))
    torch.testing.assert_close(out[:, 1], p["out_proj_bias"].expand(L, E))
    out_avg, lse_avg, weights_avg = run(True, True, bias_kv=False)
    torch.testing.assert_close(weights_avg, weights.mean(1), equal_nan=True)
    out_no, lse_no, weights_no = run(False, True, bias_kv=False)
    assert weights_no.shape == (0,) and torch.equal(out_no, out) and torch.equal(lse_no, lse)
    # A float mask with -inf where the bool mask is True gives the same result.
    as_float = lambda m: torch.zeros(m.shape, dtype=torch.float64).masked_fill(m, float("-inf"))  # noqa: E731
    out_f, lse_f, weights_f = run(True, False, kpm=as_float(kpm), am=as_float(am), bias_kv=False)
    torch.testing.assert_close(out_f, out)
    torch.testing.assert_close(lse_f, lse)
    torch.testing.assert_close(weights_f, weights, equal_nan=True)
    # bias_k appends one key that the masks leave visible: every row now sees it, and batch 1 sees only it.
    out, lse, weights = run(True, False)
    assert weights.shape == (B, H, L, S + 1) and torch.isfinite(lse).all()
    assert (weights[1, :, :, :S] == 0).all() and (weights[1, :, :, S] == 1).all()
    # add_zero_attn: one more key with score 0 and value 0.
    assert run(True, False, zero_attn=True)[2].shape == (B, H, L, S + 2)


def test_reference_mha_lse_is_the_logsumexp_of_the_scaled_scores():
    B, L, S = 2, 3, 5
    p = params(torch.float64)
    query, key = torch.randn(L, B, E, dtype=torch.float64), torch.randn(S, B, E, dtype=torch.float64)
    out, lse, weights = reference.mha(*op_args(query, key, key, p, is_causal=True, average=False))
    w_q, w_k, _ = p["in_proj_weight"].chunk(3)
    b_q, b_k, _ = p["in_proj_bias"].chunk(3)
    q = (query @ w_q.T + b_q).reshape(L, B, H, D).permute(1, 2, 0, 3)
    k = (key @ w_k.T + b_k).reshape(S, B, H, D).permute(1, 2, 0, 3)
    scores = (q @ k.transpose(-2, -1) / D**0.5).masked_fill(
        torch.ones(L, S, dtype=torch.bool).triu(1), -torch.inf
    )
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    torch.testing.assert_close(weights, scores.softmax(-1))


def test_ops_mha_wrapper_returns_the_schema_s_outputs():
    B, L, S = 3, 4, 6
    p = params(torch.float32, separate=True, kdim=5, vdim=3)
    query, key, value = torch.randn(L, B, E), torch.randn(S, B, 5), torch.randn(S, B, 3)
    for need_weights, average in WEIGHTS:
        out, lse, weights = ops.mha(*op_args(query, key, value, p, zero_attn=True, kpm=torch.rand(B, S) < 0.2,
                                             am=torch.rand(B * H, L, S) < 0.2, need_weights=need_weights,
                                             average=average))
        assert out.shape == (L, B, E) and lse.shape == (B, H, L) and lse.dtype == torch.float32
        expected = ((B, L, S + 1) if average else (B, H, L, S + 1)) if need_weights else (0,)
        assert weights.shape == expected


# ------------------------------------------------------------------------------------------------------------
# Bad input: torch's exception types and messages


def _bad(p=None, **overrides):
    p = params(torch.float32) if p is None else p
    args = dict(
        query=torch.randn(4, 2, E),
        key=torch.randn(6, 2, E),
        value=torch.randn(6, 2, E),
        embed_dim_to_check=E,
        num_heads=H,
        add_zero_attn=False,
        dropout_p=0.0,
        **p,
    )
    args.update(overrides)
    return (lambda: F.multi_head_attention_forward(**args)), (
        lambda: functional.multi_head_attention_forward(**args)
    )


BAD = {
    "query_4d": dict(query=torch.randn(1, 4, 2, E)),
    "key_2d": dict(key=torch.randn(6, E), value=torch.randn(6, E)),
    "unbatched_key_3d": dict(query=torch.randn(4, E)),
    "kpm_1d": dict(key_padding_mask=torch.zeros(6, dtype=torch.bool)),
    "unbatched_kpm_2d": dict(
        query=torch.randn(4, E),
        key=torch.randn(6, E),
        value=torch.randn(6, E),
        key_padding_mask=torch.zeros(1, 6, dtype=torch.bool),
    ),
    "am_1d": dict(attn_mask=torch.zeros(6)),
    "unbatched_am_3d": dict(
        query=torch.randn(4, E),
        key=torch.randn(6, E),
        value=torch.randn(6, E),
        attn_mask=torch.zeros(2 * H, 4, 6),
    ),
    "am_2d_shape": dict(attn_mask=torch.zeros(6, 4)),
    "am_3d_shape": dict(attn_mask=torch.zeros(H, 4, 6, dtype=torch.bool)),
    "kpm_shape_0": dict(key_padding_mask=torch.zeros(3, 6, dtype=torch.bool)),
    "kpm_shape_1": dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)),
    "kpm_shape_zero_attn": dict(key_padding_mask=torch.zeros(2, 5), add_zero_attn=True),
    "kpm_shape_static": dict(
        key_padding_mask=torch.zeros(2, 6),
        static_k=torch.randn(2 * H, 5, D),
        static_v=torch.randn(2 * H, 5, D),
    ),
    "kpm_uint8": dict(key_padding_mask=torch.zeros(2, 6, dtype=torch.uint8)),
    "kpm_int64": dict(key_padding_mask=torch.zeros(2, 6, dtype=torch.int64)),
    "am_int32": dict(attn_mask=torch.zeros(4, 6, dtype=torch.int32)),
    "is_causal_without_mask": dict(is_causal=True),
    "embed_dim_to_check": dict(embed_dim_to_check=E + 1),
    "not_divisible": dict(num_heads=3),
    "key_value_shape": dict(value=torch.randn(5, 2, E)),
    "in_proj_weight_none": dict(in_proj_weight=None),
    "bias_k_without_bias_v": dict(bias_k=torch.randn(1, 1, E)),
    "bias_v_without_bias_k": dict(bias_v=torch.randn(1, 1, E)),
    "bias_with_static_k": dict(
        bias_k=torch.randn(1, 1, E), bias_v=torch.randn(1, 1, E), static_k=torch.randn(2 * H, 6, D)
    ),
    "bias_with_static_v": dict(
        bias_k=torch.randn(1, 1, E), bias_v=torch.randn(1, 1, E), static_v=torch.randn(2 * H, 6, D)
    ),
    "static_k_heads": dict(static_k=torch.randn(H, 6, D)),
    "static_k_head_dim": dict(static_k=torch.randn(2 * H, 6, D + 1)),
    "static_v_heads": dict(static_v=torch.randn(H, 6, D)),
    "static_v_head_dim": dict(static_v=torch.randn(2 * H, 6, D + 1)),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_like_torch(case):
    same_error(*_bad(**BAD[case]))


def test_bad_separate_projection_weights_raise_like_torch():
    separate = params(torch.float32, separate=True, kdim=5, vdim=3)
    key, value = torch.randn(6, 2, 5), torch.randn(6, 2, 3)
    for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        same_error(*_bad({**separate, name: None}, key=key, value=value))
        same_error(*_bad({**separate, name: torch.randn(E, 7)}, key=key, value=value))
    same_error(*_bad({**separate, "in_proj_bias": torch.randn(3 * E + 3)}, key=key, value=value))
    same_error(*_bad(separate, key=key, value=torch.randn(5, 2, 3)))


def test_mismatched_mask_types_warn_like_torch():
    torch_fn, attnx_fn = _bad(
        key_padding_mask=torch.zeros(2, 6, dtype=torch.bool), attn_mask=torch.zeros(4, 6)
    )
    expected = warning_messages(torch_fn)
    assert expected and warning_messages(attnx_fn) == expected


@pytest.mark.parametrize("average", [True, False])
def test_weights_are_exact_at_large_scores(average):
    # float32 scores of magnitude ~4e3 that differ by a few units (as in torch's own samples): weights
    # computed as exp(score - lse) would carry lse's rounding (2^-12 at that magnitude) into every weight,
    # where torch's softmax normalises by the row's maximum and sum. attnx's weights must agree with torch's
    # to torch's own rounding.
    L, B = 5, 3
    in_proj = torch.cat([torch.eye(E)] * 3)  # q = k = v = x: scores are x . x' / sqrt(D) per head
    x = 45 + 0.05 * torch.randn(L, B, E)
    kwargs = dict(need_weights=True, average_attn_weights=average)
    args = (x, x, x, E, H, in_proj, None, None, None, False, 0.0, torch.eye(E), None)
    _, want = F.multi_head_attention_forward(*args, **kwargs)
    _, got = functional.multi_head_attention_forward(*args, **kwargs)
    head = x[..., :D].transpose(0, 1)  # (B, L, D): head 0
    scores = head @ head.transpose(-1, -2) / D**0.5
    assert scores.min() > 4000 and want.min() > 1e-4  # large scores, none of them negligible
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
