"""Batched LoRA: many adapters in one batch of tokens (multi-LoRA serving, as Punica and S-LoRA batch them).

For one LoRA-targeted linear layer ``y = base(x)``, every token ``t`` of adapter index ``s`` gets
``y[t] += scale[s] * B[s] @ (A[s] @ x[t])``, PEFT's ``lora_B(lora_A(x)) * scaling``; tokens of index ``-1`` keep the
base output. The base weights are never touched (nothing is merged).

Layout (one targeted linear layer, ``N`` adapters, ranks padded to ``R``)::

    lora_a          [N, R, in_features]   A of each adapter (rows past its rank are zero)
    lora_b          [N, R, out_features]  B transposed (rows past its rank are zero)
    scales          [N]                   lora_alpha / r (or / sqrt(r) with rslora)
    token_adapters  [T] int               the adapter index of each token, -1: none

Two implementations, one contract:

* :func:`add_lora_torch` (the reference, and the CPU path): tokens grouped by adapter (:func:`lora_groups`, once per
  step); per group one shrink matmul ``[n, in] @ [in, r]`` and one expand ``[n, r] @ [r, out]`` at the adapter's own
  rank, on a slice of the batch when the group's tokens are contiguous, else gathered and added back by index.
* ``add_lora_triton`` (``hf_paged.ops.triton_lora``, CUDA or the Triton interpreter): a shrink kernel (one program
  per token: ``h[t] = A[s] @ x[t]``, fp32) and an expand kernel (one program per token and tile of outputs:
  ``y[t] += scale[s] * h[t] @ B[s]^T``), reading the token's index from ``token_adapters``.

Example::

    import torch
    from hf_paged.ops.lora import add_lora_torch, lora_groups

    x = torch.randn(5, 64)                                   # [T, in]
    y = torch.zeros(5, 32)                                   # [T, out]: the base layer's output
    lora_a = torch.randn(2, 8, 64)                           # [N, R, in]
    lora_b = torch.randn(2, 8, 32)                           # [N, R, out] (B transposed)
    groups = lora_groups([0, 0, -1, 1, 1], ranks=[8, 4])     # index 1 has rank 4: rows 4..7 unused
    add_lora_torch(y, x, lora_a, lora_b, [2.0, 0.5], groups)
    assert torch.allclose(y[0], 2.0 * lora_b[0].T @ (lora_a[0] @ x[0]), atol=1e-4)
    assert (y[2] == 0).all()                                 # token 2 has no adapter
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lora_shapes import check_lora_shapes

__all__ = ["LoraGroup", "lora_groups", "add_lora_torch", "add_lora_kernel", "check_lora_shapes"]


@dataclass(frozen=True)
class LoraGroup:
    """The tokens of one adapter index in a batch: ``rows`` is a ``slice`` when they are contiguous, else a LongTensor
    of token indices (moved to the batch's device by :func:`lora_groups`)."""

    index: int
    rank: int
    rows: slice | torch.Tensor
    num_tokens: int


def lora_groups(token_adapters: list[int], ranks: list[int], device: torch.device | str = "cpu") -> list[LoraGroup]:
    """The batch's tokens grouped by adapter index (``-1`` and indices of rank 0 left out), in order of first use.

    ``token_adapters``: the index of each token (a host list, built once per step); ``ranks``: each index's rank."""
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for t in range(1, len(token_adapters) + 1):
        if t == len(token_adapters) or token_adapters[t] != token_adapters[start]:
            index = token_adapters[start]
            if index >= 0 and ranks[index] > 0:
                runs.setdefault(index, []).append((start, t))
            start = t
    groups = []
    for index, spans in runs.items():
        count = sum(end - begin for begin, end in spans)
        if len(spans) == 1:
            rows = slice(*spans[0])
        else:
            rows = torch.cat([torch.arange(begin, end) for begin, end in spans]).to(device)
        groups.append(LoraGroup(index, ranks[index], rows, count))
    return groups


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scales: list[float], groups: list[LoraGroup]) -> torch.Tensor:
    """``y[t] += scales[s] * (x[t] @ A[s, :r].T) @ B[s, :r]`` for each group's tokens, in place; returns ``y``.

    ``y``: ``[T, out]`` (the base layer's output), ``x``: ``[T, in]``, ``lora_a``: ``[N, R, in]``, ``lora_b``:
    ``[N, R, out]``, ``scales``: one float per index, ``groups``: from :func:`lora_groups`. The products run in
    ``lora_a``'s dtype, the sum in ``y``'s."""
    for g in groups:
        a = lora_a[g.index, : g.rank]  # [r, in]
        b = lora_b[g.index, : g.rank]  # [r, out]
        if isinstance(g.rows, slice) and a.dtype == x.dtype == y.dtype:  # a slice of the batch: two ops
            y[g.rows].addmm_(x[g.rows] @ a.T, b, alpha=scales[g.index])
            continue
        xs = x[g.rows].to(a.dtype)  # [n, in]
        delta = ((xs @ a.T) @ b) * scales[g.index]  # [n, out]
        if isinstance(g.rows, slice):
            y[g.rows] += delta.to(y.dtype)
        else:
            y.index_add_(0, g.rows, delta.to(y.dtype))
    return y


def add_lora_kernel(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    scales: torch.Tensor, token_adapters: torch.Tensor) -> torch.Tensor:
    """The Triton path (``hf_paged.ops.triton_lora.add_lora_triton``, imported on first use: triton is optional):
    ``scales [N]`` float32 and ``token_adapters [T]`` int32 as tensors on ``x``'s device."""
    from .triton_lora import add_lora_triton

    return add_lora_triton(y, x, lora_a, lora_b, scales, token_adapters)
