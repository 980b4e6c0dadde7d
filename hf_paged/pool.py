"""The KV block pool: one allocator shared by every layer, and the K/V tensors on each layer's device.

Physical layout per K/V tensor: ``[num_blocks + 1, block_size, num_kv_heads, head_dim]``. The last block is a scratch
block no sequence owns: rows that finished write their (discarded) token there, so every decode step has the same
shape. Layers are mapped to tensor *slots* by :class:`~hf_paged.groups.LayerGroups` (one slot per layer for most
models; hybrid models share a slot between one layer of each group).

With ``kv_dtype=torch.float8_e4m3fn`` the tensors hold e4m3 bits as ``uint8`` (torch cannot index float8 tensors on
CPU), and each layer has per-KV-head scales ``[num_kv_heads]`` fixed by its first write.

A pool can back several :class:`~hf_paged.PagedCache` objects (concurrent requests sharing one memory budget).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch

from .allocator import BlockAllocator
from .step import StepBuffers

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
KV_DTYPES = (None, torch.float8_e4m3fn)


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
    dtype: torch.dtype  # the model's K/V dtype
    device: torch.device


class BlockPool:
    """Fixed-size KV blocks for every layer of one model.

    Args:
        block_size: tokens per block (default 16).
        num_blocks: cap on the number of blocks; allocated up front on first use. ``None`` grows on demand.
        max_memory: cap in bytes (or ``"2GiB"``), converted to blocks once the model's shape is seen.
        prefix_caching: keep finished rows' full blocks, keyed by their tokens, so a later prompt that starts the
            same way starts from them (see :class:`~hf_paged.allocator.BlockAllocator`).
        kv_dtype: ``None`` (the model's dtype) or ``torch.float8_e4m3fn``: fp8 blocks, half the bytes of bf16.

    A pool with a cap (``num_blocks`` or ``max_memory``) never reallocates its tensors, which compiled decoding needs.
    """

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, max_memory: int | str | None = None,
                 prefix_caching: bool = False, kv_dtype: torch.dtype | None = None):
        if num_blocks is not None and max_memory is not None:
            raise ValueError("give num_blocks or max_memory, not both.")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES} (None: the model's dtype), got {kv_dtype!r}.")
        self.allocator = BlockAllocator(block_size, num_blocks, prefix_caching=prefix_caching)
        self.max_memory = parse_memory(max_memory) if max_memory is not None else None
        self.kv_dtype = kv_dtype
        self.num_layers: int | None = None
        self.layer_shapes: dict[int, LayerShape] = {}
        self.layer_slot: dict[int, object] = {}  # layer -> key of its K/V tensors
        self.key_caches: dict[object, torch.Tensor] = {}  # slot -> [num_blocks + 1, block_size, Hkv, D]
        self.value_caches: dict[object, torch.Tensor] = {}
        self.k_scales: dict[int, torch.Tensor] = {}  # layer -> [Hkv] float32 (fp8 pools)
        self.v_scales: dict[int, torch.Tensor] = {}
        self._free_step_buffers: list[StepBuffers] = []

    def lend_step_buffers(self, cache) -> StepBuffers:
        """Step buffers for ``cache``, given back to this pool when the cache is collected. A later cache on the same
        pool gets the same buffers, so a CUDA graph recorded for the first replays for it without re-recording."""
        try:  # list.pop/append are atomic: no lock, since the finalizer may run inside a garbage collection anywhere
            buffers = self._free_step_buffers.pop()
        except IndexError:
            buffers = StepBuffers()
        weakref.finalize(cache, self._free_step_buffers.append, buffers)
        return buffers

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def lock(self):
        return self.allocator.lock

    @property
    def fixed(self) -> bool:
        """Whether the pool has a cap (its tensors are allocated once, at full size)."""
        return self.allocator.max_blocks is not None or self.max_memory is not None

    @property
    def storage_dtype(self):
        return torch.uint8 if self.kv_dtype is not None else None

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_caching

    def _block_bytes(self, shape: LayerShape) -> int:
        itemsize = 1 if self.kv_dtype is not None else shape.dtype.itemsize
        return 2 * self.block_size * shape.num_kv_heads * shape.head_dim * itemsize

    def bytes_per_block(self, layers=None) -> int:
        """K+V bytes of one block summed over ``layers`` (default: every layer seen so far)."""
        layers = self.layer_shapes if layers is None else layers
        return sum(self._block_bytes(self.layer_shapes[i]) for i in layers if i in self.layer_shapes)

    def bind_layer(self, layer_idx: int, num_layers: int, key: torch.Tensor, slot=None, slots_per_block: int = 0):
        """Record (or check) layer ``layer_idx``'s shape from its first key tensor ``[B, Hkv, S, D]``.

        ``slot``: the K/V tensor slot the layer uses (layers of different groups may share one);
        ``slots_per_block``: how many slots a block id spans (for ``max_memory``).
        """
        if layer_idx in self.layer_shapes:
            self.check_layer(layer_idx, key)
            return
        shape = LayerShape(key.shape[1], key.shape[3], key.dtype, key.device)
        with self.lock:
            if self.num_layers is None:
                self.num_layers = num_layers
            self.layer_shapes[layer_idx] = shape
            slot = layer_idx if slot is None else slot
            owner = next((i for i, s in self.layer_slot.items() if s == slot), None)
            if owner is not None and self.layer_shapes[owner] != shape:
                slot = ("layer", layer_idx)  # a shape/device differing from its slot partner: own tensors
            self.layer_slot[layer_idx] = slot
            self.apply_memory_cap(shape.num_kv_heads, shape.head_dim, shape.dtype, slots_per_block or num_layers)

    def apply_memory_cap(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slots_per_block: int) -> None:
        """Turn ``max_memory`` into a block cap, once, from the model's K/V shape: before the first blocks are taken,
        so the pool never grows past it."""
        if self.max_memory is None or self.allocator.max_blocks is not None:
            return
        shape = LayerShape(num_kv_heads, head_dim, dtype, torch.device("cpu"))
        per_block = self._block_bytes(shape) * slots_per_block
        blocks = self.max_memory // per_block - 1  # the scratch block counts against the budget
        if blocks < 1:
            raise ValueError(
                f"max_memory={self.max_memory} bytes holds no block: one block of {self.block_size} tokens "
                f"takes {per_block} bytes over the model's layers. Raise max_memory."
            )
        with self.lock:
            self.allocator.set_limit(blocks)

    def check_layer(self, layer_idx: int, key: torch.Tensor) -> None:
        """``ValueError`` unless ``key`` ``[B, Hkv, S, D]`` fits the shape, dtype and device layer ``layer_idx`` holds."""
        known = self.layer_shapes[layer_idx]
        if (known.num_kv_heads, known.head_dim, known.dtype, known.device) != (
                key.shape[1], key.shape[3], key.dtype, key.device):
            raise ValueError(
                f"layer {layer_idx} of this KV pool holds {known.num_kv_heads} KV heads x {known.head_dim} "
                f"({known.dtype}, {known.device}) but got keys with {key.shape[1]} x {key.shape[3]} "
                f"({key.dtype}, {key.device}). The cache was built for a different model, dtype or device; a "
                "pool serves one model shape: create a new PagedCache(model.config) for this model."
            )

    @property
    def rows(self) -> int:
        """Rows of every K/V tensor: the blocks that may exist, plus the scratch block."""
        return (self.allocator.max_blocks or self.allocator.capacity) + 1

    @property
    def scratch_block(self) -> int:
        return self.rows - 1

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V tensors, grown to the allocator's current capacity."""
        slot = self.layer_slot[layer_idx]
        k = self.key_caches.get(slot)
        if k is None or k.shape[0] < self.rows:
            with self.lock:
                self._grow_slot(slot, self.layer_shapes[layer_idx])
        return self.key_caches[slot], self.value_caches[slot]

    def ensure_capacity(self) -> None:
        """Grow every existing tensor to the allocator's capacity (called before a forward, never inside one)."""
        rows = self.rows
        for layer, slot in self.layer_slot.items():
            k = self.key_caches.get(slot)
            if k is not None and k.shape[0] < rows:
                self.layer_kv(layer)

    def _grow_slot(self, slot, s: LayerShape) -> None:
        old_k = self.key_caches.get(slot)
        rows = self.rows
        if old_k is not None and old_k.shape[0] >= rows:
            return
        shape = (rows, self.block_size, s.num_kv_heads, s.head_dim)
        dtype = self.storage_dtype or s.dtype
        new_k = torch.zeros(shape, dtype=dtype, device=s.device)
        new_v = torch.zeros(shape, dtype=dtype, device=s.device)
        if old_k is not None:  # the old scratch block is not copied: it holds nothing
            new_k[: old_k.shape[0] - 1] = old_k[:-1]
            new_v[: old_k.shape[0] - 1] = self.value_caches[slot][:-1]
        for t in (new_k, new_v):
            torch._dynamo.mark_static_address(t)
        self.key_caches[slot], self.value_caches[slot] = new_k, new_v

    def layer_scales(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """fp8 pools: the layer's ``(k_scale, v_scale)`` ``[Hkv]``, fixed from its first write ``[N, Hkv, D]``."""
        if self.kv_dtype is None:
            return None, None
        k_scale = self.k_scales.get(layer_idx)
        if k_scale is None:
            from .ops import fp8_scales

            with self.lock:
                k_scale = self.k_scales[layer_idx] = fp8_scales(key)
                self.v_scales[layer_idx] = fp8_scales(value)
                for t in (k_scale, self.v_scales[layer_idx]):
                    torch._dynamo.mark_static_address(t)
        return k_scale, self.v_scales[layer_idx]

    def bytes_reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key_caches.values(), *self.value_caches.values()))

    def memory_stats(self):
        """Figures for the whole pool, over every cache drawing from it (see :class:`~hf_paged.MemoryStats`)."""
        from .stats import MemoryStats

        with self.lock:
            a = self.allocator
            seqs = a.sequences
            return MemoryStats.from_tables(
                block_size=a.block_size, num_blocks=self.rows - 1, max_blocks=a.max_blocks,
                tables=[a.block_table(s) for s in seqs], lens=[a.seq_len(s) for s in seqs],
                peak_blocks_in_use=a.peak_blocks_in_use, bytes_per_block=self.bytes_per_block_id(),
                bytes_reserved=self.bytes_reserved(), allocator=a,
            )

    def bytes_per_block_id(self) -> int:
        """Bytes one block id stands for: one block of every distinct K/V tensor slot."""
        seen, total = set(), 0
        for layer, slot in self.layer_slot.items():
            if slot not in seen:
                seen.add(slot)
                total += self._block_bytes(self.layer_shapes[layer])
        return total
