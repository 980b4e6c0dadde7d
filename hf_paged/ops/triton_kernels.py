"""Triton kernels for paged attention and the KV write; ``reference.py`` holds their PyTorch twins.

Layout: ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD).

Three kernels, one job each:

* ``_decode_kernel``: one query per sequence. A program owns one (sequence, KV head, KV split); the query heads of
  the GQA group fill its tile's first dimension, so each K/V tile is loaded once for the whole group. With more than
  one split (flash-decoding) every program covers a slice of the context and ``_merge_splits_kernel`` combines the
  partial results by their log-sum-exp.
* ``_prefill_kernel``: many queries per sequence, with cached history before them (prefill, chunked prefill, extend,
  speculative verification). A program owns one (query tile, KV head, sequence); the tile's entries are (query,
  head-in-group) pairs, and the KV loop stops at the tile's causal limit and starts at its window start.
* ``_write_kv_kernel``: scatter new K/V into the pool through ``slot_mapping``.

Both attention kernels share ``_attend_kv_range``: block ids are loaded as a vector, one per KV position, so the KV
tile size is independent of ``block_size`` (a tile may span several blocks or part of one). Address arithmetic is
done in int64, so pools past 2**31 elements do not overflow.

Optional features, each a constexpr switch so a kernel built without it carries none of its code:

* ``USE_SOFTCAP`` (Gemma2): scores ``s * scale`` become ``softcap * tanh(s * scale / softcap)`` before the masks.
* ``USE_SINKS`` (gpt-oss ``s_aux``): one logit per query head joins the softmax denominator and adds no value; with
  split-KV it is added once, in ``_merge_splits_kernel``.
* ``KV_FP8``: the pool holds float8 e4m3fn bits as uint8, with scale caches ``[num_blocks, block_size,
  num_kv_heads]`` bfloat16 holding one scale per slot and KV head (the write kernel picks it from the token's own
  amax). Dequantizing the bits is exact (every e4m3 value is exact in fp16/bf16/fp32); a program reads one KV head,
  so it loads one key and one value scale per KV position: the key scale multiplies that position's score column, the
  value scale its probability column before ``p @ V`` (a multiply per score, not per element).
  ``FP8_NATIVE`` converts with Triton's ``float8e4nv`` (sm_89+); otherwise by bit manipulation (sm_80, and the
  interpreter's write, whose fp32 -> fp8 rounding does not carry into the exponent in Triton 3.9).

``launch_choices`` is the one place that picks tile sizes, warps and stages; the launch specs and the ahead-of-time
build check (``hf_paged/tools/kernel_check.py``) both call it. A launcher call looks its ``LaunchSpec`` up by the
shapes, strides, dtypes, device and options of its arguments (``attention_spec``, ``write_kv_spec``): choices, grids
and scalar arguments are worked out once per key, so an eager call costs little more than Triton's own launch.

Runs on CUDA, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is first
imported: triton decides interpreter or compiler when the kernels are defined).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only read (this module also loads from a bare path: python -m hf_paged check-kernels)
    from .metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError as e:  # hf_paged.ops.triton_available() turns this into False
    raise ImportError("hf_paged's Triton kernels need the `triton` package: pip install triton") from e

__all__ = ["paged_attention_triton", "write_kv_triton", "choose_num_kv_splits", "launch_choices", "LaunchChoice",
           "attention_spec", "write_kv_spec", "LaunchSpec", "Launch", "clear_launch_specs"]

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # "window" wider than any context: the window test is always true

# Split-KV heuristic: aim for this many programs per SM, never split below this many KV positions per split.
_PROGRAMS_PER_SM = 2
_MIN_KV_PER_SPLIT = 256
_MAX_KV_SPLITS = 32
_DEFAULT_NUM_SMS = 132  # H100/H200; used when there is no CUDA device to ask (the interpreter)
_DEFAULT_CAPABILITY = 90  # compute capability assumed when there is no CUDA device to ask
_FP8_MAX = 448.0  # largest finite float8 e4m3fn


# Whether @triton.jit below builds interpreter functions: triton decides once, when this module is imported.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# --------------------------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32. DOT_FP32 multiplies exact fp32 copies of the operands instead: Triton 3.9's
    interpreter multiplies bf16 operands as their raw uint16 bits."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _fp8_to_float(bits, FP8_NATIVE: tl.constexpr):
    """uint8 float8-e4m3fn bits -> the exact fp32 value."""
    if FP8_NATIVE:
        x = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # e4m3 (bias 7) placed in fp16 (bias 15) is the value times 2**-8, subnormals included; fp16 -> fp32 is exact.
        b = bits.to(tl.int32)
        half_bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        x = half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return x


@triton.jit
def _float_to_fp8(x, FP8_NATIVE: tl.constexpr):
    """fp32 -> uint8 float8-e4m3fn bits: clamped to +-448, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if FP8_NATIVE:
        bits = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        u = x.to(tl.int32, bitcast=True)
        sign = (u >> 24) & 0x80
        mag = u & 0x7FFFFFFF
        # Normal range (|x| >= 2**-6): round the fp32 mantissa to 3 bits (a carry moves into the exponent), rebias.
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        # Subnormal range: |x| = m * 2**-9 with m in [0, 8], m rounded half to even.
        v = tl.abs(x) * 512.0
        m = v.to(tl.int32)
        frac = v - m.to(tl.float32)
        m += ((frac > 0.5) | ((frac == 0.5) & ((m & 1) == 1))).to(tl.int32)
        bits = (sign | tl.where(tl.abs(x) < 0.015625, m, normal)).to(tl.uint8)
    return bits


@triton.jit
def _fp8_scale(amax):
    """Per-head amax [HEADS] fp32 -> the fp8 scale ``reference.fp8_scales`` picks: ``amax / 448`` (1 / 448 for a zero
    or non-finite amax) rounded up to the next bfloat16 strictly above it (exact as bf16, never zero)."""
    amax = tl.where((amax > 0) & (amax < float("inf")), amax, 1.0)
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    return ((bits + 0x10000) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _add_sink(acc, m_i, l_i, sink):
    """Fold one logit per tile entry (``sink``, log2 units) into the softmax denominator; it adds no value."""
    m_f = tl.maximum(m_i, sink)  # [BLOCK_M], finite: the sink is
    alpha = tl.exp2(m_i - m_f)  # 0 for an entry that saw no key
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_f)


@triton.jit
def _attend_kv_range(
    acc,  # [BLOCK_M, HEAD_DIM_P] fp32, running sum of p @ V (not yet divided by l)
    m_i,  # [BLOCK_M] fp32, running max of each entry's scores (log2 units)
    l_i,  # [BLOCK_M] fp32, running sum of each entry's exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_P], one query head per tile entry
    q_hi,  # [BLOCK_M] int32, last position each entry's query sees (its own, or its bidirectional span's end)
    q_lo,  # [BLOCK_M] int32, first position each entry's query sees (window start, chunk start, or 0)
    kv_lo,  # first KV position any entry of the tile may need
    kv_hi,  # one past the last such position
    block_table_ptr,  # this sequence's row of block_tables
    stride_bt_block,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    stride_cb,  # cache strides: block, token-in-block, head, dim (shared by K and V)
    stride_ct,
    stride_ch,
    stride_cd,
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16 scale caches, read when KV_FP8
    v_scale_ptr,
    stride_st,  # the scale caches' stride per slot (num_kv_heads; a KV head's is 1)
    qk_scale,  # scores = (q @ k) * qk_scale; see _score_scales
    softcap,  # softcap * log2(e) when USE_SOFTCAP
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    head_off = kv_head.to(tl.int64) * stride_ch

    first_tile = (kv_lo // TILE_N) * TILE_N  # tiles aligned to TILE_N, so to blocks (both powers of two)
    for tile_start in range(first_tile, kv_hi, TILE_N):
        kv_pos = tile_start + offs_n  # [TILE_N]
        in_range = (kv_pos >= kv_lo) & (kv_pos < kv_hi)
        # One physical block id per KV position; entries outside the range (e.g. -1 for blocks that slid out of
        # the window) are never loaded, and a -1 inside it is masked rather than dereferenced.
        block_id = tl.load(block_table_ptr + (kv_pos // BLOCK_SIZE) * stride_bt_block, mask=in_range, other=-1)
        kv_ok = in_range & (block_id >= 0)  # [TILE_N]
        slot_off = block_id.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_ct + head_off
        kv_off = slot_off[:, None] + offs_d[None, :].to(tl.int64) * stride_cd  # [TILE_N, HEAD_DIM_P]
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        if KV_FP8:  # exact fp8 values; each position's scales multiply its score and its probability below
            k = _fp8_to_float(tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0), FP8_NATIVE).to(q.dtype)
            v = _fp8_to_float(tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0), FP8_NATIVE).to(q.dtype)
            scale_off = (block_id.to(tl.int64) * BLOCK_SIZE + kv_pos % BLOCK_SIZE) * stride_st + kv_head  # [TILE_N]
            k_s = tl.load(k_scale_ptr + scale_off, mask=kv_ok, other=0.0).to(tl.float32)  # [TILE_N]
            v_s = tl.load(v_scale_ptr + scale_off, mask=kv_ok, other=0.0).to(tl.float32)
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # [TILE_N, HEAD_DIM_P]
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # [TILE_N, HEAD_DIM_P]

        # Scores in log2 units, soft-capped, then masked: causal (or span end), window or chunk start, and positions
        # not loaded.
        s = _dot(q, tl.trans(k), DOT_FP32, DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        if KV_FP8:
            s = s * k_s[None, :]
        if USE_SOFTCAP:  # softcap * tanh(x), tanh(x) = 1 - 2 / (e^(2x) + 1): saturates to +-1 without NaN
            s = softcap * (1.0 - 2.0 / (tl.exp2(s * 2.8853900817779268) + 1.0))
        visible = (
            kv_ok[None, :]
            & (kv_pos[None, :] <= q_hi[:, None])
            & (kv_pos[None, :] >= q_lo[:, None])
        )
        s = tl.where(visible, s, float("-inf"))

        # Online softmax update, step by step:
        # 1. the new running max includes this tile's scores;
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # 2. an entry that has seen no visible key yet still has max -inf; subtract 0 instead so that
        #    exp2(-inf - -inf) = NaN never happens (its p and alpha are then exactly 0);
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        # 3. rescale what was accumulated under the old max;
        alpha = tl.exp2(m_i - m_ref)  # [BLOCK_M]
        # 4. unnormalised probabilities of this tile under the new max;
        p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
        # 5. fold them into the running sum and the running output.
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            p = p * v_s[None, :]  # V = fp8 * scale per position: fold the scale into p (l_i has the plain sum)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32, DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# --------------------------------------------------------------------------------------------------------------------
# Decode (one query per sequence), optionally split over the context
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], uint8 when KV_FP8
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_q_heads, head_dim], written when not SPLIT_KV
    partial_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32, written when SPLIT_KV
    partial_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32 (log2 units), written when SPLIT_KV
    sinks_ptr,  # [num_q_heads] fp32, read when USE_SINKS
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16, read when KV_FP8
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16, read when KV_FP8
    qk_scale,
    softcap,
    sliding_window,
    chunk,  # chunked attention: a query sees its own chunk of this many positions (_NO_WINDOW: none)
    num_splits,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt_seq,
    stride_bt_block,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_st,  # the scale caches' stride per slot (num_kv_heads)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # the tile's query heads: GROUP padded to a power of two, at least 16
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,  # add the sinks here (off when SPLIT_KV: the merge adds them once)
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len == 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1

    # KV range this program covers: the window (or the chunk), cut into num_splits runs of whole tiles.
    kv_lo = tl.maximum(tl.maximum(q_pos - sliding_window + 1, (q_pos // chunk) * chunk), 0)
    kv_hi = seq_len
    first_tile = kv_lo // TILE_N
    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi, TILE_N) - first_tile, num_splits)
    split_lo = tl.maximum(kv_lo, (first_tile + split * tiles_per_split) * TILE_N)
    split_hi = tl.minimum(kv_hi, (first_tile + (split + 1) * tiles_per_split) * TILE_N)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    m_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_DIM
    q_head = kv_head * GROUP + offs_m  # [BLOCK_M]

    q_off = q_start.to(tl.int64) * stride_qt + q_head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(query_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    q_pos_rows = tl.full([BLOCK_M], 0, dtype=tl.int32) + q_pos
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos_rows, q_pos_rows * 0 + kv_lo, split_lo, split_hi,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq, stride_bt_block,
        k_cache_ptr, v_cache_ptr, kv_head, stride_cb, stride_ct, stride_ch, stride_cd,
        k_scale_ptr, v_scale_ptr, stride_st, qk_scale, softcap,
        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, USE_SOFTCAP, KV_FP8, FP8_NATIVE, DOT_FP32, DOT_PRECISION,
    )
    if USE_SINKS:
        sink = tl.load(sinks_ptr + q_head, mask=m_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # [BLOCK_M]
        acc, l_i = _add_sink(acc, m_i, l_i, sink)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an entry that saw no key (empty split) outputs 0
    o = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM_P]
    if SPLIT_KV:
        idx = (seq.to(tl.int64) * num_q_heads + q_head) * num_splits + split  # [BLOCK_M]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(partial_lse_ptr + idx, lse, mask=m_ok)
        tl.store(partial_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=m_ok[:, None] & d_ok[None, :])
    else:
        o_off = q_start.to(tl.int64) * stride_ot + q_head[:, None].to(tl.int64) * stride_oh
        o_off += offs_d[None, :] * stride_od  # [BLOCK_M, HEAD_DIM_P]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32
    partial_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32
    sinks_ptr,  # [num_q_heads] fp32, read when USE_SINKS
    query_start_loc_ptr,
    num_splits,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,  # num_splits padded to a power of two
    USE_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:
        return

    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    idx = (seq.to(tl.int64) * num_q_heads + q_head) * num_splits + offs_s  # [SPLITS_P]
    lse = tl.load(partial_lse_ptr + idx, mask=s_ok, other=float("-inf"))  # [SPLITS_P]
    o_mask = s_ok[:, None] & d_ok[None, :]
    o = tl.load(partial_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=o_mask, other=0.0)  # [SPLITS_P, D_P]

    # Each split's output is already normalised by its own sum; weight it by its share of the total sum. The sink
    # (one logit per head, no value) joins the total once, here.
    lse_max = tl.max(lse, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + q_head).to(tl.float32) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: weights all 0
    w = tl.exp2(lse - lse_max)  # [SPLITS_P]
    w_sum = tl.sum(w, 0)
    if USE_SINKS:
        w_sum += tl.exp2(sink - lse_max)
    merged = tl.sum(w[:, None] * o, 0) / tl.where(w_sum > 0, w_sum, 1.0)  # [HEAD_DIM_P]
    o_off = q_start.to(tl.int64) * stride_ot + q_head.to(tl.int64) * stride_oh + offs_d * stride_od
    tl.store(out_ptr + o_off, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


# --------------------------------------------------------------------------------------------------------------------
# Prefill / extend (many queries per sequence, history before them)
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], uint8 when KV_FP8
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    sinks_ptr,  # [num_q_heads] fp32, read when USE_SINKS
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16, read when KV_FP8
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16, read when KV_FP8
    query_limits_ptr,  # [num_tokens] int32, the last position each query sees, read when USE_LIMITS
    qk_scale,
    softcap,
    sliding_window,
    chunk,  # chunked attention: a query sees its own chunk of this many positions (_NO_WINDOW: none)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt_seq,
    stride_bt_block,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_st,  # the scale caches' stride per slot (num_kv_heads)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP padded to a power of two
    BLOCK_Q: tl.constexpr,  # queries per tile; the tile has BLOCK_Q * GROUP_P (query, head) entries
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_LIMITS: tl.constexpr,  # bidirectional spans: each query's last visible position from query_limits_ptr
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # past this sequence's queries (or q_len == 0)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached history before the new queries

    # Entry m of the tile is query q_tile * BLOCK_Q + m // GROUP_P, head m % GROUP_P of the group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP_P  # [BLOCK_M], index among this sequence's queries
    head_in_group = offs_m % GROUP_P
    m_ok = (q_idx < q_len) & (head_in_group < GROUP)
    d_ok = offs_d < HEAD_DIM
    q_head = kv_head * GROUP + head_in_group  # [BLOCK_M]
    q_token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M]
    q_off = q_token[:, None] * stride_qt + q_head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(query_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]
    q_pos = context_len + q_idx  # [BLOCK_M]

    # KV tiles this query tile can see: from the first query's window (or chunk) start to the last query's own
    # position. Each query's own start: the later of its window's and its chunk's.
    q_lo = tl.maximum(q_pos - sliding_window + 1, (q_pos // chunk) * chunk)  # [BLOCK_M]
    first_q_pos = context_len + q_tile * BLOCK_Q
    last_q_pos = tl.minimum(first_q_pos + BLOCK_Q, seq_len) - 1
    kv_lo = tl.maximum(tl.maximum(first_q_pos - sliding_window + 1, (first_q_pos // chunk) * chunk), 0)
    kv_hi = last_q_pos + 1
    q_hi = q_pos  # [BLOCK_M]
    if USE_LIMITS:  # a query in a bidirectional span sees up to the span's end: the tile reads as far as its latest
        q_hi = tl.maximum(tl.load(query_limits_ptr + q_token, mask=m_ok, other=0), q_pos)
        kv_hi = tl.maximum(kv_hi, tl.max(tl.where(m_ok, q_hi, 0), 0) + 1)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_hi, q_lo, kv_lo, kv_hi,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq, stride_bt_block,
        k_cache_ptr, v_cache_ptr, kv_head, stride_cb, stride_ct, stride_ch, stride_cd,
        k_scale_ptr, v_scale_ptr, stride_st, qk_scale, softcap,
        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P, USE_SOFTCAP, KV_FP8, FP8_NATIVE, DOT_FP32, DOT_PRECISION,
    )
    if USE_SINKS:
        sink = tl.load(sinks_ptr + q_head, mask=m_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # [BLOCK_M]
        acc, l_i = _add_sink(acc, m_i, l_i, sink)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BLOCK_M, HEAD_DIM_P]
    o_off = q_token[:, None] * stride_ot + q_head[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], uint8 when KV_FP8
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int32 or int64
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] bf16 scale caches, written when KV_FP8
    v_scale_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    h_ok = offs_h < num_kv_heads
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)  # [HEADS_P, HEAD_DIM_P]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask,
                other=0.0)  # [HEADS_P, HEAD_DIM_P]
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask,
                other=0.0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    dst_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd  # [HEADS_P, HEAD_DIM_P]
    if KV_FP8:  # each head's scale from the token's own values (stored beside it), then x / scale rounded to e4m3
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k_scale = _fp8_scale(tl.max(tl.abs(k), 1))  # [HEADS_P]
        v_scale = _fp8_scale(tl.max(tl.abs(v), 1))
        scale_off = slot * num_kv_heads + offs_h  # [HEADS_P]: the contiguous scale caches' slot, head
        tl.store(k_scale_ptr + scale_off, k_scale.to(k_scale_ptr.dtype.element_ty), mask=h_ok)
        tl.store(v_scale_ptr + scale_off, v_scale.to(v_scale_ptr.dtype.element_ty), mask=h_ok)
        tl.store(k_cache_ptr + dst_off, _float_to_fp8(k / k_scale[:, None], FP8_NATIVE), mask=mask)
        tl.store(v_cache_ptr + dst_off, _float_to_fp8(v / v_scale[:, None], FP8_NATIVE), mask=mask)
    else:
        tl.store(k_cache_ptr + dst_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------------------------
# Launch choices: tiles, warps, stages, feature switches (pure functions of the configuration)
# --------------------------------------------------------------------------------------------------------------------

_KINDS = ("decode", "prefill", "write_kv")
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8"}


@dataclass(frozen=True)
class LaunchChoice:
    """One kernel launch as the launcher would make it.

    ``kernel`` names the ``@triton.jit`` function in this module; ``constexprs`` holds a value for every one of its
    ``tl.constexpr`` parameters; ``signature`` maps every parameter, in order, to its Triton type (``"*bf16"``,
    ``"i32"``, ``"fp32"``, ``"constexpr"``), ready for ``triton.compiler.ASTSource(fn, signature, constexprs)``.
    """

    kernel: str
    constexprs: dict = field(hash=False)
    num_warps: int
    num_stages: int
    signature: dict = field(hash=False)


def _tile_config(head_dim_p: int, element_size: int) -> tuple[int, int, int]:
    """(target (query, head) entries per prefill tile, KV positions per tile, num_warps) for a head size and input
    width.

    Picked so that sm_90 builds neither spill nor exceed shared memory (checked by compiling ahead of time); not tuned
    by measurement yet: bench/paged_kernels.py is where that happens.
    """
    if element_size >= 4:  # fp32 tiles are twice the bytes
        return (16 if head_dim_p > 128 else 32), 32, 8
    if head_dim_p > 128:
        return 64, 32, 8
    return 64, 64, 8 if head_dim_p == 128 else 4


def _dot_settings(dtype: torch.dtype, interpreted: bool) -> tuple[bool, str]:
    """(DOT_FP32, DOT_PRECISION) for operands of ``dtype``: see ``_dot``."""
    dot_fp32 = interpreted and dtype == torch.bfloat16
    # fp32 inputs get true fp32 products (tf32 would lose ~3 digits vs the torch reference).
    return dot_fp32, "ieee" if dtype == torch.float32 else "tf32"


def _triton_type(dtype: torch.dtype) -> str:
    if dtype not in _TRITON_TYPES:
        raise ValueError(f"No Triton kernel for dtype {dtype}; use one of {tuple(_TRITON_TYPES)}.")
    return _TRITON_TYPES[dtype]


def _signature(kernel_name: str, constexprs: dict, query_dtype: torch.dtype, kv_dtype: torch.dtype) -> dict:
    """Triton type of every parameter of ``kernel_name`` (see ``LaunchChoice``)."""
    kernel = globals()[kernel_name]
    names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    fixed = {
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "slot_mapping_ptr": "*i64",
        "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale": "fp32", "softcap": "fp32",
    }
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in fixed:
            signature[name] = fixed[name]
        elif name == "query_limits_ptr":  # int32 limits; the fp32 placeholder when not read
            signature[name] = "*i32" if constexprs.get("USE_LIMITS") else "*fp32"
        elif name in ("k_scale_ptr", "v_scale_ptr"):  # bf16 scale caches; the fp32 placeholder when not fp8
            signature[name] = "*bf16" if kv_dtype == torch.uint8 else "*fp32"
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            signature[name] = "*" + _triton_type(kv_dtype)
        elif name.endswith("_ptr"):  # query, out, key, value
            signature[name] = "*" + _triton_type(query_dtype)
        else:  # strides, lengths, counts
            signature[name] = "i32"
    return signature


def _choice(kernel: str, constexprs: dict, num_warps: int, num_stages: int, query_dtype, kv_dtype) -> LaunchChoice:
    signature = _signature(kernel, constexprs, query_dtype, kv_dtype)
    return LaunchChoice(kernel, constexprs, num_warps, num_stages, signature)


def launch_choices(
    query_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
    group: int,
    block_size: int,
    split_kv: bool = False,
    kind: str = "decode",
    *,
    softcap: bool = False,
    sinks: bool = False,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    num_kv_heads: int = 1,
    capability: int | None = None,
    interpreted: bool | None = None,
    limits: bool = False,
) -> list[LaunchChoice]:
    """The kernels a launch runs and the compile-time values, warps and stages the launchers pick for them.

    Args:
        query_dtype: dtype of the queries (``kind="write_kv"``: of the keys/values written).
        kv_dtype: dtype of the pool; ``torch.uint8`` for float8 e4m3fn blocks.
        head_dim, group (query heads per KV head), block_size: the shapes the kernels specialise on.
        split_kv: decode only: split-KV, which adds the merge kernel.
        kind: ``"decode"`` (one query per sequence), ``"prefill"`` (any number) or ``"write_kv"``.
        softcap, sinks: whether logit soft-capping / attention sinks are on.
        limits: prefill only: whether per-query visibility limits (bidirectional spans) are read.
        max_query_len: prefill only: caps the query tile for short extends (None: no cap, the largest tile).
        num_splits: decode with split-KV: the split count (None: the largest, ``_MAX_KV_SPLITS``).
        num_kv_heads: write_kv only (its tile holds every KV head of a token).
        capability: CUDA compute capability as ``major * 10 + minor`` (80, 90); None: this machine's device
            (``_DEFAULT_CAPABILITY`` without one). fp8 converts natively from 89 up.
        interpreted: build for the Triton CPU interpreter; None: whatever this module runs under.

    Returns:
        One ``LaunchChoice`` per kernel launched, in launch order: ``[_decode_kernel]`` or
        ``[_decode_kernel, _merge_splits_kernel]``, ``[_prefill_kernel]``, ``[_write_kv_kernel]``.

    Example::

        import torch
        from triton.compiler import ASTSource
        from hf_paged.ops import triton_kernels

        c = triton_kernels.launch_choices(torch.bfloat16, torch.uint8, 128, 4, 16, split_kv=True, kind="decode",
                                          capability=80)
        source = ASTSource(fn=getattr(triton_kernels, c[0].kernel), signature=c[0].signature,
                           constexprs=c[0].constexprs)  # what triton.compile builds for sm_80
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}.")
    interpreted = _INTERPRETED if interpreted is None else interpreted
    capability = _capability(None) if capability is None else capability
    kv_fp8 = kv_dtype == torch.uint8
    fp8_native = interpreted or capability >= 89
    if kind == "write_kv":
        # The interpreter's fp32 -> float8e4nv rounding does not carry into the exponent: convert by bits there.
        constexprs = dict(
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEADS_P=_next_pow2(num_kv_heads), HEAD_DIM_P=_next_pow2(head_dim),
            KV_FP8=kv_fp8, FP8_NATIVE=fp8_native and not interpreted,
        )
        return [_choice("_write_kv_kernel", constexprs, 4, 3, query_dtype, kv_dtype)]

    head_dim_p = max(16, _next_pow2(head_dim))
    dot_fp32, dot_precision = _dot_settings(query_dtype, interpreted)
    tile_m, tile_n, num_warps = _tile_config(head_dim_p, torch.empty((), dtype=query_dtype).element_size())
    common = dict(
        GROUP=group, BLOCK_SIZE=block_size, TILE_N=tile_n, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        USE_SOFTCAP=bool(softcap), KV_FP8=kv_fp8, FP8_NATIVE=fp8_native, DOT_FP32=dot_fp32,
        DOT_PRECISION=dot_precision,
    )
    if kind == "prefill":
        group_p = _next_pow2(group)
        # ~`tile_m` entries per tile (queries x heads of the group), at least 16 for tl.dot, no more queries than
        # needed.
        block_q = max(1, tile_m // group_p)
        if max_query_len is not None:
            block_q = min(block_q, max(_next_pow2(max_query_len), max(1, 16 // group_p)))
        # Eight heads per query fill the tile with the widest group: halving the KV tile keeps the scores
        # and the accumulator in registers (found by `python -m hf_paged check-kernels`: 8-16 B spilled otherwise).
        prefill_tile_n = tile_n // 2 if group_p == 8 else tile_n
        constexprs = dict(common, TILE_N=prefill_tile_n, GROUP_P=group_p, BLOCK_Q=block_q, USE_SINKS=bool(sinks),
                          USE_LIMITS=bool(limits))
        return [_choice("_prefill_kernel", constexprs, num_warps, 2, query_dtype, kv_dtype)]

    decode = dict(common, BLOCK_M=max(16, _next_pow2(group)), SPLIT_KV=bool(split_kv),
                  USE_SINKS=bool(sinks) and not split_kv)
    choices = [_choice("_decode_kernel", decode, num_warps, 2, query_dtype, kv_dtype)]
    if split_kv:
        merge = dict(HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=_next_pow2(num_splits or _MAX_KV_SPLITS),
                     USE_SINKS=bool(sinks))
        choices.append(_choice("_merge_splits_kernel", merge, 4, 3, query_dtype, kv_dtype))
    return choices


# --------------------------------------------------------------------------------------------------------------------
# Host side: launch specs
# --------------------------------------------------------------------------------------------------------------------
#
# Everything a call's launches need that depends only on shapes, strides, dtypes, the device and the options (the
# kernels, grids, constexprs, warps and stages, the split count, the integer and float arguments) is a LaunchSpec,
# built on the first call with a given key and kept. A later call with the same key reads its tensors' shapes and
# strides, looks the spec up and launches: no tensor value is read on the host (when the maxima are given), nothing is
# allocated but the output (in the eager model path split-KV partials come from scratch kept per device and stream),
# and nothing is checked (hf_paged.ops checks the arguments of its public functions once, on the way in).

_MAX_SPECS = 512  # per kind; past it the cache starts over (an engine with ever-new prefill shapes stays bounded)
_MAX_SCRATCH = 16


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a spec: ``kernel[grid](*tensors, *scalars, **options)``.

    The tensors (pointers) are the call's own and come first; ``scalars`` are the kernel's other runtime arguments in
    order (scales, window, counts, strides); ``options`` holds every constexpr plus ``num_warps`` and ``num_stages``.
    """

    kernel: str  # the @triton.jit function's name in this module (looked up at launch: recorders may replace it)
    grid: tuple
    scalars: tuple
    options: dict = field(hash=False)


@dataclass(frozen=True)
class LaunchSpec:
    """What a call launches, for one key (see :func:`attention_spec` and :func:`write_kv_spec`).

    ``launches`` is empty when there is nothing to compute (no tokens). ``partial_shape``: the split-KV partial
    outputs ``[num_seqs, num_q_heads, num_splits, head_dim]`` (None without split-KV). ``device_index``: the CUDA
    device launched on (None off CUDA). ``placeholder``: the tensor passed for pointers a kernel does not read.
    """

    launches: tuple
    partial_shape: tuple | None = None
    device_index: int | None = None
    placeholder: torch.Tensor | None = field(default=None, hash=False, compare=False)


_ATTENTION_SPECS: dict = {}
_WRITE_SPECS: dict = {}
_SCRATCH: dict = {}
_CAPABILITIES: dict = {}
_NUM_SMS: dict = {}


def clear_launch_specs() -> None:
    """Forget every cached spec and scratch buffer (after changing what ``_capability`` reports, as the build check
    does, or to give the memory back)."""
    _ATTENTION_SPECS.clear()
    _WRITE_SPECS.clear()
    _SCRATCH.clear()


def _check_runnable(t: torch.Tensor) -> None:
    if t.device.type not in ("cuda", "meta") and not _INTERPRETED:  # meta: specs only (nothing runs there)
        raise ValueError(
            f"The Triton kernels need CUDA tensors, got tensors on {t.device}. Use backend='torch' on CPU, or set "
            "TRITON_INTERPRET=1 before hf_paged.ops.triton_kernels is first imported to run them in the (slow) "
            "interpreter."
        )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def _capability(device: torch.device | None) -> int:
    """Compute capability as major * 10 + minor of ``device`` (None: the current CUDA device, if any)."""
    if device is not None and device.type == "cuda":
        if device not in _CAPABILITIES:
            major, minor = torch.cuda.get_device_capability(device)
            _CAPABILITIES[device] = major * 10 + minor
        return _CAPABILITIES[device]
    if device is None and not _INTERPRETED and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    return _DEFAULT_CAPABILITY


_PLACEHOLDERS: dict = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """A float32 tensor passed for pointers a kernel does not read (sinks or scales switched off)."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


def _partials(device: torch.device, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV scratch ``[num_seqs, num_q_heads, num_splits, head_dim]`` and ``[..., num_splits]`` fp32.

    Kept per (device, stream, shape): launches on one stream run in order, so the next call may overwrite what the
    merge kernel of this one has read. While a CUDA graph is being captured the buffers come from the graph's own
    memory pool instead (a fresh allocation, not kept).
    """
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return (torch.empty(shape, dtype=torch.float32, device=device),
                    torch.empty(shape[:3], dtype=torch.float32, device=device))
        stream = torch._C._cuda_getCurrentRawStream(device.index)
    key = (device, stream, shape)
    found = _SCRATCH.get(key)
    if found is None:
        if len(_SCRATCH) >= _MAX_SCRATCH:
            _SCRATCH.clear()
        found = _SCRATCH[key] = (torch.empty(shape, dtype=torch.float32, device=device),  # [S, Hq, splits, D]
                                 torch.empty(shape[:3], dtype=torch.float32, device=device))  # [S, Hq, splits]
    return found


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """How many splits the decode kernel cuts each context into (1: no split-KV).

    One split per (sequence, KV head) already gives ``num_seqs * num_kv_heads`` programs. When that is below the
    target of ``_PROGRAMS_PER_SM * num_sms``, the GPU would idle, so the context is split until the target is met,
    but never into splits shorter than ``_MIN_KV_PER_SPLIT`` positions (the merge pass would cost more than it
    saves) and never into more than ``_MAX_KV_SPLITS``. ``max_kv_len`` is the longest KV range attended (the
    window, when one is set).
    """
    base = num_seqs * num_kv_heads
    target = _PROGRAMS_PER_SM * num_sms
    if base >= target:
        return 1
    by_parallelism = triton.cdiv(target, base)
    by_length = max_kv_len // _MIN_KV_PER_SPLIT
    return max(1, min(by_parallelism, by_length, _MAX_KV_SPLITS))


def _score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap argument) of the kernels: scores come out in log2 units, so exp2 replaces exp.

    Without soft-capping ``qk_scale = scale * log2(e)``; with it the kernel computes
    ``(softcap * log2(e)) * tanh((q @ k) * scale / softcap)``.
    """
    if softcap is None:
        return float(scale) * _LOG2E, 1.0
    return float(scale) / float(softcap), float(softcap) * _LOG2E


def _options(choice: LaunchChoice) -> dict:
    return dict(choice.constexprs, num_warps=choice.num_warps, num_stages=choice.num_stages)


def attention_spec(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    max_seq_len: int | None,
    num_kv_splits: int | None = None,
    *,
    softcap: float | None = None,
    sinks: bool = False,
    kv_scales: bool = False,
    chunk: int | None = None,
    limits: bool = False,
) -> LaunchSpec:
    """The (cached) spec of a :func:`paged_attention_triton` call on tensors shaped like these.

    The key is everything the launches depend on: the device, the query's and the pool's dtype, shape and strides,
    the block tables' shape and strides, ``scale``, ``sliding_window``, ``softcap``, whether sinks / fp8 scales are
    passed, ``max_query_len`` and (decode) ``max_seq_len`` and ``num_kv_splits``. ``max_seq_len`` may be None only
    when ``num_kv_splits`` is given or ``max_query_len != 1``. The value cache must share the key cache's layout.

    Example (no launch: the spec of a decode step of 32 sequences over 4096 positions)::

        import torch
        from hf_paged.ops import triton_kernels

        query = torch.empty(32, 32, 128, dtype=torch.bfloat16, device="meta")  # [num_tokens, num_q_heads, head_dim]
        key_cache = torch.empty(8192, 16, 8, 128, dtype=torch.bfloat16, device="meta")
        block_tables = torch.empty(32, 256, dtype=torch.int32, device="meta")
        spec = triton_kernels.attention_spec(query, key_cache, block_tables, 128 ** -0.5, None, 1, 4096)
        assert spec is triton_kernels.attention_spec(query, key_cache, block_tables, 128 ** -0.5, None, 1, 4096)
        print([(launch.kernel, launch.grid) for launch in spec.launches])  # decode + merge: splits fill the SMs
    """
    decode = max_query_len == 1
    key = (query.device, query.dtype, query.shape, query.stride(), key_cache.dtype, key_cache.shape,
           key_cache.stride(), block_tables.shape, block_tables.stride(), max_query_len,
           max_seq_len if decode else None, num_kv_splits, sliding_window, scale, softcap, sinks, kv_scales, chunk,
           limits and not decode)
    spec = _ATTENTION_SPECS.get(key)
    if spec is None:
        spec = _build_attention_spec(query, key_cache, block_tables, scale, sliding_window, max_query_len,
                                     max_seq_len, num_kv_splits, softcap, sinks, chunk, limits and not decode)
        if len(_ATTENTION_SPECS) >= _MAX_SPECS:
            _ATTENTION_SPECS.clear()
        _ATTENTION_SPECS[key] = spec
    return spec


def _build_attention_spec(query, key_cache, block_tables, scale, sliding_window, max_query_len, max_seq_len,
                          num_kv_splits, softcap, sinks, chunk=None, limits=False) -> LaunchSpec:
    _check_runnable(query)
    device = query.device
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 (or None to choose), got {num_kv_splits}.")
    device_index = device.index if device.type == "cuda" else None
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return LaunchSpec((), device_index=device_index)
    qk_scale, softcap_arg = _score_scales(scale, softcap)
    window = _NO_WINDOW if sliding_window is None else int(sliding_window)
    chunk_arg = _NO_WINDOW if chunk is None else int(chunk)
    out_strides = (num_q_heads * head_dim, head_dim, 1)  # the output is a fresh contiguous tensor
    strides = (*query.stride(), *out_strides, *block_tables.stride(), *key_cache.stride(), num_kv_heads)
    choose = dict(
        query_dtype=query.dtype, kv_dtype=key_cache.dtype, head_dim=head_dim, group=num_q_heads // num_kv_heads,
        block_size=block_size, softcap=softcap is not None, sinks=sinks, capability=_capability(device),
    )
    placeholder = _placeholder(device)
    if max_query_len != 1:
        (prefill,) = launch_choices(kind="prefill", max_query_len=max_query_len, limits=limits, **choose)
        grid = (triton.cdiv(max_query_len, prefill.constexprs["BLOCK_Q"]), num_kv_heads, num_seqs)
        launch = Launch("_prefill_kernel", grid, (qk_scale, softcap_arg, window, chunk_arg, *strides), _options(prefill))
        return LaunchSpec((launch,), None, device_index, placeholder)

    if num_kv_splits is None:
        if max_seq_len is None:
            raise ValueError("a decode spec needs max_seq_len (the longest context) or num_kv_splits.")
        max_kv_len = min(max_seq_len, sliding_window or max_seq_len, chunk or max_seq_len)
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_kv_len, _num_sms(device))
    split_kv = num_kv_splits > 1
    choices = launch_choices(kind="decode", split_kv=split_kv, num_splits=num_kv_splits, **choose)
    launches = [Launch("_decode_kernel", (num_seqs, num_kv_heads, num_kv_splits),
                       (qk_scale, softcap_arg, window, chunk_arg, num_kv_splits, num_q_heads, *strides),
                       _options(choices[0]))]
    partial_shape = None
    if split_kv:
        partial_shape = (num_seqs, num_q_heads, num_kv_splits, head_dim)
        launches.append(Launch("_merge_splits_kernel", (num_seqs, num_q_heads),
                               (num_kv_splits, num_q_heads, *out_strides), _options(choices[1])))
    return LaunchSpec(tuple(launches), partial_shape, device_index, placeholder)


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_kv_splits: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    reuse_partials: bool = False,
) -> torch.Tensor:
    """Triton paged attention; same contract as ``hf_paged.ops.paged_attention``, which checks the arguments (here
    nothing is checked: ``seq_lens``/``query_start_loc`` contiguous, caches of one layout, as that function makes them).

    A batch whose sequences have at most one query each runs the decode kernel (split-KV when
    ``choose_num_kv_splits`` asks for it, or ``num_kv_splits`` forces a count); anything else the prefill kernel.
    With ``meta.max_query_len`` and ``meta.max_seq_len`` given nothing here waits for the device (CUDA-graph
    capturable): the grid depends only on tensor shapes and those ints, and the launches come from
    :func:`attention_spec`'s cache. ``reuse_partials``: take the split-KV partials from scratch kept per device,
    stream and shape instead of allocating them (the eager model path; a compiled graph's call allocates, so its
    memory stays the graph's).

    Returns:
        ``[num_tokens, num_q_heads, head_dim]``, same dtype as ``query``.
    """
    device = query.device
    block_tables, seq_lens, query_start_loc = meta.block_tables, meta.seq_lens, meta.query_start_loc
    max_query_len, max_seq_len = meta.max_query_len, meta.max_seq_len
    out = torch.empty(query.shape, dtype=query.dtype, device=device)  # [num_tokens, num_q_heads, head_dim]
    if max_query_len is None:
        if query.shape[0] == 0 or seq_lens.shape[0] == 0:
            return out
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 1 and max_seq_len is None and num_kv_splits is None:
        max_seq_len = int(seq_lens.max())
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()
    spec = attention_spec(query, key_cache, block_tables, scale, meta.sliding_window, max_query_len, max_seq_len,
                          num_kv_splits, softcap=softcap, sinks=sinks is not None, kv_scales=k_scale is not None,
                          chunk=meta.chunk, limits=meta.query_limits is not None)
    if not spec.launches:
        return out
    placeholder = spec.placeholder
    pointers = (placeholder if sinks is None else sinks, placeholder if k_scale is None else k_scale,
                placeholder if v_scale is None else v_scale,
                placeholder if meta.query_limits is None else meta.query_limits)
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    if spec.device_index is not None and spec.device_index != torch.cuda.current_device():
        with torch.cuda.device(spec.device_index):
            _launch_attention(spec, tensors, pointers, reuse_partials)
    else:
        _launch_attention(spec, tensors, pointers, reuse_partials)
    return out


def _launch_attention(spec, tensors, pointers, reuse_partials: bool):
    """``tensors``: query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out; ``pointers``: sinks,
    k_scale, v_scale, query_limits (or the placeholder; the decode kernels take the first three)."""
    first = spec.launches[0]
    out, query_start_loc, device = tensors[6], tensors[5], tensors[0].device
    if first.kernel == "_prefill_kernel":
        _prefill_kernel[first.grid](*tensors, *pointers, *first.scalars, **first.options)
        return
    if spec.partial_shape is None:
        _decode_kernel[first.grid](*tensors, out, out, *pointers[:3], *first.scalars, **first.options)  # no partials
        return
    if reuse_partials:
        partial_out, partial_lse = _partials(device, spec.partial_shape)
    else:
        partial_out = torch.empty(spec.partial_shape, dtype=torch.float32, device=device)  # [S, Hq, splits, D]
        partial_lse = torch.empty(spec.partial_shape[:3], dtype=torch.float32, device=device)  # [S, Hq, splits]
    _decode_kernel[first.grid](*tensors, partial_out, partial_lse, *pointers[:3], *first.scalars, **first.options)
    merge = spec.launches[1]
    _merge_splits_kernel[merge.grid](out, partial_out, partial_lse, pointers[0], query_start_loc, *merge.scalars,
                                     **merge.options)


def write_kv_spec(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  kv_scales: bool = False) -> LaunchSpec:
    """The (cached) spec of a :func:`write_kv_triton` call: keyed by the device, the dtypes, shapes and strides of
    ``key``, ``value`` and the pool (the value cache shares the key cache's layout), and whether scales are passed."""
    cache_key = (key.device, key.dtype, key.shape, key.stride(), value.stride(), key_cache.dtype, key_cache.shape,
                 key_cache.stride(), kv_scales)
    spec = _WRITE_SPECS.get(cache_key)
    if spec is None:
        _check_runnable(key)
        device = key.device
        num_tokens, num_kv_heads, head_dim = key.shape
        device_index = device.index if device.type == "cuda" else None
        launches = ()
        if num_tokens:
            (choice,) = launch_choices(key.dtype, key_cache.dtype, head_dim, 1, key_cache.shape[1], kind="write_kv",
                                       num_kv_heads=num_kv_heads, capability=_capability(device))
            scalars = (num_kv_heads, *key.stride(), *value.stride(), *key_cache.stride())
            launches = (Launch("_write_kv_kernel", (num_tokens,), scalars, _options(choice)),)
        spec = LaunchSpec(launches, None, device_index, _placeholder(device))
        if len(_WRITE_SPECS) >= _MAX_SPECS:
            _WRITE_SPECS.clear()
        _WRITE_SPECS[cache_key] = spec
    return spec


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool at ``slot_mapping``, in place.

    Tokens whose slot is negative (padding) are skipped. A uint8 (fp8) pool stores ``x / scale`` rounded to e4m3fn,
    each token's scales (per KV head, from its own amax) going to its slot of the contiguous scale caches
    ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` bfloat16. ``slot_mapping`` must be contiguous
    (``hf_paged.ops.write_kv`` makes it so); nothing is checked here.
    """
    spec = write_kv_spec(key, value, key_cache, k_scale is not None)
    if not spec.launches:
        return
    (launch,) = spec.launches
    placeholder = spec.placeholder
    args = (key, value, key_cache, value_cache, slot_mapping, placeholder if k_scale is None else k_scale,
            placeholder if v_scale is None else v_scale, *launch.scalars)
    if spec.device_index is not None and spec.device_index != torch.cuda.current_device():
        with torch.cuda.device(spec.device_index):
            _write_kv_kernel[launch.grid](*args, **launch.options)
    else:
        _write_kv_kernel[launch.grid](*args, **launch.options)
