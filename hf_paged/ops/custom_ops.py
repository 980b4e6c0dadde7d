"""``write_kv`` and ``paged_attention`` as PyTorch operators (``torch.ops.hf_paged.*``).

Defined with ``torch.library`` (a schema, one implementation for every device, and a fake, shape-only
implementation), so ``torch.compile`` traces a model forward through them without graph breaks, whichever backend
runs inside (the torch reference or the Triton kernels). The low-level ``Library.define``/``impl`` registration is used
rather than ``torch.library.custom_op``: its dispatch costs ~6 us a call here against ~120 us (measured on this CPU).
In eager mode the model path (:func:`write_kv`, :func:`paged_attention` below) calls the same implementations without
the dispatcher (two calls per layer per step: the round trip and the read layout's conversion to a tensor list cost
~10 us a call on this CPU); while dynamo traces, it emits the operators.

Only tensors and values that stay fixed over a generation cross the op boundary (a varying Python int would be baked
into a compiled graph and force a recompile each step): the step's :class:`~hf_paged.ops.metadata.AttentionMetadata` is
flattened by :func:`op_arguments` (the torch backend's read layout as a list of tensors whose shapes carry its sizes;
its ints are constant in compiled steps) and rebuilt inside by :func:`from_op_arguments`, which takes the block tables'
(bucketed) width as the length bound. The implementations call the backends directly, without the public functions'
argument checks (the step planner made the arguments).
"""

from __future__ import annotations

import torch

from . import _triton_kernels, paged_attention_unchecked
from .layout import ReadLayout
from .metadata import AttentionMetadata
from .reference import write_kv_torch

WRITE_KV_SCHEMA = ("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                   "Tensor slot_mapping, Tensor(c!)? k_scale, Tensor(d!)? v_scale, str backend) -> ()")
PAGED_ATTENTION_SCHEMA = (
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start_loc, Tensor?[] layout, int[] layout_ints, Tensor? sinks, Tensor? k_scale, "
    "Tensor? v_scale, float scale, int sliding_window, float softcap, int max_query_len, str backend, "
    "int chunk=0, Tensor? query_limits=None) -> Tensor")

_LIB = torch.library.Library("hf_paged", "DEF")
_LIB.define(WRITE_KV_SCHEMA)
_LIB.define(PAGED_ATTENTION_SCHEMA)

_NO_SOFTCAP = 0.0
NO_WINDOW = 0  # how the op's schema spells "no sliding window"


def op_arguments(meta: AttentionMetadata) -> tuple:
    """``(block_tables, seq_lens, query_start_loc, layout_tensors, layout_ints, sliding_window, max_query_len, chunk,
    query_limits)`` of ``meta`` as the op's schema takes them. ``max_seq_len`` does not cross: the op reads the
    tables' width times the block size (a shape, which a compiled graph keeps symbolic) instead of a Python int it
    would bake in."""
    layout_tensors, layout_ints = ReadLayout.op_arguments(meta.plan)
    return (meta.block_tables, meta.seq_lens, meta.query_start_loc, layout_tensors, layout_ints,
            int(meta.sliding_window or NO_WINDOW), int(meta.max_query_len), int(meta.chunk or NO_WINDOW),
            meta.query_limits)


def from_op_arguments(block_tables, seq_lens, query_start_loc, layout_tensors, layout_ints, sliding_window: int,
                      max_query_len: int, block_size: int, chunk: int = NO_WINDOW,
                      query_limits: torch.Tensor | None = None) -> AttentionMetadata:
    """The :class:`AttentionMetadata` that :func:`op_arguments` flattened, its ``max_seq_len`` the tables' width
    times ``block_size``."""
    return AttentionMetadata(block_tables, seq_lens, query_start_loc, max_query_len,
                             block_tables.shape[1] * block_size, sliding_window or None,
                             ReadLayout.from_op_arguments(layout_tensors, layout_ints), chunk or None, query_limits)


def _write_kv_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend: str) -> None:
    if backend == "triton" and value_cache.shape[-1] != key_cache.shape[-1]:  # K, V of two widths (MLA): a pass each
        write = _triton_kernels().write_kv_triton
        write(key, key, key_cache, key_cache, slot_mapping, k_scale=k_scale, v_scale=k_scale)
        write(value, value, value_cache, value_cache, slot_mapping, k_scale=v_scale, v_scale=v_scale)
    elif backend == "triton":
        _triton_kernels().write_kv_triton(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                                          v_scale=v_scale)
    else:
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


_LIB.impl("write_kv", _write_kv_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged::write_kv")
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend) -> None:
    return None


def _paged_attention_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, layout_tensors,
                          layout_ints: list[int], sinks, k_scale, v_scale, scale: float, sliding_window: int,
                          softcap: float, max_query_len: int, backend: str, chunk: int = 0,
                          query_limits=None) -> torch.Tensor:
    meta = from_op_arguments(block_tables, seq_lens, query_start_loc, layout_tensors, layout_ints, sliding_window,
                             max_query_len, key_cache.shape[1], chunk, query_limits)
    return paged_attention_unchecked(query, key_cache, value_cache, meta, scale, backend,
                                     softcap=softcap or None, sinks=sinks, k_scale=k_scale, v_scale=v_scale)


_LIB.impl("paged_attention", _paged_attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged::paged_attention")
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, layout, layout_ints, sinks, k_scale,
      v_scale, scale, sliding_window, softcap, max_query_len, backend, chunk=0, query_limits=None):
    return torch.empty_like(query)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend: str) -> None:
    """``[N, Hkv, D]`` new K/V into the pool at ``slot_mapping`` ``[N]`` (no argument checks: the model path)."""
    if not torch.compiler.is_compiling():  # eager: the implementation itself, without the dispatcher's round trip
        _write_kv_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend)
        return
    torch.ops.hf_paged.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend)


def paged_attention(query, layer, scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``[N, Hq, D]`` packed queries attending through ``layer`` (a :class:`~hf_paged.step.LayerStep`)."""
    meta = layer.group.attention
    if not torch.compiler.is_compiling():  # eager: the implementation itself, the metadata as it is
        return paged_attention_unchecked(query, layer.key_cache, layer.value_cache, meta, float(scale), layer.backend,
                                         softcap=softcap or None, sinks=sinks, k_scale=layer.k_scale,
                                         v_scale=layer.v_scale, reuse_partials=True)
    tables, lens, query_start_loc, layout_tensors, layout_ints, window, max_query_len, chunk, limits = \
        op_arguments(meta)
    return torch.ops.hf_paged.paged_attention(
        query, layer.key_cache, layer.value_cache, tables, lens, query_start_loc, layout_tensors, layout_ints, sinks,
        layer.k_scale, layer.v_scale, float(scale), window, float(softcap or _NO_SOFTCAP), max_query_len, layer.backend,
        chunk, limits)
