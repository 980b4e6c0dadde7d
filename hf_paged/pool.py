"""The KV block pool: one allocator shared by every layer, and the K/V tensors on each layer's device.

Physical layout per K/V tensor: ``[num_blocks + 1, block_size, num_kv_heads, head_dim]``. The last block is a scratch
block no sequence owns: rows that finished write their (discarded) token there, so every decode step has the same
shape. The tensors grow with the blocks in use (doubling), up to the cap when there is one; a pool takes its cap's
full size at once only when asked (``preallocate=True`` or :meth:`BlockPool.preallocate`, which a compiled
``generate()`` needs: its graphs read the pool at fixed addresses).

Layers are mapped to their *K/V tensors* by :class:`~hf_paged.groups.LayerGroups` (one per layer for most models;
hybrid models share one K/V tensor between one layer of each group).

With ``kv_dtype=torch.float8_e4m3fn`` the tensors hold e4m3 bits as ``uint8`` (torch cannot index float8 tensors on
CPU), and each K/V tensor has a scale cache ``[num_blocks + 1, block_size, num_kv_heads]`` bfloat16 beside it: one
scale per slot and KV head, written with the token from its own values (``ops.fp8_scales``), grown, copied
(copy-on-write) and saved with the blocks. A written slot's meaning never changes, whoever shares its block.

A pool can back several :class:`~hf_paged.PagedCache` objects (concurrent requests sharing one memory budget).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch

from .allocator import BlockAllocator, cdiv
from .ops.reference import FP8_SCALE_DTYPE
from .states import StateStore
from .stats import MemoryStats
from .step import StepBuffers
from .weights import WeightsFingerprint

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
KV_DTYPES = (None, torch.float8_e4m3fn)
SCALE_BYTES = FP8_SCALE_DTYPE.itemsize  # fp8 pools: one scale per token and KV head, for K and for V


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


def format_memory(n: int) -> str:
    """Bytes as a ``max_memory`` string, rounded up to a tenth of its unit: ``"512KiB"``, ``"1.5MiB"``, ``"8GiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{cdiv(n * 10, size) / 10:g}{unit}"
    return f"{n}B"


def _smallest_block(block_size: int) -> int:
    return 2 * block_size  # K and V, one layer, one KV head of one dim, one byte


def _describe(tensor_shapes, dtype: torch.dtype) -> str:
    """``tensor_shapes``: ``(num_kv_heads, key_dim, value_dim)`` per K/V tensor one block id stands for."""
    counts: dict = {}
    for shape in tensor_shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    parts = []
    for (heads, key, value), layers in counts.items():
        plural, dims = "s" if layers != 1 else "", str(key) if key == value else f"{key} (K) + {value} (V)"
        parts.append(f"{layers} layer{plural} x {heads} KV heads x {dims}")
    return f"this model (K and V of {' and '.join(parts)}, {str(dtype).removeprefix('torch.')})"


@dataclass(frozen=True)
class LayerShape:
    """One layer's per-token K/V shape in the pool (its :class:`~hf_paged.geometry.LayerKV` as bound)."""

    num_kv_heads: int
    head_dim: int  # key head size
    dtype: torch.dtype  # the model's K/V dtype
    device: torch.device
    value_dim: int | None = None  # value head size (None: head_dim)

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim


class BlockPool:
    """Fixed-size KV blocks for every layer of one model.

    Args:
        block_size: tokens per block (default 16).
        num_blocks: cap on the number of blocks (the scratch block comes on top). ``None`` grows without a cap.
        max_memory: cap in bytes (or ``"2GiB"``) on the K/V tensors, scratch block included, converted to blocks once
            the model's shape is seen.
        prefix_caching: keep finished rows' full blocks, keyed by their tokens, so a later prompt that starts the
            same way starts from them (see :class:`~hf_paged.allocator.BlockAllocator`).
        kv_dtype: ``None`` (the model's dtype) or ``torch.float8_e4m3fn``: fp8 blocks, half the bytes of bf16.
        preallocate: take the cap's full size at the first write instead of growing to it (needs a cap).

    A cap bounds the memory; it is not reserved up front: the tensors grow on demand (doubling, each growth briefly
    holding the old and the new tensors) and never past the cap. A compiled ``generate()`` preallocates the pool
    (:meth:`preallocate`) before its first step, since its graphs read the pool at fixed addresses.

    Example::

        pool = BlockPool(num_blocks=256)                      # at most 256 blocks of 16 tokens
        first = model.generate(**inputs, cache=PagedCache(model.config, pool=pool), max_new_tokens=8)
        second = model.generate(**inputs, cache=PagedCache(model.config, pool=pool), max_new_tokens=8)
        print(pool.memory_stats().bytes_reserved)             # what the calls needed, never past the cap
    """

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, max_memory: int | str | None = None,
                 prefix_caching: bool = False, kv_dtype: torch.dtype | None = None, preallocate: bool = False):
        if num_blocks is not None and max_memory is not None:
            raise ValueError("give num_blocks or max_memory, not both.")
        if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool)
                                       or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int or None (grow on demand), got {num_blocks!r}.")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES} (None: the model's dtype), got {kv_dtype!r}.")
        if preallocate and num_blocks is None and max_memory is None:
            raise ValueError("preallocate=True needs a cap to allocate: give num_blocks=N or max_memory='2GiB'.")
        # The allocator starts empty and grows up to the cap; its block ids stay below its capacity, which the
        # tensors follow (the scratch block is always their last block).
        self.allocator = BlockAllocator(block_size, None, prefix_caching=prefix_caching)
        if num_blocks is not None:
            self.allocator.set_limit(num_blocks)
        self.max_memory = parse_memory(max_memory) if max_memory is not None else None
        self._max_memory_arg = max_memory
        self.kv_dtype = kv_dtype
        self._preallocate = preallocate
        self._cap_block_bytes: int | None = None  # bytes per block id the max_memory cap was computed with
        if self.max_memory is not None:
            self._check_memory(_smallest_block(block_size), "any model (one layer, one KV head of one dim, one "
                                                            "byte per value)")
        self.num_layers: int | None = None
        self.layer_shapes: dict[int, LayerShape] = {}
        self.layer_tensor: dict[int, object] = {}  # layer -> key of its K/V tensors
        self.key_caches: dict[object, torch.Tensor] = {}  # K/V tensor key -> [tensor_blocks, block_size, Hkv, D]
        self.value_caches: dict[object, torch.Tensor] = {}
        self.k_scale_caches: dict[object, torch.Tensor] = {}  # K/V tensor key -> [tensor_blocks, block_size, Hkv] bf16
        self.v_scale_caches: dict[object, torch.Tensor] = {}
        self._free_step_buffers: list[StepBuffers] = []
        self._sized_blocks = 0  # every K/V tensor had at least this many blocks at the last ensure_capacity()
        # per-row states of state layers (hybrid models), in state cells; under max_memory they share the cap with
        # the blocks
        self.states = StateStore()
        if self.max_memory is not None:
            self.states.limit_bytes = self._state_budget
        # each model's weights fingerprint, the root of its blocks' keys (prefix caching)
        self._fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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
        """Whether the pool has a cap (``num_blocks`` or ``max_memory``): its size is bounded, so it can be
        preallocated for compiled decoding."""
        return self.allocator.max_blocks is not None or self.max_memory is not None

    @property
    def preallocated(self) -> bool:
        """Whether the K/V tensors take the cap's full size when made and are never reallocated afterwards."""
        return self._preallocate

    def preallocate(self) -> None:
        """Give every K/V tensor the cap's full size now, once; tensors of layers not seen yet get it when made.

        Called before a compiled forward (its graphs read the pool at fixed addresses); later calls do nothing.
        ``ValueError`` for a pool without a cap. Example::

            pool = BlockPool(max_memory="1GiB")
            pool.preallocate()      # the K/V tensors take the whole 1 GiB at their first write and never move
        """
        if not self.fixed:
            raise ValueError("a pool without a cap cannot be preallocated: build it with num_blocks=N or "
                             "max_memory='2GiB'.")
        with self.lock:
            self._preallocate = True
            self.ensure_capacity()

    @property
    def storage_dtype(self):
        return torch.uint8 if self.kv_dtype is not None else None

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_caching

    def block_bytes(self, shape: LayerShape) -> int:
        """K+V bytes of one block of one K/V tensor of ``shape``; fp8 pools add the block's scales (2 bytes per token,
        KV head, K/V)."""
        if self.kv_dtype is not None:
            return self.block_size * shape.num_kv_heads * (shape.head_dim + shape.v_dim + 2 * SCALE_BYTES)
        return self.block_size * shape.num_kv_heads * (shape.head_dim + shape.v_dim) * shape.dtype.itemsize

    def block_id_bytes(self, tensor_shapes, dtype: torch.dtype) -> int:
        """Bytes one block id stands for: a block of each K/V tensor, ``tensor_shapes`` ``(num_kv_heads, key_dim,
        value_dim)`` per K/V tensor (from :attr:`~hf_paged.groups.LayerGroups.tensor_shapes`), in ``dtype``."""
        cpu = torch.device("cpu")
        return sum(self.block_bytes(LayerShape(h, k, dtype, cpu, v)) for h, k, v in tensor_shapes)

    def bytes_per_block(self, layers=None) -> int:
        """K+V bytes of one block summed over ``layers`` (default: every layer seen so far)."""
        layers = self.layer_shapes if layers is None else layers
        return sum(self.block_bytes(self.layer_shapes[i]) for i in layers if i in self.layer_shapes)

    def bind_layer(self, layer_idx: int, num_layers: int, key: torch.Tensor, tensor=None, tensors_per_block: int = 0,
                   value: torch.Tensor | None = None, tensor_shapes=()):
        """Record (or check) layer ``layer_idx``'s shape from its first key (and value) tensor ``[B, Hkv, S, D]``.

        ``tensor``: the key of the K/V tensor the layer uses (layers of different groups may share one; default: its
        own); ``tensors_per_block``: how many K/V tensors a block id spans, all of this layer's shape, or
        ``tensor_shapes``: the ``(num_kv_heads, key_dim, value_dim)`` of each (for ``max_memory``).
        """
        if layer_idx in self.layer_shapes:
            self.check_layer(layer_idx, key)
            return
        value_dim = value.shape[3] if value is not None and value.shape[3] != key.shape[3] else None
        shape = LayerShape(key.shape[1], key.shape[3], key.dtype, key.device, value_dim)
        with self.lock:
            # the cap first: a max_memory too small for this shape is refused before anything is recorded
            self.apply_memory_cap_for(tensor_shapes or [(shape.num_kv_heads, shape.head_dim, shape.v_dim)]
                                      * (tensors_per_block or num_layers), shape.dtype)
            if self.num_layers is None:
                self.num_layers = num_layers
            self.layer_shapes[layer_idx] = shape
            tensor = layer_idx if tensor is None else tensor
            owner = next((i for i, t in self.layer_tensor.items() if t == tensor), None)
            if owner is not None and self.layer_shapes[owner] != shape:
                tensor = ("layer", layer_idx)  # a shape/device differing from its K/V tensor's partner: its own
            self.layer_tensor[layer_idx] = tensor

    def apply_memory_cap(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tensors_per_block: int) -> None:
        """:meth:`apply_memory_cap_for` with ``tensors_per_block`` K/V tensors of one shape."""
        self.apply_memory_cap_for([(num_kv_heads, head_dim, head_dim)] * tensors_per_block, dtype)

    def apply_memory_cap_for(self, tensor_shapes, dtype: torch.dtype) -> None:
        """Turn ``max_memory`` into a block cap, once, from the model's K/V shapes (``(num_kv_heads, key_dim,
        value_dim)`` per K/V tensor a block id stands for: :attr:`~hf_paged.groups.LayerGroups.tensor_shapes`):
        before the first blocks are taken, so the pool never grows past it. ``ValueError`` (with the minimum) if it
        cannot hold one block."""
        if self.max_memory is None or self.allocator.max_blocks is not None:
            return
        per_block = self.block_id_bytes(tensor_shapes, dtype)
        self._check_memory(per_block, _describe(tensor_shapes, self.kv_dtype or dtype))
        with self.lock:
            if self.allocator.max_blocks is None:
                self.allocator.set_limit(self.max_memory // per_block - 1)  # the scratch block counts against it
                self._cap_block_bytes = per_block
            if self._preallocate:
                self.ensure_capacity()

    def check_memory_fits(self, num_kv_heads: int, head_dim: int, tensors_per_block: int,
                          dtype: torch.dtype | None = None) -> None:
        """``ValueError`` now if ``max_memory`` cannot hold one block of this shape (plus the scratch block).

        For a caller that knows the model's shape before its first forward (a cache built from its config);
        ``dtype`` ``None`` checks against the smallest dtype the model could run in (2 bytes; fp8 pools 1 byte).
        """
        self.check_memory_fits_for([(num_kv_heads, head_dim, head_dim)] * tensors_per_block, dtype)

    def check_memory_fits_for(self, tensor_shapes, dtype: torch.dtype | None = None) -> None:
        """:meth:`check_memory_fits` for K/V tensors of the given ``(num_kv_heads, key_dim, value_dim)``."""
        if self.max_memory is None:
            return
        dtype = dtype or torch.float16
        per_block = self.block_id_bytes(tensor_shapes, dtype)
        self._check_memory(per_block, _describe(tensor_shapes, self.kv_dtype or dtype))

    def _check_memory(self, per_block: int, what: str) -> None:
        need = 2 * per_block  # one block, and the scratch block
        if self.max_memory >= need:
            return
        given = repr(self._max_memory_arg) if isinstance(self._max_memory_arg, str) else str(self._max_memory_arg)
        hint = ""
        if isinstance(self._max_memory_arg, int) and self._max_memory_arg < 1024:
            hint = f" (max_memory is in bytes: did you mean max_memory='{self._max_memory_arg}GiB'?)"
        raise ValueError(
            f"max_memory={given} ({self.max_memory:,} bytes) holds no block of {what}: a block of "
            f"{self.block_size} tokens takes {per_block:,} bytes and the pool keeps one more as its scratch block, so "
            f"max_memory must be at least {need:,} bytes ({format_memory(need)}){hint}. Raise max_memory."
        )

    def sizing_call(self, num_blocks: int, cache: bool = False) -> str:
        """The constructor call that builds this pool again with room for ``num_blocks`` blocks (same block size,
        prefix caching, kv_dtype; a pool capped by bytes gets ``max_memory=``, its scratch block included):
        ``"BlockPool(num_blocks=64)"``, or with ``cache=True`` (a cache that made its own pool)
        ``"PagedCache(model.config, num_blocks=64)"``. For :class:`~hf_paged.OutOfBlocksError`'s ``fix``."""
        args = [] if self.block_size == 16 else [f"block_size={self.block_size}"]
        if self.max_memory is not None and self._cap_block_bytes is not None:
            args.append(f"max_memory={format_memory((num_blocks + 1) * self._cap_block_bytes)!r}")
        else:
            args.append(f"num_blocks={num_blocks}")
        if self.prefix_caching:
            args.append("prefix_caching=True")
        if self.kv_dtype is not None:
            args.append(f"kv_dtype={self.kv_dtype}")
        if self._preallocate and not cache:
            args.append("preallocate=True")
        return f"PagedCache(model.config, {', '.join(args)})" if cache else f"BlockPool({', '.join(args)})"

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
    def tensor_blocks(self) -> int:
        """Blocks every K/V tensor holds (its first dimension): the blocks that exist (all the cap allows, once
        preallocated), plus the scratch block, always the last."""

        a = self.allocator
        if self._preallocate and a.max_blocks is not None:
            return a.max_blocks + 1
        return a.capacity + 1

    @property
    def scratch_block(self) -> int:
        return self.tensor_blocks - 1

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V tensors ``[tensor_blocks, block_size, Hkv, D]``, grown to :attr:`tensor_blocks` (fp8 pools:
        with their scale caches, see :meth:`layer_scales`)."""
        tensor = self.layer_tensor[layer_idx]
        k = self.key_caches.get(tensor)
        if k is None or k.shape[0] < self.tensor_blocks:
            with self.lock:
                self._grow_tensor(tensor, self.layer_shapes[layer_idx])
        return self.key_caches[tensor], self.value_caches[tensor]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp8 pools: the layer's scale caches ``(k_scale, v_scale)`` ``[tensor_blocks, block_size, Hkv]`` bfloat16, one
        scale per slot and KV head, grown with the K/V tensors; ``(None, None)`` on other pools."""
        if self.kv_dtype is None:
            return None, None
        self.layer_kv(layer_idx)
        tensor = self.layer_tensor[layer_idx]
        return self.k_scale_caches[tensor], self.v_scale_caches[tensor]

    def ensure_capacity(self) -> None:
        """Grow every existing tensor to :attr:`tensor_blocks` (called before a forward, never inside one)."""
        blocks = self.tensor_blocks
        if blocks == self._sized_blocks:  # nothing grew since (tensors made since were made this large)
            return
        for layer, tensor in self.layer_tensor.items():
            k = self.key_caches.get(tensor)
            if k is not None and k.shape[0] < blocks:
                self.layer_kv(layer)
        self._sized_blocks = blocks

    def _grow_tensor(self, tensor, s: LayerShape) -> None:
        old_k = self.key_caches.get(tensor)
        blocks = self.tensor_blocks
        if old_k is not None and old_k.shape[0] >= blocks:
            return
        shape = (blocks, self.block_size, s.num_kv_heads, s.head_dim)
        v_shape = (blocks, self.block_size, s.num_kv_heads, s.v_dim)
        dtype = self.storage_dtype or s.dtype
        kept = 0 if old_k is None else old_k.shape[0] - 1  # the old scratch block is not copied: it holds nothing

        def grown(old, shape, dtype):  # the old blocks copied, the rest zeros (unwritten slots must read as 0)
            new = torch.empty(shape, dtype=dtype, device=s.device)
            if kept:
                new[:kept] = old[:kept]
            new[kept:].zero_()
            return new

        new_k, new_v = grown(old_k, shape, dtype), grown(self.value_caches.get(tensor), v_shape, dtype)
        new = [new_k, new_v]
        if self.kv_dtype is not None:  # the scales of the slots, grown (and copied) with them
            new_ks = grown(self.k_scale_caches.get(tensor), shape[:3], FP8_SCALE_DTYPE)  # [blocks, block_size, Hkv]
            new_vs = grown(self.v_scale_caches.get(tensor), shape[:3], FP8_SCALE_DTYPE)
            new += [new_ks, new_vs]
            self.k_scale_caches[tensor], self.v_scale_caches[tensor] = new_ks, new_vs
        for t in new:
            torch._dynamo.mark_static_address(t)
        self.key_caches[tensor], self.value_caches[tensor] = new_k, new_v

    # ------------------------------------------------------------ state cells
    def _state_budget(self) -> int:
        """Bytes ``max_memory`` leaves the state store beside the blocks that exist (and the scratch block)."""
        return self.max_memory - (self.allocator.capacity + 1) * (self._cap_block_bytes or 0)

    def take_state_cells(self, count: int) -> list[int]:
        """``count`` state cells (:meth:`StateStore.take`); a ``max_memory`` cap then holds fewer blocks."""
        with self.lock:
            cells = self.states.take(count)
            self.fit_blocks_to_states()
            return cells

    def give_back_state_cells(self, cells: list[int]) -> None:
        with self.lock:
            self.states.give_back(cells)

    def fit_blocks_to_states(self) -> None:
        """Under ``max_memory``: the block cap less what the state tensors take (never below the blocks that exist;
        the store refuses to grow past what the blocks leave it)."""
        a = self.allocator
        if self.max_memory is None or self._cap_block_bytes is None or a.max_blocks is None:
            return
        with self.lock:
            limit = (self.max_memory - self.states.bytes_reserved()) // self._cap_block_bytes - 1
            a.max_blocks = max(a.capacity, min(a.max_blocks, limit))

    def bytes_reserved(self) -> int:
        """Bytes of the K/V tensors (and fp8 scale caches) as allocated now (a capped pool grows to its cap on
        demand)."""
        tensors = (*self.key_caches.values(), *self.value_caches.values(), *self.k_scale_caches.values(),
                   *self.v_scale_caches.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_stats(self):
        """Figures for the whole pool, over every cache drawing from it (see :class:`~hf_paged.MemoryStats`).

        Caches of a mixed-window model hold one sequence per layer group and row: the top-level figures count each
        row and token once and every group's blocks (the per-group detail is on each cache's ``memory_stats()``).
        """
        with self.lock:
            a = self.allocator
            by_group: dict[int, list[int]] = {}
            for seq in a.sequences:
                by_group.setdefault(a.group_of(seq), []).append(seq)
            common = dict(block_size=a.block_size, num_blocks=self.tensor_blocks - 1, max_blocks=a.max_blocks,
                          peak_blocks_in_use=a.peak_blocks_in_use, bytes_per_block=self.bytes_per_block_id(),
                          bytes_reserved=self.bytes_reserved(), allocator=a)
            groups = [MemoryStats.from_tables(tables=[a.block_table(s) for s in seqs],
                                              lens=[a.seq_len(s) for s in seqs], **common)
                      for _, seqs in sorted(by_group.items() or {0: []}.items())]
            stats = groups[0] if len(groups) == 1 else MemoryStats.combine(groups, a.peak_blocks_in_use, detail=False)
            return stats.with_states(self.states, self.states.in_use)

    def bytes_per_block_id(self) -> int:
        """Bytes one block id stands for: one block of every distinct K/V tensor."""
        seen, total = set(), 0
        for layer, tensor in self.layer_tensor.items():
            if tensor not in seen:
                seen.add(tensor)
                total += self.block_bytes(self.layer_shapes[layer])
        return total

    # ---------------------------------------------------- stale K/V, sleeping
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no K/V written before this call is reused by a later prompt (rows still
        running keep theirs but no longer offer their blocks). Cached blocks return to the free list. Call it after
        changing the weights of the model this pool serves, to free the blocks at once (not needed for correctness:
        blocks are keyed under the weights fingerprint, :meth:`weights_root`, so the old weights' K/V is never found
        again and is evicted as the pool needs room).

        Example::

            pool = BlockPool(num_blocks=256, prefix_caching=True)
            out = model.generate(**inputs, cache=PagedCache(model.config, pool=pool), max_new_tokens=8)
            optimizer.step()
            pool.reset_prefix_cache()   # optional: the next generate() keys its blocks under the new weights
        """
        with self.lock:
            self.allocator.reset_prefix_cache()

    @property
    def prefix_epoch(self) -> int:
        """How many times the prefix cache was reset (a K/V user keyed by prefixes drops its own entries when it
        changes: the engine's state checkpoints)."""
        return self.allocator.prefix_epoch

    def weights_root(self, model, rewalk: bool = True) -> bytes:
        """The key-chain root of K/V ``model`` computes now: its weights fingerprint (``hf_paged.weights``), which
        changes when any of its parameters' or buffers' values change, however they were written. Blocks are keyed
        under it, so K/V made with other weights (another model on this pool, or this one before an update) is never
        found, while K/V of the same weights is shared (and a saved prompt cache names the weights that made it).
        Costs a strided sample of every tensor (one gather per device and dtype); ``rewalk=True`` (each
        ``generate()`` call, each engine session) also walks the modules and reads every value once."""
        with self.lock:
            fingerprint = self._fingerprints.get(model)
            if fingerprint is None:
                fingerprint = self._fingerprints[model] = WeightsFingerprint()
            return fingerprint.root(model, rewalk)

    def check_weights(self, model, rewalk: bool = True) -> bool:
        """Whether ``model``'s weights fingerprint changed since the last look at it on this pool (False the first
        time, and on a pool without prefix caching). Nothing needs resetting: blocks are keyed under the fingerprint
        (:meth:`weights_root`), so K/V of the old weights is simply never found again."""
        if not self.prefix_caching:
            return False
        with self.lock:
            before = self._fingerprints[model].last_root if model in self._fingerprints else None
            return before is not None and self.weights_root(model, rewalk) != before

    def release_tensors(self) -> int:
        """Free the K/V tensors (and fp8 scale caches) while no row holds a block, e.g. between RL rollouts while the
        trainer needs the memory; returns the bytes they took. The prefix cache is reset (its K/V is gone). The next
        forward (or :meth:`make_tensors`) makes them again, zeroed, at the pool's current size. ``ValueError`` while
        rows hold blocks."""
        with self.lock:
            live = self.allocator.sequences
            if live:
                raise ValueError(f"cannot release the KV pool's tensors: {len(live)} row(s) still hold blocks. Let "
                                 "the requests finish (or free their caches) first.")
            freed = self.bytes_reserved()
            self.allocator.reset_prefix_cache()
            for caches in (self.key_caches, self.value_caches, self.k_scale_caches, self.v_scale_caches):
                caches.clear()
            self._sized_blocks = 0
            return freed

    def make_tensors(self) -> int:
        """Make the K/V tensors of every layer seen so far now (after :meth:`release_tensors`), instead of at the
        next forward; returns the bytes they take."""
        with self.lock:
            for layer in self.layer_tensor:
                self.layer_kv(layer)
            self._sized_blocks = self.tensor_blocks
            return self.bytes_reserved()
