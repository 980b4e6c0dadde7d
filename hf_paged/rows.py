"""The row model: who holds which KV.

A :class:`Row` is one batch row of a :class:`~hf_paged.PagedCache` or one request of the continuous-batching engine.
It owns one allocator sequence per layer group (its block table in that group), on models with state layers one
state cell of the pool's state store (``states.py``: its conv / recurrent states), the token ids whose K/V it holds,
and whether it was released (its blocks and state cell went back to the pool). :class:`Rows` holds the rows on one
pool, in batch order, and is the only code that changes them: create (optionally from cached prefix blocks), fork,
share, record a step's new tokens, reorder, select, crop, release, and export / import for ``save`` / ``load``. The
step planner (``step.py``) reads rows, appends to their sequences through the allocator and records their new tokens
through :meth:`Rows.add_tokens` / :meth:`Rows.share`; nothing else writes a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import NULL_BLOCK
from .groups import LayerGroups


@dataclass(eq=False)
class Row:
    """One sequence of tokens in the pool (per layer group, one allocator sequence)."""

    seqs: list[int]  # its allocator sequence in each layer group
    tokens: list[int] | None = field(default_factory=list)  # ids whose K/V it holds; None: fed embeddings
    released: bool = False  # its blocks went back to the pool: it holds no KV and cannot be continued
    state: int | None = None  # its state cell in the pool's state store (models with state layers; None once
    # released)
    root: bytes = b""  # its blocks' key-chain root (allocator.root_key): forks keep it


@dataclass
class RowExport:
    """A row as ``save`` writes it: its length, token ids (or None) and per group its block table."""

    length: int
    tokens: list[int] | None
    tables: list[list[int]]
    released: bool


class Rows:
    """The rows drawing from one :class:`~hf_paged.BlockPool` for one model's layer groups.

    ``rows`` is the batch in order (``PagedCache``) or the running requests (the engine). Every method takes the
    pool's lock around allocator calls.
    """

    def __init__(self, pool, groups: LayerGroups, stateful: bool = False):
        self.pool = pool
        self.groups = groups
        self.stateful = stateful  # the model has state layers: every live row holds a state cell
        self.rows: list[Row] = []
        self.root = b""  # the key-chain root of rows made without one (PagedCache: its weights fingerprint)

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]

    def __iter__(self):
        return iter(self.rows)

    @property
    def released(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row.released]

    @property
    def live(self) -> list[Row]:
        return [row for row in self.rows if not row.released]

    def length(self, row: Row) -> int:
        """Tokens ``row`` holds in the pool (0 once released)."""
        return 0 if row.released else self.pool.allocator.seq_len(row.seqs[0])

    def table(self, row: Row, group: int = 0) -> list[int]:
        return self.pool.allocator.block_table(row.seqs[group])

    def holds_whole_history(self, row: Row) -> bool:
        """False once blocks slid out of a window were given back."""
        return all(NULL_BLOCK not in self.table(row, g) for g in range(self.groups.num_groups))

    def tokens_known(self) -> bool:
        return all(row.tokens is not None for row in self.live)

    # -------------------------------------------------------------- creation
    def new(self, prefix_blocks: list[int] = (), prefix_tokens: list[int] = (), state: int | None = None,
            root: bytes | None = None) -> Row:
        """A new row (appended to ``rows``), starting from ``prefix_blocks`` — full cached blocks holding
        ``prefix_tokens`` (from :meth:`match_prefix`; single-group models only; on stateful models the caller restores
        the states at the prefix's end). ``state``: a state cell taken for it by the caller (:meth:`extend` takes a
        batch's cells at once), else one is taken here on stateful models. ``root``: its blocks' key-chain root (what
        made its K/V besides the tokens: an adapter, a weights fingerprint; see ``allocator.chain_root``; None:
        :attr:`root`)."""
        if root is None:
            root = self.root
        if prefix_blocks and self.groups.num_groups != 1:
            raise ValueError("a row can start from cached prefix blocks only on models with one layer group.")
        a = self.pool.allocator
        with self.pool.lock:
            if state is None and self.stateful:
                state = self._take_state_cells(1)[0]
            seqs = [a.new_sequence(list(prefix_blocks) if g == 0 else (), group=g, root=root)
                    for g in range(self.groups.num_groups)]
        row = Row(seqs, list(prefix_tokens), state=state, root=root)
        self.rows.append(row)
        return row

    def extend(self, count: int) -> None:
        """``count`` new empty rows (on stateful models with consecutive state cells where the store has them)."""
        with self.pool.lock:
            cells = self._take_state_cells(count) if self.stateful else [None] * count
        for cell in cells:
            self.new(state=cell)

    def _take_state_cells(self, count: int) -> list[int]:
        """State cells for ``count`` rows (call under the pool's lock)."""
        return self.pool.take_state_cells(count)

    def state_cells(self) -> list[int | None]:
        """Each row's state cell, in batch order (None: released)."""
        return [row.state for row in self.rows]

    def match_prefix(self, tokens: list[int], max_tokens: int | None = None, root: bytes | None = None) -> list[int]:
        """The cached (or live) full blocks that start ``tokens`` under ``root`` (None: :attr:`root`; prefix-caching
        pools with one layer group)."""
        if not self.prefix_caching:
            return []
        if root is None:
            root = self.root
        with self.pool.lock:
            return self.pool.allocator.match_prefix(tokens, max_tokens, root)

    @property
    def prefix_caching(self) -> bool:
        """Whether rows can start from cached prefix blocks here (mixed-window models cannot; on models with state
        layers only where the states at the prefix's end are kept: the engine's checkpoints)."""
        return self.pool.prefix_caching and self.groups.num_groups == 1 and not self.groups.limited(0)

    # ------------------------------------------------------------ operations
    def fork(self, row: Row, join: bool = False, state: int | None = None) -> Row:
        """A row sharing ``row``'s blocks copy-on-write and holding a copy of its states (in ``state``, a state cell
        the caller took, or a new one); a released row's copy is released too. ``join``: append it to ``rows`` (an
        engine's new request), else the caller places it (``select``)."""
        if row.released:
            if state is not None:
                self.pool.give_back_state_cells([state])
            child = Row(list(row.seqs), [], True)
        else:
            a = self.pool.allocator
            with self.pool.lock:
                if state is None and row.state is not None:
                    state = self._take_state_cells(1)[0]
                seqs = [a.fork(s) for s in row.seqs]
            if state is not None:
                self.pool.states.copy([state], [row.state])
            child = Row(seqs, None if row.tokens is None else list(row.tokens), state=state, root=row.root)
        if join:
            self.rows.append(child)
        return child

    def share(self, row: Row, source: Row) -> None:
        """``row`` (just created, holding at most shared prefix blocks) takes ``source``'s blocks instead."""
        a = self.pool.allocator
        with self.pool.lock:
            for g, seq in enumerate(row.seqs):
                a.free(seq)
                row.seqs[g] = a.fork(source.seqs[g])
        row.tokens = None if source.tokens is None else list(source.tokens)
        row.root = source.root
        if row.state is not None and source.state is not None:
            self.pool.states.copy([row.state], [source.state])

    def add_tokens(self, row: Row, tokens: list[int] | None) -> None:
        """The step planner gave ``row`` slots for its new ``tokens``: record their ids (None: the model got
        embeddings, so the row's ids are unknown from now on; a row whose ids are unknown stays so)."""
        if row.tokens is None:
            return
        if tokens is None:
            row.tokens = None
        else:
            row.tokens.extend(tokens)

    def _forks(self, indices: list[int]) -> list[Row]:
        """Copies of rows ``indices`` (consecutive state cells where the store has them)."""
        with self.pool.lock:
            cells = self._take_state_cells(len(indices)) if self.stateful else [None] * len(indices)
        return [self.fork(self.rows[i], state=cell) for i, cell in zip(indices, cells)]

    def select(self, indices: list[int]) -> "Rows":
        """New rows (same pool) that are copies of ``indices`` (rows may repeat), sharing blocks copy-on-write and
        each holding its own copy of the states."""
        out = Rows(self.pool, self.groups, self.stateful)
        out.root = self.root
        out.rows = self._forks(indices)
        return out

    def keep(self, indices: list[int]) -> None:
        """Keep only ``indices`` (in that order, repeats allowed); the others' blocks and state cells go back."""
        kept = self._forks(indices)
        self.clear()
        self.rows = kept

    def reorder(self, order: list[int]) -> None:
        """Beam search: row ``i`` becomes a copy of row ``order[i]`` (block tables re-pointed, no KV copied)."""
        a = self.pool.allocator
        with self.pool.lock:
            for g in range(self.groups.num_groups):
                a.reorder([row.seqs[g] for row in self.rows], order)
        tokens = [row.tokens for row in self.rows]
        for row, i in zip(self.rows, order):
            row.tokens = None if tokens[i] is None else list(tokens[i])
        if self.stateful:  # states are copied (each row keeps its own state cell), not shared
            pairs = [(row.state, self.rows[i].state) for row, i in zip(self.rows, order)]
            pairs = [(d, s) for d, s in pairs if d is not None and s is not None and d != s]
            self.pool.states.copy([d for d, _ in pairs], [s for _, s in pairs])

    def truncate(self, row: Row, length: int) -> None:
        """Keep ``row``'s first ``length`` tokens (a row whose last forward failed: what it did not finish writing
        is cut off before its blocks can be published)."""
        a = self.pool.allocator
        with self.pool.lock:
            for seq in row.seqs:
                if a.seq_len(seq) > length:
                    a.crop(seq, length)
        if row.tokens is not None:
            del row.tokens[length:]

    def publish(self, rows: list[Row]) -> None:
        """The forward that wrote these rows' blocks has run: make their keyed blocks findable by later prompts."""
        a = self.pool.allocator
        with self.pool.lock:
            for row in rows:
                if not row.released:
                    for seq in row.seqs:
                        a.publish(seq)

    def crop(self, drop: int) -> None:
        """Drop the last ``drop`` tokens of every live row's blocks (a model's state cells are the cache's to roll
        back: ``PagedCache.crop``)."""
        a = self.pool.allocator
        with self.pool.lock:
            for row in self.live:
                new_len = max(0, a.seq_len(row.seqs[0]) - drop)
                for seq in row.seqs:
                    a.crop(seq, new_len)
                if row.tokens is not None:
                    del row.tokens[new_len:]

    def release(self, row: Row) -> None:
        """Give back ``row``'s blocks; it stays in ``rows`` (a batch keeps its shape) but holds no KV."""
        if row.released:
            return
        a = self.pool.allocator
        with self.pool.lock:
            for seq in row.seqs:
                a.free(seq)
            if row.state is not None:
                self.pool.give_back_state_cells([row.state])
        row.released, row.state = True, None
        if row.tokens is not None:
            row.tokens = []

    def remove(self, row: Row) -> None:
        """Give back ``row``'s blocks and drop it from ``rows`` (a request that left the engine)."""
        self.release(row)
        self.rows = [r for r in self.rows if r is not row]

    def discard(self) -> None:
        """Like :meth:`clear`, but no block is published to the prefix cache (rows whose K/V were not all written)."""
        a = self.pool.allocator
        with self.pool.lock:
            for row in self.live:
                for seq in row.seqs:
                    a.crop(seq, 0)
        self.clear()

    def clear(self) -> None:
        """Give back every row's blocks; no rows remain."""
        for row in self.rows:
            self.release(row)
        self.rows = []

    # ----------------------------------------------------------- persistence
    def export(self) -> list[RowExport]:
        """Each row's length, tokens and block tables (``save`` reads the K/V at those blocks)."""
        with self.pool.lock:
            return [RowExport(self.length(row), None if row.tokens is None else list(row.tokens),
                              [] if row.released else [list(self.table(row, g)) for g in range(self.groups.num_groups)],
                              row.released)
                    for row in self.rows]

    def import_rows(self, lengths: list[int], tokens: list[list[int] | None], released: list[bool],
                    publish: bool) -> None:
        """Rows of the given lengths (the K/V are written by the caller at their slots). ``publish``: key their
        full blocks by ``tokens`` so later prompts can start from them (only for trusted content). All or nothing:
        on ``OutOfBlocksError`` no row is created."""
        if self.rows:
            raise ValueError("import_rows needs an empty Rows.")
        a = self.pool.allocator
        keyed = [self.pool.prefix_caching and publish and not self.groups.limited(g) for g in range(self.groups.num_groups)]
        with self.pool.lock:
            rows = [Row([a.new_sequence(group=g, root=self.root) for g in range(self.groups.num_groups)],
                        None if t is None else list(t), False, root=self.root) for t in tokens]
            live = [(row, n) for row, n, gone in zip(rows, lengths, released) if not gone]
            if self.stateful:  # the caller writes their states into these cells
                for (row, _), cell in zip(live, self._take_state_cells(len(live))):
                    row.state = cell
            requests = [(row.seqs[g], n) for row, n in live for g in range(self.groups.num_groups)]
            request_tokens = [row.tokens if keyed[g] else None for row, _ in live for g in range(self.groups.num_groups)]
            try:
                a.append(requests, request_tokens)
            except Exception:
                for row in rows:
                    for seq in row.seqs:
                        a.free(seq)
                self.pool.give_back_state_cells([row.state for row in rows if row.state is not None])
                raise
            for row, gone in zip(rows, released):
                if gone:
                    for seq in row.seqs:
                        a.free(seq)
                    row.released, row.tokens = True, []
        self.rows = rows
