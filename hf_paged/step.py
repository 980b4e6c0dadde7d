"""The step planner: everything host-side about one model forward, done once, before it runs.

Given the rows' new tokens it asks the allocator for slots (all rows and layer groups at once, all or nothing),
applies copy-on-write copies to the pool, gives back blocks that left a sliding window, and builds the small tensors
the forward reads: per layer group ``slot_mapping``, ``block_tables``, ``seq_lens``, ``query_start_loc`` (and the
torch backend's gather plan). Inside the forward nothing changes Python state: the cache's ``update`` writes K/V
with those tensors and the attention reads the pool through them, so the forward can be compiled and replayed as a
CUDA graph. Decode steps stage their tensors into buffers allocated once per shape (stable addresses).

Rows that finished and gave their blocks back still run (a batch keeps its shape): their token is written to the
pool's scratch block and its output is discarded by ``generate()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ops import plan_torch_attention


@dataclass
class GroupStep:
    """One layer group's view of a step on one device."""

    slot_mapping: torch.Tensor  # [num_writes] int64
    block_tables: torch.Tensor  # [B, W] int32, W bucketed to a power of two in decode steps
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    window: int | None
    plan: object | None = None  # TorchAttentionPlan (torch backend)
    gather_slots: torch.Tensor | None = None  # [B, L] int64, gathered mode only


@dataclass
class LayerStep:
    """What one layer's write and attention read: its pool tensors and its group's step tensors."""

    key_cache: torch.Tensor  # [num_blocks + 1, block_size, Hkv, D]
    value_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [Hkv] fp8 pools
    v_scale: torch.Tensor | None
    group: GroupStep
    token_index: torch.Tensor | None  # [num_tokens] real tokens among the B*S columns; None: all
    write_index: torch.Tensor | None  # [num_writes] written tokens among the real ones; None: all
    no_history: bool  # a first prefill: the model's own attention over the fresh K/V gives the same result
    max_query_len: int
    backend: str


@dataclass
class Step:
    """A planned forward, host side; :meth:`layer` gives each layer its device view."""

    batch_size: int
    query_len: int
    max_query_len: int
    no_history: bool
    token_index: torch.Tensor | None
    write_index: torch.Tensor | None
    groups: list[GroupStep]
    backend: str
    static: bool = False  # a compiled decode step: the same inputs every step, all staged in step buffers
    layers: list = field(default_factory=list)  # per layer: LayerStep once built
    _on_device: dict = field(default_factory=dict)

    def device_view(self, group: int, device: torch.device, buffers: "StepBuffers") -> tuple[GroupStep, tuple]:
        key = (group, device)
        view = self._on_device.get(key)
        if view is None:
            g = self.groups[group]
            if self.static:  # stable buffers, one per shape: a compiled graph reads the same addresses every step
                def put(name, t):
                    return None if t is None else buffers.stage((group, name), t, device)
            else:
                def put(name, t):
                    return None if t is None else t.to(device, non_blocking=True)
            moved = {n: put(n, getattr(g, n)) for n in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")}
            plan = None
            if g.plan is not None:
                plan = type(g.plan)(**{n: (put("plan." + n, v) if isinstance(v, torch.Tensor) or v is None else v)
                                       for n, v in vars(g.plan).items()})
            packing = tuple(put(n, t) for n, t in (("token_index", self.token_index),
                                                   ("write_index", self.write_index)))
            view = self._on_device[key] = (GroupStep(**moved, window=g.window, plan=plan,
                                                     gather_slots=put("gather_slots", g.gather_slots)), packing)
        return view


class StepBuffers:
    """Device tensors reused by every compiled decode step of one shape: written in place, never reallocated, so a
    compiled (CUDA-graph) forward reads them at the same address every step."""

    def __init__(self):
        self._buffers: dict = {}

    def stage(self, name, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (name, device, tuple(host.shape), host.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(host.shape, dtype=host.dtype, device=device)
            torch._dynamo.mark_static_address(buf)
        buf.copy_(host, non_blocking=True)
        return buf


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def real_columns(attention_mask: torch.Tensor | None, batch: int, query_len: int) -> torch.Tensor | None:
    """``[B, S]`` bool of the columns holding real tokens (None: all of them), from a 2D attention mask."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    real = attention_mask[:, -query_len:].to("cpu", torch.bool)
    if real.shape != (batch, query_len):
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not cover a batch of {batch} x "
                         f"{query_len} new tokens.")
    return None if bool(real.all()) else real


def duplicate_rows(input_ids: torch.Tensor | None, real: torch.Tensor | None) -> dict[int, int]:
    """Rows whose prompt equals an earlier row's (num_beams / num_return_sequences expansion): row -> source."""
    if input_ids is None or input_ids.shape[0] < 2:
        return {}
    ids = input_ids.to("cpu")
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


def row_tokens(input_ids: torch.Tensor | None, real: torch.Tensor | None) -> list[list[int]] | None:
    """Each row's real new token ids (host lists), or None when the forward got embeddings."""
    if input_ids is None or input_ids.dim() != 2:
        return None
    ids = input_ids.to("cpu").tolist()
    if real is None:
        return ids
    return [[t for t, keep in zip(row, mask) if keep] for row, mask in zip(ids, real.tolist())]


def group_tensors(tables, lens, counts, starts, written, scratch: int, block_size: int, bucket: bool):
    """The step tensors of one group (host).

    ``tables``/``lens``: per row (``None`` for a released row); ``counts``: per row, its real new tokens;
    ``starts``: per row, the position of its first new token; ``written``: per row, whether its tokens are written.
    """
    batch = len(counts)
    width = max(1, max((len(t) for t in tables if t is not None), default=1))
    if bucket:
        width = next_pow2(width)
    block_tables = torch.zeros((batch, width), dtype=torch.int32)
    for row, table in enumerate(tables):
        if table:
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    block_tables.clamp_(min=0)  # NULL_BLOCK entries (slid out of the window) are masked, never read
    seq_lens = torch.tensor([lens[r] if tables[r] is not None else counts[r] for r in range(batch)], dtype=torch.int32)
    query_start_loc = torch.zeros(batch + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, out=query_start_loc[1:])

    # Slots of the written tokens, vectorised: token t of row r sits at position starts[r] + t.
    n = torch.tensor([c if w else 0 for c, w in zip(counts, written)], dtype=torch.long)
    token_row = torch.repeat_interleave(torch.arange(batch), n)
    first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    pos = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long), n) + (torch.arange(token_row.shape[0]) - first)
    slot_mapping = block_tables[token_row, pos // block_size].long() * block_size + pos % block_size
    released = torch.tensor([t is None for t in tables])[token_row]
    slot_mapping[released] = scratch * block_size
    return block_tables, seq_lens, query_start_loc, slot_mapping


def plan_step(cache, input_ids, attention_mask, batch: int, query_len: int, gathered: bool) -> Step:
    """Plan one forward of ``cache``: allocate, copy-on-write, window release, and the step tensors.

    Raises :class:`~hf_paged.OutOfBlocksError` with the cache and pool unchanged when the blocks do not fit.
    """
    pool, groups = cache.pool, cache.groups
    a, bs = pool.allocator, pool.block_size
    real = real_columns(attention_mask, batch, query_len)
    counts = real.sum(1).tolist() if real is not None else [query_len] * batch
    fresh = not cache._rows
    alias = duplicate_rows(input_ids, real) if fresh and not gathered else {}
    tokens = row_tokens(input_ids, real)
    released = cache._released
    keyed = [pool.prefix_caching and window is None for window in groups.windows]

    with pool.lock:
        if fresh:
            cache._rows = [[a.new_sequence() for _ in groups.windows] for _ in range(batch)]
            cache._tokens = [[] for _ in range(batch)]
        rows = cache._rows
        live = [r for r in range(batch) if r not in released]
        requests, request_tokens = [], []
        for r in live:
            n = 0 if r in alias else counts[r]
            for g, seq in enumerate(rows[r]):
                requests.append((seq, n))
                request_tokens.append(tokens[r] if tokens is not None and keyed[g] else None)
        starts = {r: a.seq_len(rows[r][0]) for r in live}
        try:
            plan = a.append(requests, request_tokens)
        except Exception:
            if fresh:
                cache._drop_rows()
            raise
        for r, src in alias.items():
            for g in range(groups.num_groups):
                a.free(rows[r][g])
                rows[r][g] = a.fork(rows[src][g])
        if not gathered and not cache._recording:
            for r in live:  # keep what this step's first query still sees
                first_query = a.seq_len(rows[r][0]) - counts[r]
                for g, window in enumerate(groups.windows):
                    if window is not None:
                        a.release_outside_window(rows[r][g], first_query - window + 1)
        pool.ensure_capacity()
        _copy_on_write(pool, plan.copies)
        if tokens is not None and cache._tokens is not None:
            for r in live:
                cache._tokens[r].extend(tokens[r])
        elif cache._tokens is not None and live:
            cache._tokens = None
        group_steps = []
        decode = query_len == 1
        written = [r not in alias for r in range(batch)]
        start_list = [starts.get(r, 0) for r in range(batch)]
        for g, window in enumerate(groups.windows):
            tables = [None if r in released else a.block_table(rows[r][g]) for r in range(batch)]
            lens = [0 if r in released else a.seq_len(rows[r][g]) for r in range(batch)]
            block_tables, seq_lens, qsl, slots = group_tensors(
                tables, lens, counts, start_list, written, pool.scratch_block, bs, bucket=decode)
            group_steps.append(GroupStep(slots, block_tables, seq_lens, qsl, window))

    token_index = None if real is None else real.flatten().nonzero().flatten()
    write_index = None
    if alias:
        q_lens = torch.tensor(counts)
        writes = torch.repeat_interleave(torch.tensor(written), q_lens)
        write_index = writes.nonzero().flatten()
    backend = cache._resolved_backend(input_ids)
    static = decode and cache.is_compileable
    max_query_len = max(counts) if counts else 0
    num_tokens = sum(counts)
    for g in group_steps:
        if gathered:
            length = max(1, int(g.seq_lens.max()))
            pos = torch.arange(length)
            g.gather_slots = g.block_tables.long()[:, pos // bs] * bs + pos % bs  # [B, L]
        elif backend == "torch":
            # Whole blocks: the plan's width tells its length. A compiled step always carries the mask; its width
            # changes block by block (dynamo compiles that dimension as dynamic after the first change).
            context = -(-int(g.seq_lens.max()) // bs) * bs
            g.plan = plan_torch_attention(g.block_tables, g.seq_lens, g.query_start_loc, bs, num_tokens, g.window,
                                          max_query_len, context, always_mask=static)
    return Step(batch, query_len, max_query_len, fresh and not gathered, token_index, write_index, group_steps,
                backend, static, layers=[None] * max(cache.num_layers or 0, 1))


def _copy_on_write(pool, copies) -> None:
    """Copy shared blocks before they are written, in every K/V tensor (host side, before the forward)."""
    if not copies:
        return
    from .ops import copy_blocks

    src = torch.tensor([c[0] for c in copies], dtype=torch.long)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long)
    for slot, k in pool.key_caches.items():
        copy_blocks(k, pool.value_caches[slot], src.to(k.device), dst.to(k.device))
