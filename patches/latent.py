"""Multi-head latent attention (MLA): what the paged path needs to know about DeepSeek-V2/V3-shaped attention.

transformers 5.24's MLA attentions (``DeepseekV3Attention`` and the families copied from it) compress each token's
keys and values to a latent ``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) plus a rotated key ``k_rot``
shared by every head (``qk_rope_head_dim`` values), and call ``cache.update(c [B, 1, S, R], k_rot [B, 1, S, P],
layer_idx, kwargs=kwargs)``. The cache keeps exactly that: one "KV head" per token whose key tensor holds the latent
and whose value tensor holds the rotated key (``R + P`` values per token and layer). The module then expands what
``update`` returned through ``kv_b_proj`` and calls the attention function with per-head queries ``[B, H, S, Dn + P]``
(``[q_nope, q_rot]``), keys and values. On the paged path ``update`` returns only the new tokens (their expansion is
cheap); the attention function ignores keys and values and runs :func:`latent_attention`, which attends in the latent
space with ``kv_b_proj`` absorbed (``hf_paged.ops.mla``). A first prefill runs the model's own attention on its fresh
latent, expanded.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.ops import mla

from .windows import text_config


def latent_widths(config) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of an MLA decoder config: what its cache stores per token and layer
    (the latent, then the rotated key); ``None`` for other configs."""
    config = text_config(config)
    rank, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if isinstance(rank, int) and isinstance(rope, int) and rank > 0 and rope > 0:
        return rank, rope
    return None


def latent_attention(module: nn.Module, query: torch.Tensor, layer, scale: float) -> torch.Tensor:
    """The paged attention of one MLA layer: packed queries ``[N, H, Dn + P]`` -> ``[N, H, Dv]``.

    ``layer`` is the layer's :class:`~hf_paged.step.LayerStep`: its key cache holds the latents ``[blocks,
    block_size, 1, R]``, its value cache the rotated keys ``[blocks, block_size, 1, P]``. Reads ``kv_b_proj`` and
    ``qk_nope_head_dim`` from the module (every MLA family in transformers names them so)."""
    proj = module.kv_b_proj
    return mla.paged_mla(query, proj.weight, proj.bias, module.qk_nope_head_dim, layer.key_cache, layer.value_cache,
                         layer.group.attention, scale, layer.backend, latent_scale=layer.k_scale,
                         rope_scale=layer.v_scale)
