"""Who runs in the next forward, and with how many tokens. Tensor-free: the memory simulation
(``hf_paged/tools/simulate.py``) serves workloads with it on a pool that never makes a K/V tensor.

First come, first served. Each step:

1. Running requests, in admission order: a decoding request gets its one token (decode tokens are served before any
   prefill chunk takes the budget), a request still prefilling gets a chunk of what is left of the budget. When the
   pool cannot hold a request's new tokens, a prefill chunk shrinks to what fits; if nothing fits, the most
   recently admitted request is preempted: its blocks go back and it returns to the head of the queue with its
   tokens (prompt and generated), to be recomputed later (its full blocks stay cached, so mostly found again).
2. If nobody was preempted, waiting requests are admitted in order while the budget lasts and the pool can hold
   their first chunk with a small watermark to spare. An admitted request starts from the cached blocks its tokens
   begin with; one whose next blocks are being computed by another running request waits for them instead.

A beam request (``beams.py``) runs its rows together: all of them in a step, one token each, or none; it is admitted
only with room for its worst case, and preempted whole (every row back, restarted from its prompt). A decoding request
with a draft (``speculative.py``) runs it with its token, from the budget the decode tokens leave; afterwards
:meth:`Scheduler.rollback` cuts the rejected tokens off its row.

The scheduler owns the waiting queue, the running list and each request's ``num_computed``, ``row`` and status;
the rows' blocks are asked of :class:`~hf_paged.engine.kv.RequestKV`. Its schedule of a step is a :class:`Batch`;
the runner plans and runs it; :meth:`Scheduler.advance` then records what ran.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .outputs import RequestStatus
from .request import Request


@dataclass
class Chunk:
    """One request's share of a step: ``num_tokens`` tokens from position ``start``."""

    request: Request
    start: int
    num_tokens: int
    draft: list[int] = field(default_factory=list)  # speculation: proposed tokens run after the known ones (the
    # last ``len(draft)`` of ``num_tokens``), each position's logits kept to verify them

    @property
    def sample(self) -> bool:
        """Whether this chunk reaches the end of the request's known tokens: its last logits give the next token
        (with a draft: the logits of its last ``len(draft) + 1`` positions verify the draft)."""
        return self.start + self.num_tokens - len(self.draft) == len(self.request.tokens)

    @property
    def num_logits(self) -> int:
        """Logits this chunk's sampling takes: one, or one per draft token plus one (0 for a chunk that does not
        sample)."""
        return 1 + len(self.draft) if self.sample else 0

    @property
    def tokens(self) -> list[int]:
        known = self.request.tokens[self.start: self.start + self.num_tokens - len(self.draft)]
        return known + self.draft if self.draft else known

    @property
    def prompt_positions(self) -> range:
        """The positions of this chunk whose logits the request still needs for its prompt logprobs (empty unless
        it asked for them)."""
        req = self.request
        if req.prompt_logprobs is None:
            return range(0)
        return range(max(self.start, req.prompt_logits_done), min(self.start + self.num_tokens, req.num_prompt - 1))


@dataclass
class Batch:
    """A step's schedule: the chunks to run (in this order), and the requests preempted to make room."""

    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    recomputed_tokens: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    tokens_computed: int = 0
    held_back: int = 0  # admissions deferred because another request was computing the same prefix


class Scheduler:
    """FCFS continuous-batching scheduler over a :class:`~hf_paged.engine.kv.RequestKV`.

    Args:
        kv: the rows' view of the pool.
        max_batch_tokens: tokens per step (decode tokens and prefill chunks together).
        max_num_seqs: the most requests running at once (default ``max_batch_tokens``, so every decode fits).
        watermark: share of the pool kept free when admitting (so running requests can grow); 0 with nothing running.
        hold_back: a request whose next prompt blocks another running request is computing waits for them.
    """

    def __init__(self, kv, max_batch_tokens: int, max_num_seqs: int | None = None, watermark: float = 0.01,
                 hold_back: bool = True):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}.")
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = min(max_num_seqs or max_batch_tokens, max_batch_tokens)
        capacity = kv.capacity
        self.watermark_blocks = max(1, int(watermark * capacity)) if capacity and watermark > 0 else 0
        self.hold_back = hold_back and kv.prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        self._admissions = 0
        self._pending: dict[bytes, Request] = {}  # key of a block being computed -> the request computing it

    # ---------------------------------------------------------------- queries
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.PENDING
        self.waiting.append(request)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> Batch:
        """The next step's schedule (see the module's docstring). Admission and preemption happen here; the blocks
        for the chunks are taken by the planner, which :meth:`RequestKV.num_free` accounts for as ``reserved``."""
        batch = Batch()
        self._schedule_running(batch)
        if not batch.preempted:
            self._admit(batch)
        return batch

    def _schedule_running(self, batch: Batch) -> None:
        decoding = sum(1 for r in self.running if r.remaining == 1)
        decode_left = self.max_batch_tokens
        # speculation: a decoding request's draft runs with its token, from the budget decode tokens leave
        spare = max(self.max_batch_tokens - decoding, 0)
        drafts = {}
        for r in self.running:
            if r.draft and r.remaining == 1 and spare > 0:
                drafts[id(r)] = r.draft[:spare]
                spare -= len(drafts[id(r)])
        prefill_left = spare
        reserved = 0
        i = 0
        while i < len(self.running):
            req = self.running[i]
            decode = req.remaining == 1
            if req.beam is not None and req.beam.started:
                if req is req.beam.requests[0]:
                    reserved += self._schedule_beams(req.beam, batch, decode_left, reserved)
                    decode_left -= len(req.beam.requests)
                    if req.status != RequestStatus.RUNNING:
                        break
                i += 1
                continue
            draft = drafts.get(id(req), [])
            n = 1 + len(draft) if decode and decode_left > 0 else min(req.remaining, prefill_left) if not decode else 0
            if n and not decode:
                n = outside_spans(req, req.num_computed, self.kv.chunk_tokens(req.row, req.num_computed, n),
                                  self.max_batch_tokens)
            if n == 0:
                i += 1
                continue
            need = self.kv.blocks_needed(req.row, n)
            while need > self.kv.num_free() - reserved:
                available = self.kv.num_free() - reserved
                fit = 0 if decode else outside_spans(req, req.num_computed,
                                                     self.kv.tokens_that_fit(req.row, available, n))
                if decode and draft:  # the draft goes first
                    fit = self.kv.tokens_that_fit(req.row, available, n)
                    if fit > 0:
                        draft = draft[:fit - 1]
                if fit > 0:
                    n, need = fit, self.kv.blocks_needed(req.row, fit)
                    break
                victim = self.running[-1]
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # it preempted itself: the requests after it are gone too
            batch.chunks.append(Chunk(req, req.num_computed, n, draft if decode else []))
            reserved += need
            if decode:
                decode_left -= n
            else:
                prefill_left -= n
            i += 1
        self._reserved = reserved

    def _schedule_beams(self, group, batch: Batch, decode_left: int, reserved: int) -> int:
        """A beam request's rows all run in a step (one token each) or none does. Returns the blocks reserved."""
        members = group.requests
        if decode_left < len(members):
            return 0
        need = sum(self.kv.blocks_needed(m.row, 1) for m in members)
        while need > self.kv.num_free() - reserved:
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if members[0].status != RequestStatus.RUNNING:
                return 0
        batch.chunks.extend(Chunk(m, m.num_computed, 1) for m in members)
        return need

    def _admit(self, batch: Batch) -> None:
        budget = self.max_batch_tokens - batch.num_tokens
        reserved = self._reserved
        held = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            width = req.beam.num_beams if req.beam is not None else \
                1 if req.forked else getattr(req.params, "num_return_sequences", 1)
            if self.running and len(self.running) + width > self.max_num_seqs:
                break
            self.waiting.popleft()
            limit = req.cache_limit  # the last known token always runs: its logits give the next token
            prefix = self.kv.match(req.key_tokens, limit, req.cache_root)
            if self._waits_for_prefix(req, len(prefix), limit):
                held.append(req)
                continue
            row = self.kv.open(prefix, req.key_tokens, req.cache_root)
            if row is None:  # no room for its state cell (hybrid models under a byte cap)
                self.waiting.appendleft(req)
                break
            cached = len(prefix) * self.kv.block_size
            n = outside_spans(req, cached, self.kv.chunk_tokens(row, cached, min(len(req.tokens) - cached, budget)),
                              self.max_batch_tokens)
            need = self.kv.blocks_needed(row, n)
            available = self.kv.num_free() - reserved - (self.watermark_blocks if self.running else 0)
            if need > available:
                n = outside_spans(req, cached, self.kv.tokens_that_fit(row, available, n))
                need = self.kv.blocks_needed(row, n) if n else 0
            if req.beam is not None and self.kv.capacity is not None:  # admitted only with room for its worst case
                worst = req.beam.worst_case_blocks(self.kv, min(req.num_prompt + req.max_new_tokens, req.max_length))
                if worst - len(prefix) > self.kv.num_free() - reserved - (self.watermark_blocks if self.running else 0):
                    n = 0
            if n == 0:
                self.kv.free(row)
                self.waiting.appendleft(req)
                break
            self._start(req, row, cached)
            self.kv.note_lookup(limit // self.kv.block_size * self.kv.block_size, cached)
            batch.chunks.append(Chunk(req, cached, n))
            reserved += need
            budget -= n
        self.waiting.extendleft(reversed(held))
        self._reserved = reserved

    def _waits_for_prefix(self, req: Request, cached_blocks: int, limit: int) -> bool:
        if not self.hold_back or cached_blocks >= limit // self.kv.block_size:
            return False
        key = self._keys(req, cached_blocks + 1)[cached_blocks]
        owner = self._pending.get(key)
        if owner is not None and owner is not req:
            self.counters.held_back += 1
            return True
        return False

    def _keys(self, req: Request, num_blocks: int) -> list[bytes]:
        if req.prefix_keys is None or len(req.prefix_keys) < num_blocks:
            req.prefix_keys = self.kv.prefix_keys(req.key_tokens, len(req.tokens) // self.kv.block_size, req.cache_root)
        return req.prefix_keys

    def _start(self, req: Request, row, cached: int) -> None:
        req.row, req.num_computed = row, cached
        req.status = RequestStatus.RUNNING
        req.admitted_at = self._admissions
        self._admissions += 1
        c = self.counters
        c.prefix_hit_tokens += cached
        if req.ever_admitted:
            c.recomputed_tokens += max(0, req.lost_tokens - cached)
        else:
            c.prompt_tokens += req.num_prompt
            req.cached_tokens = cached
            req.ever_admitted = True
        self.running.append(req)
        if self.hold_back:  # the full blocks it is about to compute: others with the same prefix wait for them
            keys = self._keys(req, len(req.tokens) // self.kv.block_size)
            first = cached // self.kv.block_size
            req.pending_from = first
            req.pending_keys = 0
            for key in keys[first: len(req.tokens) // self.kv.block_size]:
                if key in self._pending:
                    break
                self._pending[key] = req
                req.pending_keys += 1

    def add_fork(self, parent: Request, child: Request) -> None:
        """Run ``child`` from now on, sharing ``parent``'s blocks (``num_return_sequences``): its tokens are the
        parent's, computed as far as the parent's."""
        parent.fork(into=child)
        child.row = self.kv.fork(parent.row)
        child.num_computed = parent.num_computed
        child.status = RequestStatus.RUNNING
        child.ever_admitted = child.forked = True
        child.admitted_at = self._admissions
        self._admissions += 1
        self.running.append(child)

    def add_beams(self, parent: Request, beams: list[Request]) -> None:
        """Run ``beams`` (a beam request's rows besides ``parent``, holding no row yet) right after ``parent`` (a
        group's rows stay together in ``running``); :meth:`apply_beams` gives them rows."""
        at = self.running.index(parent) + 1
        for beam in beams:
            beam.status = RequestStatus.RUNNING
            beam.ever_admitted = beam.forked = True
            beam.admitted_at = parent.admitted_at
        self.running[at:at] = beams

    def apply_beams(self, beams: list[Request], sources: list[int], tokens: list[int]) -> None:
        """Beam search's step: row i continues row ``sources[i]`` with ``tokens[i]`` (not computed yet). A row
        continued twice is forked (blocks shared, copy-on-write), one continued by nobody is released."""
        rows = [b.row for b in beams]
        known = [list(b.tokens) for b in beams]
        taken: set[int] = set()
        new_rows = []
        for src in sources:
            new_rows.append(self.kv.fork(rows[src]) if src in taken else rows[src])
            taken.add(src)
        for j, row in enumerate(rows):
            if j not in taken and row is not None:
                self.kv.free(row)
        for beam, row, src, token in zip(beams, new_rows, sources, tokens):
            beam.row = row
            beam.tokens = known[src] + [token]
            beam.num_computed = len(known[src])

    def rollback(self, req: Request, keep: int) -> None:
        """Speculation: keep the first ``keep`` computed tokens of ``req``'s row (its rejected draft tokens' K/V is
        cut off, their blocks go back)."""
        if req.num_computed > keep:
            self.kv.rows.truncate(req.row, keep)
            req.num_computed = keep

    def preempt(self, req: Request) -> None:
        """Give ``req``'s blocks back and requeue it at the head, keeping its tokens (recomputed later). A beam
        request gives back all its rows and starts again from its prompt."""
        if req.beam is not None and req.beam.started:
            group = req.beam
            req = group.requests[0]
            for beam in group.hidden:
                self.running.remove(beam)
                self.kv.free(beam.row)
                beam.row = None
                beam.status = RequestStatus.CANCELLED
            del req.tokens[req.num_prompt:]
            req.num_computed = min(req.num_computed, req.num_prompt)
            group.reset()
        self.running.remove(req)
        self._drop_pending(req)
        self.kv.free(req.row)
        req.row = None
        req.lost_tokens = req.num_computed
        req.num_computed = 0
        req.preemptions += 1
        req.status = RequestStatus.PENDING
        self.counters.preemptions += 1
        self.waiting.appendleft(req)

    def _drop_pending(self, req: Request, upto: int | None = None) -> None:
        """Forget the pending keys ``req`` computes (all, or those of blocks before block ``upto``)."""
        if not req.pending_keys:
            return
        keys = req.prefix_keys
        end = req.pending_from + req.pending_keys
        stop = end if upto is None else min(end, upto)
        for key in keys[req.pending_from: stop]:
            if self._pending.get(key) is req:
                del self._pending[key]
        req.pending_keys = end - stop
        req.pending_from = stop

    # ----------------------------------------------------------------- results
    def advance(self, batch: Batch) -> None:
        """The batch's forward ran and its blocks were published: count the computed tokens."""
        c = self.counters
        for chunk in batch.chunks:
            req = chunk.request
            req.num_computed = chunk.start + chunk.num_tokens
            c.tokens_computed += chunk.num_tokens
            c.prompt_tokens_computed += max(0, min(req.num_computed, req.num_prompt) - chunk.start)
            if req.pending_keys:
                self._drop_pending(req, upto=req.num_computed // self.kv.block_size)

    def finish(self, req: Request, status: RequestStatus, keep: int | None = None) -> None:
        """End ``req`` (finished, cancelled or failed), wherever it is; its blocks go back to the pool.

        ``keep``: for a request whose last forward failed, the tokens its row holds validly (the rest is cut off
        before the row is freed, so no half-written block is offered as a prefix)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._drop_pending(req)
        if req.row is not None:
            if keep is None:
                self.kv.free(req.row)
            else:
                self.kv.discard(req.row, keep)
            req.row = None
        req.status = status

    def check_invariants(self) -> None:
        """Assert the scheduler's state is consistent with the pool (tests)."""
        assert not set(map(id, self.running)) & set(map(id, self.waiting)), "a request is both running and waiting"
        for req in self.running:
            assert req.status == RequestStatus.RUNNING and req.row is not None, req.request_id
            assert self.kv.length(req.row) == req.num_computed, (req.request_id, self.kv.length(req.row),
                                                                  req.num_computed)
            assert 0 < req.remaining, req.request_id
        for req in self.waiting:
            assert req.status == RequestStatus.PENDING and req.row is None and req.num_computed == 0, req.request_id
        for key, owner in self._pending.items():
            assert owner in self.running, "a pending prefix block belongs to a request that is not running"


def outside_spans(req: Request, start: int, n: int, most: int | None = None) -> int:
    """``n`` tokens from ``start``, or fewer so that the chunk never ends inside one of the request's bidirectional
    spans (its tokens see each other: they run in one forward); 0 when the chunk would have to end inside the span
    it starts in (it waits for a step with room for the whole span), unless what is left of that span is longer than
    ``most`` (a step's whole budget): then all of it, over the budget, rather than never."""
    end = start + n
    for span_start, span_end in req.bidirectional_spans:
        if span_start < end < span_end:
            if span_start <= start and most is not None and span_end - start > most:
                return span_end - start
            return max(0, span_start - start)
    return n
