"""Pure-PyTorch paged attention: the CPU path and the oracle the Triton kernels are tested against.

Layout (everywhere in hf_paged): ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
An fp8 pool is ``torch.uint8`` holding float8 e4m3fn bits (torch on CPU cannot index_select/index_copy float8 tensors),
with scale caches ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` bfloat16, one scale per slot and KV
head written with the token: the stored value is ``fp8 * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


FP8_MAX = 448.0  # largest finite float8 e4m3fn
FP8_SCALE_DTYPE = torch.bfloat16  # the scale caches' dtype: fp32's range in 2 bytes; see fp8_scales


def fp8_scales(x: torch.Tensor) -> torch.Tensor:
    """The scales :func:`hf_paged.ops.write_kv` stores with fp8 tokens: one per token and KV head, from its own values.

    ``scale = amax(|x|) over head_dim / 448``, rounded *up* to the next bfloat16 above it, so the token's largest
    value lands just under 448 and nothing is clamped; a head whose values are all zero (or not finite) gets
    ``1 / 448`` rounded the same way, so a scale is never zero. A token's scale depends on that token alone: a
    block's meaning never changes after it is written, whoever shares it and whatever is written after it.

    bfloat16 is enough: it has float32's exponent range (no scale underflows or overflows) and the rounding up
    moves the scale by under 2**-7 relative, which shifts where the largest value falls inside the e4m3 range but not
    e4m3's own 3-bit relative precision; a scale costs 2 bytes per token and KV head for K and V each (``2 * 2 /
    head_dim`` over the fp8 bytes: +3.1% at head_dim 64).

    Args:
        x: ``[..., num_kv_heads, head_dim]`` floating point (keys or values).

    Returns:
        ``[..., num_kv_heads]`` bfloat16, on ``x``'s device.

    Example::

        import torch
        from hf_paged import ops

        key = torch.randn(3, 2, 64)                          # [num_tokens, num_kv_heads, head_dim]
        scales = ops.fp8_scales(key)                         # [3, 2] bfloat16
        assert ((key.abs().amax(-1) / scales.float()) < 448).all()  # the largest value fits, unclamped
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(
            f"fp8_scales needs a float tensor [..., num_kv_heads, head_dim], got "
            f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}."
        )
    amax = x.detach().abs().to(torch.float32).amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])  # [..., Hkv]
    amax = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax)).to(torch.float32)
    return _bf16_above(amax * (1.0 / FP8_MAX))  # a product (not a quotient): the Triton kernel's very bits


def _bf16_above(s: torch.Tensor) -> torch.Tensor:
    """float32 ``s >= 0`` -> the next bfloat16 strictly above it (drop the low 16 bits, add one bf16 step): never
    below ``s``, never zero. The Triton write kernel does the same bit arithmetic, so both store the same bits."""
    bits = s.contiguous().view(torch.int32)
    return ((bits + 0x10000) & -0x10000).view(torch.float32).to(FP8_SCALE_DTYPE)  # exact: low 16 bits are 0


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., num_kv_heads, head_dim]`` float -> uint8 e4m3fn bits of ``x / scale``, clamped to +-448; ``scale``
    ``[..., num_kv_heads]`` (or anything broadcasting to it), e.g. :func:`fp8_scales` of ``x``."""
    scaled = x.to(torch.float32) / scale.to(torch.float32)[..., None]  # [..., Hkv, D]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 e4m3fn bits ``[..., num_kv_heads, head_dim]`` -> ``fp8 * scale`` in ``dtype``; ``scale``
    ``[..., num_kv_heads]``, one per token and KV head."""
    return (bits.view(torch.float8_e4m3fn).to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)


def write_kv_torch(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool at ``slot_mapping``.

    A uint8 (fp8) pool stores :func:`quantize_fp8` of them with each token's :func:`fp8_scales`, which go to the same
    slots of the scale caches ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]``.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    if slot_mapping.dtype != torch.long:
        slot_mapping = slot_mapping.to(torch.long)
    if key_cache.dtype == torch.uint8:
        ks, vs = fp8_scales(key), fp8_scales(value)  # [num_tokens, Hkv]
        key, value = quantize_fp8(key, ks), quantize_fp8(value, vs)
        k_scale.view(num_blocks * block_size, num_kv_heads).index_copy_(0, slot_mapping, ks)
        v_scale.view(num_blocks * block_size, num_kv_heads).index_copy_(0, slot_mapping, vs)
    flat_k.index_copy_(0, slot_mapping, key if key.dtype == key_cache.dtype else key.to(key_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value if value.dtype == value_cache.dtype else value.to(value_cache.dtype))


def copy_blocks_torch(key_cache, value_cache, src, dst, k_scale=None, v_scale=None) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (copy-on-write), and their fp8 scales when the scale caches are given."""
    for cache in (key_cache, value_cache, k_scale, v_scale):
        if cache is not None:
            cache.index_copy_(0, dst, cache.index_select(0, src))


@dataclass
class TorchAttentionPlan:
    """How :func:`paged_attention_torch` reads one batch: built once per step and shared by its layers.

    Rows are grouped by their query count, so no row is padded to another kind's length: the rows with one query
    (decode) form one batched call, those with several (prefill, chunked prefill, extend, verification) another,
    padded to the longest query among them; a row with none takes no part. Each part gathers its rows' blocks up to
    its own longest context, in whole blocks (``L = nb * block_size``), or reads them as a view of the pool when the
    part is a single row whose blocks are consecutive (``*_run``: the first block). Index tensors exist only when
    both parts do (each part's rows are otherwise the packed batch, in order).

    Every field is a tensor, an int or None (the step planner moves the tensors to the model's device), and every
    size the attention needs is a tensor's shape (a compiled graph sees no varying Python int): see
    :meth:`arguments` and :meth:`from_arguments`, through which the plan crosses the custom-op boundary.
    """

    # rows with one query: the query heads of a KV head become its queries (one SDPA call, no repeated K/V)
    tables: torch.Tensor | None  # [Sd * nb] int64, physical block of each context block
    mask: torch.Tensor | None = None  # [Sd, 1, 1, L] bool; None: every row sees all L positions
    decode_index: torch.Tensor | None = None  # [Sd] int64, each row's query in the packed batch (mixed steps)
    decode_run: int | None = None  # Sd == 1 and its blocks are decode_run .. decode_run + nb - 1
    # rows with several queries
    prefill_tables: torch.Tensor | None = None  # [Sp * nbp] int64
    prefill_mask: torch.Tensor | None = None  # [Sp, 1, Qp, Lp] bool: causal, window; padded query slots see all
    prefill_q_index: torch.Tensor | None = None  # [Sp, Qp] int64 into the packed queries (padding clamped)
    prefill_q_valid: torch.Tensor | None = None  # [Np] int64, the real slots among the Sp * Qp
    prefill_index: torch.Tensor | None = None  # [Np] int64, their queries in the packed batch (mixed steps)
    prefill_run: int | None = None
    # slots holding a token (others zeroed: a caller's pool may hold NaN there); built for the public entry only
    kv_valid: torch.Tensor | None = None  # [Sd, L, 1, 1] bool
    prefill_kv_valid: torch.Tensor | None = None  # [Sp, Lp, 1, 1] bool

    TENSORS = ("tables", "mask", "decode_index", "prefill_tables", "prefill_mask", "prefill_q_index",
               "prefill_q_valid", "prefill_index", "kv_valid", "prefill_kv_valid")

    def arguments(self) -> tuple[list, int, int]:
        """``(tensors, decode_run, prefill_run)``: the tensor fields in ``TENSORS`` order, runs as ints (-1: none)."""
        return ([getattr(self, n) for n in self.TENSORS], -1 if self.decode_run is None else self.decode_run,
                -1 if self.prefill_run is None else self.prefill_run)

    @classmethod
    def from_arguments(cls, tensors, decode_run: int, prefill_run: int) -> "TorchAttentionPlan":
        return cls(**dict(zip(cls.TENSORS, tensors)), decode_run=None if decode_run < 0 else decode_run,
                   prefill_run=None if prefill_run < 0 else prefill_run)


def plan_torch_attention(
    block_tables, seq_lens, query_start_loc, block_size: int, num_tokens: int,
    sliding_window: int | None = None, max_query_len: int | None = None, max_seq_len: int | None = None,
    always_mask: bool = False, *, zero_unowned: bool = False,
) -> TorchAttentionPlan:
    """Index and mask tensors for :func:`paged_attention_torch`, built once per step and shared by its layers.

    ``max_seq_len`` may exceed every ``seq_lens`` entry (a bucketed width, up to ``block_tables.shape[1] *
    block_size``), and table columns past a sequence's blocks may hold any valid block id (e.g. 0): positions at or
    past ``seq_lens[s]`` are masked, so what those slots hold never reaches the output unless it is NaN/inf.

    ``always_mask``: build the decode mask even where every sequence fills its context (a compiled step's plan then
    holds the same tensors, of shapes fixed by the context, every step), and never read blocks as views.
    ``zero_unowned``: also mark the slots no sequence wrote (a caller's pool; hf_paged's own pools hold zeros there).
    Reads ``seq_lens`` and ``query_start_loc`` on the host (they are host tensors in a step plan).
    """
    seq_lens_l = seq_lens.to(torch.long)
    num_seqs = seq_lens.shape[0]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.long)  # [S]
    if max_query_len is None:
        max_query_len = int(q_lens.max()) if num_seqs else 0
    if max_seq_len is not None and -(-max_seq_len // block_size) > block_tables.shape[1]:
        raise ValueError(
            f"max_seq_len={max_seq_len} needs {-(-max_seq_len // block_size)} blocks per sequence but block_tables "
            f"has {block_tables.shape[1]} columns; pass max_seq_len <= block_tables.shape[1] * block_size."
        )
    part = dict(block_tables=block_tables, seq_lens=seq_lens_l, block_size=block_size, window=sliding_window,
                always_mask=always_mask, zero_unowned=zero_unowned)
    if max_query_len == 1 and num_tokens == num_seqs:  # every row decodes: one part, rows as they are
        plan = TorchAttentionPlan(None)
        _decode_part(plan, None, max_seq_len, **part)
        return plan
    decode_rows = (q_lens == 1).nonzero().flatten()
    prefill_rows = (q_lens > 1).nonzero().flatten()
    mixed = decode_rows.numel() > 0 and prefill_rows.numel() > 0
    plan = TorchAttentionPlan(None)
    if decode_rows.numel():
        _decode_part(plan, decode_rows, max_seq_len if not mixed else None, **part)
        if mixed:
            plan.decode_index = query_start_loc.to(torch.long)[decode_rows]
    if prefill_rows.numel():
        _prefill_part(plan, prefill_rows, q_lens, query_start_loc, num_tokens, max_seq_len if not mixed else None,
                      mixed, **part)
    return plan


def _context_blocks(seq_lens, max_seq_len, block_size: int) -> int:
    longest = max(int(seq_lens.max()) if max_seq_len is None else max_seq_len, 1)
    return -(-longest // block_size)


def _part_tables(block_tables, rows, num_ctx_blocks: int, always_mask: bool) -> tuple[torch.Tensor, int | None]:
    """The part's flat block ids (-1 clamped to 0: masked positions) and, for one row of consecutive blocks, the
    first (read as a view)."""
    raw = block_tables[:, :num_ctx_blocks] if rows is None else block_tables[rows, :num_ctx_blocks]  # [Sx, nb]
    tables = raw.to(torch.long).clamp_min(0).flatten()
    run = None
    if raw.shape[0] == 1 and not always_mask and int(raw[0, 0]) >= 0:
        if num_ctx_blocks == 1 or bool((raw[0, 1:] - raw[0, :-1] == 1).all()):
            run = int(raw[0, 0])
    return tables, run


def _owned(block_tables, rows, seq_lens, num_ctx_blocks: int, block_size: int) -> torch.Tensor:
    """``[Sx, L, 1, 1]`` bool: positions below the row's length in a block the table names."""
    raw = block_tables[:, :num_ctx_blocks] if rows is None else block_tables[rows, :num_ctx_blocks]
    length = num_ctx_blocks * block_size
    pos = torch.arange(length, device=raw.device)
    owned = raw.repeat_interleave(block_size, 1) >= 0  # [Sx, L]
    return ((pos[None, :] < seq_lens[:, None]) & owned)[:, :, None, None]


def _decode_part(plan, rows, max_seq_len, *, block_tables, seq_lens, block_size, window, always_mask, zero_unowned):
    lens = seq_lens if rows is None else seq_lens[rows]  # [Sd]
    nb = _context_blocks(lens, max_seq_len, block_size)
    length = nb * block_size
    plan.tables, plan.decode_run = _part_tables(block_tables, rows, nb, always_mask)
    if always_mask or window is not None or not bool((lens == length).all()):
        kv_pos = torch.arange(length, device=lens.device)
        q_pos = lens[:, None] - 1  # [Sd, 1]
        mask = kv_pos[None, :] <= q_pos  # [Sd, L]
        if window is not None:
            mask &= kv_pos[None, :] > q_pos - window
        plan.mask = mask[:, None, None, :]  # [Sd, 1, 1, L]
    if zero_unowned:
        plan.kv_valid = _owned(block_tables, rows, lens, nb, block_size)


def _prefill_part(plan, rows, q_lens, query_start_loc, num_tokens, max_seq_len, mixed, *, block_tables, seq_lens,
                  block_size, window, always_mask, zero_unowned):
    lens, counts = seq_lens[rows], q_lens[rows]  # [Sp]
    nb = _context_blocks(lens, max_seq_len, block_size)
    length = nb * block_size
    plan.prefill_tables, plan.prefill_run = _part_tables(block_tables, rows, nb, always_mask)
    queries = int(counts.max())
    offs = torch.arange(queries, device=lens.device)
    q_index = query_start_loc.to(torch.long)[rows][:, None] + offs  # [Sp, Qp]
    valid = offs[None, :] < counts[:, None]  # [Sp, Qp]
    q_valid = valid.flatten().nonzero().flatten()
    plan.prefill_q_index = q_index.clamp(max=max(num_tokens - 1, 0))
    plan.prefill_q_valid = q_valid
    if mixed:
        plan.prefill_index = q_index.flatten()[q_valid]
    q_pos = (lens - counts)[:, None] + offs  # [Sp, Qp]
    kv_pos = torch.arange(length, device=lens.device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [Sp, Qp, Lp]
    if window is not None:
        mask &= kv_pos[None, None, :] > (q_pos[:, :, None] - window)
    mask |= ~valid[:, :, None]  # padded query slots: any finite row, discarded afterwards
    plan.prefill_mask = mask[:, None]
    if zero_unowned:
        plan.prefill_kv_valid = _owned(block_tables, rows, lens, nb, block_size)


def _read_blocks(cache, tables, run, num_rows: int, kv_valid):
    """``[Sx, L, Hkv, D]`` K or V of a part: a view of ``cache`` for a run of blocks, else gathered. index_select
    copies whole blocks; advanced indexing (``cache[tables]``) is ~20x slower on CPU."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_blocks = tables.shape[0] // num_rows
    shape = (num_rows, num_blocks * block_size, num_kv_heads, head_dim)
    if run is not None:
        out = cache[run : run + num_blocks].view(shape)
    else:
        out = cache.index_select(0, tables).view(shape)
    return out if kv_valid is None else out.masked_fill(~kv_valid, 0)


def _read_kv(key_cache, value_cache, tables, run, num_rows, kv_valid, dtype, k_scale, v_scale):
    """``[Sx, L, Hkv, D]`` K and V of a part in ``dtype``; an fp8 pool's scale caches ``[num_blocks, block_size,
    Hkv]`` are read through the same tables (as ``[..., Hkv, 1]`` blocks) and multiply their tokens."""
    keys = _read_blocks(key_cache, tables, run, num_rows, kv_valid)  # [Sx, L, Hkv, D]
    values = _read_blocks(value_cache, tables, run, num_rows, kv_valid)
    if key_cache.dtype == torch.uint8:
        ks = _read_blocks(k_scale[..., None], tables, run, num_rows, kv_valid)[..., 0]  # [Sx, L, Hkv]
        vs = _read_blocks(v_scale[..., None], tables, run, num_rows, kv_valid)[..., 0]
        return dequantize_fp8(keys, ks, dtype), dequantize_fp8(values, vs, dtype)
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


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
    """Gather each part's blocks (:class:`TorchAttentionPlan`), then one batched SDPA call per part: the decode
    rows with the query heads of each KV head as its queries, the others with a causal (and window) mask.

    With ``softcap`` or ``sinks`` (which SDPA cannot express) the scores take an explicit fp32 softmax instead. A uint8
    (fp8) pool is dequantized with its scale caches ``k_scale``/``v_scale``, gathered with the blocks.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0:
        return query.new_empty(query.shape)
    if plan is None:
        # A caller's pool may hold NaN in slots no sequence owns (torch.empty); masked scores still multiply them,
        # so zero them. hf_paged's own pools start zeroed and only hold written tokens, so the model path skips it.
        plan = plan_torch_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1], num_tokens,
                                    sliding_window, max_query_len, max_seq_len, zero_unowned=True)
    explicit = softcap is not None or sinks is not None
    kv_dtype = torch.float32 if explicit else query.dtype
    features = (scale, softcap, sinks, explicit)
    decode = prefill = None
    if plan.tables is not None:
        q = query if plan.decode_index is None else query.index_select(0, plan.decode_index)  # [Sd, Hq, D]
        keys, values = _read_kv(key_cache, value_cache, plan.tables, plan.decode_run, q.shape[0], plan.kv_valid,
                                kv_dtype, k_scale, v_scale)
        decode = _decode_attention(q, keys, values, plan.mask, *features)  # [Sd, Hq, D]
        if plan.prefill_tables is None:
            return decode
    if plan.prefill_tables is not None:
        q_index = plan.prefill_q_index  # [Sp, Qp]
        q = query.index_select(0, q_index.flatten()).view(*q_index.shape, num_q_heads, head_dim)  # [Sp, Qp, Hq, D]
        keys, values = _read_kv(key_cache, value_cache, plan.prefill_tables, plan.prefill_run, q_index.shape[0],
                                plan.prefill_kv_valid, kv_dtype, k_scale, v_scale)
        padded = _prefill_attention(q, keys, values, plan.prefill_mask, *features)  # [Sp, Qp, Hq, D]
        prefill = padded.reshape(-1, num_q_heads, head_dim).index_select(0, plan.prefill_q_valid)  # [Np, Hq, D]
        if decode is None:
            return prefill
    out = query.new_empty(query.shape)  # [num_tokens, Hq, D]
    out.index_copy_(0, plan.decode_index, decode)
    return out.index_copy_(0, plan.prefill_index, prefill)


def _decode_attention(q, keys, values, mask, scale, softcap, sinks, explicit) -> torch.Tensor:
    """q ``[Sd, Hq, D]``, keys/values ``[Sd, L, Hkv, D]``, mask ``[Sd, 1, 1, L]`` or None -> ``[Sd, Hq, D]``."""
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    if explicit:
        return _explicit_attention(q[:, None], keys, values, mask, scale, softcap, sinks)[:, 0]
    # one query, so the query heads of a KV head can be that head's queries: GQA without repeating K/V
    packed = q.reshape(num_rows, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Sd, Hkv, G, D]
    out = F.scaled_dot_product_attention(packed, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                         scale=scale)  # [Sd, Hkv, G, D]
    return out.reshape(num_rows, num_q_heads, head_dim)


def _prefill_attention(q, keys, values, mask, scale, softcap, sinks, explicit) -> torch.Tensor:
    """q ``[Sp, Qp, Hq, D]``, keys/values ``[Sp, Lp, Hkv, D]``, mask ``[Sp, 1, Qp, Lp]`` -> ``[Sp, Qp, Hq, D]``."""
    if explicit:
        return _explicit_attention(q, keys, values, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != keys.shape[2],
    ).transpose(1, 2)


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
