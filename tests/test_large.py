"""Index math past 32 bits: CPU attention over L = S = 65536 (B*H*L*S = 2^33 scores, never stored), with masks
read through stride-0 broadcast dims, checked against the reference on slices of rows at the start, middle and
end, where an index that wrapped at 2^31 would read the wrong keys; and masks, keys and values read through
views whose element offsets and strides pass 2^31, forward and backward, on every device whose memory can hold
such views (the CPU and the emulated backends)."""

import pytest
import torch

import attnx
from attention_helpers import assert_matches_reference, kernel_or_skip, make_qkv
from attnx import reference

pytestmark = pytest.mark.kernel

N = 65536  # L = S; B * H * L * S = 2^33
B, H, D = 2, 1, 4
ROWS = [slice(0, 3), slice(N // 2 - 2, N // 2 + 1), slice(N - 3, N)]


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    # Batch 1 sees only the second half of the keys, through a (B, S) mask; every query row also skips the
    # last 4096 keys through an (L, S) mask broadcast from a single row (stride 0 along L).
    key_padding_mask = torch.zeros(B, N, dtype=torch.bool)
    key_padding_mask[1, : N // 2] = True
    attn_mask = torch.zeros(1, N, dtype=torch.bool)
    attn_mask[0, N - 4096:] = True
    return q, k, v, key_padding_mask, attn_mask.expand(N, N)


# The CPU kernel alone: 2^33 scores are far past what the emulators can run.
@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_attention_past_2_to_31_scores(inputs, is_causal):
    q, k, v, key_padding_mask, attn_mask = inputs
    with torch.no_grad():
        out, lse = attnx.attention(q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                   is_causal=is_causal)
    assert out.shape == (B, H, N, D) and bool(torch.isfinite(out[0]).all())
    for rows in ROWS:
        # The reference on these query rows only: with is_causal, the top-left-aligned causal mask of the
        # whole problem, restricted to the rows.
        mask = attn_mask[rows].clone()
        if is_causal:
            positions = torch.arange(N)[rows, None]
            mask |= torch.arange(N)[None, :] > positions
        want_out, want_lse = reference.attention(
            q[:, :, rows].double(), k.double(), v.double(), attn_mask=mask,
            key_padding_mask=key_padding_mask,
        )
        torch.testing.assert_close(out[:, :, rows].double(), want_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[:, :, rows].double(), want_lse, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Mask element offsets past 2^31: a few query rows, masks read through views whose elements lie past 2^31 (and
# whose row strides pass it) in a storage that is mostly never touched (reserved, not resident).

FAR = 2**31 + 17  # the first element's offset and the row stride of a far view, in elements


def _far(values, row_stride=FAR):
    """``values`` (R, C) written into a view of a new storage at element offset FAR, rows ``row_stride``
    elements apart."""
    rows, cols = values.shape
    storage = torch.empty(FAR + (rows - 1) * row_stride + cols, dtype=values.dtype)
    view = storage.as_strided((rows, cols), (row_stride, 1), FAR)
    view.copy_(values)
    return view


def _far_masks():
    """(attn_mask, key_padding_mask) for B=2, H=2, L=3, S=70 as compact tensors and as far views: a bool
    (L, S) mask with rows 2^31+ elements apart, a float16 (B, S) padding mask whose batch rows are too."""
    g = torch.Generator().manual_seed(5)
    attn_mask = torch.rand(3, 70, generator=g) < 0.3
    key_padding_mask = torch.randn(2, 70, generator=g).to(torch.float16)
    key_padding_mask[1, :40] = float("-inf")
    return (attn_mask, key_padding_mask), (_far(attn_mask), _far(key_padding_mask))


def _far_cases(dtype=torch.float32):
    (mask, padding), (far_mask, far_padding) = _far_masks()
    assert far_mask.stride(0) > 2**31 and far_padding.storage_offset() > 2**31
    return make_qkv(2, 2, 3, 70, 8, 8, dtype=dtype), dict(attn_mask=mask, key_padding_mask=padding), dict(
        attn_mask=far_mask, key_padding_mask=far_padding
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_mask_offsets_past_2_to_31(device, is_causal, dtype):
    # bfloat16 too: the 16-bit kernels read the masks in their own loops (the tensor cores' on cuda-emu).
    if device.backend in ("cuda", "mps"):
        pytest.skip("views past 2^31 elements of a device storage would need 2^31+ bytes of device memory")
    (q, k, v), masks, far_masks = _far_cases(dtype)
    kernel_or_skip(device, q, k, v, is_causal=is_causal, **far_masks)
    with torch.no_grad():
        out, lse = attnx.attention(q, k, v, **far_masks, is_causal=is_causal)
    assert_matches_reference(out, lse, q, k, v, **masks, is_causal=is_causal)


def test_mask_offsets_past_2_to_31_backward(device):
    if device.backend in ("cuda", "mps"):
        pytest.skip("views past 2^31 elements of a device storage would need 2^31+ bytes of device memory")
    (q, k, v), masks, far_masks = _far_cases()
    kernel_or_skip(device, q, k, v, backward=True, **far_masks)
    out, lse = attnx.attention(q, k, v, **masks)
    grad_out = torch.randn_like(out)
    got = attnx.ops.attention_backward(grad_out, q, k, v, out, lse, **far_masks)
    want = attnx.ops.attention_backward(grad_out, q, k, v, out, lse, **masks)
    for name, g, w in zip(("grad_query", "grad_key", "grad_value"), got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------------------
# Key and value batch strides past 2^31: both views of one mostly untouched bfloat16 storage, batch 1 at an
# element offset past 2^31.


def _far_kv(k, v):
    """k and v (B=2, H, S, D) copied into views of one storage, batch stride FAR, v between k's batches."""
    assert k.shape == v.shape and k.shape[0] == 2
    per_batch = k[0].numel()
    storage = torch.empty(FAR + 2 * per_batch, dtype=k.dtype)
    sizes, inner = tuple(k.shape), k[0].stride()
    far_k = storage.as_strided(sizes, (FAR, *inner), 0)
    far_v = storage.as_strided(sizes, (FAR, *inner), per_batch)
    far_k.copy_(k)
    far_v.copy_(v)
    return far_k, far_v


def _far_kv_case():
    q, k, v = make_qkv(2, 2, 3, 70, 8, 8, dtype=torch.bfloat16)
    far_k, far_v = _far_kv(k, v)
    assert far_k.stride(0) > 2**31 and far_v[1].storage_offset() > 2**31
    return q, k, v, far_k, far_v


def test_key_value_strides_past_2_to_31(device):
    if device.backend in ("cuda", "mps"):
        pytest.skip("views past 2^31 elements of a device storage would need 2^31+ bytes of device memory")
    q, k, v, far_k, far_v = _far_kv_case()
    mask = _far_masks()[0][0]
    kernel_or_skip(device, q, far_k, far_v, attn_mask=mask)
    out, lse = attnx.attention(q, far_k, far_v, attn_mask=mask)
    want_out, want_lse = attnx.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert_matches_reference(out, lse, q, k, v, attn_mask=mask)
    grad_out = torch.randn_like(out)
    got = attnx.ops.attention_backward(grad_out, q, far_k, far_v, out, lse, attn_mask=mask)
    want = attnx.ops.attention_backward(grad_out, q, k, v, out, lse, attn_mask=mask)
    for name, g, w in zip(("grad_query", "grad_key", "grad_value"), got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
