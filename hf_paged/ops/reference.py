"""Pure-PyTorch paged attention: the CPU path and the oracle the Triton kernels are tested against.

Layout (everywhere in hf_paged): ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv_torch(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool at ``slot_mapping``."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    slot_mapping = slot_mapping.to(torch.long)
    flat_k.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def copy_blocks_torch(key_cache, value_cache, src, dst) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (copy-on-write)."""
    key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
    value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


@dataclass
class TorchAttentionPlan:
    """Index and mask tensors of one batch's attention, shared by every layer with the same pool shape."""

    tables: torch.Tensor  # [S * nb] int64, physical block of each context block
    context_len: int  # L: the longest sequence
    num_ctx_blocks: int
    q_index: torch.Tensor | None  # [S, Q] int64 into the packed queries; None for decode
    q_valid: torch.Tensor | None  # [S * Q] int64: flat positions of the real query slots
    mask: torch.Tensor | None  # [S, 1, Q, L] bool; None when every query sees its whole (equal-length) context
    kv_valid: torch.Tensor | None = None  # [S, L, 1, 1] bool: slots holding a token (others zeroed: may be NaN)


def plan_torch_attention(
    block_tables, seq_lens, query_start_loc, block_size: int, num_tokens: int,
    sliding_window: int | None = None, max_query_len: int | None = None, max_seq_len: int | None = None,
) -> TorchAttentionPlan:
    device = block_tables.device
    seq_lens_l = seq_lens.to(torch.long)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.long)  # [S]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens_l.max())
    max_seq_len = max(max_seq_len, 1)
    num_ctx_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_ctx_blocks].to(torch.long).clamp_min(0).flatten()

    num_seqs = seq_lens.shape[0]
    decode = max_query_len == 1 and num_tokens == num_seqs
    q_index = q_valid = None
    if decode:
        queries = 1
        if sliding_window is None and bool((seq_lens_l == max_seq_len).all()):
            return TorchAttentionPlan(tables, max_seq_len, num_ctx_blocks, None, None, None)
    else:
        queries = max_query_len
        offs = torch.arange(queries, device=device)
        q_index = (query_start_loc[:-1].to(torch.long)[:, None] + offs).clamp(max=max(num_tokens - 1, 0))
        valid = offs[None, :] < q_lens[:, None]
        q_valid = valid.flatten().nonzero().flatten()
    q_pos = (seq_lens_l - q_lens)[:, None] + torch.arange(queries, device=device)  # [S, Q]
    kv_pos = torch.arange(max_seq_len, device=device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
    if q_valid is not None:
        mask |= ~valid[:, :, None]  # padded query slots: any finite row, discarded afterwards
    return TorchAttentionPlan(tables, max_seq_len, num_ctx_blocks, q_index, q_valid, mask[:, None])


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    plan: TorchAttentionPlan | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched SDPA call with a causal (and window) mask."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_tokens == 0:
        return query.new_empty(query.shape)
    if plan is None:
        plan = plan_torch_attention(block_tables, seq_lens, query_start_loc, block_size, num_tokens,
                                    sliding_window, max_query_len, max_seq_len)
        # A caller's pool may hold NaN in slots no sequence owns (torch.empty); masked scores still multiply them,
        # so zero them. hf_paged's own pools start zeroed and only hold written tokens, so the model path skips it.
        pos = torch.arange(plan.context_len, device=block_tables.device)
        owned = block_tables[:, : plan.num_ctx_blocks].repeat_interleave(block_size, 1)[:, : plan.context_len] >= 0
        plan.kv_valid = ((pos[None, :] < seq_lens[:, None].to(torch.long)) & owned)[:, :, None, None]

    # index_select copies whole blocks; advanced indexing (key_cache[tables]) is ~20x slower on CPU.
    ctx_shape = (num_seqs, plan.num_ctx_blocks * block_size, num_kv_heads, head_dim)
    keys = key_cache.index_select(0, plan.tables).view(ctx_shape)[:, : plan.context_len]  # [S, L, Hkv, D]
    values = value_cache.index_select(0, plan.tables).view(ctx_shape)[:, : plan.context_len]
    if plan.kv_valid is not None:
        keys, values = keys.masked_fill(~plan.kv_valid, 0), values.masked_fill(~plan.kv_valid, 0)

    if plan.q_index is None:
        q = query.unsqueeze(1)  # [S, 1, Hq, D]
    else:  # index_select: advanced indexing is many times slower on CPU
        q = query.index_select(0, plan.q_index.flatten()).view(*plan.q_index.shape, num_q_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    ).transpose(1, 2)  # [S, Q, Hq, D]
    if plan.q_index is None:
        return out.reshape(num_tokens, num_q_heads, head_dim)
    return out.reshape(-1, num_q_heads, head_dim).index_select(0, plan.q_valid)
