"""The requests' view of the block pool: one row (``hf_paged.rows.Row``) per running request, and the block
arithmetic admission needs.

A row holds one allocator sequence per layer group (one for most models); ``hf_paged.rows.Rows`` owns them, and the
step planner appends to them. Tensor-free, like the allocator: the scheduler's tests run it on a pool whose tensors
are never made.
"""

from __future__ import annotations

from ..allocator import _ROOT_KEY, block_key, cdiv, chain_root
from ..groups import LayerGroups
from ..rows import Row, Rows
from ..states import OutOfStateMemoryError
from .states import StateCheckpoints

UNBOUNDED = 1 << 40  # free blocks of a pool that grows on demand
CHECKPOINTS = 16  # state checkpoints a hybrid model's engine keeps for prefix caching (least recently used out;
# also given up, oldest first, when a request needs their room)


class RequestKV:
    """The engine's rows on one pool, for the scheduler.

    Args:
        pool: a :class:`~hf_paged.BlockPool`.
        groups: the model's layer groups.
        max_batch_tokens: the per-step token budget (sizes a sliding group's worst case).
        model: the model whose K/V the rows hold: every block key's chain starts from its weights fingerprint
            (``BlockPool.weights_root``), looked at once per admitting step, so no K/V made with other weights is
            reused. None: no weights in the keys.
    """

    def __init__(self, pool, groups: LayerGroups, max_batch_tokens: int, state_layers=(), model=None):
        self.pool = pool
        self.allocator = pool.allocator
        self.groups = groups
        self.state_layers = tuple(state_layers)  # hybrid models: each row also holds a state cell
        self.rows = Rows(pool, groups, bool(self.state_layers))
        self.block_size = self.allocator.block_size
        self.max_batch_tokens = max_batch_tokens
        # Prefix caching needs one block table per request: mixed-window models run without it. Hybrid models need
        # the states at the prefix's end too: checkpoints at block boundaries (engine/states.py).
        self.prefix_caching = self.rows.prefix_caching
        self.checkpoints = StateCheckpoints(pool, CHECKPOINTS) if self.prefix_caching and self.state_layers else None
        self._matched: dict[int, int] = {}  # id(tokens) -> its cached K/V blocks, for the open() following match()
        self._targets: dict[int, int] = {}  # id(row) -> a block boundary its prefill stops at, to checkpoint there
        self.model = model
        self._epoch = pool.prefix_epoch  # the pool's prefix cache resets seen (checkpoints are dropped with it)
        self._weights_checked = False  # since the last forward (one check per step, at its first lookup)
        self.weights_root = _ROOT_KEY  # the model's weights fingerprint at the last check
        self.adapters = None  # the engine's AdapterSet (engine/lora.py), whose PEFT bypass is part of every key

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
        full = cdiv(total_tokens, bs)
        blocks = 0
        for window in self.groups.windows:
            if window is None:
                blocks += full
            else:
                blocks += min(full, cdiv(window - 1 + self.max_batch_tokens, bs) + 1)
        return blocks

    def blocks_needed(self, row: Row, num_tokens: int) -> int:
        """Blocks appending ``num_tokens`` to ``row`` takes (copy-on-write of a shared last block included)."""
        with self.pool.lock:
            return self.allocator.blocks_needed_for([(seq, num_tokens) for seq in row.seqs])

    def tokens_that_fit(self, row: Row, blocks: int, most: int) -> int:
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
    def key_root(self, root: bytes = _ROOT_KEY) -> bytes:
        """The chain root of a request's blocks: the model's weights fingerprint, whether the engine bypasses PEFT's
        own layers, and the request's own root (``root``: its adapter's digest, ``b""`` for the base model)."""
        bypass = b"peft-bypassed" if self.adapters is not None and self.adapters.peft_bypassed else b""
        return chain_root(self.weights_root, bypass, root)

    def prefix_keys(self, tokens: list[int], num_blocks: int, root: bytes = _ROOT_KEY) -> list[bytes]:
        """Keys of the first ``num_blocks`` full blocks of ``tokens`` of a request with root ``root`` (as the
        allocator keys them, under :meth:`key_root`)."""
        return self._chain(tokens, num_blocks, self.key_root(root))

    def _chain(self, tokens: list[int], num_blocks: int, key: bytes) -> list[bytes]:
        bs, keys = self.block_size, []
        for i in range(num_blocks):
            key = block_key(key, tokens[i * bs: (i + 1) * bs])
            keys.append(key)
        return keys

    def match(self, tokens: list[int], max_tokens: int, root: bytes = _ROOT_KEY) -> list[int]:
        """Cached blocks (written by a finished forward) that start ``tokens`` of a request with root ``root``, at
        most ``max_tokens`` tokens; on hybrid models only as many as end where a state checkpoint was kept. Nothing
        computed with other weights (or adapter, or PEFT switches) than the model's now is found."""
        self.check_weights()
        full = self.key_root(root)
        blocks = self.rows.match_prefix(tokens, max_tokens, full)
        if self.checkpoints is None or not blocks:
            return blocks
        keys = self._chain(tokens, len(blocks), full)
        usable = next((i for i in range(len(blocks), 0, -1) if keys[i - 1] in self.checkpoints), 0)
        self._matched = {id(tokens): len(blocks)}  # the latest lookup only: open() follows it
        return blocks[:usable]

    def check_weights(self, rewalk: bool = False) -> None:
        """Look at the model's weights fingerprint (once per step, at its first lookup; ``rewalk=True``, each
        session's start, walks the modules again and reads every value) and at the pool's resets. Rows still running
        when the weights changed key no further block (their K/V mixes old and new weights)."""
        if not self.prefix_caching:
            return
        if self.model is not None and (rewalk or not self._weights_checked):
            root = self.pool.weights_root(self.model, rewalk)
            if root != self.weights_root:
                with self.pool.lock:
                    for row in self.rows.live:
                        for seq in row.seqs:
                            self.allocator.stop_keying(seq)
                self.weights_root = root
            self._weights_checked = True
        if self.pool.prefix_epoch != self._epoch:
            self._epoch = self.pool.prefix_epoch
            if self.checkpoints is not None:
                self.checkpoints.clear()
            self._targets.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix now (the pool's, and this engine's state checkpoints at the next lookup)."""
        self.pool.reset_prefix_cache()

    def note_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count an admission's prefix lookup in the pool's figures (``pool.memory_stats()``)."""
        if self.prefix_caching:
            self.allocator.note_prefix_lookup(query_tokens, hit_tokens)

    # ------------------------------------------------------------------- rows
    def open(self, prefix_blocks: list[int] = (), tokens: list[int] = (), root: bytes = _ROOT_KEY) -> Row | None:
        """A new row starting from ``prefix_blocks`` (from :meth:`match` under ``root``), which hold the first tokens
        of ``tokens``; None when a capped pool has no room for its state cell (hybrid models)."""
        root = self.key_root(root)
        while True:
            try:
                row = self.rows.new(list(prefix_blocks), list(tokens[: len(prefix_blocks) * self.block_size]),
                                    root=root)
                break
            except OutOfStateMemoryError:
                if not self.checkpoints:  # a request's state cell before a checkpoint's
                    return None
                try:
                    self.checkpoints.evict(keep=self._chain(tokens, len(prefix_blocks), root)[-1] if prefix_blocks
                                           else None)
                except OutOfStateMemoryError:
                    return None
        matched = self._matched.pop(id(tokens), 0)
        if self.checkpoints is not None and prefix_blocks:
            self.checkpoints.restore(self._chain(tokens, len(prefix_blocks), root)[-1], row.state)
        if self.checkpoints is not None and matched > len(prefix_blocks):
            # K/V cached further than any checkpoint: stop the prefill there once, so the next request with this
            # prefix finds its states
            self._targets[id(row)] = matched * self.block_size
        return row

    def chunk_tokens(self, row: Row, start: int, num_tokens: int) -> int:
        """Hybrid models' prefix caching: ``num_tokens`` from ``start``, cut at the block boundary where ``row``'s
        states are to be checkpointed (:meth:`open`)."""
        target = self._targets.get(id(row))
        if target is None:
            return num_tokens
        if start >= target:
            del self._targets[id(row)]
            return num_tokens
        return min(num_tokens, target - start)

    def fork(self, row: Row) -> Row:
        """A new row sharing every block of ``row`` (copy-on-write when either writes a shared last block)."""
        return self.rows.fork(row, join=True)  # the engine's rows are its running requests

    def free(self, row: Row) -> None:
        """All its blocks back (keyed full blocks stay cached for later prompts)."""
        self._targets.pop(id(row), None)
        self.rows.remove(row)

    def discard(self, row: Row, keep: int) -> None:
        """Free a row whose last forward failed: its blocks past ``keep`` tokens were never fully written, so they
        are cut off first and never offered to other prompts."""
        self.rows.truncate(row, keep)
        self.rows.remove(row)

    def publish(self, rows: list[Row]) -> None:
        """The forward that wrote these rows' blocks has run: make their keyed blocks findable now, so a request
        waiting for that prefix can be admitted at the next step (the allocator would otherwise publish them at the
        rows' next append)."""
        self._weights_checked = False  # a forward ran: the next lookup looks at the weights again
        if self.prefix_caching and rows:
            self.rows.publish(rows)
        if self.checkpoints is not None:  # rows whose states now end at a block boundary: checkpoint them
            for row in rows:
                length = self.length(row)
                if row.state is not None and row.tokens is not None and length and length % self.block_size == 0 \
                        and len(row.tokens) >= length:
                    self.checkpoints.save(self._chain(row.tokens, length // self.block_size, row.root)[-1],
                                          row.state)

    def length(self, row: Row) -> int:
        with self.pool.lock:
            return self.rows.length(row)
