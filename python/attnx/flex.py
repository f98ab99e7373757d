"""FlexAttention's masks on attnx's kernels: ``BlockMask`` as a block-sparse mask, and ``flex_attention``.

FlexAttention expresses a mask as a ``mask_mod`` and its ``BlockMask``: per query block, the key blocks that
are FULL (every pair kept) and those that are PARTIAL (``mask_mod`` decides per pair). :func:`block_sparse`
turns a ``BlockMask`` into :func:`attnx.attention`'s block-sparse mask without calling ``mask_mod`` on a FULL
or an EMPTY block: the PARTIAL blocks' pairs are evaluated once, vectorised as ``create_block_mask`` does, and
packed a bit per pair. The result is kept while the ``BlockMask`` lives, so a model whose layers share one
``BlockMask`` converts it once. :func:`flex_attention` has
``torch.nn.attention.flex_attention.flex_attention``'s signature and runs on attnx's kernels when
``score_mod`` is None; a ``score_mod`` (a function of each score) goes to PyTorch's own implementation,
unchanged.

The takeover, opt-in and undone completely, makes unchanged code that calls
``torch.nn.attention.flex_attention.flex_attention`` run :func:`flex_attention`, in eager mode and under
``torch.compile`` with the ``eager`` and ``aot_eager`` backends, forward and backward::

    attnx.flex.enable()          # process-wide; attnx.flex.disable() undoes it
    with attnx.flex.enabled():   # for a block
        loss = model(x).sum(); loss.backward()

It swaps the code of PyTorch's function object for a trampoline (and back): a name bound by
``from torch.nn.attention.flex_attention import flex_attention`` before ``enable()`` is that same object, so
every call site is covered without touching it. Calls that attnx does not take run PyTorch's code unchanged:
a ``score_mod``, ``kernel_options``, the row maxima (``return_aux`` with ``max_scores``), a ``BlockMask`` that
the device's attnx kernels do not take (CUDA's take blocks of their tiles, in the dtypes and head dims of the
tensor-core kernels, and a backward only where the fused one is on; Metal's take none), and code that inductor
compiles (PyTorch's generated kernels).
"""

import contextlib
import inspect
import types
import weakref
from typing import Any

import torch
from torch import Tensor

from attnx import _switch, ops

__all__ = ["block_sparse", "disable", "enable", "enabled", "flex_attention", "is_enabled"]

# BlockMask -> its options, and the device kernels' answers for it (_kernels_take). Weak keys: an entry goes
# with its BlockMask.
_cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_answers: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

# Pairs of mask_mod evaluated per vectorised call (bounds the temporaries of a large PARTIAL set).
_PAIRS_PER_CALL = 1 << 22


def block_sparse(block_mask: Any) -> dict:
    """A FlexAttention ``BlockMask`` as :func:`attnx.attention`'s block-sparse mask options.

    Args:
        block_mask: a ``torch.nn.attention.flex_attention.BlockMask`` (its ``kv_num_blocks``,
            ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices``, ``BLOCK_SIZE``, ``seq_lengths`` and
            ``mask_mod``).

    Returns:
        ``{"block_map": ..., "block_bits": ..., "block_q": ..., "block_k": ...}`` on the BlockMask's device,
        to pass to :func:`attnx.attention` as keyword arguments for ``(L, S) = block_mask.seq_lengths``. Kept
        while the BlockMask lives.
    """
    options = _cache.get(block_mask)
    if options is None:
        options = _cache[block_mask] = _convert(block_mask, *block_mask.seq_lengths)
    return options


def _listed(num: Tensor | None, indices: Tensor | None, k_blocks: int) -> tuple[Tensor, Tensor] | None:
    """For each slot ``(b, h, query block, j)`` of a BlockMask's index list: its key block, or ``k_blocks``
    (the map's spare column) where the slot is past the row's count; and whether the slot is listed."""
    if num is None or indices is None:
        return None
    slots = torch.arange(indices.shape[-1], device=indices.device)
    listed = slots < num.unsqueeze(-1)  # (Bm, Hm, QB, N)
    return indices.long().where(listed, k_blocks), listed


def _convert(block_mask: Any, L: int, S: int) -> dict:
    block_q, block_k = block_mask.BLOCK_SIZE
    q_blocks, k_blocks = -(-L // block_q), -(-S // block_k)
    num, indices = block_mask.kv_num_blocks[..., :q_blocks], block_mask.kv_indices[..., :q_blocks, :]
    device = num.device
    Bm, Hm = num.shape[0], num.shape[1]
    # One spare column per row takes the unlisted slots of the index lists; it is cut off at the end.
    block_map = torch.full((Bm, Hm, q_blocks, k_blocks + 1), -1, dtype=torch.int32, device=device)
    full = _listed(getattr(block_mask, "full_kv_num_blocks", None),
                   getattr(block_mask, "full_kv_indices", None), k_blocks)
    if full is not None:
        columns, _ = full
        block_map.scatter_(3, columns[..., :q_blocks, :], -2)
    columns, listed = _listed(num, indices, k_blocks)
    # The PARTIAL blocks, numbered in (b, h, query block, slot) order.
    where = listed.nonzero()  # (P, 4): b, h, query block, slot
    P = where.shape[0]
    ids = torch.full(listed.shape, -1, dtype=torch.int32, device=device)
    ids[listed] = torch.arange(P, dtype=torch.int32, device=device)
    partial = torch.full_like(block_map, -1).scatter_(3, columns, ids)
    block_map = torch.where(partial >= 0, partial, block_map)[..., :k_blocks].contiguous()
    words = -(-block_k // 32)
    bits = torch.empty((P, block_q, words), dtype=torch.int32, device=device)
    if P > 0:
        kb = columns[where[:, 0], where[:, 1], where[:, 2], where[:, 3]]
        step = max(1, _PAIRS_PER_CALL // (block_q * block_k))
        for p0 in range(0, P, step):
            sel = slice(p0, min(P, p0 + step))
            bits[sel] = _pack(_kept(block_mask.mask_mod, where[sel, 0], where[sel, 1],
                                    where[sel, 2] * block_q, kb[sel] * block_k, block_q, block_k, L, S))
    return {"block_map": block_map, "block_bits": bits, "block_q": block_q, "block_k": block_k}


def _kept(mask_mod: Any, b: Tensor, h: Tensor, q0: Tensor, k0: Tensor, block_q: int, block_k: int, L: int,
          S: int) -> Tensor:
    """mask_mod over the pairs of each of n blocks, ``(n, block_q, block_k)`` bool (True: kept); pairs past L
    or S are not kept (and mask_mod sees them clamped into range, so that it never indexes out of it)."""
    device = b.device
    q = q0.unsqueeze(1) + torch.arange(block_q, device=device)  # (n, block_q)
    k = k0.unsqueeze(1) + torch.arange(block_k, device=device)  # (n, block_k)
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    fn = torch.vmap(fn, in_dims=(0, 0, 0, 0))
    with _index_transform():
        kept = fn(b, h, q.clamp(max=L - 1), k.clamp(max=S - 1)).to(torch.bool)
    return kept & (q < L).unsqueeze(2) & (k < S).unsqueeze(1)


def _index_transform() -> Any:
    """What PyTorch's FlexAttention evaluates a mask_mod under: indexing a tensor by a batched index
    (``ids[b, q]``) as torch.index rather than by the index's value, which vmap cannot read (torch 2.10)."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # a torch without it indexes batched tensors itself
        return contextlib.nullcontext()
    return TransformGetItemToIndex()


def _pack(kept: Tensor) -> Tensor:
    """``(n, rows, keys)`` bool -> ``(n, rows, ceil(keys / 32))`` int32 bit rows, bit j of word w set where
    key 32 w + j is *not* kept (attnx's bool masks: True = masked out)."""
    n, rows, keys = kept.shape
    words = -(-keys // 32)
    removed = torch.nn.functional.pad(~kept, (0, 32 * words - keys), value=True).view(n, rows, words, 32)
    weights = torch.ones(32, dtype=torch.int64, device=kept.device).bitwise_left_shift(
        torch.arange(32, device=kept.device))
    packed = (removed.long() * weights).sum(-1)  # in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
    *,
    return_aux: Any = None,
) -> Tensor | tuple[Tensor, Any]:
    """``torch.nn.attention.flex_attention.flex_attention`` on attnx's kernels when ``score_mod`` is None.

    Same arguments, layouts and results: query ``(B, H, L, E)``, key ``(B, Hkv, S, E)``, value
    ``(B, Hkv, S, Ev)``; ``Hkv != H`` only with ``enable_gqa``; a row that sees no key gives out 0 and
    ``lse = -inf`` (FlexAttention's convention; :func:`attnx.attention`'s is ``+inf``). The ``BlockMask``
    becomes attnx's block-sparse mask (:func:`block_sparse`): EMPTY blocks are never read, FULL blocks read
    no mask, PARTIAL blocks a bit per pair; autograd runs attnx's fused backward. A ``score_mod`` changes the
    scores by an arbitrary function, which attnx's kernels do not take: such calls, ``kernel_options``, the
    row maxima and a ``BlockMask`` that the device's attnx kernels do not take (the CPU's take every one;
    CUDA's blocks of their tiles: ``block_q`` a multiple of 16, ``block_k`` of 64, as FlexAttention's
    default 128; Metal's none) go to PyTorch's implementation unchanged.

    Args:
        query: ``(B, H, L, E)``.
        key: ``(B, Hkv, S, E)``.
        value: ``(B, Hkv, S, Ev)``.
        score_mod: None on attnx's kernels; a function of each score goes to PyTorch's implementation.
        block_mask: a ``BlockMask`` for ``(L, S)`` (converted by :func:`block_sparse`), or None (every key).
        scale: the scores' scale; None: ``1/sqrt(E)``.
        enable_gqa: whether ``Hkv`` may divide ``H`` (grouped KV heads, indexed in place).
        return_lse: whether to return the logsumexp too (PyTorch's deprecated form of ``return_aux``).
        kernel_options: PyTorch's kernel options; given, the call goes to PyTorch's implementation.
        return_aux: PyTorch's ``AuxRequest``: ``lse`` on attnx's kernels, ``max_scores`` on PyTorch's.

    Returns:
        out, or ``(out, lse)`` with ``return_lse``, or ``(out, AuxOutput)`` with ``return_aux``, as PyTorch's.

    Raises:
        ValueError: for ``Hkv != H`` without ``enable_gqa``, as PyTorch's.
        RuntimeError: for a ``BlockMask`` made for other lengths, with PyTorch's message.
    """
    from torch.nn.attention import flex_attention as flex

    if not _taken(query, score_mod, block_mask, kernel_options, return_aux):
        # (Under the takeover, PyTorch's function runs the trampoline: its own code is the copy's.)
        pytorch = _pytorch_copy if is_enabled() else flex.flex_attention
        return pytorch(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                       kernel_options, return_aux=return_aux)
    H, Hkv = query.shape[1], key.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={H} and Hkv={Hkv}. "
            "Try setting enable_gqa=True for GQA."
        )
    L, S = query.shape[2], key.shape[2]
    if block_mask is not None:
        # PyTorch's errors (its own wording, where this torch has it).
        q_len, kv_len = block_mask.seq_lengths
        if L > q_len or S > kv_len:
            raise RuntimeError(getattr(flex, "_BLOCK_MASK_TOO_SMALL_ERROR",
                                       "block_mask was created for a smaller length than you use it for"))
        if L < q_len or S < kv_len:
            raise RuntimeError(getattr(flex, "_BLOCK_MASK_TOO_LARGE_ERROR",
                                       "block_mask was created for a larger length than you're using it for"))
    if block_mask is None:
        options = {}
    elif torch.compiler.is_compiling():
        options = (_block_sparse_between_graphs or block_sparse)(block_mask)
    else:
        _prepare_for_compile()
        options = block_sparse(block_mask)
    takes = (_kernels_take_between_graphs if torch.compiler.is_compiling() else None) or _kernels_take
    # (The CPU kernels take every block-sparse mask: no question asked, no dispatch spent.)
    if options and query.device.type != "cpu" and not takes(query, key, value, scale, block_mask, options):
        pytorch = _pytorch_copy if is_enabled() else flex.flex_attention
        return pytorch(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                       kernel_options, return_aux=return_aux)
    out, lse = ops.attention(query, key, value, scale=scale, **options)
    want_lse = return_lse or (return_aux is not None and getattr(return_aux, "lse", False))
    if not want_lse:
        return out if return_aux is None else (out, flex.AuxOutput())
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))
    if return_aux is not None:
        return out, flex.AuxOutput(lse=lse)
    return out, lse


# ------------------------------------------------------------------------------------------------------------
# The takeover


def _trampoline(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                return_lse=False, kernel_options=None, *, return_aux=None):
    # The code PyTorch's flex_attention runs while the takeover is on (its globals are PyTorch's module's:
    # attnx is imported by name).
    import attnx.flex

    return attnx.flex._served(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                              kernel_options, return_aux=return_aux)


_pytorch: Any = None  # PyTorch's function (whose code the takeover swaps), once enable() has run
_pytorch_code: Any = None  # its own code
_pytorch_copy: Any = None  # a function running that code: what the trampoline falls back to


# What torch.compile needs of this module, made on first use (each wrapper imports torch._dynamo, seconds
# that `import attnx` does not pay): block_sparse under torch.compiler.disable, since the conversion reads
# data (the listed blocks' count, the cache), so that it runs eagerly between graphs and returns the cached
# result for a BlockMask it has seen; _kernels_take likewise (it asks the backend, whose answer is a string);
# and _compiling_with_inductor as a constant of the graph being traced.
_block_sparse_between_graphs: Any = None
_kernels_take_between_graphs: Any = None
_inductor_probe: Any = None


def _prepare_for_compile() -> None:
    global _block_sparse_between_graphs, _kernels_take_between_graphs, _inductor_probe
    if _block_sparse_between_graphs is None:
        _block_sparse_between_graphs = torch.compiler.disable(block_sparse)
        _kernels_take_between_graphs = torch.compiler.disable(_kernels_take)
        _inductor_probe = torch.compiler.assume_constant_result(_compiling_with_inductor)


def _compiling_with_inductor() -> bool:
    """Whether torch.compile is tracing for inductor (asked while dynamo traces)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
        names = (getattr(backend, n, None) for n in ("_compiler_name", "compiler_name", "__name__"))
        return next((n for n in names if n), None) not in ("eager", "aot_eager")
    except Exception:  # another torch's internals: leave the call to PyTorch
        return True


def _taken(query, score_mod, block_mask, kernel_options, return_aux) -> bool:
    """Whether attnx's kernels may take a flex_attention call: no score_mod, kernel_options or row maxima (a
    BlockMask off the CPU is asked of the device's kernels once converted: _kernels_take)."""
    return (
        score_mod is None
        and kernel_options is None
        and not (return_aux is not None and getattr(return_aux, "max_scores", False))
    )


def _kernels_take(query, key, value, scale, block_mask, options) -> bool:
    """Whether the device's attnx kernels take the call with block_mask's block-sparse mask `options`: its
    forward, and its backward where autograd will ask for one (the backend's own answer, ops.kernel_for),
    asked once per BlockMask and kind of call (the layers of a model share both)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    answers = _answers.setdefault(block_mask, {})
    call = (query.device, query.dtype, query.shape, key.shape, value.shape, scale, grad)
    if call not in answers:
        answers[call] = all(ops.kernel_for(query, key, value, backward=b, scale=scale, **options) is not None
                            for b in ((False, True) if grad else (False,)))
    return answers[call]


def _served(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options, *,
            return_aux):
    """The takeover's flex_attention: PyTorch's code for what inductor compiles, else :func:`flex_attention`
    (which leaves to PyTorch's code what attnx's kernels do not take)."""
    if torch.compiler.is_compiling() and (_inductor_probe is None or _inductor_probe()):
        return _pytorch_copy(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                             kernel_options, return_aux=return_aux)
    return flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                          kernel_options, return_aux=return_aux)


def enable() -> None:
    """Turn the takeover on (nothing happens when it is on already).

    Raises:
        RuntimeError: where this torch has no FlexAttention, or its ``flex_attention`` takes other parameters
            than the trampoline (then nothing is changed).
    """
    global _pytorch, _pytorch_code, _pytorch_copy
    if is_enabled():
        return
    from torch.nn.attention import flex_attention as flex

    fn = flex.flex_attention
    ours, theirs = inspect.signature(_trampoline), inspect.signature(fn)
    def parameters(signature):
        return [(p.name, p.kind) for p in signature.parameters.values()]

    if parameters(ours) != parameters(theirs):
        raise RuntimeError(f"attnx.flex.enable: this torch's flex_attention{theirs} differs from the "
                           f"parameters the takeover knows, {ours}; call attnx.flex.flex_attention instead")
    _pytorch, _pytorch_code = fn, fn.__code__
    _pytorch_copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                       fn.__closure__)
    _pytorch_copy.__kwdefaults__ = fn.__kwdefaults__
    _prepare_for_compile()
    fn.__code__ = _trampoline.__code__
    _reset_dynamo()


def disable() -> None:
    """Turn the takeover off: PyTorch's code again (nothing happens when it is off)."""
    if is_enabled():
        _pytorch.__code__ = _pytorch_code
        _reset_dynamo()


def _reset_dynamo() -> None:
    """torch.compile's caches hold code traced through flex_attention as it was: dropped when it changes."""
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def enabled():
    """The takeover on for a ``with`` block, then back to how it was."""
    return _switch.while_on(is_enabled, enable, disable)


def is_enabled() -> bool:
    """Whether the takeover is on."""
    return _pytorch is not None and _pytorch.__code__ is _trampoline.__code__
