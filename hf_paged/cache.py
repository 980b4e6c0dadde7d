"""``PagedCache``: a transformers ``Cache`` whose KV lives in blocks of a shared pool."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from . import compat, ops
from .errors import OutOfBlocksError
from .pool import BlockPool
from .stats import MemoryStats


@dataclass
class StepMetadata:
    """Everything one model forward needs to read and write the pool; built once, shared by every layer."""

    batch_size: int
    query_len: int  # padded columns in this forward
    token_index: torch.Tensor | None  # [num_tokens] flat index into B*S of the real tokens; None when all are real
    write_index: torch.Tensor | None  # [num_writes] index into the real tokens that get written; None: all of them
    slot_mapping: torch.Tensor  # [num_writes] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    copy_src: torch.Tensor | None = None  # [num_copies] int64, copy-on-write
    copy_dst: torch.Tensor | None = None
    gather_slots: torch.Tensor | None = None  # [B, L] int64, gathered mode only
    no_history: bool = False  # a first prefill: the model's own attention on the fresh K/V gives the same result
    _on_device: dict = field(default_factory=dict)
    _plans: dict = field(default_factory=dict)

    _TENSORS = ("token_index", "write_index", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                "copy_src", "copy_dst", "gather_slots")

    def torch_plan(self, block_size: int, num_tokens: int, sliding_window: int | None):
        """The torch backend's gather indices and mask for this step, built by the first layer that asks."""
        key = (block_size, sliding_window)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = ops.plan_torch_attention(
                self.block_tables, self.seq_lens, self.query_start_loc, block_size, num_tokens, sliding_window,
                self.max_query_len, self.max_seq_len)
        return plan

    def to(self, device: torch.device) -> "StepMetadata":
        """A view of this metadata on ``device``, copied there once per step however many layers live there."""
        if self.slot_mapping.device == device:
            return self
        cached = self._on_device.get(device)
        if cached is None:
            moved = {n: (getattr(self, n).to(device, non_blocking=True) if getattr(self, n) is not None else None)
                     for n in self._TENSORS}
            cached = StepMetadata(self.batch_size, self.query_len, max_query_len=self.max_query_len,
                                  max_seq_len=self.max_seq_len, no_history=self.no_history, **moved)
            self._on_device[device] = cached
        return cached


class PagedCache(Cache):
    """A paged KV cache for ``model.generate()``.

    Keys and values live in fixed-size blocks (``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer); each
    row of the batch owns a block table mapping its logical blocks to physical ones anywhere in the pool. Blocks are
    taken as rows grow, shared between rows with the same prompt (beams, ``num_return_sequences``) and given back
    when rows finish.

    Args:
        config: the model's config (``model.config``); gives the layer count and sliding window.
        block_size: tokens per block (default 16).
        num_blocks: cap on blocks in the pool (allocated on first use). Default: grow as needed.
        max_memory: cap in bytes, or a string like ``"2GiB"``; converted to blocks from the model's shape.
        pool: a :class:`BlockPool` to share with other caches (then block_size/num_blocks/max_memory come from it).
        release_finished: give back a row's blocks as soon as it finishes while other rows continue (default).

    Example::

        from hf_paged import PagedCache, enable_paged_attention
        enable_paged_attention(model)
        cache = PagedCache(model.config)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
        print(cache.memory_stats())
    """

    is_compileable = False

    def __init__(
        self,
        config=None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        pool: BlockPool | None = None,
        release_finished: bool = True,
    ):
        compat.init_cache_base(self)
        if pool is not None and (num_blocks is not None or max_memory is not None or block_size != 16):
            raise ValueError("pass sizing (block_size, num_blocks, max_memory) to the shared BlockPool, not to "
                             "PagedCache when pool= is given.")
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = text_config
        self.num_layers = getattr(text_config, "num_hidden_layers", None)
        self.sliding_window = getattr(text_config, "sliding_window", None)
        self.pool = pool if pool is not None else BlockPool(block_size, num_blocks, max_memory)
        self.release_finished = release_finished
        self._rows: list[int] = []
        self._released: set[int] = set()
        self._columns = 0
        self._mode: str | None = None  # "paged" (attention reads the pool) or "gathered"
        self._step: StepMetadata | None = None
        self._pending: dict | None = None  # set by the model hook before a forward
        self._beam_reordered = False
        self._recording = False
        self._warned = False
        self._backend_name = "auto"
        self._new_call = False

    # ---------------------------------------------------------- Cache contract
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self._columns + compat.query_length(query_length), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._columns

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return bool(self._rows)

    @property
    def is_sliding(self) -> list[bool]:
        return [self.sliding_window is not None] * (self.num_layers or 1)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * (self.num_layers or 1)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * (self.num_layers or 1)

    def __len__(self) -> int:
        return self.num_layers or 0

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self._rows)}, columns={self._columns}, block_size={self.pool.block_size})"

    def activate_past_recording(self):
        self._recording = True

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self._recording

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new K/V ``[B, num_kv_heads, S, head_dim]`` of layer ``layer_idx``.

        On the paged attention path the attention reads the pool directly and the fresh K/V are returned as they
        came. Otherwise the row's whole history is gathered to ``[B, num_kv_heads, kv_len, head_dim]``.
        """
        if self.num_layers is not None and layer_idx >= self.num_layers:
            raise ValueError(
                f"this PagedCache was built for a model with {self.num_layers} layers but layer {layer_idx} wrote to "
                "it. Build the cache from this model's config: PagedCache(model.config)."
            )
        self.pool.bind_layer(layer_idx, self.num_layers or layer_idx + 1, key_states)
        if layer_idx == 0 or self._step is None:
            self._begin_step(key_states)
        step = self._step.to(key_states.device)
        with self.pool.lock:
            key_cache, value_cache = self.pool.layer_kv(layer_idx)
            if step.copy_src is not None:
                ops.copy_blocks(key_cache, value_cache, step.copy_src, step.copy_dst)
            if step.slot_mapping.numel():
                backend = ops.resolve_backend(self._backend, key_cache.device)
                ops.write_kv_unchecked(_pack(key_states, step), _pack(value_states, step), key_cache, value_cache,
                                       step.slot_mapping, backend)
        if self._mode == "paged":
            return key_states, value_states
        return _gather(key_cache, step.gather_slots), _gather(value_cache, step.gather_slots)

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end: ``crop(-n)`` removes ``n`` (transformers' call); ``crop(n)`` with ``n > 0``
        keeps the first ``n`` (the older, absolute form)."""
        new_columns = self._columns + max_length if max_length <= 0 else min(max_length, self._columns)
        if new_columns < 0:
            raise ValueError(f"cannot crop {-max_length} tokens from a cache of {self._columns}.")
        drop = self._columns - new_columns
        if drop == 0:
            return
        a = self.pool.allocator
        with self.pool.lock:
            for row, seq in enumerate(self._rows):
                if row not in self._released:
                    a.crop(seq, max(0, a.seq_len(seq) - drop))
        self._columns = new_columns
        self._step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: re-point block tables; no KV is copied."""
        order = beam_idx.tolist()
        self.pool.allocator.reorder(self._rows, order)
        self._beam_reordered = True
        self._step = None

    def reset(self) -> None:
        """Give every block back to the pool; the cache can then start a new generation."""
        with self.pool.lock:
            for row, seq in enumerate(self._rows):
                if row not in self._released:
                    self.pool.allocator.free(seq)
        self._rows, self._released, self._columns = [], set(), 0
        self._mode, self._step, self._pending = None, None, None
        self._beam_reordered = self._recording = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        a = self.pool.allocator
        with self.pool.lock:
            self._rows = [seq if r == 0 else a.fork(seq) for seq in self._rows for r in range(repeats)]
        self._step = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        keep = indices.tolist()
        if self._released:
            raise RuntimeError("batch_select_indices on a cache with released rows; use release_finished=False.")
        with self.pool.lock:
            kept = [self.pool.allocator.fork(self._rows[i]) for i in keep]
            for seq in self._rows:
                self.pool.allocator.free(seq)
        self._rows = kept
        self._step = None

    def __del__(self):
        try:
            self.reset()
        except Exception:
            pass

    # --------------------------------------------------------------- features
    def fork(self, batch_size: int = 1) -> "PagedCache":
        """A new cache on the same pool whose rows share this cache's blocks (no copy).

        ``batch_size`` copies of a single-row cache are made, e.g. one per prompt of a batch that all continue the
        same prefix. Writes into shared blocks copy them first, so neither cache sees the other's tokens.
        """
        if not self._rows:
            raise ValueError("fork() needs a cache that already holds tokens: run the prefix through the model first.")
        if self._released:
            raise ValueError("fork() of a cache with released rows: those rows hold no KV anymore.")
        if len(self._rows) != 1 and batch_size != len(self._rows) and batch_size != 1:
            raise ValueError(f"fork(batch_size={batch_size}) of a {len(self._rows)}-row cache: fork a 1-row cache, "
                             "or keep batch_size equal to the rows.")
        child = PagedCache(self.config, pool=self.pool, release_finished=self.release_finished)
        src = self._rows * batch_size if len(self._rows) == 1 else self._rows
        with self.pool.lock:
            child._rows = [self.pool.allocator.fork(seq) for seq in src]
        child._columns = self._columns
        child._mode = self._mode
        return child

    def _start_generate(self) -> None:
        """A new generate() call begins: rows released in an earlier call cannot take part."""
        self._new_call = True

    def release_rows(self, rows) -> None:
        """Give back the blocks of finished ``rows``; they will take no KV and may not be continued."""
        with self.pool.lock:
            for row in rows:
                if row not in self._released:
                    self.pool.allocator.free(self._rows[row])
                    self._released.add(row)
        self._step = None

    def mark_finished(self, done: torch.Tensor) -> None:
        """Called after each decoding step with the rows whose generation ended (``[B]`` bool)."""
        if not self.release_finished or self._beam_reordered or len(self._rows) < 2 or done.shape[0] != len(self._rows):
            return
        done_rows = [r for r in done.nonzero().flatten().tolist() if r not in self._released]
        if done_rows and len(done_rows) + len(self._released) < len(self._rows):
            self.release_rows(done_rows)

    def block_tables(self) -> list[list[int] | None]:
        """Each batch row's block table (physical block per logical block; -1: slid out of the window), or
        ``None`` for a row that finished and was released."""
        a = self.pool.allocator
        with self.pool.lock:
            return [None if row in self._released else list(a.block_table(seq)) for row, seq in enumerate(self._rows)]

    def seq_lens(self) -> list[int | None]:
        """Tokens each batch row holds in the pool (its real tokens, padding excluded); ``None`` if released."""
        a = self.pool.allocator
        with self.pool.lock:
            return [None if row in self._released else a.seq_len(seq) for row, seq in enumerate(self._rows)]

    def memory_stats(self, all_ranks: bool = False) -> MemoryStats:
        """Figures for this cache's rows, with the pool's size and peak (see :class:`MemoryStats`).

        Under tensor parallelism each rank holds only its KV heads; ``all_ranks=True`` sums the byte figures over
        the ranks of the default process group (a collective: call it on every rank).
        """
        if all_ranks:
            from .distributed import sum_over_ranks

            return sum_over_ranks(self.memory_stats())
        pool = self.pool
        with pool.lock:
            a = pool.allocator
            live = [s for i, s in enumerate(self._rows) if i not in self._released]
            return MemoryStats.from_tables(
                block_size=a.block_size,
                num_blocks=max(a.capacity, max((k.shape[0] for k in pool.key_caches.values()), default=0)),
                max_blocks=a.max_blocks,
                tables=[a.block_table(s) for s in live],
                lens=[a.seq_len(s) for s in live],
                peak_blocks_in_use=a.peak_blocks_in_use,
                bytes_per_block=pool.bytes_per_block(),
                bytes_reserved=pool.bytes_reserved(),
            )

    # ------------------------------------------------------------- internals
    @property
    def _backend(self) -> str:
        return self._backend_name if self._mode == "paged" else "torch"

    def _begin_step(self, key: torch.Tensor) -> None:
        """Plan the whole forward: allocate slots for every row's new tokens, once, before layer 0 writes."""
        pending, self._pending = self._pending, None
        mode = "paged" if pending is not None else "gathered"
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise RuntimeError(
                "this PagedCache was filled with paged attention "
                f"{'on' if self._mode == 'paged' else 'off'} and is now used with it "
                f"{'on' if mode == 'paged' else 'off'}. Call enable_paged_attention(model) before the first "
                "generate(), or reset() the cache."
            )
        if mode == "gathered" and not self._warned:
            self._warned = True
            warnings.warn(
                "PagedCache is used without enable_paged_attention(model): results are correct but the whole KV "
                "history is gathered for every layer and padding is stored. Call hf_paged.enable_paged_attention(model) "
                "for the paged fast path.",
                stacklevel=4,
            )
        if pending is not None:
            self._backend_name = pending.get("backend", "auto")
        batch, query_len = key.shape[0], key.shape[2]
        a = self.pool.allocator
        fresh = not self._rows
        if not fresh and batch != len(self._rows):
            raise ValueError(
                f"this PagedCache holds {len(self._rows)} rows but the model got a batch of {batch}. Use a new "
                "PagedCache (or cache.reset()) for a new batch."
            )

        new_call, self._new_call = self._new_call, False
        if new_call and self._released:
            raise RuntimeError(
                f"rows {sorted(self._released)} of this PagedCache finished in an earlier generate() call and were "
                "released (their blocks went back to the pool), so they cannot be continued. Use "
                "PagedCache(config, release_finished=False) to continue finished rows later, or start a new cache."
            )
        real = _real_columns(pending, batch, query_len)  # [B, S] bool
        counts = real.sum(1).tolist() if real is not None else [query_len] * batch
        alias = _duplicate_rows(pending, real) if fresh and mode == "paged" else {}
        for row in self._released:
            if counts[row]:
                counts[row] = 0
                if real is not None:
                    real[row] = False
                else:
                    real = torch.ones(batch, query_len, dtype=torch.bool)
                    real[row] = False

        with self.pool.lock:
            if fresh:
                self._rows = [a.new_sequence() for _ in range(batch)]
            requests = [(seq, 0 if row in alias else counts[row])
                        for row, seq in enumerate(self._rows) if row not in self._released]
            try:
                plan = a.append(requests)
            except OutOfBlocksError:
                if fresh:
                    for seq in self._rows:
                        a.free(seq)
                    self._rows = []
                    self._mode = None
                raise
            for row, src in alias.items():
                a.free(self._rows[row])
                self._rows[row] = a.fork(self._rows[src])
            tables = [a.block_table(s) if i not in self._released else [] for i, s in enumerate(self._rows)]
            lens = [a.seq_len(s) if i not in self._released else 0 for i, s in enumerate(self._rows)]
            if self.sliding_window is not None and mode == "paged" and not self._recording:
                for row, seq in enumerate(self._rows):
                    if row not in self._released:  # keep what this step's first query still sees
                        a.release_outside_window(seq, lens[row] - counts[row] - self.sliding_window + 1)
        self._columns += query_len
        plan_rows = [row for row in range(batch) if row not in self._released]
        self._step = _build_metadata(plan, plan_rows, tables, lens, counts, real, alias, batch, query_len,
                                     a.block_size, gathered=mode == "gathered")
        self._step.no_history = fresh


def _real_columns(pending: dict | None, batch: int, query_len: int) -> torch.Tensor | None:
    """``[B, S]`` bool of the columns holding real tokens (None: all of them), from the 2D attention mask."""
    mask = (pending or {}).get("attention_mask")
    if mask is None or mask.dim() != 2:
        return None
    real = mask[:, -query_len:].to("cpu", torch.bool)
    if real.shape != (batch, query_len):
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not cover a batch of {batch} x "
                         f"{query_len} new tokens.")
    return None if bool(real.all()) else real


def _duplicate_rows(pending: dict | None, real: torch.Tensor | None) -> dict[int, int]:
    """Rows whose prompt equals an earlier row's (num_beams / num_return_sequences expansion): row -> source."""
    ids = (pending or {}).get("input_ids")
    if ids is None or ids.shape[0] < 2:
        return {}
    ids = ids.to("cpu")
    if real is not None:
        ids = ids.masked_fill(~real, -1)
    first: dict[bytes, int] = {}
    alias = {}
    for row in range(ids.shape[0]):
        key = ids[row].numpy().tobytes()
        if key in first:
            alias[row] = first[key]
        else:
            first[key] = row
    return alias


def _build_metadata(plan, plan_rows, tables, lens, counts, real, alias, batch, query_len, block_size,
                    gathered) -> StepMetadata:
    max_blocks = max(1, max((len(t) for t in tables), default=1))
    block_tables = torch.full((batch, max_blocks), 0, dtype=torch.int32)
    for row, table in enumerate(tables):
        if table:
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    block_tables.clamp_(min=0)  # NULL_BLOCK entries (slid out of the window) are masked, never read
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_lens = torch.tensor(counts, dtype=torch.int32)
    query_start_loc = torch.zeros(batch + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    # Slots of the written tokens, vectorised: token t of request r sits at position starts[r] + t.
    written = torch.tensor(plan.counts, dtype=torch.long)
    token_row = torch.repeat_interleave(torch.tensor(plan_rows, dtype=torch.long), written)
    first = torch.repeat_interleave(torch.cumsum(written, 0) - written, written)
    pos = torch.repeat_interleave(torch.tensor(plan.starts, dtype=torch.long), written) + (
        torch.arange(token_row.shape[0]) - first)
    slot_mapping = block_tables[token_row, pos // block_size].long() * block_size + pos % block_size

    token_index = None if real is None else real.flatten().nonzero().flatten()
    write_index = None
    if alias:
        writes = torch.ones(int(q_lens.sum()), dtype=torch.bool)
        for row in alias:
            writes[int(query_start_loc[row]): int(query_start_loc[row + 1])] = False
        write_index = writes.nonzero().flatten()

    copy_src = copy_dst = None
    if plan.copies:
        copy_src = torch.tensor([c[0] for c in plan.copies], dtype=torch.long)
        copy_dst = torch.tensor([c[1] for c in plan.copies], dtype=torch.long)

    gather_slots = None
    if gathered:
        length = max(lens)
        pos = torch.arange(length)
        gather_slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]

    return StepMetadata(
        batch_size=batch,
        query_len=query_len,
        token_index=token_index,
        write_index=write_index,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=max(counts) if counts else 0,
        max_seq_len=max(lens) if lens else 0,
        copy_src=copy_src,
        copy_dst=copy_dst,
        gather_slots=gather_slots,
    )


def _pack(states: torch.Tensor, step: StepMetadata) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[num_writes, H, D]``: the real, written tokens back to back."""
    batch, heads, seq, dim = states.shape
    flat = states.transpose(1, 2).reshape(batch * seq, heads, dim)
    if step.token_index is not None:
        flat = flat.index_select(0, step.token_index)
    if step.write_index is not None:
        flat = flat.index_select(0, step.write_index)
    return flat


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` slots -> ``[B, H, L, D]`` contiguous history."""
    num_blocks, block_size, heads, dim = cache.shape
    flat = cache.view(num_blocks * block_size, heads, dim)
    return flat.index_select(0, slots.flatten()).view(*slots.shape, heads, dim).transpose(1, 2)
