"""Memory figures of a paged KV cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .allocator import NULL_BLOCK


@dataclass(frozen=True)
class MemoryStats:
    """What a cache (or a pool) holds.

    The top-level figures describe the whole cache: its rows' tokens and every block it holds. For models whose
    layers use different windows, ``groups`` gives the same figures per layer group beside them.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks that exist (the K/V tensors' first dimension, less the scratch block); ``max_blocks`` is
            the cap (None: grows).
        blocks_in_use: distinct physical blocks referenced by at least one sequence (all layer groups).
        peak_blocks_in_use: the most blocks ever in use at once in the pool (all caches on it); in a group's
            figures, the most that group's sequences held at once.
        tokens_stored: distinct tokens whose K/V are held (a shared prompt counts once; with mixed windows a token
            held by several layer groups counts once, so it is the figure of the group holding the most).
        logical_tokens: tokens summed over the rows (a shared prompt counts once per row), whatever the windows.
        bytes_reserved: bytes of the K/V tensors, summed over layers.
        bytes_in_use: bytes of the blocks in use, summed over layers.
        utilization: share of the token slots in the blocks in use that hold a token (1.0 when nothing is in use).
        num_sequences: live rows.
        blocks_cached: prefix caching: full blocks nobody holds, kept for reuse (not in use: evicted on demand).
        prefix_query_tokens / prefix_hit_tokens: the pool's prompt tokens looked up in the prefix cache / found
            there, summed over every cache and call on the pool since it was built.
        cache_prefix_query_tokens / cache_prefix_hit_tokens: the same for this cache's own lookups only (a cache
            looks up once, when a ``generate()`` starts on it empty); 0 in a pool's figures.
        state_slots_in_use: models with state layers (linear attention, Mamba, short convolutions): state cells the
            rows hold (one per live row; the pool's figures: every cache's).
        state_bytes_per_slot: bytes of one state cell: one row's states over every state layer (0 before their
            first write).
        state_bytes_in_use: ``state_slots_in_use * state_bytes_per_slot``.
        state_bytes_reserved: bytes of the state store's tensors (every state cell, held or not; the pool's, shared).
        adapter_bytes / adapter_bytes_reserved: an engine's LoRA adapters (``manager.memory_stats()`` only): their
            own weights, and the stacked adapter tensors holding them (ranks padded to each layer's largest).
        window: the sliding window of a group's layers (group figures only).
        groups: for models whose layers use different windows, the same figures per block-table group.

    Example::

        cache = PagedCache(model.config)
        model.generate(**inputs, cache=cache, max_new_tokens=8)
        stats = cache.memory_stats()
        print(stats.blocks_in_use, stats.tokens_stored, f"{stats.utilization:.0%}")
        for group in stats.groups:          # mixed-window models only
            print(group.window, group.blocks_in_use, group.peak_blocks_in_use)
    """

    block_size: int
    num_blocks: int
    max_blocks: int | None
    blocks_in_use: int
    peak_blocks_in_use: int
    tokens_stored: int
    logical_tokens: int
    bytes_per_block: int
    bytes_reserved: int
    bytes_in_use: int
    utilization: float
    num_sequences: int
    blocks_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cache_prefix_query_tokens: int = 0
    cache_prefix_hit_tokens: int = 0
    state_slots_in_use: int = 0
    state_bytes_per_slot: int = 0
    state_bytes_in_use: int = 0
    state_bytes_reserved: int = 0
    window: int | None = None
    groups: tuple = field(default=())
    adapter_bytes: int = 0  # an engine's LoRA adapters: their own weights (engine/lora.py)
    adapter_bytes_reserved: int = 0  # ... and their stacked adapter tensors (ranks padded)

    def with_states(self, store, cells_in_use: int) -> "MemoryStats":
        """These figures with a state store's (:class:`~hf_paged.states.StateStore`), ``cells_in_use`` of its cells
        counted as this cache's."""
        per_cell = store.bytes_per_cell()
        return replace(self, state_slots_in_use=cells_in_use, state_bytes_per_slot=per_cell,
                       state_bytes_in_use=cells_in_use * per_cell, state_bytes_reserved=store.bytes_reserved())

    @property
    def peak_bytes_in_use(self) -> int:
        return self.peak_blocks_in_use * self.bytes_per_block

    def as_dict(self) -> dict:
        """Plain values (JSON-ready): ``groups`` becomes a list of dicts."""
        out = asdict(self)
        out["groups"] = list(out["groups"])
        return out

    @classmethod
    def from_tables(cls, *, block_size, num_blocks, max_blocks, tables, lens, peak_blocks_in_use,
                    bytes_per_block, bytes_reserved, allocator=None, **extra) -> "MemoryStats":
        """Figures for one group of sequences (``tables``/``lens`` per sequence)."""
        fill: dict[int, int] = {}
        for table, length in zip(tables, lens):
            for i, block in enumerate(table):
                if block != NULL_BLOCK:
                    used = min(block_size, length - i * block_size)
                    fill[block] = max(fill.get(block, 0), used)
        in_use = len(fill)
        tokens = sum(fill.values())
        return cls(
            block_size=block_size,
            num_blocks=num_blocks,
            max_blocks=max_blocks,
            blocks_in_use=in_use,
            peak_blocks_in_use=peak_blocks_in_use,
            tokens_stored=tokens,
            logical_tokens=sum(lens),
            bytes_per_block=bytes_per_block,
            bytes_reserved=bytes_reserved,
            bytes_in_use=in_use * bytes_per_block,
            utilization=tokens / (in_use * block_size) if in_use else 1.0,
            num_sequences=len(tables),
            blocks_cached=allocator.num_cached if allocator is not None else 0,
            prefix_query_tokens=allocator.prefix_queries if allocator is not None else 0,
            prefix_hit_tokens=allocator.prefix_hits if allocator is not None else 0,
            **extra,
        )

    @classmethod
    def for_rows(cls, pool, rows: list[list[int]], windows, detail: bool = True) -> "MemoryStats":
        """Figures for ``rows`` of a cache on ``pool``: per row, its allocator sequence in each layer group (the
        order of ``windows``, one window per group). Call under ``pool.lock``.

        One group: that group's figures, with the pool's peak. Several: the whole cache at the top (blocks of
        every group; tokens and rows counted once) and, with ``detail``, each group's own figures in ``groups``.
        """
        a = pool.allocator
        common = dict(block_size=a.block_size, num_blocks=pool.tensor_blocks - 1, max_blocks=a.max_blocks,
                      bytes_per_block=pool.bytes_per_block_id(), bytes_reserved=pool.bytes_reserved(), allocator=a)
        per_group = []
        for g, window in enumerate(windows):
            seqs = [row[g] for row in rows]
            peak = a.peak_by_group.get(a.group_of(seqs[0]) if seqs else g, 0)
            per_group.append(cls.from_tables(tables=[a.block_table(s) for s in seqs], lens=[a.seq_len(s) for s in seqs],
                                             peak_blocks_in_use=peak, window=window, **common))
        if len(per_group) == 1:
            return replace(per_group[0], peak_blocks_in_use=a.peak_blocks_in_use, window=None)
        return cls.combine(per_group, a.peak_blocks_in_use, detail)

    @classmethod
    def combine(cls, groups: list["MemoryStats"], peak_blocks_in_use: int, detail: bool = True) -> "MemoryStats":
        """The whole-cache figures of the same rows' layer groups (a block belongs to one group at a time)."""
        first, bs = groups[0], groups[0].block_size
        in_use = sum(g.blocks_in_use for g in groups)
        filled = sum(g.tokens_stored for g in groups)  # token slots holding a token, over every group's blocks
        return replace(
            first,
            blocks_in_use=in_use,
            peak_blocks_in_use=peak_blocks_in_use,
            tokens_stored=max(g.tokens_stored for g in groups),
            bytes_in_use=in_use * first.bytes_per_block,
            utilization=filled / (in_use * bs) if in_use else 1.0,
            window=None,
            groups=tuple(groups) if detail else (),
        )
