"""Triton kernel for MLA's latent-space attention over a paged latent; ``mla.py`` holds its PyTorch twin.

Layout: ``latent_cache [num_blocks, block_size, 1, R]`` and ``rope_cache [num_blocks, block_size, 1, P]`` (one "KV
head": the latent and the shared rotated key of each token); queries ``q_lat [N, H, R]`` (absorbed through the key
half of ``kv_b_proj``) and ``q_rot [N, H, P]``; output ``[N, H, R]``, the softmax-weighted latent sum per head.

One kernel, ``_mla_kernel``, for decode, prefill and extend over a varlen batch. A program owns one (sequence, tile of
``BLOCK_Q`` queries, group of ``BLOCK_H`` heads); its tile's ``BLOCK_M = BLOCK_Q * BLOCK_H`` entries are (query, head)
pairs (entry ``m``: query ``m // BLOCK_H``, head ``m % BLOCK_H``). Every head shares the one latent, so each KV tile is
loaded once for all the entries and serves twice: as the key (with the rope part) and as the value. The KV loop stops at
the tile's causal limit. Block ids are loaded as a vector, one per KV position (the tile size does not depend on the
block size); addresses in int64.

``KV_FP8``: the caches hold float8 e4m3fn bits as uint8, with one bfloat16 scale per token for the latent and one
for the rotated key (``[num_blocks, block_size, 1]``): the latent scale multiplies the latent part of the score and
the probability before ``p @ c``, the rope scale the rope part of the score.

Tiles: ``BLOCK_M`` 16 entries at DeepSeek-V3's rank 512 (the fp32 accumulator ``[16, 512]`` fits in registers with 8
warps, no spills on sm_80/sm_90: ``python -m hf_paged check-kernels --only mla``); decode takes 16 heads per program,
prefill as many queries as fit next to the heads. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .triton_kernels import (
    _capability, _check_runnable, _dot, _dot_settings, _fp8_to_float, _merge_splits_kernel, _next_pow2, _num_sms,
    choose_num_kv_splits,
)

if TYPE_CHECKING:
    from .metadata import AttentionMetadata

__all__ = ["mla_attention_triton", "mla_launch", "MlaLaunch"]

_LOG2E = 1.4426950408889634
_TILE_M = 16  # BLOCK_M: (query, head) entries per program


@triton.jit
def _mla_kernel(
    q_lat_ptr,  # [num_tokens, num_heads, R]
    q_rot_ptr,  # [num_tokens, num_heads, P]
    latent_ptr,  # [num_blocks, block_size, 1, R], uint8 when KV_FP8
    rope_ptr,  # [num_blocks, block_size, 1, P], uint8 when KV_FP8
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, R], written when not SPLIT_KV
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, R] fp32, written when SPLIT_KV
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (log2 units), written when SPLIT_KV
    latent_scale_ptr,  # [num_blocks, block_size, 1] bf16, read when KV_FP8
    rope_scale_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_splits,
    stride_lt,  # q_lat: token, head (dim stride 1)
    stride_lh,
    stride_rt,  # q_rot
    stride_rh,
    stride_ot,  # out
    stride_oh,
    stride_bt_seq,
    stride_cb,  # latent cache: block, token (dim stride 1)
    stride_ct,
    stride_pb,  # rope cache: block, token
    stride_pt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    RANK: tl.constexpr,
    RANK_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # decode only: axis 1 is the split of the context, not a query tile
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = 0 if SPLIT_KV else tl.program_id(1)
    split = tl.program_id(1) if SPLIT_KV else 0
    head_group = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    history = seq_len - q_len  # positions before the first query

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // BLOCK_H  # [BLOCK_M] query of each entry, within the sequence
    head = head_group * BLOCK_H + offs_m % BLOCK_H  # [BLOCK_M]
    m_ok = (q_idx < q_len) & (head < num_heads)
    q_pos = history + q_idx  # [BLOCK_M]
    token = (q_start + q_idx).to(tl.int64)

    offs_r = tl.arange(0, RANK_P)
    offs_p = tl.arange(0, ROPE_P)
    r_ok = offs_r < RANK
    p_ok = offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + token[:, None] * stride_lt + head[:, None].to(tl.int64) * stride_lh + offs_r[None, :],
                    mask=m_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, RANK_P]
    q_rot = tl.load(q_rot_ptr + token[:, None] * stride_rt + head[:, None].to(tl.int64) * stride_rh + offs_p[None, :],
                    mask=m_ok[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_M, ROPE_P]

    acc = tl.zeros([BLOCK_M, RANK_P], dtype=tl.float32)  # running sum of p @ c (not yet divided by l)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max per entry (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum per entry of exp2(s - m_i)

    kv_hi = history + tl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q)  # the tile's last query sees up to itself
    kv_lo = 0
    if SPLIT_KV:  # this program's run of whole tiles
        tiles_per_split = tl.cdiv(tl.cdiv(kv_hi, TILE_N), num_splits)
        kv_lo = split * tiles_per_split * TILE_N
        kv_hi = tl.minimum(kv_hi, kv_lo + tiles_per_split * TILE_N)
    offs_n = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(kv_lo, kv_hi, TILE_N):
        kv_pos = tile_start + offs_n  # [TILE_N]
        in_range = kv_pos < kv_hi
        block_id = tl.load(table + kv_pos // BLOCK_SIZE, mask=in_range, other=-1)
        kv_ok = in_range & (block_id >= 0)
        slot = block_id.to(tl.int64) * BLOCK_SIZE + (kv_pos % BLOCK_SIZE)  # [TILE_N]
        c_off = (block_id.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_ct)[:, None] \
            + offs_r[None, :]
        p_off = (block_id.to(tl.int64) * stride_pb + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_pt)[:, None] \
            + offs_p[None, :]
        c_mask = kv_ok[:, None] & r_ok[None, :]
        p_mask = kv_ok[:, None] & p_ok[None, :]
        if KV_FP8:  # exact fp8 values; each token's scales multiply its score parts and its probability below
            c = _fp8_to_float(tl.load(latent_ptr + c_off, mask=c_mask, other=0), FP8_NATIVE).to(q_lat.dtype)
            r = _fp8_to_float(tl.load(rope_ptr + p_off, mask=p_mask, other=0), FP8_NATIVE).to(q_rot.dtype)
            c_s = tl.load(latent_scale_ptr + slot, mask=kv_ok, other=0.0).to(tl.float32)  # [TILE_N]
            r_s = tl.load(rope_scale_ptr + slot, mask=kv_ok, other=0.0).to(tl.float32)
            s = _dot(q_lat, tl.trans(c), DOT_FP32, DOT_PRECISION) * c_s[None, :] \
                + _dot(q_rot, tl.trans(r), DOT_FP32, DOT_PRECISION) * r_s[None, :]
        else:
            c = tl.load(latent_ptr + c_off, mask=c_mask, other=0.0).to(q_lat.dtype)  # [TILE_N, RANK_P]
            r = tl.load(rope_ptr + p_off, mask=p_mask, other=0.0).to(q_rot.dtype)  # [TILE_N, ROPE_P]
            s = _dot(q_lat, tl.trans(c), DOT_FP32, DOT_PRECISION) + _dot(q_rot, tl.trans(r), DOT_FP32, DOT_PRECISION)
        s = s * qk_scale  # [BLOCK_M, TILE_N], log2 units
        visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Online softmax: the new running max; an entry that has seen no visible key keeps -inf and subtracts 0 (its
        # p and alpha are then exactly 0, never NaN); rescale the old sums; add this tile's.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            p = p * c_s[None, :]  # the value is the latent: fp8 * its scale, folded into p
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, DOT_FP32, DOT_PRECISION)  # [BLOCK_M, RANK_P]
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an entry that saw no key (an empty split) outputs 0
    o = acc / l_safe[:, None]
    if SPLIT_KV:  # normalised partial output and its log-sum-exp; _merge_splits_kernel weighs the splits
        idx = (seq.to(tl.int64) * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(partial_lse_ptr + idx, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=m_ok)
        tl.store(partial_out_ptr + idx[:, None] * RANK + offs_r[None, :], o, mask=m_ok[:, None] & r_ok[None, :])
    else:
        o_off = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_r[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@dataclass(frozen=True)
class MlaLaunch:
    """How :func:`mla_attention_triton` launches ``_mla_kernel`` for a batch shape (a pure function of it)."""

    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    num_splits: int = 1  # decode split-KV: the merge kernel's launch follows


def mla_launch(num_seqs: int, max_query_len: int, num_heads: int, rank: int, rope: int, block_size: int,
               query_dtype: torch.dtype, fp8: bool, capability: int, interpreted: bool, max_seq_len: int | None = None,
               num_sms: int = 132, num_splits: int | None = None) -> MlaLaunch:
    """Tiles, warps and stages: ``_TILE_M`` entries of (query, head); decode entries are heads, prefill entries as
    many queries as fit beside ``min(num_heads, _TILE_M)`` heads; KV tiles of 32 positions (16 at ranks above 256 in
    fp32). Decode splits the context (``choose_num_kv_splits`` over sequences x head groups, given ``max_seq_len``) when
    too few programs would fill the GPU; ``num_splits`` forces a count."""
    block_h = min(_next_pow2(num_heads), _TILE_M)
    block_q = 1 if max_query_len == 1 else max(1, _TILE_M // block_h)
    rank_p, rope_p = max(16, _next_pow2(rank)), max(16, _next_pow2(rope))
    wide = rank_p * (4 if query_dtype == torch.float32 else 2) > 1024  # fp32 at rank 512: halve the KV tile
    dot_fp32, precision = _dot_settings(query_dtype, interpreted)
    constexprs = dict(BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_H=block_h, TILE_N=16 if wide else 32, RANK=rank,
                      RANK_P=rank_p, ROPE=rope, ROPE_P=rope_p, KV_FP8=fp8, FP8_NATIVE=fp8 and capability >= 89,
                      DOT_FP32=dot_fp32, DOT_PRECISION=precision)
    head_groups = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = 1
        if max_query_len == 1 and max_seq_len is not None:
            num_splits = choose_num_kv_splits(num_seqs, head_groups, max_seq_len, num_sms)
    num_splits = num_splits if max_query_len == 1 else 1
    constexprs["SPLIT_KV"] = num_splits > 1
    axis1 = num_splits if num_splits > 1 else triton.cdiv(max_query_len, block_q)
    return MlaLaunch((num_seqs, axis1, head_groups), constexprs, num_warps=8 if rank_p >= 256 else 4,
                     num_stages=1 if rank_p >= 256 else 2, num_splits=num_splits)


def mla_attention_triton(q_lat: torch.Tensor, q_rot: torch.Tensor, latent_cache: torch.Tensor,
                         rope_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                         latent_scale: torch.Tensor | None = None, rope_scale: torch.Tensor | None = None,
                         num_kv_splits: int | None = None) -> torch.Tensor:
    """Triton twin of :func:`hf_paged.ops.mla.mla_attention_torch` (same arguments, same result): ``[N, H, R]``.

    With ``meta.max_query_len`` given nothing here waits for the device (the grid depends on it and on shapes); a
    decode batch splits its contexts only when ``meta.max_seq_len`` is known too (or ``num_kv_splits`` forces a
    count)."""
    _check_runnable(q_lat)
    num_tokens, num_heads, rank = q_lat.shape
    out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)  # [N, H, R]
    max_query_len = meta.max_query_len
    if max_query_len is None:
        if num_tokens == 0:
            return out
        max_query_len = int((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).max())
    if num_tokens == 0 or max_query_len == 0:
        return out
    q_rot = q_rot if q_rot.stride(-1) == 1 else q_rot.contiguous()
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    fp8 = latent_cache.dtype == torch.uint8
    num_seqs = meta.seq_lens.shape[0]
    launch = mla_launch(num_seqs, max_query_len, num_heads, rank, rope_cache.shape[-1], latent_cache.shape[1],
                        q_lat.dtype, fp8, _capability(q_lat.device), q_lat.device.type != "cuda",
                        meta.max_seq_len, _num_sms(q_lat.device), num_kv_splits)
    scales = (latent_scale, rope_scale) if fp8 else (out, out)  # unread without KV_FP8
    splits = launch.num_splits
    if splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, splits, rank, dtype=torch.float32, device=q_lat.device)
        partial_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q_lat.device)
    else:
        partial_out = partial_lse = out  # unwritten
    _mla_kernel[launch.grid](
        q_lat, q_rot, latent_cache, rope_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
        partial_out, partial_lse, *scales, scale * _LOG2E, num_heads, splits, q_lat.stride(0), q_lat.stride(1),
        q_rot.stride(0), q_rot.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        latent_cache.stride(0), latent_cache.stride(1), rope_cache.stride(0), rope_cache.stride(1),
        **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    if splits > 1:
        rank_p = launch.constexprs["RANK_P"]
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, partial_lse, meta.query_start_loc, splits, num_heads, out.stride(0),
            out.stride(1), out.stride(2), HEAD_DIM=rank, HEAD_DIM_P=rank_p, SPLITS_P=_next_pow2(splits),
            USE_SINKS=False, num_warps=4 if rank_p <= 256 else 8, num_stages=1)
    return out
