"""Paged-attention ops, usable on their own (like FlashInfer's or vLLM's).

Layout of the KV pool, per layer: ``key_cache``/``value_cache`` of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A sequence's logical block ``i`` lives in physical block ``block_tables[s, i]``; token ``p`` of it sits at
slot ``block_tables[s, p // block_size] * block_size + p % block_size``.

Example::

    import torch
    from hf_paged import ops

    key_cache = torch.zeros(64, 16, 2, 64)                    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = torch.zeros_like(key_cache)
    block_tables = torch.tensor([[7, 3], [12, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)       # KV length including the new tokens
    query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)  # one new token per sequence (decode)
    slot_mapping = torch.tensor([3 * 16 + 3, 12 * 16 + 4])    # where the new tokens' K/V go
    k_new = v_new = torch.randn(2, 2, 64)
    ops.write_kv(k_new, v_new, key_cache, value_cache, slot_mapping)
    out = ops.paged_attention(torch.randn(2, 8, 64), key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, scale=64 ** -0.5)  # [2, 8, 64]

Options, all off by default: ``softcap=`` (Gemma2 logit soft-capping), ``sinks=`` (gpt-oss attention sinks), and fp8
blocks: a ``torch.uint8`` pool holding float8 e4m3fn bits with scale caches ``k_scale``/``v_scale`` of one bfloat16
scale per slot and KV head, which ``write_kv`` fills with each token's own scale (``ops.fp8_scales``)::

    key_cache = torch.zeros(64, 16, 2, 64, dtype=torch.uint8)  # fp8 bits
    value_cache = torch.zeros_like(key_cache)
    k_scale = torch.zeros(64, 16, 2, dtype=torch.bfloat16)    # [num_blocks, block_size, num_kv_heads]
    v_scale = torch.zeros_like(k_scale)
    ops.write_kv(k_new, v_new, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    query = torch.randn(2, 8, 64)                              # [num_tokens, num_q_heads, head_dim]
    out = ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale=0.125,
                              k_scale=k_scale, v_scale=v_scale)  # [2, 8, 64]

Every example in this package's docstrings runs as written (``tests/test_ops_api.py`` executes them).
"""

from __future__ import annotations

import sys

import torch

from .metadata import AttentionMetadata
from .reference import copy_blocks_torch, fp8_scales, paged_attention_torch, plan_torch_attention, write_kv_torch

__all__ = ["paged_attention", "write_kv", "copy_blocks", "fp8_scales", "plan_torch_attention", "resolve_backend",
           "AttentionMetadata", "BACKENDS", "triton_available"]

BACKENDS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POOL_DTYPES = _FLOAT_DTYPES + (torch.uint8,)  # uint8: float8 e4m3fn bits, with k_scale / v_scale


# The Triton kernels are imported on first use, not at the top: triton is optional and importing triton_kernels
# without it raises ImportError (triton_available() reports that as False); and triton fixes interpreter or compiler
# (TRITON_INTERPRET) when the kernels are defined, which must not happen at `import hf_paged`.
_TRITON_MODULE = __name__ + ".triton_kernels"


def _triton_kernels():
    """The Triton kernels module, imported on first use; found in ``sys.modules`` after that, which costs far less
    per call than an import statement."""
    module = sys.modules.get(_TRITON_MODULE)
    if module is None:
        from . import triton_kernels as module
    return module


def triton_available() -> bool:
    """Whether the Triton kernels can run here (a CUDA device, or the CPU interpreter via TRITON_INTERPRET=1)."""
    try:
        from . import triton_kernels
    except Exception:
        return False
    return torch.cuda.is_available() or triton_kernels._INTERPRETED


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` picks Triton on CUDA tensors and torch elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend


def _fail(msg: str):
    raise ValueError(msg)


def _check_pool(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if not isinstance(key_cache, torch.Tensor) or not isinstance(value_cache, torch.Tensor):
        _fail("key_cache and value_cache must be torch.Tensors of shape [num_blocks, block_size, num_kv_heads, "
              "head_dim].")
    if key_cache.dim() != 4:
        _fail(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim] (4 dims), got shape "
            f"{tuple(key_cache.shape)}."
        )
    if 0 in key_cache.shape:
        _fail(f"key_cache has an empty dimension: shape {tuple(key_cache.shape)}.")
    if value_cache.shape != key_cache.shape:
        _fail(f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape {tuple(key_cache.shape)}.")
    if key_cache.dtype not in _POOL_DTYPES or value_cache.dtype != key_cache.dtype:
        _fail(f"key/value caches must share one of {_POOL_DTYPES} (uint8 holds float8 e4m3fn bits), got "
              f"{key_cache.dtype} and {value_cache.dtype}.")
    if value_cache.device != key_cache.device:
        _fail(f"key_cache is on {key_cache.device} but value_cache is on {value_cache.device}; put both on one device.")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        _fail("key_cache and value_cache must be contiguous; call .contiguous() once when you create the pool.")


def _check_kv_scales(key_cache: torch.Tensor, k_scale, v_scale) -> None:
    """A uint8 (fp8) pool needs both scale caches, ``[num_blocks, block_size, num_kv_heads]`` bfloat16 on its device;
    a float pool takes none."""
    shape = tuple(key_cache.shape[:3])
    shape_text = "[" + ", ".join(map(str, shape)) + "]"
    if key_cache.dtype != torch.uint8:
        if k_scale is not None or v_scale is not None:
            _fail(f"k_scale/v_scale apply only to a uint8 (fp8 e4m3fn) pool, but the pool is {key_cache.dtype}; "
                  "drop them, or store the pool as torch.uint8.")
        return
    if k_scale is None or v_scale is None:
        _fail(f"A uint8 pool holds fp8 e4m3fn blocks and needs the scale caches k_scale and v_scale ({shape_text} "
              "bfloat16, one scale per slot and KV head, value = fp8 * scale); make them once with "
              "torch.zeros(key_cache.shape[:3], dtype=torch.bfloat16) and pass them to every write_kv and "
              "paged_attention call on this pool.")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or tuple(t.shape) != shape:
            _fail(f"{name} must be a bfloat16 scale cache of shape {shape_text} ([num_blocks, block_size, "
                  f"num_kv_heads], one scale per slot and KV head), got {getattr(t, 'dtype', type(t).__name__)} "
                  f"{tuple(getattr(t, 'shape', ()))}; make it with torch.zeros(key_cache.shape[:3], "
                  "dtype=torch.bfloat16).")
        if t.device != key_cache.device:
            _fail(f"{name} is on {t.device} but the KV cache is on {key_cache.device}; move it with "
                  ".to(key_cache.device).")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous; make it once with torch.zeros(key_cache.shape[:3], "
                  "dtype=torch.bfloat16).")
        if t.device != key_cache.device:
            _fail(f"{name} is on {t.device} but the KV cache is on {key_cache.device}; move it with "
                  ".to(key_cache.device).")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous; call .contiguous() once when you make it.")


def _check_softcap_sinks(softcap, sinks, num_q_heads: int, device: torch.device) -> None:
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf")
    ):
        _fail(f"softcap must be a positive finite float (scores -> softcap * tanh(scores / softcap)) or None, "
              f"got {softcap!r}.")
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (num_q_heads,):
        _fail(f"sinks must be a float tensor of shape [num_q_heads] = [{num_q_heads}] (one logit per query head), "
              f"got {getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}.")
    if sinks.device != device:
        _fail(f"sinks is on {sinks.device} but the query is on {device}; move it with .to(query.device).")


def _check_index(name: str, t: torch.Tensor, dims: int, device: torch.device, dtypes=(torch.int32,)) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in dtypes:
        _fail(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}; convert with .to(torch.int32).")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}.")
    if t.device != device:
        _fail(f"{name} is on {t.device} but the KV cache is on {device}; move it with .to(key_cache.device).")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new keys and values into the pool, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, float or uint8 (fp8 e4m3fn bits).
        slot_mapping: ``[num_tokens]`` int32 or int64, slot ``block * block_size + offset`` of each token.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        k_scale, v_scale: uint8 pools only, the scale caches ``[num_blocks, block_size, num_kv_heads]`` bfloat16:
            each token's K (V) gets, per KV head, the scale :func:`fp8_scales` picks from its own values, stored at
            its slot here; the pool stores ``x / scale`` rounded to e4m3fn (never clamped: the scale fits the token).

    Example::

        import torch
        from hf_paged import ops

        key_cache = torch.zeros(8, 4, 2, 16)                # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache = torch.zeros_like(key_cache)
        key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)  # [num_tokens, num_kv_heads, head_dim]
        ops.write_kv(key, value, key_cache, value_cache, torch.tensor([20, 21, 22]))  # block 5, offsets 0-2
        assert torch.equal(key_cache[5, :3], key)
    """
    _check_pool(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
        _fail(f"key and value must be torch.Tensors of shape [num_tokens, {num_kv_heads}, {head_dim}].")
    if key.device != key_cache.device or value.device != key_cache.device:
        _fail(f"key/value are on {key.device}/{value.device} but the KV cache is on {key_cache.device}; "
              "move them with .to(key_cache.device).")
    if key.dtype not in _FLOAT_DTYPES or value.dtype not in _FLOAT_DTYPES:
        _fail(f"key/value must be floating point ({_FLOAT_DTYPES}), got {key.dtype} and {value.dtype}.")
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        _fail(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}."
        )
    _check_index("slot_mapping", slot_mapping, 1, key_cache.device, (torch.int32, torch.int64))
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens.")
    _check_kv_scales(key_cache, k_scale, v_scale)
    write_kv_unchecked(key, value, key_cache, value_cache, slot_mapping.contiguous(),
                       resolve_backend(backend, key_cache.device), k_scale=k_scale, v_scale=v_scale)


def write_kv_unchecked(key, value, key_cache, value_cache, slot_mapping, backend: str, *, k_scale=None,
                       v_scale=None) -> None:
    """:func:`write_kv` without argument checks or ``"auto"`` (the model path checks once per step);
    ``slot_mapping`` contiguous."""
    if backend == "triton":
        _triton_kernels().write_kv_triton(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                                          v_scale=v_scale)
    else:
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, *,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Copy whole blocks ``src[i]`` to ``dst[i]`` in both caches (copy-on-write of shared blocks); any pool dtype.
    A uint8 (fp8) pool's blocks mean something only with their scales, so it needs its scale caches
    ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` (``ValueError`` without them), whose blocks are
    copied too.

    Example::

        import torch
        from hf_paged import ops

        key_cache = torch.randn(8, 4, 2, 16)                # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache = torch.randn_like(key_cache)
        ops.copy_blocks(key_cache, value_cache, torch.tensor([2]), torch.tensor([6]))  # int64 block ids
        assert torch.equal(key_cache[6], key_cache[2]) and torch.equal(value_cache[6], value_cache[2])
    """
    _check_kv_scales(key_cache, k_scale, v_scale)
    copy_blocks_torch(key_cache, value_cache, src, dst, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    backend: str = "auto",
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    chunk: int | None = None,
    query_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries over KV read through block tables.

    Query ``i`` of a sequence with ``q_len`` queries sits at position ``seq_lens[s] - q_len + i`` and attends to KV
    positions ``<=`` its own; with ``sliding_window=W`` only to the last ``W`` of those (itself included).

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``, the queries of all sequences back to back.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``num_q_heads`` must be a
            multiple of ``num_kv_heads`` (grouped-query attention).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, logical block -> physical block.
        seq_lens: ``[num_seqs]`` int32, each sequence's KV length including its new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32, where each sequence's queries start in ``query``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: optional window size ``W``.
        backend: ``"torch"`` (reference), ``"triton"`` (kernels) or ``"auto"`` (Triton on CUDA, torch otherwise).
        max_query_len, max_seq_len: optional host-side maxima, saving a device sync when the caller knows them
            (``max_seq_len`` may be a bucketed width above every ``seq_lens``, up to ``max_blocks_per_seq *
            block_size``).
        softcap: logit soft-capping (Gemma2): scores (already times ``scale``) become ``softcap * tanh(scores /
            softcap)``, before the causal/window mask.
        sinks: ``[num_q_heads]`` float, attention sinks (gpt-oss ``s_aux``): one logit per query head joins the softmax
            denominator and contributes no value.
        k_scale, v_scale: the scale caches ``[num_blocks, block_size, num_kv_heads]`` bfloat16, required with a
            uint8 pool (fp8 e4m3fn bits, as :func:`write_kv` fills them): the stored value is ``fp8 * scale``, read
            through the same block tables.
        chunk: chunked attention (Llama 4): a query at position ``p`` sees only positions ``floor(p / chunk) *
            chunk .. p`` (with ``sliding_window``, both bounds apply).
        query_limits: ``[num_tokens]`` int32, bidirectional spans (Gemma 3's image tokens): query ``i`` sees the
            positions ``<= query_limits[i]`` (at or after its own, before its sequence's end) instead of ``<=`` its
            own; the window and the chunk still count from its own position. A span's tokens each get the span's
            last position. None: every query its own.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]``, same dtype as ``query``.

    Example (one step of continuous batching: a 5-token chunk of a prompt after 3 cached tokens, and a decode row)::

        import torch
        from hf_paged import ops

        key_cache = torch.randn(8, 4, 2, 16)                # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache = torch.randn_like(key_cache)
        block_tables = torch.tensor([[3, 1], [6, 0]], dtype=torch.int32)  # row 1 uses one block; 0 is padding
        seq_lens = torch.tensor([8, 2], dtype=torch.int32)  # history + new tokens
        query_start_loc = torch.tensor([0, 5, 6], dtype=torch.int32)  # 5 queries, then 1
        query = torch.randn(6, 4, 16)                       # [num_tokens, num_q_heads, head_dim]: GQA, 2 per KV head
        out = ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                  scale=16 ** -0.5)         # [6, 4, 16]
    """
    _check_pool(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        _fail(f"query must be [num_tokens, num_q_heads, head_dim], got shape {tuple(getattr(query, 'shape', ()))}.")
    if query.shape[2] != head_dim:
        _fail(f"query head_dim {query.shape[2]} differs from the cache's head_dim {head_dim}.")
    if query.shape[1] % num_kv_heads:
        _fail(f"num_q_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    if query.dtype not in _FLOAT_DTYPES:
        _fail(f"query dtype must be one of {_FLOAT_DTYPES}, got {query.dtype}.")
    if query.device != key_cache.device:
        _fail(f"query is on {query.device} but the KV cache is on {key_cache.device}.")
    _check_index("block_tables", block_tables, 2, key_cache.device)
    _check_index("seq_lens", seq_lens, 1, key_cache.device)
    _check_index("query_start_loc", query_start_loc, 1, key_cache.device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences (seq_lens).")
    if query_start_loc.shape[0] != num_seqs + 1:
        _fail(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}.")
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        _fail(f"sliding_window must be a positive int or None, got {sliding_window!r}.")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        _fail(f"chunk must be a positive int or None, got {chunk!r}.")
    if not isinstance(scale, (int, float)):
        _fail(f"scale must be a Python float, got {type(scale).__name__}.")
    _check_softcap_sinks(softcap, sinks, query.shape[1], query.device)
    _check_kv_scales(key_cache, k_scale, v_scale)
    if query_limits is not None:
        _check_index("query_limits", query_limits, 1, key_cache.device)
        if query_limits.shape[0] != query.shape[0]:
            _fail(f"query_limits must have one entry per query ({query.shape[0]}), got {query_limits.shape[0]}.")
        query_limits = query_limits.contiguous()
    if max_seq_len is not None and max_seq_len > block_tables.shape[1] * block_size:
        _fail(f"max_seq_len={max_seq_len} exceeds what block_tables can address ({block_tables.shape[1]} blocks x "
              f"{block_size} = {block_tables.shape[1] * block_size}); pass a width <= that, or None.")
    meta = AttentionMetadata(block_tables, seq_lens.contiguous(), query_start_loc.contiguous(), max_query_len,
                             max_seq_len, sliding_window, chunk=chunk, query_limits=query_limits)
    return paged_attention_unchecked(
        query, key_cache, value_cache, meta, float(scale), resolve_backend(backend, query.device),
        softcap=None if softcap is None else float(softcap),
        sinks=None if sinks is None else sinks.to(torch.float32).contiguous(), k_scale=k_scale, v_scale=v_scale,
    )


def paged_attention_unchecked(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, backend: str, *,
                              softcap=None, sinks=None, k_scale=None, v_scale=None, reuse_partials: bool = False):
    """:func:`paged_attention` without argument checks, on an :class:`~hf_paged.ops.metadata.AttentionMetadata`;
    ``backend`` is ``"torch"`` or ``"triton"``; ``seq_lens`` and ``query_start_loc`` contiguous. The model path and
    the custom op call the backends through here.

    ``meta.plan`` (torch backend): the step's read layout (:class:`~hf_paged.ops.layout.ReadLayout`), shared by
    the layers of a step. ``reuse_partials`` (Triton): split-KV scratch kept per device and shape (eager calls only).
    """
    if backend == "triton":
        return _triton_kernels().paged_attention_triton(
            query, key_cache, value_cache, meta, scale, softcap=softcap, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale, reuse_partials=reuse_partials,
        )
    return paged_attention_torch(query, key_cache, value_cache, meta, scale, softcap=softcap, sinks=sinks,
                                 k_scale=k_scale, v_scale=v_scale)
