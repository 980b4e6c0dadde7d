"""Layer groups: layers that share a sliding window share a block table.

Most models have one group (every layer full, or every layer with the same window). Hybrid models (Gemma2/3,
gpt-oss, Cohere2, ...) mix windows: their sliding layers give back blocks that left the window while the full layers
keep theirs, so each kind needs its own block table. All groups draw block ids from one allocator.

Groups are cut to one size (the greatest common divisor of the layer counts per window, as vLLM's hybrid allocator
does): Gemma3's 5 sliding layers per full one become 5 sliding groups and 1 full group of equal size. Then layer
``i`` of every group can share one K/V tensor (its *slot*): a block id belongs to one group at a time, so a block
costs the same bytes whichever group holds it and no group's tensors sit idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroups:
    """How the decoder layers split into block-table groups.

    Attributes:
        windows: per group, the sliding window of its layers (``None`` = full attention).
        layer_group: per layer, its group.
        layer_slot: per layer, the K/V tensor slot it uses (its rank inside its group).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @classmethod
    def from_windows(cls, layer_windows: list[int | None]) -> "LayerGroups":
        if not layer_windows:
            return cls((None,), (), ())
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        windows, layer_group, layer_slot = [], [0] * len(layer_windows), [0] * len(layer_windows)
        for window, layers in by_window.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start: start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group (= K/V tensor slots per block id)."""
        return max(self.layer_slot, default=0) + 1

    def window_of(self, layer_idx: int) -> int | None:
        return self.windows[self.layer_group[layer_idx]]
