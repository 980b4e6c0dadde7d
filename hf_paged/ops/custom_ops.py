"""``write_kv`` and ``paged_attention`` as PyTorch custom ops (``torch.ops.hf_paged.*``).

Registered with ``torch.library.custom_op`` and a fake (shape-only) implementation each, so ``torch.compile``
traces a model forward through them without graph breaks, whichever backend runs inside (the torch reference or
the Triton kernels). :func:`write_kv` and :func:`paged_attention` are the model path's one entry point: while
compiling they emit the custom op; in eager mode they call the same implementation directly, since the custom-op
dispatcher costs 0.3-6 ms a call on CPU (measured here), more than the write itself.

Only tensors and values that stay fixed over a generation cross the op boundary (a varying Python int would be
baked into a compiled graph and force a recompile each step): the torch backend's gather plan travels as tensors
whose shapes carry its sizes, and the Triton kernels get the block tables' (bucketed) width as their length bound.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import TorchAttentionPlan

_NO_WINDOW = 0  # sliding_window=0 means none
_NO_SOFTCAP = 0.0


def _extras(softcap=None, sinks=None, k_scale=None, v_scale=None) -> dict:
    """Keyword arguments for the optional features, passed only when used."""
    extra = {}
    if softcap:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
    if k_scale is not None:
        extra["k_scale"], extra["v_scale"] = k_scale, v_scale
    return extra


def _write_kv_impl(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                   backend: str) -> None:
    from . import write_kv_unchecked

    write_kv_unchecked(key, value, key_cache, value_cache, slot_mapping, backend,
                       **_extras(k_scale=k_scale, v_scale=v_scale))


_write_kv_op = torch.library.custom_op("hf_paged::write_kv", _write_kv_impl,
                                       mutates_args=("key_cache", "value_cache"))


@_write_kv_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend) -> None:
    return None


def _paged_attention_impl(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan_tables: Optional[torch.Tensor],
    plan_mask: Optional[torch.Tensor], plan_q_index: Optional[torch.Tensor], plan_q_valid: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor], k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
    scale: float, sliding_window: int, softcap: float, max_query_len: int, backend: str,
) -> torch.Tensor:
    from . import paged_attention_unchecked

    plan = None
    if plan_tables is not None:
        num_ctx_blocks = plan_tables.shape[0] // seq_lens.shape[0]
        context_len = num_ctx_blocks * key_cache.shape[1]
        plan = TorchAttentionPlan(plan_tables, context_len, num_ctx_blocks, plan_q_index, plan_q_valid, plan_mask)
    max_seq_len = block_tables.shape[1] * key_cache.shape[1]
    return paged_attention_unchecked(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window or None,
        backend, max_query_len, max_seq_len, plan=plan,
        **_extras(softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale))


_paged_attention_op = torch.library.custom_op("hf_paged::paged_attention", _paged_attention_impl, mutates_args=())


@_paged_attention_op.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, plan_tables, plan_mask, plan_q_index,
      plan_q_valid, sinks, k_scale, v_scale, scale, sliding_window, softcap, max_query_len, backend):
    return torch.empty_like(query)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend: str) -> None:
    """``[N, Hkv, D]`` new K/V into the pool at ``slot_mapping`` ``[N]`` (no argument checks: the model path)."""
    write = torch.ops.hf_paged.write_kv if torch.compiler.is_compiling() else _write_kv_impl
    write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend)


def paged_attention(query, layer, scale: float, sliding_window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """``[N, Hq, D]`` packed queries attending through ``layer`` (a :class:`~hf_paged.step.LayerStep`)."""
    g, plan = layer.group, layer.group.plan
    attend = torch.ops.hf_paged.paged_attention if torch.compiler.is_compiling() else _paged_attention_impl
    return attend(
        query, layer.key_cache, layer.value_cache, g.block_tables, g.seq_lens, g.query_start_loc,
        plan.tables if plan is not None else None, plan.mask if plan is not None else None,
        plan.q_index if plan is not None else None, plan.q_valid if plan is not None else None,
        sinks, layer.k_scale, layer.v_scale, float(scale), int(sliding_window or _NO_WINDOW),
        float(softcap or _NO_SOFTCAP), int(layer.max_query_len), layer.backend)
