"""Index math past 32 bits on the CPU: attention over L = S = 65536 (B*H*L*S = 2^33 scores, never stored),
with masks read through stride-0 broadcast dims, checked against the reference on slices of rows at the start,
middle and end, where an index that wrapped at 2^31 would read the wrong keys."""

import pytest
import torch

import attnx
from attnx import reference

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
