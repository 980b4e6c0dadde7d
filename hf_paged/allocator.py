"""Tensor-free block bookkeeping: free list, reference counts and per-sequence block tables.

A sequence is an integer handle. Its block table maps logical block ``i`` (tokens ``i*block_size`` to
``(i+1)*block_size - 1``) to a physical block id. A block can sit in several tables (forks, shared prompts,
beams); its reference count is the number of table entries pointing at it, and it returns to the free list at
zero. Writing into a shared, partly filled block copies it first (copy-on-write); the copy is returned to the
caller, who owns the tensors, as a ``(src, dst)`` pair.

Entries equal to ``NULL_BLOCK`` mark blocks that slid out of a sliding window and were given back.

A capped allocator (``set_limit``) that starts smaller than its cap grows into it before it evicts cached blocks.

Each sequence belongs to a *group* (an int, 0 by default; a cache gives each of its layer groups one), and so does
each block it takes: the allocator counts blocks in use, and their peak, per group as well as in total.

Prefix caching (``prefix_caching=True``): a full block whose tokens are known gets a key, a digest of its tokens
chained with its parent block's key, so a key names the whole prefix up to the block's end. When its last holder lets
go, a keyed block is not freed but *cached*: reference count zero, still valid, kept in least-recently-used order and
evicted only when a block is needed and the free list is empty. :meth:`BlockAllocator.match_prefix` finds the cached
(or live) blocks that start a token sequence, and :meth:`BlockAllocator.new_sequence` can start from them.

A sequence's chain starts from its *root* key (``b""`` by default): what else besides the token ids made its K/V —
the weights' fingerprint, an adapter's digest (``chain_root``) — so that blocks written under one root are never
found under another. The tokens a
caller keys may themselves stand for more than ids (a request's image content, see the engine's inputs).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .errors import OutOfBlocksError

NULL_BLOCK = -1
_ROOT_KEY = b""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints: e.g. the blocks ``a`` tokens fill."""
    return -(-a // b)


def slot_of(block, position, block_size: int):
    """The pool slot of token ``position`` held in physical block ``block`` (the row's block table at
    ``position // block_size``): ``block * block_size + offset``. Ints or tensors."""
    return block * block_size + position % block_size


def root_key(*parts) -> bytes:
    """A chain's root key from what made its K/V besides the tokens (each part's ``str``); ``b""`` for none."""
    parts = [str(p) for p in parts if p is not None and p != ""]
    if not parts:
        return _ROOT_KEY
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()


def chain_root(*parts: bytes) -> bytes:
    """A chain's root key from several roots (a weights fingerprint, an adapter's digest, ...): ``b""`` parts are
    skipped, one part is itself, ``b""`` for none."""
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return parts[0] if parts else _ROOT_KEY
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(2, "little") + p)
    return h.digest()


def block_key(parent: bytes, tokens) -> bytes:
    """The key of a full block: a digest of its parent's key and its token ids (collisions: 2**-128)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


@dataclass
class Appended:
    """What one batched append did, per request: where it started (``starts``), how many tokens (``counts``), the
    block table covering them (``tables``), and the copy-on-write block copies to perform before writing."""

    block_size: int
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def slots(self) -> list[list[int]]:
        """Slot ids (``block * block_size + offset``) per request, token by token (for tests and small tools;
        the cache computes them vectorised from ``starts``, ``counts`` and the block tables)."""
        bs = self.block_size
        return [[slot_of(table[p // bs], p, bs) for p in range(start, start + n)]
                for start, n, table in zip(self.starts, self.counts, self.tables)]


class BlockAllocator:
    """Hands out fixed-size blocks to sequences.

    Args:
        block_size: tokens per block.
        num_blocks: the most blocks that may ever exist. ``None`` lets the pool grow on demand.
        prefix_caching: keep released full blocks, keyed by their prefix, for later sequences to start from.
    """

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, prefix_caching: bool = False):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}; 16 is the usual choice.")
        if num_blocks is not None and (
            not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1
        ):
            raise ValueError(
                f"num_blocks must be a positive int or None (grow on demand), got {num_blocks!r}."
            )
        self.block_size = block_size
        self.max_blocks = num_blocks
        self.capacity = 0
        self.peak_blocks_in_use = 0
        self.peak_by_group: dict[int, int] = {}  # group -> the most blocks its sequences held at once
        self._in_use_by_group: dict[int, int] = {}
        self._seq_group: dict[int, int] = {}
        self._seq_root: dict[int, bytes] = {}  # each sequence's key-chain root
        self._block_group: list[int] = []  # per block, the group of the sequence that took it
        self.lock = threading.RLock()
        self._free: deque[int] = deque()
        self._refcount: list[int] = []
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_seq = 0
        self.prefix_caching = prefix_caching
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, least recently used first
        self._key_of: dict[int, bytes] = {}  # block -> key, for keyed blocks (live or cached)
        self._block_of: dict[bytes, int] = {}  # key -> block
        self._seq_keys: dict[int, list[bytes] | None] = {}  # keys of a sequence's full blocks; None: tokens unknown
        self._seq_tail: dict[int, list[int]] = {}  # token ids of a sequence's partly filled last block
        self._published: dict[int, int] = {}  # how many of a sequence's keys are findable (K/V written)
        self.prefix_queries = 0  # prompt tokens looked up (in whole blocks)
        self.prefix_hits = 0  # of which found
        self.evictions = 0
        self.prefix_epoch = 0  # reset_prefix_cache() calls so far (blocks keyed before the last one are forgotten)
        if num_blocks is not None:
            self._grow(num_blocks)

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that can still be handed out, counting room the pool may still grow into."""
        headroom = 0 if self.max_blocks is None else self.max_blocks - self.capacity
        return len(self._free) + len(self._cached) + headroom

    @property
    def blocks_in_use(self) -> int:
        """Blocks some sequence holds (cached blocks nobody holds are not in use: they can be evicted)."""
        return self.capacity - len(self._free) - len(self._cached)

    @property
    def num_cached(self) -> int:
        """Keyed blocks that nobody holds, kept for prefix reuse until evicted."""
        return len(self._cached)

    @property
    def sequences(self) -> list[int]:
        return list(self._tables)

    def block_table(self, seq: int) -> list[int]:
        return self._tables[self._check_seq(seq)]

    def seq_len(self, seq: int) -> int:
        return self._lens[self._check_seq(seq)]

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def group_of(self, seq: int) -> int:
        return self._seq_group[self._check_seq(seq)]

    def blocks_in_use_by_group(self) -> dict[int, int]:
        """Blocks in use per group (groups that never took a block are absent)."""
        return {g: n for g, n in self._in_use_by_group.items()}

    def blocks_needed(self, seq: int, num_tokens: int) -> int:
        """Blocks an append of ``num_tokens`` to ``seq`` would take from the free list."""
        return self.blocks_needed_for([(self._check_seq(seq), num_tokens)])

    def blocks_needed_for(self, requests: list[tuple[int, int]]) -> int:
        """Blocks a batched append takes: new blocks, plus copies of shared partly filled last blocks, where the
        last of a block's holders to write in the batch finds it unshared and writes in place."""
        bs = self.block_size
        new = 0
        writers: dict[int, int] = {}
        for seq, n in requests:
            if n <= 0:
                continue
            length = self._lens[seq]
            new += cdiv(length + n, bs) - cdiv(length, bs)
            if length % bs:
                last = self._tables[seq][length // bs]
                writers[last] = writers.get(last, 0) + 1
        copies = sum(min(count, self._refcount[b] - 1) for b, count in writers.items())
        return new + copies

    # ------------------------------------------------------------- mutations
    def set_limit(self, num_blocks: int) -> None:
        """Cap a pool that was created unbounded (used when the cap is known only later, e.g. from bytes)."""
        with self.lock:
            if num_blocks < self.capacity:
                raise ValueError(f"cannot cap the pool at {num_blocks} blocks: {self.capacity} already exist.")
            self.max_blocks = num_blocks

    def new_sequence(self, prefix_blocks: list[int] = (), group: int = 0, root: bytes = _ROOT_KEY) -> int:
        """A new sequence of ``group``; ``prefix_blocks`` (from :meth:`match_prefix` under the same ``root``) become
        its first, full, shared blocks; ``root``: its key chain's root (see the module docstring)."""
        with self.lock:
            seq = self._next_seq
            self._next_seq += 1
            self._seq_group[seq] = group
            self._seq_root[seq] = root
            self._tables[seq] = list(prefix_blocks)
            self._lens[seq] = len(prefix_blocks) * self.block_size
            self._seq_keys[seq] = [self._key_of[b] for b in prefix_blocks]
            self._seq_tail[seq] = []
            self._published[seq] = len(prefix_blocks)
            self._incref(prefix_blocks, group)
            return seq

    def match_prefix(self, tokens: list[int], max_tokens: int | None = None, root: bytes = _ROOT_KEY) -> list[int]:
        """The keyed blocks (live or cached) holding the longest run of whole blocks that starts ``tokens`` under
        ``root``, at most ``max_tokens`` tokens. Only blocks whose K/V were written by a finished forward are found."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        blocks, key = [], root
        with self.lock:
            for i in range(limit // bs):
                key = block_key(key, tokens[i * bs: (i + 1) * bs])
                block = self._block_of.get(key)
                if block is None:
                    break
                blocks.append(block)
            return blocks

    def note_prefix_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count a prompt's prefix-cache lookup (for :class:`~hf_paged.MemoryStats`)."""
        with self.lock:
            self.prefix_queries += query_tokens
            self.prefix_hits += hit_tokens

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq`` (no copy)."""
        with self.lock:
            table = self._tables[self._check_seq(seq)]
            child = self.new_sequence(group=self._seq_group[seq], root=self._seq_root[seq])
            self._tables[child] = list(table)
            self._lens[child] = self._lens[seq]
            self._copy_keys(seq, child)
            self._incref(table)
            return child

    def free(self, seq: int) -> None:
        """Give back ``seq``'s blocks. Keyed ones stay cached, tail first into the least-recently-used order, so
        eviction cuts a cached prefix from its end rather than breaking its first block (and with it the chain)."""
        with self.lock:
            self._check_seq(seq)
            self._publish(seq)
            self._decref(self._tables.pop(seq)[::-1])
            del self._lens[seq], self._seq_keys[seq], self._seq_tail[seq], self._published[seq], self._seq_group[seq]
            del self._seq_root[seq]

    def publish(self, seq: int) -> None:
        """The forward that wrote ``seq``'s keyed blocks has run: make them findable now (otherwise they become
        findable at its next append or when it is freed)."""
        with self.lock:
            self._publish(self._check_seq(seq))

    def append(self, requests: list[tuple[int, int]], tokens: list[list[int] | None] | None = None) -> Appended:
        """Reserve slots for ``n`` new tokens on each ``(seq, n)``, all or nothing.

        ``tokens`` (optional, per request): the ``n`` token ids, which key the blocks they fill (prefix caching);
        ``None`` for a request makes its sequence unkeyable from then on.

        Returns the slot ids (``block * block_size + offset``) per request and the copy-on-write copies to apply
        to the KV tensors before writing. Raises :class:`OutOfBlocksError` without changing anything if the
        blocks do not fit.
        """
        with self.lock:
            seqs = [self._check_seq(seq) for seq, _ in requests]
            if len(set(seqs)) != len(seqs):
                raise ValueError(f"append got a sequence twice in one batch ({seqs}); merge its requests.")
            for seq in seqs:  # the forward that wrote their last keyed blocks has run: make them findable
                self._publish(seq)
            needed = self.blocks_needed_for(requests)
            if self.max_blocks is not None and needed > self.num_free:
                raise OutOfBlocksError(needed=needed, free=self.num_free, block_size=self.block_size,
                                       capacity=self.max_blocks if self.max_blocks is not None else self.capacity)
            # Capped: grow into the cap before evicting cached blocks. Uncapped: evict before growing (else the
            # pool would grow with every distinct request).
            short = needed - len(self._free) - (len(self._cached) if self.max_blocks is None else 0)
            if short > 0:
                self._grow(max(short, self.capacity))
            appended = Appended(self.block_size)
            for i, (seq, n) in enumerate(requests):
                appended.starts.append(self._lens[seq])
                appended.counts.append(max(n, 0))
                self._append_one(seq, n, appended.copies)
                if self.prefix_caching and n > 0:
                    self._key_new_blocks(seq, tokens[i] if tokens is not None else None)
                appended.tables.append(list(self._tables[seq]))
            self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
            for group, count in self._in_use_by_group.items():
                if count > self.peak_by_group.get(group, 0):
                    self.peak_by_group[group] = count
            return appended

    def crop(self, seq: int, new_len: int) -> None:
        """Keep the first ``new_len`` tokens of ``seq``; blocks that become empty are released."""
        with self.lock:
            length = self._lens[self._check_seq(seq)]
            if not 0 <= new_len <= length:
                raise ValueError(f"cannot crop a sequence of {length} tokens to {new_len}.")
            table = self._tables[seq]
            keep = cdiv(new_len, self.block_size)
            if keep and table[keep - 1] == NULL_BLOCK:
                raise ValueError(
                    f"cannot crop to {new_len} tokens: the block holding token {new_len - 1} already slid out of the "
                    "attention window and was released. Crop fewer tokens, or record past states before generating "
                    "(PagedCache.activate_past_recording()) so no block is released."
                )
            self._decref(table[keep:])
            del table[keep:]
            self._lens[seq] = new_len
            self._crop_keys(seq, new_len)

    def reorder(self, seqs: list[int], order: list[int]) -> None:
        """Make ``seqs[i]`` hold what ``seqs[order[i]]`` held (beam search), by table only."""
        with self.lock:
            if len(order) != len(seqs):
                raise ValueError(f"reorder got {len(order)} indices for {len(seqs)} sequences.")
            if any(not 0 <= i < len(seqs) for i in order):
                raise ValueError(f"reorder indices must lie in [0, {len(seqs)}), got {order}.")
            for seq in seqs:
                self._check_seq(seq)
            if len({self._seq_group[seq] for seq in seqs}) > 1:
                raise ValueError("reorder got sequences of different groups; reorder each group's on its own.")
            new_tables = [list(self._tables[seqs[i]]) for i in order]
            new_lens = [self._lens[seqs[i]] for i in order]
            new_keys = [self._seq_keys[seqs[i]] for i in order]
            new_tails = [self._seq_tail[seqs[i]] for i in order]
            new_published = [self._published[seqs[i]] for i in order]
            new_roots = [self._seq_root[seqs[i]] for i in order]
            for table in new_tables:
                self._incref(table)
            for seq, table, length, keys, tail, pub, root in zip(seqs, new_tables, new_lens, new_keys, new_tails,
                                                                 new_published, new_roots):
                self._published[seq] = pub
                self._seq_root[seq] = root
                self._decref(self._tables[seq])
                self._tables[seq] = table
                self._lens[seq] = length
                self._seq_keys[seq] = None if keys is None else list(keys)
                self._seq_tail[seq] = list(tail)

    def release_outside_window(self, seq: int, keep_from: int) -> int:
        """Release whole blocks holding only tokens before position ``keep_from``. Returns how many."""
        with self.lock:
            table = self._tables[self._check_seq(seq)]
            keep_from = min(keep_from, self._lens[seq])  # never the partly filled last block
            released = []
            for i in range(max(0, keep_from) // self.block_size):
                if table[i] != NULL_BLOCK:
                    released.append(table[i])
                    table[i] = NULL_BLOCK
            self._decref(released)
            return len(released)

    def reset(self) -> None:
        """Free every sequence (the blocks stay allocated to the pool; keyed ones stay cached)."""
        with self.lock:
            for seq in list(self._tables):
                self.free(seq)

    def clear_cached(self) -> None:
        """Forget every cached block (they return to the free list)."""
        with self.lock:
            while self._cached:
                self._free.append(self._evict())

    def reset_prefix_cache(self) -> None:
        """Nothing written before this call is ever found by :meth:`match_prefix` again: cached blocks return to the
        free list, blocks live sequences hold lose their keys (they are freed, not cached, when let go), and live
        sequences stop keying the blocks they fill from now on (their K/V mixes before and after). For K/V made
        stale, e.g. by new weights. Bumps :attr:`prefix_epoch`."""
        with self.lock:
            self.clear_cached()
            self._key_of.clear()
            self._block_of.clear()
            for seq in self._seq_keys:
                self._seq_keys[seq], self._seq_tail[seq], self._published[seq] = None, [], 0
            self.prefix_epoch += 1

    def stop_keying(self, seq: int) -> None:
        """``seq`` keys no block it fills from now on (what made its K/V changed while it ran: its later blocks are
        not what its root names); the blocks it already published stay findable."""
        with self.lock:
            self._check_seq(seq)
            self._seq_keys[seq], self._seq_tail[seq] = None, []

    # ------------------------------------------------------------- internals
    def _append_one(self, seq: int, n: int, copies: list[tuple[int, int]]) -> None:
        if n <= 0:
            return
        table, length, bs = self._tables[seq], self._lens[seq], self.block_size
        group = self._seq_group[seq]
        if length % bs:
            last = table[-1]
            if last in self._key_of and self._refcount[last] == 1:  # (cropped) keyed block written in place: unkey
                del self._block_of[self._key_of.pop(last)]
            if self._refcount[last] > 1:
                fresh = self._take(group)
                self._refcount[last] -= 1
                table[-1] = fresh
                copies.append((last, fresh))
        for _ in range(cdiv(length + n, bs) - len(table)):
            table.append(self._take(group))
        self._lens[seq] = length + n

    def _take(self, group: int) -> int:
        """A block for writing, held once by ``group``: from the free list, else the least recently used cached
        block."""
        block = self._free.popleft() if self._free else self._evict()
        self._refcount[block] = 1
        self._block_group[block] = group
        self._in_use_by_group[group] = self._in_use_by_group.get(group, 0) + 1
        return block

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.evictions += 1
        return block

    def _key_new_blocks(self, seq: int, tokens: list[int] | None) -> None:
        """Key the blocks that ``tokens`` (just appended to ``seq``) filled; unknown tokens end the chain."""
        keys = self._seq_keys[seq]
        if keys is None:
            return
        if tokens is None:
            self._seq_keys[seq], self._seq_tail[seq] = None, []
            return
        bs, tail = self.block_size, self._seq_tail[seq]
        tail.extend(int(t) for t in tokens)
        while len(tail) >= bs:
            keys.append(block_key(keys[-1] if keys else self._seq_root[seq], tail[:bs]))
            del tail[:bs]

    def _publish(self, seq: int) -> None:
        """Make ``seq``'s keyed blocks findable. Called once the forward that wrote them has run (at the sequence's
        next append, or when it is freed), so no other sequence can start from a block still being written."""
        keys = self._seq_keys[seq]
        if keys is None:
            return
        table = self._tables[seq]
        for i in range(self._published[seq], len(keys)):
            block, key = table[i], keys[i]
            if block != NULL_BLOCK and key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
        self._published[seq] = len(keys)

    def _crop_keys(self, seq: int, new_len: int) -> None:
        keys = self._seq_keys[seq]
        if keys is None:
            return
        bs = self.block_size
        full = new_len // bs
        if len(keys) <= full:  # the crop falls inside the partly filled last block
            del self._seq_tail[seq][new_len - full * bs:]
            return
        del keys[full:]
        self._published[seq] = min(self._published[seq], full)
        self._seq_tail[seq] = []
        if new_len % bs:  # a full block became partly filled: this row's keys end here (the block is unkeyed
            self._seq_keys[seq] = None  # if this row writes into it in place, see _append_one)

    def _copy_keys(self, src: int, dst: int) -> None:
        keys = self._seq_keys[src]
        self._seq_keys[dst] = None if keys is None else list(keys)
        self._seq_tail[dst] = list(self._seq_tail[src])
        self._published[dst] = self._published[src]

    def _grow(self, count: int) -> None:
        if self.max_blocks is not None:
            count = min(count, self.max_blocks - self.capacity)
        self._free.extend(range(self.capacity, self.capacity + count))
        self._refcount.extend([0] * count)
        self._block_group.extend([0] * count)
        self.capacity += count

    def _incref(self, blocks: list[int], group: int | None = None) -> None:
        """One more holder for each block; a cached block taken back becomes ``group``'s."""
        for b in blocks:
            if b != NULL_BLOCK:
                if self._refcount[b] == 0:
                    self._cached.pop(b, None)
                    if group is not None:
                        self._block_group[b] = group
                    g = self._block_group[b]
                    self._in_use_by_group[g] = self._in_use_by_group.get(g, 0) + 1
                self._refcount[b] += 1

    def _decref(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self._refcount[b] <= 0:
                raise RuntimeError(f"block {b} freed twice (allocator bookkeeping is corrupt).")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._in_use_by_group[self._block_group[b]] -= 1
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def _check_seq(self, seq: int) -> int:
        if seq not in self._tables:
            raise KeyError(f"sequence {seq} is not allocated (it was freed, or never existed).")
        return seq

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent: used for tests and debugging."""
        counts = [0] * self.capacity
        for seq, table in self._tables.items():
            length = self._lens[seq]
            assert len(table) == cdiv(length, self.block_size), (seq, len(table), length)
            for b in table:
                if b != NULL_BLOCK:
                    counts[b] += 1
        assert counts == self._refcount, "reference counts differ from the tables"
        free = list(self._free)
        assert len(set(free)) == len(free), "a block sits twice in the free list"
        assert all(self._refcount[b] == 0 for b in free), "a referenced block sits in the free list"
        cached = list(self._cached)
        assert not set(cached) & set(free), "a block is both cached and free"
        assert all(self._refcount[b] == 0 and b in self._key_of for b in cached), "a cached block is held or unkeyed"
        assert not any(b in self._key_of for b in free), "a free block still has a key"
        assert {self._block_of[k]: k for k in self._block_of} == self._key_of, "key maps disagree"
        assert len(free) + len(cached) + sum(1 for c in counts if c > 0) == self.capacity, (
            "a block is neither free, cached nor referenced")
        by_group: dict[int, set[int]] = {}
        for seq, table in self._tables.items():
            by_group.setdefault(self._seq_group[seq], set()).update(b for b in table if b != NULL_BLOCK)
        assert all(self._block_group[b] == g for g, blocks in by_group.items() for b in blocks), (
            "a block is held by a sequence of another group than the one counting it")
        assert {g: len(b) for g, b in by_group.items() if b} == {
            g: n for g, n in self._in_use_by_group.items() if n}, "blocks in use per group differ from the tables"
