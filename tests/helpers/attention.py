"""Paged attention cases on scrambled block tables, and the float64 oracle they are checked against.

    case = scrambled_case([1, 9, 30], [1, 1, 1], dtype=torch.float16, window=6)
    error = (ops.paged_attention(**case).double().cpu() - attention_float64(**case)).abs().max()
"""

from __future__ import annotations

import torch

from hf_paged.ops.reference import fp8_scales, quantize_fp8


def scrambled_case(seq_lens, q_lens, *, num_kv_heads=2, group=2, head_dim=32, block_size=8, dtype=torch.float32,
                   window=None, seed=0, kv_fp8=False, softcap=None, sinks=False, device="cpu") -> dict:
    """``ops.paged_attention`` keyword arguments over a pool with each sequence's blocks at random physical places.

    Sequence ``s`` holds ``seq_lens[s]`` tokens; its last ``q_lens[s]`` positions are its queries (0: idle).
    Everything never written is NaN, so a kernel that reads an unwritten slot returns NaN. Table entries past a
    sequence's last block are -1, and so are blocks that slid out of the window of the sequence's first query; a
    kernel that dereferences a -1 reads outside the pool. ``kv_fp8``: a uint8 pool of e4m3fn bits (NaN bits 0x7F
    where unwritten) with its scale caches ``k_scale`` / ``v_scale`` ``[num_blocks, block_size, num_kv_heads]``
    bfloat16 (NaN where unwritten; tokens scaled by 2**-2 to 2**1 each, so a scale read from the wrong position shows);
    ``softcap`` / ``sinks``: the options turned on
    (sinks drawn at random, of the size of the scores).
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + 2  # spare -1 columns
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    physical = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    pool_dtype = torch.uint8 if kv_fp8 else dtype
    garbage = 0x7F if kv_fp8 else float("nan")  # 0x7F is e4m3fn NaN
    key_cache = torch.full(shape, garbage, dtype=pool_dtype)  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = torch.full(shape, garbage, dtype=pool_dtype)
    block_tables = torch.full((num_seqs, width), -1, dtype=torch.int32)  # [num_seqs, width]
    # fp8: heads of different ranges, so that a wrong head's scale shows
    head_gain = torch.linspace(0.25, 2.0, num_kv_heads)[:, None] if kv_fp8 else torch.ones(num_kv_heads, 1)
    k_new = [torch.randn(n, num_kv_heads, head_dim, generator=gen) * head_gain for n in seq_lens]  # [n, Hkv, D]
    v_new = [torch.randn(n, num_kv_heads, head_dim, generator=gen) * head_gain for n in seq_lens]
    if kv_fp8:
        def gain(n):  # [n, Hkv, 1] per token and head
            return 2.0 ** torch.randint(-2, 2, (n, num_kv_heads, 1), generator=gen).float()
        k_new, v_new = [k * gain(k.shape[0]) for k in k_new], [v * gain(v.shape[0]) for v in v_new]
        k_scale = torch.full(shape[:3], float("nan"), dtype=torch.bfloat16)  # [num_blocks, block_size, Hkv]
        v_scale = torch.full(shape[:3], float("nan"), dtype=torch.bfloat16)
    taken = 0
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[s, :n_blocks] = physical[taken: taken + n_blocks].to(torch.int32)
        taken += n_blocks
        pos = torch.arange(seq_len)
        blocks, offsets = block_tables[s, pos // block_size].long(), pos % block_size
        if kv_fp8:
            ks, vs = fp8_scales(k_new[s]), fp8_scales(v_new[s])  # [n, Hkv]
            key_cache[blocks, offsets], k_scale[blocks, offsets] = quantize_fp8(k_new[s], ks), ks
            value_cache[blocks, offsets], v_scale[blocks, offsets] = quantize_fp8(v_new[s], vs), vs
        else:
            key_cache[blocks, offsets] = k_new[s].to(dtype)
            value_cache[blocks, offsets] = v_new[s].to(dtype)
        if window is not None:
            first_visible = max(0, seq_len - q_lens[s] - window + 1)
            block_tables[s, : first_visible // block_size] = -1  # slid out of the window: freed
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)  # [T, Hq, D]
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)  # [num_seqs + 1]
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    case = dict(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        scale=head_dim**-0.5,
        sliding_window=window,
    )
    if kv_fp8:
        case.update(k_scale=k_scale.to(device), v_scale=v_scale.to(device))
    if softcap is not None:
        case.update(softcap=softcap)
    if sinks:
        case.update(sinks=(torch.randn(num_kv_heads * group, generator=gen) * 2).to(device))  # [Hq]
    return case


def attention_float64(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                      softcap=None, sinks=None, k_scale=None, v_scale=None, chunk=None,
                      query_limits=None) -> torch.Tensor:
    """Per sequence, per position: gather the visible keys by hand and do softmax(q k^T) v in float64, on the CPU.

    Takes what ``ops.paged_attention`` takes (a :func:`scrambled_case`) and returns ``[num_tokens, Hq, D]`` float64.
    fp8 blocks are dequantized in float64 (bits -> e4m3fn value -> times the slot's scale); ``softcap`` caps the
    scaled scores before the mask; ``sinks`` adds one logit per head to the softmax denominator and no value;
    ``chunk=C``: a query at position ``p`` sees ``floor(p / C) * C .. p`` only (chunked attention);
    ``query_limits`` ``[num_tokens]``: query ``i`` sees up to position ``query_limits[i]`` instead of its own.
    """
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads

    def gather(cache, scales, blocks, offsets):  # -> [L, Hq, D] float64
        x = cache.cpu()[blocks, offsets]  # [L, Hkv, D]
        if cache.dtype == torch.uint8:
            x = x.view(torch.float8_e4m3fn).double() * scales.cpu()[blocks, offsets].double()[..., None]
        return x.double().repeat_interleave(group, 1)

    out = torch.zeros(query.shape, dtype=torch.float64)  # [T, Hq, D]
    for s in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[s])
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if start == end:
            continue
        q_pos = torch.arange(seq_len - (end - start), seq_len)  # [q_len]
        lo = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
        pos = torch.arange(lo, seq_len)  # [L], only positions some query may see
        blocks = block_tables[s].cpu().long()[pos // block_size]
        k = gather(key_cache, k_scale, blocks, pos % block_size)  # [L, Hq, D]
        v = gather(value_cache, v_scale, blocks, pos % block_size)
        q = query.cpu()[start:end].double()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_hi = q_pos if query_limits is None else query_limits.cpu().long()[start:end]  # [q_len]
        visible = pos[None, :] <= q_hi[:, None]  # [q_len, L]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        if chunk is not None:
            visible &= pos[None, :] >= q_pos[:, None] // chunk * chunk
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.cpu().double()[:, None, None].expand(-1, end - start, 1)  # [Hq, q_len, 1]
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def on_backend(backend_fn, case: dict, *, plan=None, max_query_len=None, max_seq_len=None, **options):
    """Call a backend (``paged_attention_torch`` / ``paged_attention_triton`` / ``ops.paged_attention_unchecked``
    with its backend bound) on a :func:`scrambled_case`: the case's sequences become the
    :class:`~hf_paged.ops.AttentionMetadata`, its layer options (soft-cap, sinks, fp8 scale caches) keywords."""
    from hf_paged.ops import AttentionMetadata

    meta = AttentionMetadata(case["block_tables"], case["seq_lens"], case["query_start_loc"], max_query_len,
                             max_seq_len, case.get("sliding_window"), plan, chunk=case.get("chunk"),
                             query_limits=case.get("query_limits"))
    layer = {k: case[k] for k in ("softcap", "sinks", "k_scale", "v_scale") if k in case}
    return backend_fn(case["query"], case["key_cache"], case["value_cache"], meta, case["scale"], **layer, **options)
