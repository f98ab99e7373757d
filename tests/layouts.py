"""Input factories: the same logical tensor in the memory layouts attnx must read without a detour; and what
tests ask of layouts: a tensor moved to another device with its exact layout (``to_device``), an output's
density (``is_non_overlapping_and_dense``).

``make`` returns a tensor of the requested logical ``shape`` (last dim = features) whose values come from
the generator, laid out as named. Kernel tests take the layout as a parameter: test_linear.py,
test_mha_op.py, test_threads.py, test_metal_emulation.py; test_cuda.py and test_fuzz.py use the other two.
"""

import torch

# Layouts whose leading dims form one dense block of rows: linear folds them into one GEMM without a copy.
FOLDABLE = ["contiguous", "transposed", "sliced", "column_major", "size1_huge_stride"]
# Layouts that cannot fold: linear copies once (gapped, last_dim_strided) or broadcasts its result (expanded).
NOT_FOLDABLE = ["gapped", "expanded", "last_dim_strided"]
LAYOUTS = FOLDABLE + NOT_FOLDABLE


def make(shape, layout: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
    shape = tuple(shape)
    n = len(shape)

    def rand(s):
        return torch.randn(s, dtype=torch.float64).to(dtype=dtype, device=device)

    if layout == "contiguous" or n == 0:
        return rand(shape)
    if layout == "transposed":
        # x.transpose(0, 1) of the swapped shape: batch_first -> seq_first views, and at B=1 the
        # (D, B*D, 1) strides of the upstream report.
        if n < 3:
            return rand(shape)
        swapped = (shape[1], shape[0], *shape[2:])
        return rand(swapped).transpose(0, 1)
    if layout == "sliced":
        # A window inside a larger buffer: a storage offset, and a row stride larger than the row.
        if n < 2:
            return rand((shape[0] + 3,))[1:-2]
        big = rand((shape[0] + 2, *shape[1:-1], shape[-1] + 3))
        return big[1 : 1 + shape[0], ..., : shape[-1]]
    if layout == "column_major":
        # Every stride reversed: the feature dim is the outermost in memory (last-dim stride != 1).
        return rand(shape[::-1]).permute(*reversed(range(n)))
    if layout == "size1_huge_stride":
        # Size-1 dims carry arbitrary, huge strides (they never move a pointer).
        base = rand(shape)
        strides = [2**40 + 7 if s == 1 else st for s, st in zip(shape, base.stride(), strict=True)]
        return base.as_strided(shape, strides)
    if layout == "gapped":
        # Leading dims with gaps between blocks of rows: x[:, :b] of an (a, 2b, K) buffer.
        if n < 3:
            return rand(shape)
        big = rand((*shape[:-2], 2 * shape[-2], shape[-1]))
        return big[..., : shape[-2], :]
    if layout == "expanded":
        # Stride 0 on the outermost leading dim (an expanded / broadcast input).
        if n < 2:
            return rand(shape)
        return rand((1, *shape[1:])).expand(shape)
    if layout == "last_dim_strided":
        # Every other element of a wider buffer along the feature dim.
        return rand((*shape[:-1], 2 * shape[-1]))[..., ::2]
    raise ValueError(f"unknown layout {layout!r}")


def to_device(x, device):
    """``x`` (or the tensors in a tuple, list or dict) on ``device``: same sizes, strides, storage offset."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(a, device) for a in x)
    if isinstance(x, dict):
        return {k: to_device(a, device) for k, a in x.items()}
    if not isinstance(x, torch.Tensor):
        return x
    numel = x.untyped_storage().nbytes() // x.element_size()
    storage = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (numel,))
    return storage.to(device).as_strided(x.shape, x.stride(), x.storage_offset())


def is_non_overlapping_and_dense(t):
    """Every element of a span of t.numel() elements is addressed exactly once."""
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: t.stride(d))
    extent = 1
    for d in dims:
        if t.stride(d) != extent:
            return False
        extent *= t.shape[d]
    return True
