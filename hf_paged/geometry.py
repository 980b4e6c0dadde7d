"""KV geometry: what each decoder layer keeps in the KV pool, described once.

One :class:`LayerKV` per decoder layer, built from the model's config by ``hf_paged.patches.kv_geometry`` (the only
place that reads ``layer_types``, ``per_layer_config``, ``head_dim`` and the family's window rule). Everything that
sizes or lays out K/V reads this description and nothing else: the layer groups (``groups.py``: one block table per
kind, window/chunk and K/V shape), the pool's tensors and its ``max_memory`` cap (``pool.py``), the saved-file check
(``persist.py``), ``memory_stats`` and the engine's pool sizing.

Kinds:

- ``full``: softmax attention over the whole history (``window`` and ``chunk`` None);
- ``sliding``: over the last ``window`` positions (itself included); blocks that leave the window go back;
- ``chunked``: over the positions of its own chunk of ``chunk`` tokens (``floor(p / chunk) * chunk`` up to ``p``,
  Llama 4); blocks of finished chunks go back;
- ``reuse``: reads the K/V of layer ``source`` and keeps none of its own (Gemma 4's KV-shared layers);
- ``state``: keeps a fixed-size per-sequence state instead of K/V (linear attention, Mamba / Mamba2, short
  convolutions): a state cell of the state store (``states.py``), not blocks;
- ``none``: keeps nothing (MLP-only layers, ``"moe"`` / ``"mlp"`` layer types).

A layer of a paged kind may keep a state beside its K/V (``state=True``: transformers' ``"hybrid"`` cache layers,
Falcon-H1's attention and Mamba2 mixers in one layer): its K/V are paged and its state takes a state cell. The
shapes and dtypes of the states (conv ``[..., kernel]``, recurrent, e.g. fp32) are learned at their first write
(:class:`~hf_paged.states.StateStore`): the configs of the families name them in as many ways as there are families.

Key and value widths are separate fields (latent attention stores one "head" whose key width differs from its
value width); a kind that needs more fields gets them here, and its consumers read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("full", "sliding", "chunked", "reuse", "state", "none")
PAGED_KINDS = ("full", "sliding", "chunked")  # the kinds whose K/V live in blocks of the pool


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps: its kind and, for a paged kind, the per-token K/V shape.

    Attributes:
        kind: one of :data:`KINDS`.
        window: ``sliding``: the window ``W`` the attention passes (a query sees the last ``W`` positions).
        chunk: ``chunked``: the chunk size ``C``.
        num_kv_heads: K/V heads per token (0 for kinds that keep no K/V).
        key_dim: width of one key head.
        value_dim: width of one value head.
        source: ``reuse``: the layer whose K/V this layer reads.
        state: the layer keeps a fixed-size state (conv / recurrent) per sequence: always for ``state`` layers, and
            for hybrid layers of a paged kind whose state half sits beside their K/V.
    """

    kind: str
    window: int | None = None
    chunk: int | None = None
    num_kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    source: int | None = None
    state: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown layer kind {self.kind!r}; one of {KINDS}")
        if self.kind == "state" and not self.state:
            object.__setattr__(self, "state", True)

    @property
    def paged(self) -> bool:
        """Whether the layer's K/V live in blocks of the pool."""
        return self.kind in PAGED_KINDS

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_kv_heads, key_dim, value_dim)``: one token's K/V."""
        return self.num_kv_heads, self.key_dim, self.value_dim

    def elements_per_token(self) -> int:
        """K plus V elements of one token (0 for kinds without K/V)."""
        return self.num_kv_heads * (self.key_dim + self.value_dim) if self.paged else 0


@dataclass(frozen=True)
class KVGeometry:
    """The :class:`LayerKV` of every decoder layer of one model, in layer order."""

    layers: tuple[LayerKV, ...]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> LayerKV:
        return self.layers[layer_idx]

    @classmethod
    def uniform(cls, windows: list[int | None], num_kv_heads: int = 0, head_dim: int = 0) -> "KVGeometry":
        """Layers that differ by their sliding window only (``None``: full), all of one K/V shape."""
        return cls(tuple(LayerKV("full" if w is None else "sliding", window=w, num_kv_heads=num_kv_heads,
                                 key_dim=head_dim, value_dim=head_dim) for w in windows))

    @property
    def paged_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.paged]

    @property
    def state_layers(self) -> list[int]:
        """Layers keeping a fixed-size state (``state`` layers and hybrid layers' state half)."""
        return [i for i, layer in enumerate(self.layers) if layer.state]

    def windows(self) -> list[int | None]:
        """Per layer, the window its attention applies (``sliding`` layers; ``None`` otherwise)."""
        return [layer.window if layer.kind == "sliding" else None for layer in self.layers]

    def elements_per_token(self) -> int:
        """K plus V elements one token takes over every layer (what a contiguous cache would hold)."""
        return sum(layer.elements_per_token() for layer in self.layers)

    def kinds(self) -> dict[str, int]:
        """Layer count per kind, e.g. ``{"chunked": 3, "full": 1}``."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts
