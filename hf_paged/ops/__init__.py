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
"""

from __future__ import annotations

import torch

from .reference import copy_blocks_torch, paged_attention_torch, plan_torch_attention, write_kv_torch

__all__ = ["paged_attention", "write_kv", "copy_blocks", "plan_torch_attention", "resolve_backend", "BACKENDS",
           "triton_available"]

BACKENDS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    if key_cache.dtype not in _FLOAT_DTYPES or value_cache.dtype != key_cache.dtype:
        _fail(f"key/value caches must share one of {_FLOAT_DTYPES}, got {key_cache.dtype} and {value_cache.dtype}.")
    if value_cache.device != key_cache.device:
        _fail(f"key_cache is on {key_cache.device} but value_cache is on {value_cache.device}; put both on one device.")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        _fail("key_cache and value_cache must be contiguous; call .contiguous() once when you create the pool.")


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
) -> None:
    """Write new keys and values into the pool, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int32 or int64, slot ``block * block_size + offset`` of each token.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
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
    write_kv_unchecked(key, value, key_cache, value_cache, slot_mapping, resolve_backend(backend, key_cache.device))


def write_kv_unchecked(key, value, key_cache, value_cache, slot_mapping, backend: str) -> None:
    """:func:`write_kv` without argument checks or ``"auto"`` (the model path checks once per step)."""
    if backend == "triton":
        from .triton_kernels import write_kv_triton

        write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src[i]`` to ``dst[i]`` in both caches (copy-on-write of shared blocks)."""
    copy_blocks_torch(key_cache, value_cache, src, dst)


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
        max_query_len, max_seq_len: optional host-side maxima, saving a device sync when the caller knows them.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]``, same dtype as ``query``.
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
    if not isinstance(scale, (int, float)):
        _fail(f"scale must be a Python float, got {type(scale).__name__}.")
    return paged_attention_unchecked(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
        resolve_backend(backend, query.device), max_query_len, max_seq_len,
    )


def paged_attention_unchecked(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              sliding_window, backend: str, max_query_len=None, max_seq_len=None, plan=None):
    """:func:`paged_attention` without argument checks; ``backend`` is ``"torch"`` or ``"triton"``.

    ``plan`` (torch backend): a :class:`~hf_paged.ops.reference.TorchAttentionPlan` shared by the layers of a step.
    """
    if backend == "triton":
        from .triton_kernels import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )
    return paged_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
        max_query_len=max_query_len, max_seq_len=max_seq_len, plan=plan,
    )
