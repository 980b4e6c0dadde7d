"""Pure-PyTorch paged attention: the CPU path and the oracle the Triton kernels are tested against.

Layout (everywhere in hf_paged): ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
An fp8 pool is ``torch.uint8`` holding float8 e4m3fn bits (torch on CPU cannot index_select/index_copy float8 tensors),
with scale caches ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` bfloat16, one scale per slot and KV
head written with the token: the stored value is ``fp8 * scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..allocator import cdiv
from . import cpu_kernels
from .layout import AttentionPart, ReadLayout
from .metadata import AttentionMetadata


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
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, value_cache.shape[-1])  # MLA: narrower
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


# A decode row's context is read in whole blocks up to its part's longest: a part of rows with very different
# contexts reads mostly masked positions. Decode rows are split into parts of similar context (power-of-two ranges of
# blocks) unless a split would save fewer positions than this (another call's fixed cost; measured on the 2-core Xeon:
# ~40 us per layer for a call against ~0.25 us per position read and attended).
SPLIT_MIN_POSITIONS = 256


def plan_torch_attention(
    block_tables, seq_lens, query_start_loc, block_size: int, *, sliding_window: int | None = None,
    max_seq_len: int | None = None, always_mask: bool = False, zero_unowned: bool = False, chunk: int | None = None,
    query_limits: torch.Tensor | None = None,
) -> ReadLayout:
    """The read layout (:class:`ReadLayout`: index and mask tensors) of :func:`paged_attention_torch`, built once per
    step and shared by its layers.

    ``max_seq_len`` may exceed every ``seq_lens`` entry (a bucketed width, up to ``block_tables.shape[1] *
    block_size``), and table columns past a sequence's blocks may hold any valid block id (e.g. 0): positions at or
    past ``seq_lens[s]`` are masked, so what those slots hold never reaches the output unless it is NaN/inf. It sets
    the width of a layout with a single part (every row read as wide).

    ``always_mask``: one part per query count, every mask and index built even where a causal call or a slice would
    do, and blocks never read as views (a compiled step's layout then holds the same tensors, of shapes fixed by the
    step's sizes, every step). ``zero_unowned``: also mark the slots no sequence wrote (a caller's pool; hf_paged's
    own pools hold zeros there). ``chunk=C``: chunked attention (Llama 4), a query at position ``p`` sees positions
    ``floor(p / C) * C .. p`` only. ``query_limits`` ``[num_tokens]``: the last position each query sees, at or
    after its own (a bidirectional span; see :class:`~hf_paged.ops.AttentionMetadata`): the masks take it. Reads
    ``seq_lens``, ``query_start_loc`` and ``query_limits`` on the host (host tensors when a step is planned).
    """
    if max_seq_len is not None and cdiv(max_seq_len, block_size) > block_tables.shape[1]:
        raise ValueError(
            f"max_seq_len={max_seq_len} needs {cdiv(max_seq_len, block_size)} blocks per sequence but block_tables "
            f"has {block_tables.shape[1]} columns; pass max_seq_len <= block_tables.shape[1] * block_size."
        )
    # The sizes on the host as Python ints: a step's few values cost less in Python than in small tensor ops.
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    counts = [b - a for a, b in zip(starts, starts[1:])]
    decode_rows = [r for r, c in enumerate(counts) if c == 1]
    groups = []  # (queries, rows)
    if decode_rows:
        split = [decode_rows] if always_mask else _by_context(decode_rows, lens, block_size)
        groups += [(1, rows) for rows in split]
    for q in dict.fromkeys(c for c in counts if c > 1):  # in order of first appearance
        groups.append((q, [r for r, c in enumerate(counts) if c == q]))
    # ordered: the parts' queries, in turn, are the packed batch as it is (a compiled step: only a single part)
    ordered = [r for _, rows in groups for r in rows] == [r for r, c in enumerate(counts) if c > 0]
    layout = ReadLayout(ordered=ordered and (not always_mask or len(groups) == 1))
    limits = None if query_limits is None else query_limits.tolist()
    context = dict(lens=lens, starts=starts, ordered=layout.ordered, block_tables=block_tables, block_size=block_size,
                   window=sliding_window, chunk=chunk, always_mask=always_mask, zero_unowned=zero_unowned,
                   limits=limits)
    for q, rows in groups:  # a single part may take the step's (bucketed) width
        layout.parts.append(_part(rows, q, max_seq_len if len(groups) == 1 else None, **context))
    return layout


def _by_context(rows: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """Decode ``rows`` in groups of similar context: by power-of-two range of blocks, shortest first, each range
    merged into the next while that pads fewer than ``SPLIT_MIN_POSITIONS`` positions."""
    ranges: dict[int, list[int]] = {}
    for r in rows:
        ranges.setdefault((max(1, cdiv(lens[r], block_size)) - 1).bit_length(), []).append(r)
    groups, pending = [], []
    for key in sorted(ranges):
        widest = max(cdiv(lens[r], block_size) for r in ranges[key]) * block_size
        if pending and sum(widest - lens[r] for r in pending) >= SPLIT_MIN_POSITIONS:
            groups.append(sorted(pending))
            pending = []
        pending += ranges[key]
    return groups + [sorted(pending)]


def _part(rows: list[int], queries: int, max_seq_len, *, lens, starts, ordered: bool, block_tables, block_size,
          window, chunk, always_mask, zero_unowned, limits) -> AttentionPart:
    part_lens = [lens[r] for r in rows]
    nb = cdiv(max(max(part_lens) if max_seq_len is None else max_seq_len, 1), block_size)
    length = nb * block_size
    device = block_tables.device
    whole = rows == list(range(block_tables.shape[0]))
    index = None if whole else torch.tensor(rows, device=device)
    raw = block_tables[:, :nb] if whole else block_tables[index, :nb]  # [Sx, nb]
    run = None
    if len(rows) == 1 and not always_mask:  # one row of consecutive blocks: read as a view
        first = raw[0].tolist()
        if first[0] >= 0 and all(b == first[0] + i for i, b in enumerate(first)):
            run = first[0]
    part = AttentionPart(raw.to(torch.long).clamp_min(0).flatten(), -1 if always_mask else len(rows),
                         -1 if always_mask else queries, run=run)
    if ordered:
        part.q_start = starts[rows[0]]
    else:
        part.q_index = torch.tensor([starts[r] + i for r in rows for i in range(queries)], device=device)
    # each query's limit where a bidirectional span moves it past its own position (None: none does)
    part_limits = None
    if limits is not None:
        own = [[n - queries + i for i in range(queries)] for n in part_lens]
        given = [limits[starts[r]: starts[r] + queries] for r in rows]
        part_limits = None if given == own else given
    if queries == 1:  # decode: a mask unless every row sees all L positions
        unmasked = window is None and chunk is None and all(n == length for n in part_lens)
    else:  # the row's queries are its first positions: causal, no mask
        unmasked = all(n == queries for n in part_lens) and (window is None or window >= queries) and (
            chunk is None or chunk >= queries)
    if always_mask or not unmasked or part_limits is not None:
        q_pos = torch.tensor([n - queries for n in part_lens], device=device)[:, None] + torch.arange(
            queries, device=device)  # [Sx, Q]
        kv_pos = torch.arange(length, device=device)
        q_hi = q_pos if part_limits is None else torch.tensor(part_limits, device=device)  # [Sx, Q]
        mask = kv_pos <= q_hi[:, :, None]  # [Sx, Q, L]
        if window is not None:
            mask &= kv_pos > (q_pos[:, :, None] - window)
        if chunk is not None:  # the query's own chunk only
            mask &= kv_pos >= (q_pos[:, :, None] // chunk * chunk)
        part.mask = mask[:, None]  # [Sx, 1, Q, L]
    if zero_unowned:  # [Sx, L, 1, 1]: positions below the row's length in a block the table names
        owned = raw.repeat_interleave(block_size, 1) >= 0  # [Sx, L]
        below = torch.arange(length, device=device) < torch.tensor(part_lens, device=device)[:, None]
        part.kv_valid = (below & owned)[:, :, None, None]
    return part


def _read_kv(key_cache, value_cache, part: AttentionPart, num_rows: int, dtype, k_scale, v_scale):
    """``[Sx, L, Hkv, D]`` K and V of a part in ``dtype``: views of the pool for a run of blocks, else gathered
    (index_select copies whole blocks; advanced indexing, ``cache[tables]``, is ~20x slower on CPU). An fp8 pool's
    scale caches ``[num_blocks, block_size, Hkv]`` are read through the same tables and multiply their tokens."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    tables, run = part.tables, part.run
    num_blocks = tables.shape[0] // num_rows
    shape = (num_rows, num_blocks * block_size, num_kv_heads, head_dim)

    def read(cache, shape):
        if run is not None:
            return cache[run: run + num_blocks].view(shape)
        return cache.index_select(0, tables).view(shape)

    keys, values = read(key_cache, shape), read(value_cache, shape)
    if part.kv_valid is not None:  # a caller's pool: unwritten slots may hold NaN
        keys, values = keys.masked_fill(~part.kv_valid, 0), values.masked_fill(~part.kv_valid, 0)
    if key_cache.dtype == torch.uint8:
        ks, vs = read(k_scale, shape[:3]), read(v_scale, shape[:3])  # [Sx, L, Hkv]
        if part.kv_valid is not None:
            ks, vs = ks.masked_fill(~part.kv_valid[..., 0], 0), vs.masked_fill(~part.kv_valid[..., 0], 0)
        return dequantize_fp8(keys, ks, dtype), dequantize_fp8(values, vs, dtype)
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each part's blocks (``meta.plan``: the step's :class:`ReadLayout`; built here when None), then one
    batched SDPA call per part: decode rows with the query heads of each KV head as their queries, rows with more
    queries causal (with a mask where a history or a window needs one).

    With ``softcap`` or ``sinks`` (which SDPA cannot express) the scores take an explicit fp32 softmax instead. A uint8
    (fp8) pool is dequantized with its scale caches ``k_scale``/``v_scale``, gathered with the blocks.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0:
        return query.new_empty(query.shape)
    layout = meta.plan
    if layout is None:
        # A caller's pool may hold NaN in slots no sequence owns (torch.empty); masked scores still multiply them,
        # so zero them. hf_paged's own pools start zeroed and only hold written tokens, so the model path skips it.
        layout = plan_torch_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc, key_cache.shape[1],
                                      sliding_window=meta.sliding_window, chunk=meta.chunk,
                                      max_seq_len=meta.max_seq_len, zero_unowned=True,
                                      query_limits=meta.query_limits)
    explicit = softcap is not None or sinks is not None
    kv_dtype = torch.float32 if explicit else query.dtype
    features = (scale, softcap, sinks, explicit)
    outputs = []  # (output [n, Hq, D], its queries' index in the packed batch or None)
    for part in layout.parts:
        rows, queries = part.sizes()
        if part.q_index is not None:
            q = query.index_select(0, part.q_index)
        elif len(layout.parts) == 1 and part.q_start == 0:  # the whole batch (a step's only part starts at 0)
            q = query
        else:
            q = query[part.q_start: part.q_start + rows * queries]  # [Sx * Q, Hq, D]
        if queries == 1 and not explicit and part.kv_valid is None and cpu_kernels.supports(q, key_cache) \
                and value_cache.is_contiguous():  # the C kernel reads the blocks in place (bf16 on a CPU)
            out = cpu_kernels.decode_attention(q, key_cache, value_cache, part.tables, part.mask, scale)
            if out is not None:
                outputs.append((out, part.q_index))
                continue
        keys, values = _read_kv(key_cache, value_cache, part, rows, kv_dtype, k_scale, v_scale)
        if queries == 1:
            out = _decode_attention(q, keys, values, part.mask, *features)  # [Sx, Hq, D]
        else:
            out = _prefill_attention(q.view(rows, queries, num_q_heads, head_dim), keys, values, part.mask,
                                     *features).reshape(rows * queries, num_q_heads, head_dim)
        outputs.append((out, part.q_index))
    if len(outputs) == 1 and outputs[0][0].shape[0] == num_tokens:
        return outputs[0][0]
    if layout.ordered:
        return torch.cat([out for out, _ in outputs])
    out = query.new_zeros(query.shape)  # [num_tokens, Hq, D]
    for part, index in outputs:
        out.index_copy_(0, index, part)
    return out


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
    """q ``[Sx, Q, Hq, D]``, keys/values ``[Sx, L, Hkv, D]``, mask ``[Sx, 1, Q, L]`` or None (each row's queries are
    its first ``Q`` positions: causal) -> ``[Sx, Q, Hq, D]``."""
    if explicit:
        if mask is None:
            num_queries, length = q.shape[1], keys.shape[1]
            mask = torch.ones(num_queries, length, dtype=torch.bool, device=q.device).tril()[None, None]
        return _explicit_attention(q, keys, values, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=q.shape[2] != keys.shape[2],
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
