"""Triton kernels for batched LoRA; ``lora.py`` holds their PyTorch twin (``add_lora_torch``) and the layout.

Two kernels, one job each, per LoRA-targeted linear layer:

* ``_shrink_kernel``: one program per token ``t``: ``h[t, :R] = A[s] @ x[t]`` in fp32, ``s = token_adapters[t]``; the
  loop walks ``in_features`` in tiles of ``BLOCK_K``. A token of adapter index ``-1`` writes nothing.
* ``_expand_kernel``: one program per (token, tile of ``BLOCK_N`` outputs): ``y[t, n] += scale[s] * h[t] @ B[s][:, n]``
  (B stored transposed, ``[N, R, out]``), read and written in ``y``'s dtype with an fp32 sum.

Ranks are padded to ``R`` with zero rows, so an index of lower rank adds exact zeros past its own rank. Addresses in
int64. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (set before this module is first imported).

Example (CUDA, or CPU tensors under the interpreter)::

    h = add_lora_triton(y, x, lora_a, lora_b, scales, token_adapters)   # y updated in place
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_shapes import check_lora_shapes
from .triton_kernels import _check_runnable, _next_pow2

__all__ = ["add_lora_triton", "lora_blocks"]

_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, IN]
    a_ptr,  # [N, R, IN]
    adapters_ptr,  # [T] int32, -1: no adapter
    h_ptr,  # [T, R] fp32 out
    IN,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    index = tl.load(adapters_ptr + t).to(tl.int64)
    rank = tl.where(index >= 0, R, 0)  # a token of no adapter: every mask empty, nothing written
    index = tl.maximum(index, 0)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k < IN, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_ptr + index * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < IN), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + t * R + r, acc, mask=r < rank)


@triton.jit
def _expand_kernel(
    h_ptr,  # [T, R] fp32
    b_ptr,  # [N, R, OUT] (B transposed)
    scales_ptr,  # [N] fp32
    adapters_ptr,  # [T] int32
    y_ptr,  # [T, OUT], updated in place
    OUT,
    R,
    stride_yt,
    stride_bs,
    stride_br,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    index = tl.load(adapters_ptr + t).to(tl.int64)
    out_limit = tl.where(index >= 0, OUT, 0)  # a token of no adapter: every mask empty, y untouched
    rank = tl.where(index >= 0, R, 0)
    index = tl.maximum(index, 0)
    r = tl.arange(0, BLOCK_R)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + t * R + r, mask=r < rank, other=0.0)  # [BLOCK_R]
    b = tl.load(b_ptr + index * stride_bs + r[:, None] * stride_br + n[None, :],
                mask=(r[:, None] < rank) & (n[None, :] < out_limit), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
    scale = tl.load(scales_ptr + index)  # index clamped to 0 for a token of no adapter: a valid address, unused
    delta = tl.sum(h[:, None] * b, axis=0) * scale  # [BLOCK_N]
    mask = n < out_limit
    y = tl.load(y_ptr + t * stride_yt + n, mask=mask, other=0.0)
    tl.store(y_ptr + t * stride_yt + n, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_blocks(rank: int) -> dict:
    """The launch's tile sizes for padded rank ``rank`` (one place: the launcher and ``check-kernels`` call it)."""
    return dict(BLOCK_R=max(16, _next_pow2(rank)), BLOCK_K=_BLOCK_K, BLOCK_N=_BLOCK_N)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    scales: torch.Tensor, token_adapters: torch.Tensor) -> torch.Tensor:
    """``y[t] += scales[s] * (A[s] @ x[t]) @ B[s]`` for each token ``t`` of index ``s = token_adapters[t] >= 0``, in
    place; returns ``y``. Shapes as in :mod:`hf_paged.ops.lora`: ``y [T, out]``, ``x [T, in]``, ``lora_a [N, R, in]``,
    ``lora_b [N, R, out]``, ``scales [N]`` float32, ``token_adapters [T]`` int32 (all on one device)."""
    check_lora_shapes(y, x, lora_a, lora_b)
    _check_runnable(x)
    if token_adapters.shape != (x.shape[0],):
        raise ValueError(f"token_adapters must be [T={x.shape[0]}], got {tuple(token_adapters.shape)}.")
    if y.stride(1) != 1:
        raise ValueError("y must have a contiguous last dimension (the kernel updates it in place).")
    num_tokens, rank = x.shape[0], lora_a.shape[1]
    if num_tokens == 0 or rank == 0:
        return y
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    blocks = lora_blocks(rank)
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)  # [T, R]
    indices = token_adapters.to(torch.int32)
    _shrink_kernel[(num_tokens,)](x, lora_a, indices, h, x.shape[1], rank, x.stride(0), lora_a.stride(0),
                                  lora_a.stride(1), BLOCK_R=blocks["BLOCK_R"], BLOCK_K=blocks["BLOCK_K"])
    out = y.shape[1]
    grid = (num_tokens, triton.cdiv(out, blocks["BLOCK_N"]))
    _expand_kernel[grid](h, lora_b, scales.to(torch.float32), indices, y, out, rank, y.stride(0), lora_b.stride(0),
                         lora_b.stride(1), BLOCK_R=blocks["BLOCK_R"], BLOCK_N=blocks["BLOCK_N"])
    return y
