"""Layer groups: layers of one kind, window/chunk and K/V shape share a block table.

Most models have one group (every layer full, or every layer with the same window). Hybrid models (Gemma2/3,
gpt-oss, Cohere2, Llama 4, ...) mix kinds: their sliding (or chunked) layers give back blocks that left the window
(or a finished chunk) while the full layers keep theirs, so each kind needs its own block table. Layers of another
K/V shape (another head size or KV-head count) need tensors of that shape, so shape is part of the key too. Layers
that keep no K/V of their own (``reuse``, ``state``, ``none`` in :mod:`hf_paged.geometry`) are in no group. All groups
draw block ids from one allocator.

Groups are cut to one size (the greatest common divisor of the layer counts per key, as vLLM's hybrid allocator
does): Gemma3's 5 sliding layers per full one become 5 sliding groups and 1 full group of equal size. Then layer
``i`` of every group of one shape can share one *K/V tensor*: a block id belongs to one group at a time, so a block
costs the same bytes whichever group holds it and no group's tensors sit idle. Groups of different shapes keep
different K/V tensors: one block id then stands for a block in every K/V tensor (:attr:`LayerGroups.tensor_shapes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .geometry import KVGeometry


@dataclass(frozen=True)
class LayerGroups:
    """How the decoder layers split into block-table groups.

    Attributes:
        windows: per group, the sliding window of its layers (``None`` = no window).
        layer_group: per layer, its group (-1: a layer that keeps no K/V of its own).
        layer_tensor: per layer, the key of the K/V tensor it uses (its rank inside its group; with several K/V shapes
            ``(shape, rank)``).
        chunks: per group, the attention chunk of its layers (``None`` = not chunked).
        tensor_shapes: per K/V tensor, ``(num_kv_heads, key_dim, value_dim)`` (empty when the shapes are not known
            yet).
        sources: per layer, the layer whose K/V its attention reads: itself, or for a ``reuse`` layer its source
            (empty: every layer reads its own).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_tensor: tuple
    chunks: tuple[int | None, ...] = ()
    tensor_shapes: tuple = ()  # ((tensor key, (heads, key_dim, value_dim)), ...)
    sources: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.chunks:
            object.__setattr__(self, "chunks", (None,) * len(self.windows))

    @classmethod
    def from_windows(cls, layer_windows: list[int | None]) -> "LayerGroups":
        """Groups of layers that differ by window only (shapes unknown)."""
        return cls.from_geometry(KVGeometry.uniform(layer_windows))

    @classmethod
    def from_geometry(cls, geometry: KVGeometry) -> "LayerGroups":
        paged = geometry.paged_layers
        sources = tuple(layer.source if layer.kind == "reuse" and layer.source is not None else i
                        for i, layer in enumerate(geometry.layers))
        if not paged:
            return cls((None,), tuple(-1 if not layer.paged else 0 for layer in geometry.layers),
                       tuple(0 for _ in geometry.layers), sources=sources)
        by_key: dict[tuple, list[int]] = {}
        for layer in paged:
            spec = geometry[layer]
            by_key.setdefault((spec.kind, spec.window, spec.chunk, spec.shape), []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_key.values()))
        several_shapes = len({key[3] for key in by_key}) > 1
        windows, chunks, tensors = [], [], {}
        layer_group, layer_tensor = [-1] * len(geometry), [0] * len(geometry)
        for (kind, window, chunk, shape), layers in by_key.items():
            for start in range(0, len(layers), size):
                for rank, layer in enumerate(layers[start: start + size]):
                    tensor = (shape, rank) if several_shapes else rank
                    layer_group[layer], layer_tensor[layer] = len(windows), tensor
                    tensors[tensor] = shape
                windows.append(window)
                chunks.append(chunk)
        known = all(shape[0] for shape in tensors.values())
        return cls(tuple(windows), tuple(layer_group), tuple(layer_tensor), tuple(chunks),
                   tuple(tensors.items()) if known else (), sources)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group (= K/V tensors per block id when every layer has one shape)."""
        ranks = [s[1] if isinstance(s, tuple) else s for g, s in zip(self.layer_group, self.layer_tensor) if g >= 0]
        return max(ranks, default=0) + 1

    @property
    def num_tensors(self) -> int:
        """K/V tensors one block id stands for."""
        return len(self.tensor_shapes) or self.group_size

    def source_of(self, layer_idx: int) -> int:
        """The layer whose K/V layer ``layer_idx``'s attention reads (its own, or a ``reuse`` layer's source)."""
        return self.sources[layer_idx] if layer_idx < len(self.sources) else layer_idx

    def window_of(self, layer_idx: int) -> int | None:
        """The window layer ``layer_idx``'s attention applies (a ``reuse`` layer: its source's)."""
        group = self.layer_group[self.source_of(layer_idx)]
        return self.windows[group] if group >= 0 else None

    def chunk_of(self, layer_idx: int) -> int | None:
        group = self.layer_group[self.source_of(layer_idx)]
        return self.chunks[group] if group >= 0 else None

    def limited(self, group: int) -> bool:
        """Whether the group's layers see only part of the history (a window or a chunk): its blocks go back."""
        return self.windows[group] is not None or self.chunks[group] is not None
