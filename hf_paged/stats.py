"""Memory figures of a paged KV cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .allocator import NULL_BLOCK


@dataclass(frozen=True)
class MemoryStats:
    """What a cache (or a pool) holds.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks that exist (allocated tensors' rows); ``max_blocks`` is the cap (None: grows).
        blocks_in_use: distinct physical blocks referenced by at least one sequence.
        peak_blocks_in_use: the most blocks ever in use at once.
        tokens_stored: distinct KV slots holding a token (a shared prompt counts once).
        logical_tokens: tokens summed over sequences (a shared prompt counts once per sequence).
        bytes_reserved: bytes of the K/V tensors, summed over layers.
        bytes_in_use: bytes of the blocks in use, summed over layers.
        utilization: tokens_stored / (blocks_in_use * block_size), 1.0 when nothing is in use.
        num_sequences: live sequences.
        blocks_cached: prefix caching: full blocks nobody holds, kept for reuse (not in use: evicted on demand).
        prefix_query_tokens / prefix_hit_tokens: prompt tokens looked up in the prefix cache / found there.
        window: the sliding window of a group's layers (group figures only).
        groups: for models whose layers use different windows, the same figures per block-table group.
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
    window: int | None = None
    groups: tuple = field(default=())

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
