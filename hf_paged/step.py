"""The step planner: everything host-side about one model forward, done once, before it runs.

Two entry points over one :class:`StepOptions`: :func:`plan_generate_step` plans a padded ``generate()`` forward
(``[batch, query_len]`` columns, batch row ``r`` being row ``r``), :func:`plan_engine_step` a packed engine forward
(each row's new tokens back to back). Given the rows' new tokens the planner asks the allocator for slots (all rows
and layer groups at once, all or nothing), applies copy-on-write copies to the pool, gives back blocks that left a
sliding window, and builds the small tensors the forward reads: per layer group ``slot_mapping``,
``block_tables``, ``seq_lens``, ``query_start_loc`` (and the torch backend's read layout). Inside the forward nothing
changes Python state: the cache's ``update`` writes K/V with those tensors and the attention reads the pool through
them, so the forward can be compiled and replayed as a CUDA graph. Decode steps stage their tensors into buffers
allocated once per shape (stable addresses).

A KV-shared (``reuse``) layer writes nothing: its attention reads its source layer's step (``reading_step``), cut
to the last columns of each row when the model sliced its queries (Gemma 4's ``logits_to_keep``).

Rows that finished and gave their blocks back still run (a batch keeps its shape): their token is written to the
pool's scratch block and its output is discarded by ``generate()``.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from .allocator import cdiv, slot_of
from .ops import AttentionMetadata, copy_blocks, custom_ops, plan_torch_attention
from .rows import Row, Rows


@dataclass
class GroupStep:
    """One layer group's view of a step on one device: where its tokens are written and what its attention reads."""

    slot_mapping: torch.Tensor  # [num_writes] int64
    attention: AttentionMetadata  # block tables (width bucketed to a power of two in decode steps), lengths, window
    gather_slots: torch.Tensor | None = None  # [B, L] int64, gathered mode only


@dataclass
class LayerStep:
    """What one layer's write and attention read: its pool tensors and its group's step tensors."""

    key_cache: torch.Tensor  # [num_blocks + 1, block_size, Hkv, D]
    value_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks + 1, block_size, Hkv] bf16 scale caches, fp8 pools
    v_scale: torch.Tensor | None
    group: GroupStep
    token_index: torch.Tensor | None  # [num_tokens] real tokens among the B*S columns; None: all
    write_index: torch.Tensor | None  # [num_writes] written tokens among the real ones; None: all
    no_history: bool  # a first prefill: the model's own attention over the fresh K/V gives the same result
    backend: str


@dataclass
class Step:
    """A planned forward, host side; :meth:`device_view` gives each layer group its tensors on a device."""

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
    _tails: dict = field(default_factory=dict)  # (group, query count, device) -> (GroupStep, token_index)

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
            packing = tuple(put(n, t) for n, t in (("token_index", self.token_index),
                                                   ("write_index", self.write_index)))
            view = self._on_device[key] = (GroupStep(put("slot_mapping", g.slot_mapping),
                                                     g.attention.moved(put), put("gather_slots", g.gather_slots)),
                                           packing)
        return view

    def last_queries(self, layer: LayerStep, group: int, count: int, block_size: int) -> LayerStep:
        """``layer`` (of group ``group``) for queries cut to the last ``count`` of the step's ``query_len`` columns
        of each row: Gemma 4 slices its hidden states to ``logits_to_keep`` before the KV-shared layers, which read
        the history the step wrote. Each row keeps its real tokens among those columns (left padding: its last
        ones), so only the query offsets, the token index and the torch read layout change; tables and lengths
        stay. Such a step always reads the pool (also in a first prefill). Planned once per group, count and device,
        on the host inside the forward (a prefill: never compiled)."""
        device = layer.key_cache.device
        key = (group, count, device)
        tail = self._tails.get(key)
        if tail is None:
            real = torch.ones(self.batch_size * self.query_len, dtype=torch.bool)
            if self.token_index is not None:
                real = torch.zeros_like(real).index_fill_(0, self.token_index.cpu(), True)
            real = real.view(self.batch_size, self.query_len)[:, self.query_len - count:]  # [B, count]
            counts = real.sum(1).tolist()
            qsl = torch.tensor(list(itertools.accumulate(counts, initial=0)), dtype=torch.int32)
            meta = self.groups[group].attention
            if meta.query_limits is not None:
                raise ValueError("a model that slices its queries before KV-shared layers (Gemma 4's logits_to_keep) "
                                 "cannot take bidirectional spans on the paged path. Fix: use DynamicCache for it.")
            layout = None
            if meta.plan is not None:  # the torch backend's read layout
                context = cdiv(int(meta.seq_lens.max()), block_size) * block_size
                layout = plan_torch_attention(meta.block_tables, meta.seq_lens, qsl, block_size,
                                            sliding_window=meta.sliding_window, chunk=meta.chunk, max_seq_len=context)
            meta = dataclasses.replace(meta, query_start_loc=qsl, max_query_len=max(counts, default=0), plan=layout)

            def put(name, t):
                return t.to(device, non_blocking=True)

            token_index = None if bool(real.all()) else real.flatten().nonzero().flatten().to(device)
            tail = self._tails[key] = (GroupStep(torch.empty(0, dtype=torch.long, device=device), meta.moved(put)),
                                       token_index)
        view, token_index = tail
        # the layer's own pool tensors (layers of one group may sit in different K/V tensors)
        return dataclasses.replace(layer, group=view, token_index=token_index, write_index=None, no_history=False)


def reading_step(step: Step, groups, layer_idx: int, query_len: int, block_size: int) -> LayerStep | None:
    """The :class:`LayerStep` layer ``layer_idx``'s attention reads with ``query_len`` query columns: its own, or
    for a ``reuse`` layer (which writes nothing) its source layer's; cut to the last ``query_len`` columns of each
    row when the model sliced its queries (:meth:`Step.last_queries`). None before the layer (or source) ran."""
    source = groups.source_of(layer_idx)
    layer = step.layers[source] if source < len(step.layers) else None
    if layer is None or query_len >= step.query_len:
        return layer
    return step.last_queries(layer, groups.layer_group[source], query_len, block_size)


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

    def staged(self) -> dict:
        """Every buffer staged so far, by ``(name, device, shape, dtype)`` (for inspection: a compiled step's inputs
        are among them)."""
        return dict(self._buffers)


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


def duplicate_rows(rows: Rows, input_ids: torch.Tensor | None, real: torch.Tensor | None) -> dict[int, int]:
    """Rows whose tokens (held and new) equal an earlier row's (num_beams / num_return_sequences expansion): row ->
    source."""
    if input_ids is None or input_ids.shape[0] < 2:
        return {}
    ids = input_ids.to("cpu")
    if real is not None:
        ids = ids.masked_fill(~real, -1)
    first: dict[tuple, int] = {}
    alias = {}
    for r, row in enumerate(rows):
        if row.tokens is None:
            continue
        key = (tuple(row.tokens), ids[r].numpy().tobytes())
        if key in first:
            alias[r] = first[key]
        else:
            first[key] = r
    return alias


def row_tokens(input_ids: torch.Tensor | None, real: torch.Tensor | None) -> list[list[int]] | None:
    """Each row's real new token ids (host lists), or None when the forward got embeddings."""
    if input_ids is None or input_ids.dim() != 2:
        return None
    ids = input_ids.to("cpu").tolist()
    if real is None:
        return ids
    return [[t for t, keep in zip(row, mask) if keep] for row, mask in zip(ids, real.tolist())]


def group_tensors(tables, lens, counts, starts, written, scratch: int, block_size: int, bucket: bool,
                  min_width: int = 1):
    """The step tensors of one group, built as host arrays (one tensor each at the end: a decode step's handful of
    values costs less in Python than in small tensor ops, and an array's buffer becomes a tensor without a copy).

    ``tables``/``lens``: per row (``None`` for a released row); ``counts``: per row, its real new tokens;
    ``starts``: per row, the position of its first new token; ``written``: per row, whether its tokens are written;
    ``min_width``: the tables' fewest columns.
    """
    batch = len(counts)
    width = max(1, max((len(t) for t in tables if t is not None), default=1),
                max((cdiv(c, block_size) for t, c in zip(tables, counts) if t is None), default=1))  # released rows
    width = max(width, min_width)
    if bucket:
        width = next_pow2(width)
    entries, seq_lens, slots = array.array("i"), array.array("i"), array.array("q")
    for table, length, count, start, write in zip(tables, lens, counts, starts, written):
        if table is None:  # a released row: its tokens all go to the scratch slot
            entries.frombytes(bytes(4 * width))
            seq_lens.append(count)
            if write:
                slots.extend([scratch * block_size] * count)
            continue
        # NULL_BLOCK entries (slid out of the window) become 0: masked, never read
        if table and min(table) < 0:
            table = [max(b, 0) for b in table]
        entries.extend(table)
        entries.frombytes(bytes(4 * (width - len(table))))
        seq_lens.append(length)
        pos, end = start, start + count
        while write and pos < end:  # token t of the row sits at position start + t: one range per block touched
            block, offset = divmod(pos, block_size)
            n = min(block_size - offset, end - pos)
            first = slot_of(table[block], pos, block_size)
            slots.extend(range(first, first + n))
            pos += n
    query_start_loc = array.array("i", itertools.accumulate(counts, initial=0))
    return (_host(entries, torch.int32).view(batch, width), _host(seq_lens, torch.int32),
            _host(query_start_loc, torch.int32), _host(slots, torch.long))


def _host(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor over ``values``' buffer (kept alive by the tensor; never resized)."""
    return torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)


@dataclass
class RowInput:
    """What one row gets in one step."""

    row: Row
    num_tokens: int  # its new tokens (query length) in this step
    tokens: list[int] | None  # their ids (prefix keys and the row's record), None if unknown (embeddings)
    share_from: Row | None = None  # a new row with the same prompt as this one: takes its blocks, writes nothing
    spans: list[tuple[int, int]] = ()  # bidirectional spans [start, end) of the row's positions (Gemma 3's image
    # tokens: each sees its whole span); those holding this step's tokens must end within them


@dataclass(frozen=True)
class StepOptions:
    """How its caller wants a step planned: the same fields for :func:`plan_generate_step` (a padded
    ``generate()`` forward) and :func:`plan_engine_step` (a packed engine forward).

    Example::

        options = StepOptions(backend="torch", num_layers=model.config.num_hidden_layers)
        step = plan_engine_step(rows, [RowInput(row, len(ids), ids)], options)
    """

    backend: str  # "torch" or "triton", resolved (hf_paged.ops.resolve_backend): never "auto"
    num_layers: int  # the model's layers: the step keeps one LayerStep per layer
    static: bool = False  # a compiled (CUDA-graph) step: its tensors are staged in step buffers (the same
    # addresses every step) and the torch read layout always carries its mask
    decode_bucket: bool = False  # round the block tables' width up to a power of two (decode steps: fewer shapes)
    full_width: bool = False  # the torch read layout spans the tables' whole width, masked (a CUDA graph's shapes
    # then depend only on the rows and the width)
    min_width: int = 1  # the block tables' fewest columns (a graphed step: fewer widths, fewer graphs)
    release_windows: bool = True  # give back blocks that left every query's window
    gathered: bool = False  # the history is gathered for the model's own attention (no paged attention)

    def __post_init__(self):
        if self.backend not in ("torch", "triton"):
            raise ValueError(f"StepOptions needs a resolved backend ('torch' or 'triton'), got {self.backend!r}: "
                             "resolve 'auto' with hf_paged.ops.resolve_backend(backend, device) first.")


def plan_generate_step(rows: Rows, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch: int,
                       query_len: int, options: StepOptions, *, first: bool,
                       spans: list[list[tuple[int, int]]] | None = None) -> Step:
    """Plan a ``generate()`` forward: ``[batch, query_len]`` left-padded columns, batch row ``r`` being ``rows[r]``.

    ``input_ids``: ``[batch, query_len]`` (None: the model got embeddings); ``attention_mask``: 2D, its last
    ``query_len`` columns mark the real tokens (None: all real). ``first``: the rows were just created for this
    forward (rows with the same prompt then share one copy of it; on rows holding nothing, the model's own attention
    serves the forward). ``spans``: per row, its bidirectional spans (positions in the row; see :class:`RowInput`).
    Raises :class:`~hf_paged.OutOfBlocksError` with every row unchanged when the blocks do not fit.
    """
    real = real_columns(attention_mask, batch, query_len)
    counts = real.sum(1).tolist() if real is not None else [query_len] * batch
    tokens = row_tokens(input_ids, real)
    alias = duplicate_rows(rows, input_ids, real) if first and not options.gathered else {}
    inputs = [RowInput(row, counts[r], tokens[r] if tokens is not None else None,
                       rows[alias[r]] if r in alias else None, spans[r] if spans else ())
              for r, row in enumerate(rows)]
    empty = all(rows.length(row) == 0 for row in rows)
    return _plan(rows, inputs, options, no_history=first and empty and not options.gathered, query_len=query_len,
                 token_index=None if real is None else real.flatten().nonzero().flatten())


def plan_engine_step(rows: Rows, inputs: list[RowInput], options: StepOptions) -> Step:
    """Plan a packed engine forward: ``inputs``' new tokens back to back in one ``[1, T]`` input, no padding
    columns (a released row's tokens, if any, go to the scratch block). Raises :class:`~hf_paged.OutOfBlocksError`
    with every row unchanged when the blocks do not fit."""
    return _plan(rows, inputs, options)


def _plan(rows: Rows, inputs: list[RowInput], options: StepOptions, *, no_history: bool = False,
          query_len: int | None = None, token_index: torch.Tensor | None = None) -> Step:
    """Plan one forward over ``inputs`` (packed in that order): allocate, copy-on-write, window release, step tensors.

    A released row still runs (a batch keeps its shape): its tokens are written to the pool's scratch block.
    ``no_history``: a first prefill (the model's own attention serves it); ``query_len`` / ``token_index``: a padded
    forward's columns per row and its real tokens among them (None: packed, every column real).
    """
    pool, groups = rows.pool, rows.groups
    a, bs = pool.allocator, pool.block_size
    counts = [i.num_tokens for i in inputs]
    max_query_len = max(counts, default=0)
    keyed = [pool.prefix_caching and not groups.limited(g) for g in range(groups.num_groups)]
    live = [i for i in inputs if not i.row.released]

    with pool.lock:
        requests, request_tokens = [], []
        for i in live:
            n = 0 if i.share_from is not None else i.num_tokens
            for g, seq in enumerate(i.row.seqs):
                requests.append((seq, n))
                request_tokens.append(i.tokens if keyed[g] else None)
        starts = [0 if i.row.released else a.seq_len(i.row.seqs[0]) for i in inputs]
        appended = a.append(requests, request_tokens)
        for i in live:
            if i.share_from is not None:
                rows.share(i.row, i.share_from)
            else:
                rows.add_tokens(i.row, i.tokens)
        if options.release_windows:
            for i in live:  # keep what this step's first query still sees
                first_query = a.seq_len(i.row.seqs[0]) - i.num_tokens
                for g, (window, chunk) in enumerate(zip(groups.windows, groups.chunks)):
                    if window is not None:
                        a.release_outside_window(i.row.seqs[g], first_query - window + 1)
                    elif chunk is not None:  # the first query's chunk starts at a multiple of the chunk size
                        a.release_outside_window(i.row.seqs[g], first_query // chunk * chunk)
        pool.ensure_capacity()
        _copy_on_write(pool, appended.copies)
        limits = query_limits(inputs, starts)
        written = [i.share_from is None for i in inputs]
        group_steps = []
        for g, window in enumerate(groups.windows):
            tables = [None if i.row.released else a.block_table(i.row.seqs[g]) for i in inputs]
            lens = [0 if i.row.released else a.seq_len(i.row.seqs[g]) for i in inputs]
            block_tables, seq_lens, qsl, slots = group_tensors(
                tables, lens, counts, starts, written, pool.scratch_block, bs, bucket=options.decode_bucket,
                min_width=options.min_width)
            group_steps.append(GroupStep(slots, AttentionMetadata(block_tables, seq_lens, qsl, max_query_len,
                                                                  block_tables.shape[1] * bs, window,
                                                                  chunk=groups.chunks[g], query_limits=limits)))

    write_index = None
    if not all(written):
        writes = torch.repeat_interleave(torch.tensor(written), torch.tensor(counts, dtype=torch.long))
        write_index = writes.nonzero().flatten()
    for g in group_steps:
        meta = g.attention
        if options.gathered:
            length = max(1, int(meta.seq_lens.max()))
            pos = torch.arange(length)
            g.gather_slots = slot_of(meta.block_tables.long()[:, pos // bs], pos, bs)  # [B, L]
        elif options.backend == "torch":
            # Whole blocks: the read layout's width tells its length. A compiled step always carries the mask; its
            # width changes block by block (dynamo compiles that dimension as dynamic after the first change).
            if options.full_width:
                context = meta.max_seq_len
            else:
                context = cdiv(int(meta.seq_lens.max()), bs) * bs if len(inputs) else bs
            meta.plan = plan_torch_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc, bs,
                                             sliding_window=meta.sliding_window, chunk=meta.chunk, max_seq_len=context,
                                             always_mask=options.static, query_limits=meta.query_limits)
    return Step(len(inputs), max_query_len if query_len is None else query_len, max_query_len, no_history,
                token_index, write_index, group_steps, options.backend, options.static,
                layers=[None] * max(options.num_layers, 1))


def query_limits(inputs: list[RowInput], starts: list[int]) -> torch.Tensor | None:
    """``[num_tokens]`` int32: the last position each packed query sees (its own, or for a token of a bidirectional
    span the span's last); None when no span holds a token of this step. ``ValueError`` when a span goes past the
    step's tokens (its later tokens would be unwritten: a span is never split across forwards)."""
    if not any(i.spans for i in inputs):
        return None
    limits = array.array("i")
    for i, start in zip(inputs, starts):
        end = start + i.num_tokens
        row = list(range(start, end))
        for span_start, span_end in i.spans:
            if span_end <= start or span_start >= end:
                continue
            if span_end > end:
                raise ValueError(f"a bidirectional span [{span_start}, {span_end}) goes past this forward's tokens "
                                 f"(positions {start}..{end - 1}): its tokens must run in one forward. Fix: schedule "
                                 "chunks that end outside every span (the engine's scheduler does).")
            for p in range(max(span_start, start), span_end):
                row[p - start] = span_end - 1
        limits.extend(row)
    return _host(limits, torch.int32)


def bidirectional_spans(marks: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[tuple[int, int]]]:
    """Per row, the runs of marked tokens as half-open spans ``[start, end)`` of the row's positions (its real tokens
    counted from its first). ``marks`` ``[B, W]`` bool covers the last ``W`` columns of ``attention_mask`` ``[B, S]``
    (2D; None: every column real), e.g. ``token_type_ids == 1`` for a generate() call's whole sequence.

    Example: ``bidirectional_spans(torch.tensor([[0, 1, 1, 0, 1]]).bool(), torch.tensor([[0, 1, 1, 1, 1]]))``
    -> ``[[(0, 2), (3, 4)]]`` (the first column is padding).
    """
    marks = marks.to("cpu", torch.bool)
    batch, width = marks.shape
    if attention_mask is None or attention_mask.dim() != 2:
        real = torch.ones(batch, width, dtype=torch.bool)
        before = [0] * batch
    else:
        full = attention_mask.to("cpu", torch.bool)
        real = full[:, -width:]
        before = full[:, : full.shape[1] - width].sum(1).tolist()  # real tokens left of the marked columns
    spans = []
    for r in range(batch):
        row_marks = marks[r][real[r]].tolist()
        found, start = [], None
        for p, marked in enumerate(row_marks + [False]):
            if marked and start is None:
                start = p
            elif not marked and start is not None:
                found.append((before[r] + start, before[r] + p))
                start = None
        spans.append(found)
    return spans


def _copy_on_write(pool, copies) -> None:
    """Copy shared blocks before they are written, in every K/V tensor (host side, before the forward)."""
    if not copies:
        return
    src = torch.tensor([c[0] for c in copies], dtype=torch.long)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long)
    for tensor, k in pool.key_caches.items():  # fp8 pools: the blocks' scales with them
        copy_blocks(k, pool.value_caches[tensor], src.to(k.device), dst.to(k.device),
                    k_scale=pool.k_scale_caches.get(tensor), v_scale=pool.v_scale_caches.get(tensor))


def build_layer_step(pool, groups, step: Step, buffers: StepBuffers, layer_idx: int, num_layers: int | None,
                     key: torch.Tensor | None, value: torch.Tensor | None) -> LayerStep:
    """Layer ``layer_idx``'s view of ``step``: its pool tensors (bound from ``key`` ``[B, Hkv, S, D]`` on the layer's
    first forward) and its group's step tensors on the layer's device (fp8 pools: and its scale caches)."""
    if key is not None:
        pool.bind_layer(layer_idx, num_layers or layer_idx + 1, key,
                        groups.layer_tensor[layer_idx] if layer_idx < len(groups.layer_tensor) else None, groups.group_size,
                        value, [shape for _, shape in groups.tensor_shapes])
    group = groups.layer_group[layer_idx] if layer_idx < len(groups.layer_group) else 0
    if group < 0:
        raise ValueError(f"layer {layer_idx} wrote K/V but its kind keeps none in the pool (hf_paged.patches."
                         "kv_geometry): the model's layers differ from its config's description.")
    device = pool.layer_shapes[layer_idx].device
    view, (token_index, write_index) = step.device_view(group, device, buffers)
    key_cache, value_cache = pool.layer_kv(layer_idx)
    k_scale, v_scale = pool.layer_scales(layer_idx)  # fp8 pools: [num_blocks + 1, block_size, Hkv] bf16, else None
    return LayerStep(key_cache, value_cache, k_scale, v_scale, view, token_index, write_index, step.no_history,
                     step.backend)


def write_layer(pool, groups, step: Step, buffers: StepBuffers, layer_idx: int, num_layers: int | None,
                key: torch.Tensor, value: torch.Tensor, backend: str | None) -> LayerStep:
    """Write layer ``layer_idx``'s new K/V ``[B, Hkv, S, D]`` into the pool through ``step``'s slot mapping;
    returns the layer's :class:`LayerStep` (what its attention reads). ``backend``: override the step's."""
    layer = step.layers[layer_idx]
    if layer is None:  # first forward of this layer (never compiled): bind its shape, make its tensors
        layer = step.layers[layer_idx] = build_layer_step(pool, groups, step, buffers, layer_idx, num_layers, key, value)
    else:
        pool.check_layer(layer_idx, key)
    if pool.preallocated:
        _write(layer, key, value, backend)
        return layer
    # A growing pool shared with other threads may have grown (new tensors) since this step was planned: write
    # under the pool's lock into the current tensors, which the growth copies under the same lock.
    with pool.lock:
        key_cache, value_cache = pool.layer_kv(layer_idx)
        if key_cache is not layer.key_cache:  # grown: the step's view must follow (rare), fp8 scales too
            k_scale, v_scale = pool.layer_scales(layer_idx)
            layer = step.layers[layer_idx] = dataclasses.replace(layer, key_cache=key_cache, value_cache=value_cache,
                                                                 k_scale=k_scale, v_scale=v_scale)
        _write(layer, key, value, backend)
    return layer


def _write(layer: LayerStep, key: torch.Tensor, value: torch.Tensor, backend: str | None) -> None:
    slots = layer.group.slot_mapping
    if slots.shape[0]:
        custom_ops.write_kv(pack_tokens(key, layer), pack_tokens(value, layer), layer.key_cache, layer.value_cache,
                            slots, layer.k_scale, layer.v_scale, backend or layer.backend)


def pack_tokens(states: torch.Tensor, layer: LayerStep) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[num_writes, H, D]``: the real, written tokens back to back."""
    batch, heads, seq, dim = states.shape
    flat = states.squeeze(2) if seq == 1 else states.transpose(1, 2).reshape(batch * seq, heads, dim)
    if layer.token_index is not None:
        flat = flat.index_select(0, layer.token_index)
    if layer.write_index is not None:
        flat = flat.index_select(0, layer.write_index)
    return flat
