"""Pure-PyTorch paged attention: the CPU path and the oracle the Triton kernels are tested against.

Layout (everywhere in hf_paged): ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
An fp8 pool is ``torch.uint8`` holding float8 e4m3fn bits (torch on CPU cannot index_select/index_copy float8 tensors),
with ``k_scale``/``v_scale`` ``[num_kv_heads]`` float32: the stored value is ``fp8 * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


FP8_MAX = 448.0  # largest finite float8 e4m3fn


def fp8_scales(x: torch.Tensor, headroom: float = 2.0) -> torch.Tensor:
    """Per-KV-head scales for an fp8 pool, picked from a first batch of keys (or values).

    ``scale = amax(|x|) over tokens and head_dim / 448 * headroom``, per KV head; a head whose batch is all zero (or
    not finite) gets ``headroom / 448``, so a scale is never zero. The choice is per layer and KV head, static after
    the first write: one scalar per (layer, head) costs nothing to store, keeps the KV write a pure elementwise
    quantize, and lets the kernels fold it into the score scale (keys) and the output (values). Keys and values of a
    head share a distribution across positions (RoPE rotates but keeps norms), so the first batch's amax is a good
    guide; ``headroom`` (default 2, one binade) keeps later, larger values from saturating at +-448, and costs little:
    e4m3 has the same 3-bit relative precision across 17 binades.

    Args:
        x: ``[num_tokens, num_kv_heads, head_dim]`` floating point.
        headroom: factor over the observed amax, ``>= 1``.

    Returns:
        ``[num_kv_heads]`` float32, on ``x``'s device.

    Example::

        k_scale = fp8_scales(key)      # [num_kv_heads]
        write_kv(key, value, key_cache_u8, value_cache_u8, slot_mapping, k_scale=k_scale, v_scale=fp8_scales(value))
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(
            f"fp8_scales needs a float tensor [num_tokens, num_kv_heads, head_dim], got "
            f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}."
        )
    if not headroom >= 1.0:
        raise ValueError(f"headroom must be >= 1 (values above amax * headroom saturate), got {headroom!r}.")
    amax = x.detach().abs().to(torch.float32).amax(dim=(0, 2)) if x.shape[0] else x.new_zeros(x.shape[1])  # [Hkv]
    amax = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    return (amax * (headroom / FP8_MAX)).to(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` float -> uint8 e4m3fn bits of ``x / scale``, clamped to +-448."""
    scaled = x.to(torch.float32) / scale.to(torch.float32)[:, None]  # [..., Hkv, D]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 e4m3fn bits ``[..., num_kv_heads, head_dim]`` -> ``fp8 * scale`` in ``dtype``."""
    return (bits.view(torch.float8_e4m3fn).to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def write_kv_torch(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool at ``slot_mapping``.

    A uint8 (fp8) pool stores :func:`quantize_fp8` of them with ``k_scale``/``v_scale``.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    slot_mapping = slot_mapping.to(torch.long)
    if key_cache.dtype == torch.uint8:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
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
    always_mask: bool = False,
) -> TorchAttentionPlan:
    """Index and mask tensors for :func:`paged_attention_torch`, built once per step and shared by its layers.

    ``max_seq_len`` may exceed every ``seq_lens`` entry (a bucketed width, up to ``block_tables.shape[1] *
    block_size``), and table columns past a sequence's blocks may hold any valid block id (e.g. 0): positions at or
    past ``seq_lens[s]`` are masked, so what those slots hold never reaches the output unless it is NaN/inf.

    ``always_mask``: build the mask even where every sequence fills ``max_seq_len`` (a compiled step's plan then
    holds the same tensors, of shapes fixed by the table width, every step).
    """
    device = block_tables.device
    seq_lens_l = seq_lens.to(torch.long)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.long)  # [S]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens_l.max())
    max_seq_len = max(max_seq_len, 1)
    num_ctx_blocks = -(-max_seq_len // block_size)
    if num_ctx_blocks > block_tables.shape[1]:
        raise ValueError(
            f"max_seq_len={max_seq_len} needs {num_ctx_blocks} blocks per sequence but block_tables has "
            f"{block_tables.shape[1]} columns; pass max_seq_len <= block_tables.shape[1] * block_size."
        )
    tables = block_tables[:, :num_ctx_blocks].to(torch.long).clamp_min(0).flatten()

    num_seqs = seq_lens.shape[0]
    decode = max_query_len == 1 and num_tokens == num_seqs
    q_index = q_valid = None
    if decode:
        queries = 1
        if not always_mask and sliding_window is None and bool((seq_lens_l == max_seq_len).all()):
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
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched SDPA call with a causal (and window) mask.

    With ``softcap`` or ``sinks`` (which SDPA cannot express) the scores take an explicit fp32 softmax instead. A uint8
    (fp8) pool is dequantized with ``k_scale``/``v_scale`` after the gather.
    """
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

    explicit = softcap is not None or sinks is not None
    if key_cache.dtype == torch.uint8:
        kv_dtype = torch.float32 if explicit else query.dtype
        keys, values = dequantize_fp8(keys, k_scale, kv_dtype), dequantize_fp8(values, v_scale, kv_dtype)

    if plan.q_index is None:
        q = query.unsqueeze(1)  # [S, 1, Hq, D]
    else:  # index_select: advanced indexing is many times slower on CPU
        q = query.index_select(0, plan.q_index.flatten()).view(*plan.q_index.shape, num_q_heads, head_dim)
    if not explicit:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        ).transpose(1, 2)  # [S, Q, Hq, D]
    else:
        out = _explicit_attention(q, keys, values, plan.mask, scale, softcap, sinks)  # [S, Q, Hq, D]
    if plan.q_index is None:
        return out.reshape(num_tokens, num_q_heads, head_dim)
    return out.reshape(-1, num_q_heads, head_dim).index_select(0, plan.q_valid)


def _explicit_attention(q, keys, values, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None):
    """Attention with an fp32 softmax, soft-capped scores and sink logits (gpt-oss ``s_aux``).

    q ``[S, Q, Hq, D]``, keys/values ``[S, L, Hkv, D]``, mask ``[S, 1, Q, L]`` bool or None -> ``[S, Q, Hq, D]``.
    """
    num_seqs, num_queries, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_q_heads // num_kv_heads
    q5 = q.to(torch.float32).permute(0, 2, 1, 3).reshape(num_seqs, num_kv_heads, group, num_queries, head_dim)
    k5 = keys.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]  # [S, Hkv, 1, L, D]
    v5 = values.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]  # [S, Hkv, 1, L, D]
    scores = (q5 @ k5.transpose(-1, -2)) * scale  # [S, Hkv, G, Q, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is not None:  # one more logit per head in the denominator; it takes no value
        sink = sinks.to(torch.float32).view(1, num_kv_heads, group, 1, 1)
        scores = torch.cat([scores, sink.expand(num_seqs, -1, -1, num_queries, 1)], dim=-1)  # [S, Hkv, G, Q, L+1]
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = probs @ v5  # [S, Hkv, G, Q, D]
    return out.reshape(num_seqs, num_q_heads, num_queries, head_dim).transpose(1, 2).to(q.dtype)
