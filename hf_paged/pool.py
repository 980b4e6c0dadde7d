"""The KV block pool: one allocator shared by every layer, and per-layer K/V tensors on each layer's device.

Physical layout per layer: K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A pool can back several :class:`~hf_paged.PagedCache` objects (concurrent requests sharing one memory budget).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .allocator import BlockAllocator
from .stats import MemoryStats

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: int | str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5 gib"`` or a byte count -> bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"max_memory must be bytes (int) or a string like '2GiB', got {value!r}.")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read max_memory={value!r}; write it like '2GiB', '512MiB' or '4GB'.")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"max_memory must be positive, got {value} bytes.")
    return value


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


class BlockPool:
    """Fixed-size KV blocks for every layer of one model.

    Args:
        block_size: tokens per block (default 16).
        num_blocks: cap on the number of blocks; allocated up front on first use. ``None`` grows on demand.
        max_memory: cap in bytes (or ``"2GiB"``), converted to blocks once the model's shape is seen.
    """

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, max_memory: int | str | None = None):
        if num_blocks is not None and max_memory is not None:
            raise ValueError("give num_blocks or max_memory, not both.")
        self.allocator = BlockAllocator(block_size, num_blocks)
        self.max_memory = parse_memory(max_memory) if max_memory is not None else None
        self.num_layers: int | None = None
        self.layer_shapes: dict[int, LayerShape] = {}
        self.key_caches: dict[int, torch.Tensor] = {}
        self.value_caches: dict[int, torch.Tensor] = {}

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def lock(self):
        return self.allocator.lock

    def bytes_per_block(self) -> int:
        """K+V bytes of one block summed over the layers seen so far."""
        return sum(2 * self.block_size * s.num_kv_heads * s.head_dim * s.dtype.itemsize
                   for s in self.layer_shapes.values())

    def bind_layer(self, layer_idx: int, num_layers: int, key: torch.Tensor) -> None:
        """Record (or check) layer ``layer_idx``'s shape from its first key tensor ``[B, Hkv, S, D]``."""
        known = self.layer_shapes.get(layer_idx)
        if known is not None:  # every step of every layer: compare fields, build nothing
            if (known.num_kv_heads, known.head_dim, known.dtype, known.device) != (
                    key.shape[1], key.shape[3], key.dtype, key.device):
                raise ValueError(
                    f"layer {layer_idx} of this KV pool holds {known.num_kv_heads} KV heads x {known.head_dim} "
                    f"({known.dtype}, {known.device}) but got keys with {key.shape[1]} x {key.shape[3]} "
                    f"({key.dtype}, {key.device}). The cache was built for a different model, dtype or device; a "
                    "pool serves one model shape: create a new PagedCache(model.config) for this model."
                )
            return
        shape = LayerShape(key.shape[1], key.shape[3], key.dtype, key.device)
        with self.lock:
            if self.num_layers is None:
                self.num_layers = num_layers
            self.layer_shapes[layer_idx] = shape
            if self.max_memory is not None and layer_idx == 0 and self.allocator.max_blocks is None:
                per_block = 2 * self.block_size * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
                blocks = self.max_memory // (per_block * self.num_layers)
                if blocks < 1:
                    raise ValueError(
                        f"max_memory={self.max_memory} bytes holds no block: one block of {self.block_size} tokens "
                        f"takes {per_block * self.num_layers} bytes over {self.num_layers} layers. Raise max_memory."
                    )
                self.allocator.set_limit(blocks)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V tensors, grown to the allocator's current capacity."""
        capacity = self.allocator.capacity
        k = self.key_caches.get(layer_idx)
        if k is None or k.shape[0] < capacity:
            with self.lock:
                k = self.key_caches.get(layer_idx)
                capacity = self.allocator.capacity
                if k is None or k.shape[0] < capacity:
                    self._grow_layer(layer_idx, max(capacity, self.allocator.max_blocks or 0))
        return self.key_caches[layer_idx], self.value_caches[layer_idx]

    def _grow_layer(self, layer_idx: int, rows: int) -> None:
        s = self.layer_shapes[layer_idx]
        shape = (rows, self.block_size, s.num_kv_heads, s.head_dim)
        new_k = torch.zeros(shape, dtype=s.dtype, device=s.device)
        new_v = torch.zeros(shape, dtype=s.dtype, device=s.device)
        old_k = self.key_caches.get(layer_idx)
        if old_k is not None:
            new_k[: old_k.shape[0]] = old_k
            new_v[: old_k.shape[0]] = self.value_caches[layer_idx]
        self.key_caches[layer_idx], self.value_caches[layer_idx] = new_k, new_v

    def bytes_reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key_caches.values(), *self.value_caches.values()))

    def memory_stats(self) -> MemoryStats:
        """Figures for the whole pool, over every cache drawing from it."""
        with self.lock:
            a = self.allocator
            seqs = a.sequences
            return MemoryStats.from_tables(
                block_size=a.block_size,
                num_blocks=max(a.capacity, max((k.shape[0] for k in self.key_caches.values()), default=0)),
                max_blocks=a.max_blocks,
                tables=[a.block_table(s) for s in seqs],
                lens=[a.seq_len(s) for s in seqs],
                peak_blocks_in_use=a.peak_blocks_in_use,
                bytes_per_block=self.bytes_per_block(),
                bytes_reserved=self.bytes_reserved(),
            )
