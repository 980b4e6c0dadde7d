"""The requests' view of the block pool: one row per running request, and the block arithmetic admission needs.

A row holds one allocator sequence per layer group (one for most models). Tensor-free, like the allocator: the
scheduler's tests run it on a bare :class:`~hf_paged.BlockAllocator`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..allocator import block_key, _ROOT_KEY
from ..groups import LayerGroups

UNBOUNDED = 1 << 40  # free blocks of a pool that grows on demand


@dataclass(eq=False)
class KVRow:
    seqs: list[int]  # its allocator sequence in each layer group


class RequestKV:
    """Rows on one pool, for the scheduler.

    Args:
        pool: a :class:`~hf_paged.BlockPool` (or anything with ``allocator`` and ``lock``).
        groups: the model's layer groups.
        max_batch_tokens: the per-step token budget (sizes a sliding group's worst case).
    """

    def __init__(self, pool, groups: LayerGroups, max_batch_tokens: int):
        self.pool = pool
        self.allocator = pool.allocator
        self.groups = groups
        self.block_size = self.allocator.block_size
        self.max_batch_tokens = max_batch_tokens
        # Prefix caching needs one block table per request: mixed-window models run without it.
        self.prefix_caching = bool(self.allocator.prefix_caching) and groups.num_groups == 1 \
            and groups.windows[0] is None

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int | None:
        """Blocks the pool may ever hold (None: it grows on demand)."""
        return self.allocator.max_blocks

    def num_free(self) -> int:
        """Blocks that can be taken now (free, cached and room to grow; unbounded for a pool without a cap)."""
        if self.capacity is None:
            return UNBOUNDED
        with self.pool.lock:
            return self.allocator.num_free

    def worst_case_blocks(self, total_tokens: int) -> int:
        """Blocks one request of ``total_tokens`` (prompt + max_new_tokens) may hold at once, over all groups.
        A sliding group gives back blocks that left its window, so it holds at most window + one step's tokens."""
        bs = self.block_size
        full = -(-total_tokens // bs)
        blocks = 0
        for window in self.groups.windows:
            if window is None:
                blocks += full
            else:
                blocks += min(full, -(-(window - 1 + self.max_batch_tokens) // bs) + 1)
        return blocks

    def blocks_needed(self, row: KVRow, num_tokens: int) -> int:
        """Blocks appending ``num_tokens`` to ``row`` takes (copy-on-write of a shared last block included)."""
        with self.pool.lock:
            return self.allocator.blocks_needed_for([(seq, num_tokens) for seq in row.seqs])

    def tokens_that_fit(self, row: KVRow, blocks: int, most: int) -> int:
        """The most tokens (up to ``most``) that ``row`` can append with ``blocks`` blocks."""
        if blocks < 0 or most <= 0:
            return 0
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(row, mid) <= blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ----------------------------------------------------------------- prefix
    def prefix_keys(self, tokens: list[int], num_blocks: int) -> list[bytes]:
        """Keys of the first ``num_blocks`` full blocks of ``tokens`` (as the allocator keys them)."""
        bs, keys, key = self.block_size, [], _ROOT_KEY
        for i in range(num_blocks):
            key = block_key(key, tokens[i * bs: (i + 1) * bs])
            keys.append(key)
        return keys

    def match(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Cached blocks (written by a finished forward) that start ``tokens``, at most ``max_tokens`` tokens."""
        if not self.prefix_caching:
            return []
        return self.allocator.match_prefix(tokens, max_tokens)

    # ------------------------------------------------------------------- rows
    def open(self, prefix_blocks: list[int] = ()) -> KVRow:
        """A new row, starting from ``prefix_blocks`` (from :meth:`match`)."""
        a = self.allocator
        with self.pool.lock:
            seqs = [a.new_sequence(list(prefix_blocks) if g == 0 else []) for g in range(self.groups.num_groups)]
        return KVRow(seqs)

    def fork(self, row: KVRow) -> KVRow:
        """A new row sharing every block of ``row`` (copy-on-write when either writes a shared last block)."""
        with self.pool.lock:
            return KVRow([self.allocator.fork(seq) for seq in row.seqs])

    def free(self, row: KVRow) -> None:
        """All its blocks back (keyed full blocks stay cached for later prompts)."""
        with self.pool.lock:
            for seq in row.seqs:
                self.allocator.free(seq)

    def discard(self, row: KVRow, keep: int) -> None:
        """Free a row whose last forward failed: its blocks past ``keep`` tokens were never fully written, so they
        are cut off first and never offered to other prompts."""
        a = self.allocator
        with self.pool.lock:
            for seq in row.seqs:
                if a.seq_len(seq) > keep:
                    a.crop(seq, keep)
                a.free(seq)

    def publish(self, rows: list[KVRow]) -> None:
        """The forward that wrote these rows' blocks has run: make their keyed blocks findable now (a request
        waiting for that prefix can be admitted at the next step)."""
        if not self.prefix_caching or not rows:
            return
        with self.pool.lock:  # an empty append publishes and changes nothing else
            self.allocator.append([(seq, 0) for row in rows for seq in row.seqs])

    def length(self, row: KVRow) -> int:
        with self.pool.lock:
            return self.allocator.seq_len(row.seqs[0])

    # ------------------------------------------------------------ for shadows
    def append(self, rows_tokens: list[tuple[KVRow, list[int]]]):
        """Allocate slots for each row's new tokens, all or nothing (what the planner does before a forward; used
        by the scheduler's tests). Returns the allocator's plan."""
        requests, tokens = [], []
        for row, new in rows_tokens:
            for g, seq in enumerate(row.seqs):
                requests.append((seq, len(new)))
                tokens.append(list(new) if self.prefix_caching else None)
        with self.pool.lock:
            return self.allocator.append(requests, tokens)
