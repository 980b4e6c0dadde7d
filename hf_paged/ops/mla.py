"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and kin) over a paged latent: the PyTorch path and reference.

The pool of an MLA layer holds, per token, the compressed latent ``c`` (``kv_lora_rank`` values, in the key tensor)
and the shared rotated key ``k_rot`` (``qk_rope_head_dim`` values, in the value tensor), as one "KV head":
``latent_cache [num_blocks, block_size, 1, R]`` and ``rope_cache [num_blocks, block_size, 1, P]``.

The model's own attention re-expands every past token through ``kv_b_proj`` ``W [H * (Dn + Dv), R]``, whose rows
are per head a key half ``W_UK[h] [Dn, R]`` and a value half ``W_UV[h] [Dv, R]``::

    k[h, t] = [W_UK[h] c_t, k_rot_t]            v[h, t] = W_UV[h] c_t
    score(h, t) = scale * (q_nope[h] . W_UK[h] c_t + q_rot[h] . k_rot_t)
    out[h] = sum_t p(h, t) W_UV[h] c_t

Here the weights are absorbed (associativity of the products): ``q_lat[h] = W_UK[h]^T q_nope[h]`` ``[R]``, so
``score(h, t) = scale * (q_lat[h] . c_t + q_rot[h] . k_rot_t)``, and ``out[h] = W_UV[h] (sum_t p(h, t) c_t)``. The
attention is then multi-query attention with one shared key of width ``R + P`` and value of width ``R`` (the
latent itself), whatever the number of heads: a decode step reads ``R + P`` values per past token once.

A bias on ``kv_b_proj`` (none in the shipped families, handled anyway): its key half adds ``q_nope[h] . b_k[h]`` to
every score of a query (the softmax does not change), its value half adds ``b_v[h]`` to the output (the weights sum
to one).
"""

from __future__ import annotations

import sys

import torch

from .layout import AttentionPart
from .metadata import AttentionMetadata
from .reference import dequantize_fp8, plan_torch_attention


# Imported on first use, not at the top: triton is optional and triton_mla imports it (ImportError without it).
_TRITON_MLA = __name__.rsplit(".", 1)[0] + ".triton_mla"


def _triton_mla():
    """The Triton MLA kernel's module, imported on first use, from ``sys.modules`` after."""
    module = sys.modules.get(_TRITON_MLA)
    if module is None:
        from . import triton_mla as module
    return module


def split_kv_b(weight: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight`` ``[H * (Dn + Dv), R]`` -> ``(W_UK [H, Dn, R], W_UV [H, Dv, R])`` (views, no copy)."""
    per_head = weight.view(num_heads, -1, weight.shape[-1])  # [H, Dn + Dv, R]
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope [N, H, Dn]`` -> ``q_lat [N, H, R]`` = ``W_UK[h]^T q_nope[h]`` per head."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, N, Dn] @ [H, Dn, R] -> [N, H, R]


def project_out(out_lat: torch.Tensor, w_uv: torch.Tensor, bias_v: torch.Tensor | None = None) -> torch.Tensor:
    """``out_lat [N, H, R]`` -> ``[N, H, Dv]`` = ``W_UV[h] out_lat[h]`` (+ the value half of the bias)."""
    out = torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [N, H, Dv]
    return out if bias_v is None else out + bias_v


def _read(cache: torch.Tensor, scale: torch.Tensor | None, part: AttentionPart, num_rows: int,
          dtype: torch.dtype) -> torch.Tensor:
    """``[Sx, L, D]`` of a part (one KV head), a view for a run of blocks, else gathered; fp8 dequantized."""
    _, block_size, _, dim = cache.shape
    num_blocks = part.tables.shape[0] // num_rows
    shape = (num_rows, num_blocks * block_size, 1, dim)

    def read(t, shape):
        if part.run is not None:
            return t[part.run: part.run + num_blocks].view(shape)
        return t.index_select(0, part.tables).view(shape)

    values = read(cache, shape)
    if part.kv_valid is not None:
        values = values.masked_fill(~part.kv_valid, 0)
    if cache.dtype == torch.uint8:
        scales = read(scale, shape[:3])
        if part.kv_valid is not None:
            scales = scales.masked_fill(~part.kv_valid[..., 0], 0)
        values = dequantize_fp8(values, scales, dtype)
    return values.view(shape[:2] + (dim,)).to(dtype)  # [Sx, L, D]


def mla_attention_torch(q_lat: torch.Tensor, q_rot: torch.Tensor, latent_cache: torch.Tensor,
                        rope_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                        latent_scale: torch.Tensor | None = None,
                        rope_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Latent-space attention of packed queries through block tables.

    Args:
        q_lat: ``[N, H, R]`` absorbed queries (:func:`absorb_query`); ``q_rot``: ``[N, H, P]`` rotated queries.
        latent_cache: ``[num_blocks, block_size, 1, R]``; rope_cache: ``[num_blocks, block_size, 1, P]`` (float, or
            uint8 fp8 bits with ``latent_scale``/``rope_scale`` ``[num_blocks, block_size, 1]`` bfloat16).
        meta: block tables, lengths, query starts (and the step's read layout, ``meta.plan``, built here when None).
        scale: the softmax scale of the model (``qk_head_dim ** -0.5``, times any YaRN factor).

    Returns:
        ``[N, H, R]``: per head, the softmax-weighted sum of the latents (project with :func:`project_out`).

    Scores and the softmax are in float32 at least (the output in ``q_lat``'s dtype), as in transformers' eager
    attention.
    """
    num_tokens, num_heads, rank = q_lat.shape
    if num_tokens == 0:
        return q_lat.new_empty(q_lat.shape)
    layout = meta.plan
    if layout is None:  # a caller's pool may hold NaN in unwritten slots: zero them
        layout = plan_torch_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc, latent_cache.shape[1],
                                      sliding_window=meta.sliding_window, max_seq_len=meta.max_seq_len,
                                      zero_unowned=True, query_limits=meta.query_limits)
    dtype = q_lat.dtype
    softmax_dtype = torch.promote_types(dtype, torch.float32)
    outputs = []
    for part in layout.parts:
        rows, queries = part.sizes()
        if part.q_index is not None:
            ql, qr = q_lat.index_select(0, part.q_index), q_rot.index_select(0, part.q_index)
        else:
            ql = q_lat[part.q_start: part.q_start + rows * queries]
            qr = q_rot[part.q_start: part.q_start + rows * queries]
        latent = _read(latent_cache, latent_scale, part, rows, dtype)  # [Sx, L, R]
        rope = _read(rope_cache, rope_scale, part, rows, dtype)  # [Sx, L, P]
        ql = ql.reshape(rows, queries * num_heads, rank)  # [Sx, Q*H, R]: query-major, then heads
        qr = qr.reshape(rows, queries * num_heads, -1)
        scores = torch.bmm(ql, latent.transpose(1, 2)) + torch.bmm(qr, rope.transpose(1, 2))  # [Sx, Q*H, L]
        scores = scores.to(softmax_dtype) * scale
        scores = scores.view(rows, queries, num_heads, -1)  # [Sx, Q, H, L]
        mask = part.mask
        if mask is None and queries > 1:  # each row's queries are its first positions: causal
            length = scores.shape[-1]
            mask = torch.ones(queries, length, dtype=torch.bool, device=scores.device).tril()[None, None]
        if mask is not None:  # [Sx, 1, Q, L] -> [Sx, Q, 1, L]
            scores = scores.masked_fill(~mask.transpose(1, 2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(dtype).view(rows, queries * num_heads, -1)
        out = torch.bmm(probs, latent).view(rows * queries, num_heads, rank)  # [Sx*Q, H, R]
        outputs.append((out, part.q_index))
    if len(outputs) == 1 and outputs[0][0].shape[0] == num_tokens:
        return outputs[0][0]
    if layout.ordered:
        return torch.cat([out for out, _ in outputs])
    out = q_lat.new_zeros(q_lat.shape)
    for part, index in outputs:
        out.index_copy_(0, index, part)
    return out


def paged_mla(query: torch.Tensor, kv_b_weight: torch.Tensor, kv_b_bias: torch.Tensor | None, nope_dim: int,
              latent_cache: torch.Tensor, rope_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              backend: str = "torch", *, latent_scale: torch.Tensor | None = None,
              rope_scale: torch.Tensor | None = None) -> torch.Tensor:
    """MLA with ``kv_b_proj`` absorbed, over a paged latent.

    Args:
        query: ``[N, H, Dn + P]`` packed queries as the model builds them (``[q_nope, q_rot]`` per head).
        kv_b_weight: ``kv_b_proj.weight`` ``[H * (Dn + Dv), R]``; kv_b_bias: its bias ``[H * (Dn + Dv)]`` or None.
        nope_dim: ``Dn`` (``qk_nope_head_dim``).
        latent_cache, rope_cache, meta, scale, latent_scale, rope_scale: as :func:`mla_attention_torch`.
        backend: ``"torch"`` or ``"triton"`` (:mod:`hf_paged.ops.triton_mla`).

    Returns:
        ``[N, H, Dv]`` in ``query``'s dtype: what the model's attention over the expanded keys and values gives.

    Example::

        import torch
        from hf_paged.ops import AttentionMetadata, mla

        H, Dn, Dv, R, P = 4, 8, 8, 16, 4
        latent_cache, rope_cache = torch.randn(6, 4, 1, R), torch.randn(6, 4, 1, P)
        meta = AttentionMetadata(torch.tensor([[5, 2]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32),
                                 torch.tensor([0, 1], dtype=torch.int32))
        out = mla.paged_mla(torch.randn(1, H, Dn + P), torch.randn(H * (Dn + Dv), R), None, Dn, latent_cache,
                            rope_cache, meta, scale=(Dn + P) ** -0.5)  # [1, 4, 8]
    """
    num_tokens, num_heads, _ = query.shape
    w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope_dim)
    q_lat = absorb_query(query[..., :nope_dim], w_uk)  # [N, H, R]
    q_rot = query[..., nope_dim:]  # [N, H, P]
    if backend == "triton" and meta.query_limits is not None:
        raise ValueError("the Triton MLA kernel has no bidirectional spans (query_limits): use backend='torch' for "
                         "a prompt with them.")
    if backend == "triton":
        out_lat = _triton_mla().mla_attention_triton(q_lat, q_rot, latent_cache, rope_cache, meta, scale,
                                                     latent_scale=latent_scale, rope_scale=rope_scale)
    else:
        out_lat = mla_attention_torch(q_lat, q_rot.contiguous(), latent_cache, rope_cache, meta, scale,
                                      latent_scale=latent_scale, rope_scale=rope_scale)
    bias_v = None
    if kv_b_bias is not None:
        bias_v = kv_b_bias.view(num_heads, -1)[:, nope_dim:]  # [H, Dv]
    return project_out(out_lat, w_uv, bias_v)
