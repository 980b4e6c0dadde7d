"""Pure-PyTorch paged attention: the CPU path and the oracle the Triton kernels are tested against.

Layout (everywhere in hf_paged): ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

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
) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched SDPA call with a causal (and window) mask."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size = key_cache.shape[1]
    num_kv_heads = key_cache.shape[2]
    device = query.device
    if num_tokens == 0:
        return query.new_empty(query.shape)

    seq_lens_l = seq_lens.to(torch.long)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.long)  # [num_seqs]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens_l.max())
    max_seq_len = max(max_seq_len, 1)
    num_ctx_blocks = -(-max_seq_len // block_size)

    tables = block_tables[:, :num_ctx_blocks].to(torch.long).clamp_min(0).flatten()  # [S * nb]
    # index_select copies whole blocks; advanced indexing (key_cache[tables]) is ~20x slower on CPU.
    ctx_shape = (num_seqs, num_ctx_blocks * block_size, num_kv_heads, head_dim)
    keys = key_cache.index_select(0, tables).view(ctx_shape)[:, :max_seq_len]  # [S, L, Hkv, D]
    values = value_cache.index_select(0, tables).view(ctx_shape)[:, :max_seq_len]

    decode = max_query_len == 1 and num_tokens == num_seqs
    if decode:
        q = query.unsqueeze(1)  # [S, 1, Hq, D]
        q_valid = None
    else:
        offs = torch.arange(max_query_len, device=device)
        q_idx = query_start_loc[:-1].to(torch.long)[:, None] + offs  # [S, Q]
        q_valid = offs[None, :] < q_lens[:, None]
        q = query[q_idx.clamp(max=num_tokens - 1)]  # [S, Q, Hq, D]

    q_pos = (seq_lens_l - q_lens)[:, None] + torch.arange(q.shape[1], device=device)  # [S, Q]
    kv_pos = torch.arange(max_seq_len, device=device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
    if q_valid is not None:
        mask |= ~q_valid[:, :, None]  # padded query slots: any finite row, discarded below

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    ).transpose(1, 2)  # [S, Q, Hq, D]
    if decode:
        return out.reshape(num_tokens, num_q_heads, head_dim)
    return out[q_valid]
