"""``write_kv`` and ``paged_attention`` as PyTorch operators (``torch.ops.hf_paged.*``).

Defined with ``torch.library`` (a schema, one implementation for every device, and a fake, shape-only
implementation), so ``torch.compile`` traces a model forward through them without graph breaks, whichever backend
runs inside (the torch reference or the Triton kernels), and the model path calls the same operators in eager mode.
The low-level ``Library.define``/``impl`` registration is used rather than ``torch.library.custom_op``: its dispatch
costs ~6 us a call here against ~120 us (measured on this CPU), which matters at two calls per layer per step.

Only tensors and values that stay fixed over a generation cross the op boundary (a varying Python int would be
baked into a compiled graph and force a recompile each step): the torch backend's gather plan travels as tensors
whose shapes carry its sizes, and the Triton kernels get the block tables' (bucketed) width as their length bound.
"""

from __future__ import annotations

import torch

from .reference import TorchAttentionPlan

_LIB = torch.library.Library("hf_paged", "DEF")
_LIB.define("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
            "Tensor? k_scale, Tensor? v_scale, str backend) -> ()")
_LIB.define("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
            "Tensor seq_lens, Tensor query_start_loc, Tensor? plan_tables, Tensor? plan_mask, Tensor? plan_q_index, "
            "Tensor? plan_q_valid, Tensor? sinks, Tensor? k_scale, Tensor? v_scale, float scale, int sliding_window, "
            "float softcap, int max_query_len, str backend) -> Tensor")

_NO_WINDOW = 0  # sliding_window=0 means none
_NO_SOFTCAP = 0.0


def _write_kv_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend: str) -> None:
    from . import write_kv_unchecked

    write_kv_unchecked(key, value, key_cache, value_cache, slot_mapping, backend, k_scale=k_scale, v_scale=v_scale)


_LIB.impl("write_kv", _write_kv_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged::write_kv")
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend) -> None:
    return None


def _paged_attention_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, plan_tables,
                          plan_mask, plan_q_index, plan_q_valid, sinks, k_scale, v_scale, scale: float,
                          sliding_window: int, softcap: float, max_query_len: int, backend: str) -> torch.Tensor:
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
        softcap=softcap or None, sinks=sinks, k_scale=k_scale, v_scale=v_scale)


_LIB.impl("paged_attention", _paged_attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged::paged_attention")
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, plan_tables, plan_mask, plan_q_index,
      plan_q_valid, sinks, k_scale, v_scale, scale, sliding_window, softcap, max_query_len, backend):
    return torch.empty_like(query)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend: str) -> None:
    """``[N, Hkv, D]`` new K/V into the pool at ``slot_mapping`` ``[N]`` (no argument checks: the model path)."""
    torch.ops.hf_paged.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, backend)


def paged_attention(query, layer, scale: float, sliding_window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """``[N, Hq, D]`` packed queries attending through ``layer`` (a :class:`~hf_paged.step.LayerStep`)."""
    g, plan = layer.group, layer.group.plan
    return torch.ops.hf_paged.paged_attention(
        query, layer.key_cache, layer.value_cache, g.block_tables, g.seq_lens, g.query_start_loc,
        plan.tables if plan is not None else None, plan.mask if plan is not None else None,
        plan.q_index if plan is not None else None, plan.q_valid if plan is not None else None,
        sinks, layer.k_scale, layer.v_scale, float(scale), int(sliding_window or _NO_WINDOW),
        float(softcap or _NO_SOFTCAP), int(layer.max_query_len), layer.backend)
