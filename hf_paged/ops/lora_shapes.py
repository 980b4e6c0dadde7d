"""The shape check of the multi-LoRA ops, shared by the torch path (``lora.py``) and the Triton kernel
(``triton_lora.py``), which both import it (the kernel importing ``lora.py`` back made an import circle).

Layout: ``y [T, out]`` (the base layer's output), ``x [T, in]``, ``lora_a [N, R, in]``, ``lora_b [N, R, out]``
(B transposed): ``N`` adapter slots of padded rank ``R``.
"""

from __future__ import annotations

import torch


def check_lora_shapes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """``ValueError`` naming the shape that does not fit the layout above."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [T, in] and y [T, out] with the same T, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}.")
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a must be [N, R, in={x.shape[1]}], got {tuple(lora_a.shape)}.")
    if lora_b.dim() != 3 or lora_b.shape[:2] != lora_a.shape[:2] or lora_b.shape[2] != y.shape[1]:
        raise ValueError(f"lora_b must be [N={lora_a.shape[0]}, R={lora_a.shape[1]}, out={y.shape[1]}] (B "
                         f"transposed), got {tuple(lora_b.shape)}.")
