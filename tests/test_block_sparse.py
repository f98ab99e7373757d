"""Block-sparse masks (attnx.attention's block_map / block_bits) and FlexAttention's BlockMask on attnx.

The block-sparse mask against reference.attention (block_mask_seen) forward and backward, alone and with every
other option, on each device that takes it (the CPU kernels; the other backends refuse it with a clear error,
tested here too); attnx.flex.block_sparse against the BlockMask's own dense mask; attnx.flex.flex_attention
against PyTorch's FlexAttention (its dense path, float64) for the masks FlexAttention users write: causal,
sliding window, documents, prefix-LM, a random block pattern, broadcast B and H, GQA, lengths that are not
block multiples and rows that see no key, gradients through the reference (PyTorch's FlexAttention has no CPU
backward).
"""

import warnings

import pytest
import torch

import attnx
from attention_helpers import DTYPES, kernel_or_skip, upcast
from attnx import reference
from test_attention_features import check, check_grads, on

flex_attention_module = pytest.importorskip("torch.nn.attention.flex_attention")
BlockMask = flex_attention_module.BlockMask
create_block_mask = flex_attention_module.create_block_mask
create_mask = flex_attention_module.create_mask

pytestmark = pytest.mark.kernel


def random_block_mask(Bm, Hm, L, S, block_q, block_k, seed=0, p_partial=0.4, p_empty=0.3):
    """A random block-sparse mask (each block EMPTY, FULL or PARTIAL with random bits), as options."""
    g = torch.Generator().manual_seed(seed)
    QB, KB = -(-L // block_q), -(-S // block_k)
    u = torch.rand(Bm, Hm, QB, KB, generator=g)
    partial = u < p_partial
    P = int(partial.sum())
    block_map = torch.where(u < p_partial + p_empty, -1, -2).to(torch.int32)
    block_map[partial] = torch.arange(P, dtype=torch.int32)
    words = -(-block_k // 32)
    bits = torch.randint(-(2**31), 2**31 - 1, (P, block_q, words), generator=g, dtype=torch.int64)
    return {"block_map": block_map, "block_bits": bits.to(torch.int32), "block_q": block_q,
            "block_k": block_k}


def qkv(B, H, Hkv, L, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
            torch.randn(B, Hkv, S, D, generator=g).to(dtype))


# ------------------------------------------------------------------------------------------------------------
# The block-sparse mask on every device


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("L", "S", "blocks", "bh"), [
    (70, 90, (16, 32), (2, 3)),     # L and S not block multiples, per (b, h)
    (100, 200, (16, 64), (2, 3)),   # CUDA's tiles: a block of 16 rows a warp (a tile EMPTY for some warps)
    (130, 300, (64, 128), (1, 1)),  # broadcast over B and H
    (5, 200, (128, 128), (2, 1)),   # one query block shorter than block_q, per batch
    (40, 40, (8, 40), (1, 3)),      # block_k not a multiple of 32, per head
], ids=str)
def test_block_sparse_forward(device, dtype, L, S, blocks, bh):
    q, k, v = qkv(2, 3, 3, L, S, 16, dtype)
    opts = random_block_mask(*bh, L, S, *blocks)
    q, k, v = on(device, [q, k, v])
    opts = on(device, opts)
    kernel_or_skip(device, q, k, v, **opts)
    check(q, k, v, **opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("float_mask", [True, False], ids=["float attn_mask", "bool attn_mask"])
def test_block_sparse_with_masks_forward(device, dtype, float_mask):
    """With an attn_mask (float: the CUDA kernel's general instantiation; bool: its packed bits) and a
    key_padding_mask, forward, in every dtype."""
    B, H, L, S = 2, 3, 100, 200
    q, k, v = qkv(B, H, H, L, S, 16, dtype, seed=12)
    g = torch.Generator().manual_seed(13)
    attn_mask = torch.randn(1, H, L, S, generator=g) if float_mask else torch.rand(L, S, generator=g) < 0.3
    opts = dict(random_block_mask(B, 1, L, S, 16, 64, seed=14), attn_mask=attn_mask,
                key_padding_mask=torch.rand(B, S, generator=g) < 0.2)
    q, k, v = on(device, [q, k, v])
    opts = on(device, opts)
    kernel_or_skip(device, q, k, v, **opts)
    check(q, k, v, **opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("blocks", [(64, 32), (16, 64), (32, 128)], ids=str)
def test_block_sparse_gradients(device, dtype, blocks):
    q, k, v = qkv(2, 4, 2, 150, 170, 16, dtype, seed=1)
    opts = random_block_mask(2, 1, 150, 170, *blocks, seed=2)
    q, k, v = on(device, [q, k, v])
    opts = on(device, opts)
    kernel_or_skip(device, q, k, v, backward=True, **opts)
    check_grads(q, k, v, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("float_mask", [True, False], ids=["float attn_mask", "bool attn_mask"])
def test_block_sparse_with_every_option(device, dtype, float_mask):
    """With both masks, is_causal, a window, key lengths, soft-capping, sinks and dropout, forward and
    backward."""
    B, H, L, S = 2, 4, 90, 100
    q, k, v = qkv(B, H, 2, L, S, 16, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    attn_mask = torch.randn(L, S, generator=g) if float_mask else torch.rand(L, S, generator=g) < 0.2
    opts = dict(random_block_mask(B, H, L, S, 16, 64, seed=5, p_empty=0.1),
                attn_mask=attn_mask,
                key_padding_mask=torch.rand(B, S, generator=g) < 0.2,
                is_causal=True, window_left=70, key_lengths=torch.tensor([S, 77]), softcap=5.0,
                sinks=torch.randn(H, generator=g), dropout_p=0.2, dropout_seed=torch.tensor([3, 4]))
    q, k, v = on(device, [q, k, v])
    opts = on(device, opts)
    opts["dropout_seed"] = opts["dropout_seed"].cpu()
    kernel_or_skip(device, q, k, v, backward=True, **opts)
    check(q, k, v, **opts)
    check_grads(q, k, v, grad_names=("q", "k", "v", "attn_mask", "sinks") if float_mask else ("q", "k", "v"),
                **opts)


def test_empty_blocks_are_never_read(device):
    """NaN keys and values in EMPTY blocks reach no output or gradient; rows that see no key give out 0 and
    lse = +inf."""
    L, S = 64, 192
    q, k, v = qkv(1, 2, 2, L, S, 16, torch.float32, seed=6)
    block_map = torch.full((1, 1, 2, 3), -2, dtype=torch.int32)
    block_map[0, 0, :, 1] = -1  # keys 64..127 never read
    block_map[0, 0, 1, :] = -1  # queries 32..63 see no key
    k[:, :, 64:128] = float("nan")
    v[:, :, 64:128] = float("nan")
    opts = {"block_map": block_map, "block_q": 32, "block_k": 64}
    q, k, v = on(device, [q, k, v])
    opts = on(device, opts)
    kernel_or_skip(device, q, k, v, backward=True, **opts)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = attnx.attention(q, k, v, **opts)
    assert torch.isfinite(out).all() and (out[:, :, 32:] == 0).all()
    assert (lse[:, :, 32:] == float("inf")).all() and torch.isfinite(lse[:, :, :32]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert (k.grad[:, :, 64:128] == 0).all() and (v.grad[:, :, 64:128] == 0).all()


@pytest.mark.slow
def test_block_classes_past_the_first_window(device):
    """The tensor-core kernel classifies a window of 1024 tiles (65536 keys) at a time: blocks are seen only
    around the first window's last tile and in the second window, where the classes are read again."""
    L, S = 20, 65536 + 3 * 64 + 20
    q, k, v = qkv(1, 1, 1, L, S, 16, torch.float16, seed=8)
    opts = random_block_mask(1, 1, L, S, 16, 64, seed=9, p_partial=0.5, p_empty=0.5)
    block_map = opts["block_map"]
    block_map[:, :, :, : 1024 - 2] = -1
    block_map[0, 0, 1, 1024 - 2 : 1024] = -2
    q, k, v = on(device, [q, k, v])
    opts = on(device, opts)
    kernel_or_skip(device, q, k, v, **opts)
    out, lse = check(q, k, v, **opts)
    assert torch.isfinite(lse).all()


def test_other_backends_refuse_it(device):
    """Kernels without block-sparse masks raise a clear error, forward and backward, never a silently dense
    answer: on CUDA the tensor-core kernels take them (blocks of their tiles), the SIMT kernels (float64 here)
    and the whole-tensor backward (float32) do not; Metal has none."""
    q, k, v = on(device, list(qkv(1, 2, 2, 16, 16, 16, torch.float32)))
    opts = on(device, {"block_map": torch.full((1, 1, 1, 1), -2, dtype=torch.int32), "block_q": 16,
                       "block_k": 16})
    if device.backend == "cpu":
        pytest.skip("the CPU kernels take block-sparse masks")
    if device.cuda_like:
        with pytest.raises(RuntimeError, match="block_k a multiple of 64"):
            attnx.attention(q, k, v, **opts)
        opts["block_k"] = 64
        with pytest.raises(RuntimeError, match="block_map on CUDA runs on the tensor-core kernel"):
            attnx.attention(*(t.double() for t in (q, k, v)), **opts)
        out = torch.zeros_like(q)
        lse = torch.zeros(q.shape[:3], device=q.device)
        with pytest.raises(RuntimeError, match="block_map's backward on CUDA is the fused tensor-core"):
            attnx.attention_backward(out, q, k, v, out, lse, **opts)
        return
    with pytest.raises(RuntimeError, match="block_map is not implemented on"):
        attnx.attention(q, k, v, **opts)
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], device=q.device)
    with pytest.raises(RuntimeError, match="block_map has no backward on"):
        attnx.attention_backward(out, q, k, v, out, lse, **opts)


@pytest.mark.parametrize(("opts", "message"), [
    ({"block_bits": torch.zeros(1, 128, 4, dtype=torch.int32)}, "block_bits only with a block_map"),
    ({"block_map": torch.full((1, 1, 1, 1), -2)}, "block_map of dtype int32"),
    ({"block_map": torch.full((1, 1, 2, 1), -2, dtype=torch.int32)},
     r"block_map of shape .* got \[1, 1, 2, 1\]"),
    ({"block_map": torch.full((1, 1, 1, 1), -2, dtype=torch.int32), "block_q": 0}, "block_q and block_k > 0"),
    ({"block_map": torch.full((1, 1, 1, 1), 0, dtype=torch.int32)}, r"block_map\[0, 0, 0, 0\] = 0"),
    ({"block_map": torch.full((1, 1, 1, 1), -3, dtype=torch.int32),
      "block_bits": torch.zeros(1, 128, 4, dtype=torch.int32)}, "got block_map"),
    ({"block_map": torch.full((1, 1, 1, 1), 0, dtype=torch.int32),
      "block_bits": torch.zeros(1, 128, 3, dtype=torch.int32)}, "block_bits of shape"),
], ids=lambda x: str(x)[:30])
def test_bad_block_masks(opts, message):
    q, k, v = qkv(1, 2, 2, 100, 100, 8, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        attnx.attention(q, k, v, **opts)
    if not message.startswith(("got block_map", "block_map\\[")):  # (the fake reads no entry)
        with pytest.raises(RuntimeError, match=message), torch._subclasses.FakeTensorMode() as mode:
            fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in opts.items()}
            attnx.attention(*(mode.from_tensor(t) for t in (q, k, v)), **fake)


def test_cost_follows_the_blocks_visited():
    """A block map that lists only the diagonal's blocks: the result equals the same pattern given as a bool
    attn_mask (which reads every key)."""
    L = S = 512
    q, k, v = qkv(1, 2, 2, L, S, 32, torch.float32, seed=8)
    block_map = torch.full((1, 1, 4, 4), -1, dtype=torch.int32)
    block_map[0, 0].fill_diagonal_(-2)
    dense = ~reference.block_mask_seen(block_map, None, 128, 128, L, S)[0, 0]
    out, lse = attnx.attention(q, k, v, block_map=block_map)
    ref_out, ref_lse = attnx.attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# FlexAttention's BlockMask


def causal(b, h, q, kv):
    return q >= kv


def sliding(window):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < window)
    return mask


def documents(ids):
    def mask(b, h, q, kv):
        return ids[b, q] == ids[b, kv]
    return mask


def prefix_lm(prefix):
    def mask(b, h, q, kv):
        return (kv < prefix[b]) | (q >= kv)
    return mask


def head_pattern(b, h, q, kv):
    return ((q // 16 + kv // 16 + h) % 3 != 0) & (kv <= q + 40)


def nothing_for_early_rows(b, h, q, kv):
    return (q >= 20) & (kv <= q)


def document_ids(B, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.stack([torch.randperm(S - 1, generator=g)[:5].sort().values + 1 for _ in range(B)])
    return (torch.arange(S).view(1, S) >= cuts.unsqueeze(-1)).sum(1)  # (B, S) document index


MASKS = {
    "causal": (lambda B, L, S: causal, None, None),
    "sliding": (lambda B, L, S: sliding(37), None, None),
    "documents": (lambda B, L, S: documents(document_ids(B, S)), "B", None),
    "prefix_lm": (lambda B, L, S: prefix_lm(torch.tensor([30, 70])), "B", None),
    "per_head": (lambda B, L, S: head_pattern, None, "H"),
    "no_key_rows": (lambda B, L, S: nothing_for_early_rows, None, None),
}


def make_block_mask(name, B, H, L, S, block):
    mask_mod, per_b, per_h = MASKS[name]
    fn = mask_mod(B, L, S)
    return fn, create_block_mask(fn, B if per_b else None, H if per_h else None, L, S, device="cpu",
                                 BLOCK_SIZE=block)


@pytest.mark.parametrize("block", [(128, 128), (32, 64), (16, 48)], ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_block_sparse_of_a_block_mask(name, block):
    """attnx.flex.block_sparse expands (reference.block_mask_seen) to the BlockMask's own dense mask."""
    B, H, L, S = 2, 3, 150, 150
    fn, bm = make_block_mask(name, B, H, L, S, block)
    opts = attnx.flex.block_sparse(bm)
    assert (opts["block_q"], opts["block_k"]) == block
    seen = reference.block_mask_seen(opts["block_map"], opts["block_bits"], *block, L, S)
    want = create_mask(fn, B, H, L, S, device="cpu")
    assert torch.equal(seen.expand(B, H, L, S), want)
    assert attnx.flex.block_sparse(bm) is opts  # kept while the BlockMask lives


def test_block_sparse_calls_the_mask_only_on_partial_blocks():
    calls = []

    def counted(b, h, q, kv):
        calls.append(q.shape)
        return q >= kv

    L = 512
    bm = create_block_mask(causal, None, None, L, L, device="cpu")  # built with the plain function
    bm.mask_mod = counted
    attnx.flex.block_sparse(bm)
    # vmapped: one call for the 4 diagonal blocks; none of the 6 FULL blocks is evaluated.
    assert len(calls) == 1
    assert int((attnx.flex.block_sparse(bm)["block_map"] >= 0).sum()) == 4


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("L", "S", "gqa"), [(150, 150, False), (100, 260, True), (1, 200, False)], ids=str)
def test_flex_attention_matches_pytorch(name, L, S, gqa):
    B, H, Hkv, D = 2, 4, 2 if gqa else 4, 16
    q, k, v = qkv(B, H, Hkv, L, S, D, torch.float64, seed=9)
    if name == "prefix_lm" and S < 71:
        pytest.skip("the prefix is longer than the keys")
    _, bm = make_block_mask(name, B, H, L, S, (64, 64))
    out, lse = attnx.flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa, return_lse=True)
    with warnings.catch_warnings():  # PyTorch's notes that its eager path materialises the scores
        warnings.simplefilter("ignore")
        want, want_lse = flex_attention_module.flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa,
                                                              return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flex_attention_gradients(device, name, dtype):
    """Training with FlexAttention's masks, which PyTorch's FlexAttention does not offer on the CPU, on each
    device's kernels (CUDA's take blocks of their tiles): gradients against autograd through the reference
    given the BlockMask's dense mask."""
    B, H, L, S = 2, 4, 140, 140
    q, k, v = qkv(B, H, H, L, S, 16, dtype, seed=10)
    fn, bm = make_block_mask(name, B, H, L, S, (32, 64))
    dense = ~create_mask(fn, B, H, L, S, device="cpu")
    grad_out = torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(11)).to(dtype)
    q, k, v, grad_out = on(device, [q, k, v, grad_out])
    bm = bm.to(q.device)
    kernel_or_skip(device, q, k, v, backward=True, **attnx.flex.block_sparse(bm))

    def grads(f, cast):
        leaves = [cast(t).requires_grad_() for t in (q, k, v)]
        out = f(*leaves)
        return [g.cpu() for g in torch.autograd.grad(out, leaves, cast(grad_out).to(out.device))]

    got = grads(lambda *a: attnx.flex.flex_attention(*a, block_mask=bm), lambda t: t.detach().clone())
    q, k, v, grad_out = (t.cpu() for t in (q, k, v, grad_out))
    def reference_out(*a):
        return reference.attention(*a, attn_mask=dense)[0]

    ref64 = grads(reference_out, lambda t: upcast(t).detach().clone())
    ref = grads(reference_out, lambda t: t.detach().clone())
    for name_, g, r64, r in zip("qkv", got, ref64, ref, strict=True):
        err, ref_err = (g.double() - r64).abs().max(), (r.double() - r64).abs().max()
        assert err <= 3 * ref_err + 1e-5, f"grad {name_}: {err:.2e} vs the reference's {ref_err:.2e}"


@pytest.mark.parametrize("grad", [False, True])
def test_a_device_is_asked_once_per_block_mask(device, grad, monkeypatch):
    """Off the CPU, flex_attention asks the device's backend whether its kernels take the BlockMask (forward,
    and backward where autograd will ask): its own answer (the emulated CUDA devices': sm_90 takes 16 x 64
    blocks in bf16, sm_75 none; Metal none), once per BlockMask and kind of call."""
    q, k, v = on(device, list(qkv(1, 2, 2, 64, 128, 16, torch.bfloat16)))
    q.requires_grad_(grad)
    bm = create_block_mask(causal, None, None, 64, 128, device="cpu", BLOCK_SIZE=(16, 64)).to(q.device)
    options = attnx.flex.block_sparse(bm)
    want = device.backend in ("cpu", "cuda", "cuda-emu") and (
        not grad or attnx.ops.kernel_for(q, k, v, backward=True, **options) is not None)
    asked = []
    kernel_for = attnx.ops.kernel_for
    monkeypatch.setattr(attnx.ops, "kernel_for", lambda *a, **kw: asked.append(1) or kernel_for(*a, **kw))
    assert attnx.flex._kernels_take(q, k, v, None, bm, options) == want
    n = len(asked)
    assert n == (2 if grad and want else 1)
    assert attnx.flex._kernels_take(q, k, v, None, bm, options) == want and len(asked) == n


def test_flex_attention_falls_back_for_score_mod():
    q, k, v = qkv(1, 2, 2, 64, 64, 16, torch.float64)

    def bias(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) * 0.01

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = attnx.flex.flex_attention(q, k, v, score_mod=bias)
        want = flex_attention_module.flex_attention(q, k, v, score_mod=bias)
    torch.testing.assert_close(out, want)


def test_flex_attention_errors_as_pytorch():
    q, k, v = qkv(1, 4, 2, 64, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attnx.flex.flex_attention(q, k, v)
    bm = create_block_mask(causal, None, None, 128, 128, device="cpu")
    with pytest.raises(RuntimeError, match="larger length"):
        attnx.flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)


# ------------------------------------------------------------------------------------------------------------
# The takeover: unchanged code calling PyTorch's flex_attention


@pytest.fixture
def takeover():
    """attnx.flex's takeover on for one test, off after it (whatever the test did)."""
    attnx.flex.enable()
    yield
    attnx.flex.disable()


def _attnx_ops(prof):
    return sorted({e.name for e in prof.events() if e.name.startswith("attnx::")})


def test_takeover_serves_names_imported_before(takeover):
    """A name bound by `from ... import flex_attention` before enable() is served, forward and backward
    (PyTorch's own refuses a CPU backward), and shows attnx's ops in the profiler."""
    from torch.nn.attention.flex_attention import flex_attention  # the object the takeover changed

    B, H, L = 2, 4, 200
    q, k, v = (t.requires_grad_() for t in qkv(B, H, H, L, L, 16, torch.float32, seed=12))
    fn, bm = make_block_mask("documents", B, H, L, L, (64, 64))
    with torch.profiler.profile() as prof:
        out = flex_attention(q, k, v, block_mask=bm)
        out.sum().backward()
    assert _attnx_ops(prof) == ["attnx::_attention", "attnx::attention_backward"]
    dense = ~create_mask(fn, B, H, L, L, device="cpu")
    ref = reference.attention(q.detach(), k.detach(), v.detach(), attn_mask=dense)[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_takeover_is_undone():
    from torch.nn.attention.flex_attention import flex_attention

    code = flex_attention.__code__
    with attnx.flex.enabled():
        assert attnx.flex.is_enabled() and flex_attention.__code__ is not code
    assert not attnx.flex.is_enabled() and flex_attention.__code__ is code
    with torch.profiler.profile() as prof, warnings.catch_warnings():  # PyTorch's own again
        warnings.simplefilter("ignore")
        flex_attention(*qkv(1, 2, 2, 64, 64, 16, torch.float32))
    assert _attnx_ops(prof) == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_takeover_under_compile(takeover, backend):
    """torch.compile with the eager and aot_eager backends runs attnx's ops forward and backward (the
    BlockMask's conversion runs between graphs)."""
    from torch.nn.attention.flex_attention import flex_attention

    L = 192
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, L, L, 16, torch.float32, seed=13))
    _, bm = make_block_mask("sliding", 1, 2, L, L, (64, 64))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm), backend=backend)
    with torch.profiler.profile() as prof:
        out = compiled(q, k, v)
        out.sum().backward()
    assert _attnx_ops(prof) == ["attnx::_attention", "attnx::attention_backward"]
    dense = ~create_mask(sliding(37), 1, 2, L, L, device="cpu")
    ref = reference.attention(q.detach(), k.detach(), v.detach(), attn_mask=dense)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_takeover_leaves_inductor_to_pytorch(takeover):
    """Code that inductor compiles keeps PyTorch's generated kernel (no attnx op runs)."""
    from torch.nn.attention.flex_attention import flex_attention

    L = 128
    q, k, v = qkv(1, 2, 2, L, L, 16, torch.float32, seed=16)
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm), backend="inductor")
    with torch.profiler.profile() as prof:
        out = compiled(q, k, v)
    assert _attnx_ops(prof) == []
    torch.testing.assert_close(out, reference.attention(q, k, v, is_causal=True)[0], atol=1e-5, rtol=1e-5)


def test_takeover_falls_back_to_pytorch(takeover):
    """What attnx does not take runs PyTorch's code: a score_mod, and the row maxima."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = qkv(1, 2, 2, 64, 64, 16, torch.float64)

    def bias(score, b, h, q_idx, kv_idx):
        return score - (q_idx - kv_idx).abs() * 0.01

    with torch.profiler.profile() as prof, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q, k, v, score_mod=bias)
    assert _attnx_ops(prof) == []
    AuxRequest = getattr(flex_attention_module, "AuxRequest", None)
    if AuxRequest is not None:
        with pytest.raises(NotImplementedError, match="max scores"):  # PyTorch's CPU answer
            flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))


def _dispatches(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        result = fn()
    return Count.n, result


def test_takeover_dispatch_count(takeover):
    """The upstream report's measure: a FlexAttention backward in at most 13 dispatches (SDPA's count there;
    PyTorch's dense backward makes 83-87), its forward in no more than SDPA's."""
    from torch.nn.attention.flex_attention import flex_attention

    L = 256
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, L, L, 16, torch.float32, seed=14))
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    flex_attention(q, k, v, block_mask=bm)  # the BlockMask's conversion, once
    forward, out = _dispatches(lambda: flex_attention(q, k, v, block_mask=bm))
    backward, _ = _dispatches(lambda: out.sum().backward())
    sdpa_forward, _ = _dispatches(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert forward <= sdpa_forward and backward <= 13, (forward, sdpa_forward, backward)


def test_no_attention_sized_allocation_in_flex_training(takeover):
    """Forward and backward of a documents mask allocate nothing of size (B, H, L, S): the profiler on the CPU
    allocator, with PyTorch's dense FlexAttention forward as the control that it sees such an allocation."""
    from torch.nn.attention.flex_attention import flex_attention

    B, H, L = 1, 2, 512
    q, k, v = (t.requires_grad_() for t in qkv(B, H, H, L, L, 16, torch.float32, seed=15))
    _, bm = make_block_mask("documents", B, H, L, L, (128, 128))
    attnx.flex.block_sparse(bm)
    attention_bytes = B * H * L * L * 4
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as p:
        flex_attention(q, k, v, block_mask=bm).sum().backward()
    assert max(e.cpu_memory_usage for e in p.events()) < attention_bytes / 4
    attnx.flex.disable()
    with torch.profiler.profile(activities=cpu, profile_memory=True) as p, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q.detach(), k.detach(), v.detach(), block_mask=bm)
    assert max(e.cpu_memory_usage for e in p.events()) >= attention_bytes


@pytest.mark.wheel
def test_flex_smoke():
    """The installed build under each supported torch: a BlockMask through attnx.flex forward and backward,
    and the takeover where this torch's flex_attention has the parameters it knows (else enable() says so)."""
    L = 96
    q, k, v = (t.requires_grad_() for t in qkv(2, 2, 2, L, L, 16, torch.float32, seed=17))
    fn, bm = make_block_mask("documents", 2, 2, L, L, (32, 32))
    out = attnx.flex.flex_attention(q, k, v, block_mask=bm)
    out.sum().backward()
    dense = ~create_mask(fn, 2, 2, L, L, device="cpu")
    ref = reference.attention(q.detach(), k.detach(), v.detach(), attn_mask=dense)[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    try:
        attnx.flex.enable()
    except RuntimeError as e:
        assert "differs from the parameters the takeover knows" in str(e) and not attnx.flex.is_enabled()
        return
    try:
        assert flex_attention_module.flex_attention(q, k, v, block_mask=bm).equal(out)
    finally:
        attnx.flex.disable()
