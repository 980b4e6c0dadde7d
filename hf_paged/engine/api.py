"""``init_continuous_batching``, ``generate_batch`` and the manager: transformers' continuous-batching API over the
engine, with one engine thread running the model and any number of threads adding requests and reading results.

Thread-safety: every public method may be called from any thread. One lock guards the manager's queues and
results; the engine thread takes it only between steps (never while the model runs), and calls request callbacks
outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from typing import Iterator

import torch

from ..distributed import sum_over_ranks
from .core import EngineCore
from .distributed import AgreeingRunner, agree_on_pool, check_broadcastable, make_sync, tp_engine_loop
from .outputs import EngineStats, GenerationOutput, QueueFullError, RequestStatus
from .request import Request

from .sampling import SamplingParams

DEFAULT_MAX_UNREAD = 100_000  # finished results kept until read; the oldest unread are dropped past it
IDLE_WAIT = 0.005  # seconds the engine thread waits after a step that could run nothing
_FORGOTTEN = 10_000  # ids of results read or dropped, remembered to say so (not "unknown")
_SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                  "eos_token_id", "stop_token_ids", "logprobs", "num_return_sequences", "ignore_eos", "min_tokens",
                  "prompt_logprobs", "grammar")


class _Delivery:
    """What the engine thread hands out after a step: stream deltas, callbacks, final results."""

    __slots__ = ("request", "delta", "final")

    def __init__(self, request: Request, delta: GenerationOutput | None, final: GenerationOutput | None):
        self.request, self.delta, self.final = request, delta, final


class ContinuousBatchingManager:
    """Serves requests from many threads through one engine thread (made by :func:`init_continuous_batching`).

    Method names and meanings follow transformers' ``ContinuousBatchingManager``: ``start``, ``stop``,
    ``add_request``, ``add_requests``, ``get_result``, ``request_id_iter``, ``cancel_request``, context manager.
    Two differences: ``get_result(request_id)`` waits for *that* request and never hands back (or requeues) another
    request's result; a stream (``request_id_iter``) yields only the new tokens of each step.

    Example::

        with hf_paged.init_continuous_batching(model, max_batch_tokens=512) as manager:
            rid = manager.add_request(prompt_ids, max_new_tokens=64)
            print(manager.get_result(rid).generated_tokens)
            print(manager.stats())
    """

    def __init__(self, core: EngineCore, generation_config=None, *, vocab_size: int | None = None,
                 max_queue_size: int | None = None, max_unread_results: int = DEFAULT_MAX_UNREAD,
                 default_options: dict | None = None, sync=None):
        if max_queue_size is not None and (not isinstance(max_queue_size, int) or max_queue_size < 1):
            raise ValueError(f"max_queue_size must be a positive int or None (unlimited), got {max_queue_size!r}.")
        self._core = core
        self.generation_config = generation_config
        self.vocab_size = vocab_size
        self.max_queue_size = max_queue_size
        self.max_unread_results = max_unread_results
        self._defaults = dict(default_options or {})
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._incoming: deque[Request] = deque()
        self._cancels: list[Request] = []
        self._live: dict[str, Request] = {}  # added, not yet finished
        self._results: OrderedDict[str, GenerationOutput] = OrderedDict()  # finished, unread
        self._streams: dict[str, deque] = {}
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # id -> "read" / "dropped"
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._error: str | None = None
        self._waiting = 0  # requests in the scheduler's queue (as of the last step)
        self._ended = {RequestStatus.FINISHED: 0, RequestStatus.CANCELLED: 0, RequestStatus.FAILED: 0}
        self._dropped_warned = False
        self._signals = _Signals()  # what the engine thread reads: it holds these, never the manager itself
        self._sync = sync  # tensor parallelism: the ranks' control channel (engine/distributed.py), else None
        self._pending_new: list[Request] = []  # (tensor parallel, rank 0) broadcast, not yet in the engine
        # A manager dropped without stop(): its thread ends (cancelling what is left), then the pool is freed.
        self._finalizer = weakref.finalize(self, _shutdown, self._lock, self._cond, self._signals)

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread (no-op if it runs). Requests added before ``start`` wait for it."""
        with self._lock:
            if self._stopped or self._stopping:
                raise RuntimeError("this manager was stopped; create a new one with init_continuous_batching().")
            if self._thread is not None:
                return
            loop, extra = (_engine_loop, ()) if self._sync is None else (tp_engine_loop, (self._sync, _call_back))
            self._thread = threading.Thread(target=loop, args=(weakref.ref(self), self._core, self._lock,
                                                               self._cond, self._signals, *extra),
                                            name="hf_paged-engine", daemon=True)
            self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, drain: bool = True) -> None:
        """Stop serving. ``drain=True`` finishes the running and waiting requests first; ``drain=False`` cancels
        them. With ``block``, waits for the engine thread: when ``timeout`` seconds pass while draining, what is
        left is cancelled and the thread is joined (one more step at most). Every request ends with a final status;
        ``add_request`` raises afterwards."""
        deliveries = []
        with self._lock:
            self._stopping = True
            self._signals.stop, self._signals.drain = True, drain
            thread = self._thread
            if thread is None:  # never started: nothing runs, cancel what was queued
                self._stopped = True
                deliveries = self._cancel_queued_locked()
            self._cond.notify_all()
        _call_back(deliveries)
        if thread is None or not block or thread is threading.current_thread():  # (from a callback: no self-join)
            return
        thread.join(timeout)
        if thread.is_alive():
            with self._lock:
                self._signals.drain = False
                self._cond.notify_all()
            thread.join()

    def __enter__(self) -> "ContinuousBatchingManager":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(block=True, drain=exc_type is None)

    def is_running(self) -> bool:
        """Whether the engine thread is alive and not stopping."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def error(self) -> str | None:
        """Why the engine stopped, if it stopped on an error (a lost tensor-parallel rank, an engine bug)."""
        return self._error

    def memory_stats(self, all_ranks: bool = False):
        """The pool's :class:`~hf_paged.MemoryStats`. Under tensor parallelism each rank's pool holds its own KV
        heads; ``all_ranks=True`` sums the byte figures over the ranks (a collective: call it on every rank at a
        moment their pools agree, e.g. after ``stop()``; ``ValueError`` if their block counts differ)."""
        stats = self.pool.memory_stats()
        if all_ranks and self._sync is not None:
            return sum_over_ranks(stats, group=self._sync.stats_group)
        return stats

    @property
    def max_context(self) -> int | None:
        """The most tokens (prompt + generated) one request may hold (the model's ``max_position_embeddings``, or
        lower where its rotary embedding needs it)."""
        return self._core.max_context

    @property
    def pool(self):
        return self._core.kv.pool

    # --------------------------------------------------------------- requests
    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, *, generation_config=None, do_sample=None, temperature=None,
                    top_p=None, top_k=None, min_p=None, repetition_penalty=None, seed: int | None = None,
                    eos_token_id=None, stop_token_ids: list[int] | None = None, logprobs: int | None = None,
                    num_return_sequences: int | None = None, ignore_eos: bool | None = None,
                    min_tokens: int | None = None, prompt_logprobs: int | None = None, grammar=None, callback=None,
                    record_timestamps: bool | None = None) -> str:
        """Queue one request; returns its id.

        Args:
            input_ids: the prompt's token ids (a list of ints or a 1-D tensor).
            request_id: your id for it (default ``req_N``); must be unused.
            max_new_tokens: the most tokens to generate (default: the generation config's).
            streaming: read its tokens step by step with :meth:`request_id_iter`.
            generation_config: settings for this request instead of the manager's; the keywords after it override
                single settings (``seed`` makes a sampled request reproducible whatever shares its steps;
                ``stop_token_ids`` end it like EOS; ``ignore_eos``: EOS does not end it (stop token ids still do);
                ``min_tokens``: EOS / stop ids are masked until that many tokens were generated; ``logprobs``: None,
                0 (the sampled token's) or k (plus the top k); ``prompt_logprobs``: None, or k: every prompt
                token's log-probability, rank and the top k at its position, in ``GenerationOutput.prompt_logprobs``
                / ``prompt_ranks`` / ``prompt_top_logprobs``. Such a request computes logits at every prompt
                position through its prefill chunks; it takes from the prefix cache only the positions whose logits
                it already has (after a preemption), so a cache hit never loses them. ``grammar``: a
                :class:`~hf_paged.engine.structured.CompiledGrammar` the output must match (structured output: a
                token bitmask each step; the request ends "stop" when the grammar's text is complete).
            callback: called from the engine thread with each step's :class:`GenerationOutput` delta (keep it short).
            record_timestamps: accepted for transformers' signature; timestamps are always recorded.

        Raises:
            QueueFullError: ``max_queue_size`` requests are already waiting.
            RequestTooLargeError: the prompt + ``max_new_tokens`` could never fit the pool or the model's context.
            ValueError: a bad prompt or setting (named), or a request id in use.
            RuntimeError: the manager was stopped, or its engine failed.
        """
        return self._add([(input_ids, request_id)], max_new_tokens, streaming, generation_config, callback,
                         dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed, eos_token_id=eos_token_id,
                              stop_token_ids=stop_token_ids, logprobs=logprobs,
                              num_return_sequences=num_return_sequences, ignore_eos=ignore_eos,
                              min_tokens=min_tokens, prompt_logprobs=prompt_logprobs, grammar=grammar))[0]

    def add_requests(self, inputs, max_new_tokens: int | None = None, streaming: bool = False, **options) -> list[str]:
        """Queue several prompts with the same settings (all or none: every one is checked before any is queued).
        Returns their ids, in order. Same options as :meth:`add_request`, but ``request_ids=`` (a list) instead of
        ``request_id``."""
        ids = options.pop("request_ids", None) or [None] * len(inputs)
        if len(ids) != len(inputs):
            raise ValueError(f"request_ids has {len(ids)} ids for {len(inputs)} prompts.")
        generation_config = options.pop("generation_config", None)
        callback = options.pop("callback", None)
        options.pop("record_timestamps", None)
        unknown = set(options) - set(_SAMPLING_KEYS)
        if unknown:
            raise TypeError(f"add_requests got unexpected options {sorted(unknown)}.")
        return self._add(list(zip(inputs, ids)), max_new_tokens, streaming, generation_config, callback, options)

    def _add(self, items, max_new_tokens, streaming, generation_config, callback, sampling: dict) -> list[str]:
        config = generation_config if generation_config is not None else self.generation_config
        overrides = {**self._defaults, **{k: v for k, v in sampling.items() if v is not None}}
        prepared = []
        for input_ids, request_id in items:
            prompt = self._prompt(input_ids)
            params = SamplingParams.from_generation_config(config, prompt_length=len(prompt),
                                                           max_new_tokens=max_new_tokens, **overrides)
            self._core.check_fits(len(prompt), params.max_new_tokens)
            if self._sync is not None:
                check_broadcastable(params)
            prepared.append((prompt, params, request_id))
        with self._lock:
            self._check_accepting_locked()
            if self.max_queue_size is not None and self._queued_locked() + len(prepared) > self.max_queue_size:
                raise QueueFullError(
                    f"{self._queued_locked()} requests are waiting and max_queue_size is {self.max_queue_size}: "
                    f"cannot queue {len(prepared)} more. Retry later, or raise max_queue_size.")
            ids = []
            for prompt, params, request_id in prepared:
                rid = self._new_id_locked(request_id, ids)
                ids.append(rid)
            for (prompt, params, _), rid in zip(prepared, ids):
                req = self._core.new_request(rid, prompt, params, streaming=streaming, callback=callback)
                for r in (req, *req.children):
                    self._live[r.request_id] = r
                    self._forgotten.pop(r.request_id, None)
                    if streaming:
                        self._streams[r.request_id] = deque()
                self._incoming.append(req)
            self._cond.notify_all()
        return ids

    def _prompt(self, input_ids) -> list[int]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 2 and input_ids.shape[0] == 1:
                input_ids = input_ids[0]
            if input_ids.dim() != 1:
                raise ValueError(f"input_ids must be one prompt (a list of ints or a 1-D tensor), got a tensor of "
                                 f"shape {tuple(input_ids.shape)}; use add_requests for several.")
            input_ids = input_ids.tolist()
        try:
            prompt = [int(t) for t in input_ids]
        except (TypeError, ValueError):
            raise ValueError("input_ids must be a list of token ids (ints) or a 1-D tensor.") from None
        if any(isinstance(t, bool) for t in input_ids) or not all(isinstance(t, int) for t in input_ids):
            if not all(float(t) == int(t) for t in input_ids):
                raise ValueError("input_ids must be integer token ids.")
        if not prompt:
            raise ValueError("input_ids is empty: a request needs at least one prompt token.")
        bad = [t for t in prompt if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise ValueError(f"input_ids holds {len(bad)} token id(s) outside the vocabulary [0, {self.vocab_size}), "
                             f"e.g. {bad[0]}.")
        return prompt

    def _new_id_locked(self, request_id, taken) -> str:
        if request_id is None:
            while True:
                rid = f"req_{next(self._ids)}"
                if rid not in self._live and rid not in self._results and rid not in taken:
                    return rid
        rid = str(request_id)
        if rid in self._live or rid in self._results or rid in taken:
            raise ValueError(f"request id {rid!r} is in use (a request with it has not finished or its result is "
                             "unread); pick another id.")
        self._forgotten.pop(rid, None)
        return rid

    def _check_driver(self) -> None:
        if self._sync is not None and not self._sync.is_driver:
            raise ValueError(f"this is tensor-parallel rank {self._sync.rank}: requests are added and cancelled on "
                             "rank 0 only (the other ranks follow its steps).")

    def _check_accepting_locked(self) -> None:
        self._check_driver()
        if self._error is not None:
            raise RuntimeError(f"the engine stopped on an error and takes no more requests: {self._error}")
        if self._stopping or self._stopped:
            raise RuntimeError("this manager was stopped and takes no more requests; create a new one with "
                               "init_continuous_batching().")

    def _queued_locked(self) -> int:
        return len(self._incoming) + self._waiting

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its blocks go back at the next step, its result has status ``CANCELLED`` (with the
        tokens generated so far). No-op for a request that already ended; ``KeyError`` for an unknown id."""
        self._check_driver()
        with self._lock:
            req = self._live.get(request_id)
            if req is None:
                if request_id in self._results or request_id in self._forgotten:
                    return
                raise KeyError(f"no request with id {request_id!r}.")
            if req in self._incoming:  # never reached the engine: end it here
                self._incoming.remove(req)
                deliveries = [self._finish_locked(r) for r in self._core.cancel(req)]
            else:
                req.cancel_requested = True
                self._cancels.append(req)
                self._cond.notify_all()
                return
        _call_back(deliveries)

    # ---------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """A finished request's result, once (it is forgotten when read).

        With ``request_id``: waits until that request ends and returns its result (never another's); ``KeyError``
        if the id is unknown, or its result was already read or dropped (``max_unread_results``). Without: the
        oldest unread result of any request. ``None`` when ``timeout`` seconds pass first, or when the engine is not
        running and nothing is left to wait for.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if request_id is not None:
                self._check_known_locked(request_id)
            while True:
                if request_id is None and self._results:
                    rid, out = self._results.popitem(last=False)
                    self._forget_locked(rid, "read")
                    return out
                if request_id is not None and request_id in self._results:
                    out = self._results.pop(request_id)
                    self._forget_locked(request_id, "read")
                    self._streams.pop(request_id, None)
                    return out
                if request_id is not None and request_id not in self._live:
                    self._check_known_locked(request_id)
                if not self._can_progress_locked(request_id):
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Results as they finish, until the engine stops and none are left."""
        while True:
            out = self.get_result(timeout=0.1)
            if out is not None:
                yield out
            elif not self.is_running() and not self._results:
                return

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of one request as they come. A streaming request yields one :class:`GenerationOutput` per
        step carrying only that step's new tokens (``generated_tokens``, ``logprobs``, ``timestamps``), the last one
        with the final status; a non-streaming request yields its final result once."""
        with self._lock:
            self._check_known_locked(request_id)
            stream = self._streams.get(request_id)
        if stream is None:
            out = self.get_result(request_id)
            if out is not None:
                yield out
            return
        while True:
            with self._lock:
                while not stream and self._can_progress_locked(request_id):
                    self._cond.wait()
                if not stream:
                    return
                out = stream.popleft()
                if out.is_finished():  # the stream carried the end: its result is not kept for get_result
                    self._streams.pop(request_id, None)
                    if self._results.pop(request_id, None) is not None:
                        self._forget_locked(request_id, "read")
            yield out
            if out.is_finished():
                return

    def _check_known_locked(self, request_id: str) -> None:
        if request_id in self._live or request_id in self._results:
            return
        why = self._forgotten.get(request_id)
        if why == "read":
            raise KeyError(f"the result of request {request_id!r} was already read.")
        if why == "dropped":
            raise KeyError(f"the result of request {request_id!r} was dropped unread: more than "
                           f"max_unread_results={self.max_unread_results} results were waiting to be read.")
        raise KeyError(f"no request with id {request_id!r}.")

    def _can_progress_locked(self, request_id: str | None) -> bool:
        """Whether waiting may still bring a result (the engine runs or will run what is queued)."""
        if request_id is not None and request_id not in self._live:
            return False
        thread = self._thread
        alive = thread is not None and thread.is_alive()
        if request_id is None:
            return alive and (bool(self._live) or not self._stopping)
        return alive

    def _forget_locked(self, request_id: str, why: str) -> None:
        self._forgotten[request_id] = why
        while len(self._forgotten) > _FORGOTTEN:
            self._forgotten.popitem(last=False)

    # ---------------------------------------------------------------- figures
    def stats(self) -> EngineStats:
        """A snapshot of the engine (see :class:`EngineStats`)."""
        core = self._core
        c, t = core.scheduler.counters, core.times
        kv = core.kv
        with kv.pool.lock:
            a = kv.allocator
            in_use, cached = a.blocks_in_use, a.num_cached
            num_blocks = a.max_blocks if a.max_blocks is not None else a.capacity
            free = num_blocks - in_use - cached if a.max_blocks is not None else a.num_free
        with self._lock:
            ended = dict(self._ended)
            waiting = self._queued_locked()
        return EngineStats(
            running=len(core.scheduler.running), waiting=waiting, finished=ended[RequestStatus.FINISHED],
            cancelled=ended[RequestStatus.CANCELLED], failed=ended[RequestStatus.FAILED],
            preemptions=c.preemptions, recomputed_tokens=c.recomputed_tokens, prompt_tokens=c.prompt_tokens,
            prompt_tokens_computed=c.prompt_tokens_computed, prefix_hit_tokens=c.prefix_hit_tokens,
            generated_tokens=core.generated_tokens, blocks_in_use=in_use, blocks_cached=cached, blocks_free=free,
            num_blocks=num_blocks, steps=core.steps, ttft=list(core.ttft), inter_token=list(core.inter_token),
            host_time_s=t.host, forward_time_s=t.forward, schedule_time_s=t.schedule, plan_time_s=t.plan,
            sample_time_s=t.sample, output_time_s=t.output, tokens_computed=c.tokens_computed,
            uptime_s=time.perf_counter() - core.started, **_graph_stats(getattr(core.runner, "graphs", None)),
        )

    # ------------------------------------------------ engine-thread side (locked)
    def _take_requests_locked(self) -> None:
        """Move new requests into the engine and apply cancellations (between steps)."""
        core = self._core
        while self._incoming:
            core.add(self._incoming.popleft())
        deliveries = []
        for req in self._cancels:
            deliveries += [self._finish_locked(r) for r in core.cancel(req)]
        self._cancels.clear()
        self._waiting = len(core.scheduler.waiting)
        return deliveries

    def _deliver_locked(self, touched: list[Request]) -> list[_Delivery]:
        out = []
        for req in touched:
            if req.is_finished:
                out.append(self._finish_locked(req))
            elif req.streaming or req.callback is not None:
                delta = req.output(delta=True)
                if req.streaming:
                    self._streams[req.request_id].append(delta)
                out.append(_Delivery(req, delta, None))
        self._waiting = len(self._core.scheduler.waiting)
        if out:
            self._cond.notify_all()
        return out

    def _engine_failed_locked(self, core, error: str) -> None:
        """The engine thread stops on ``error``: every request the engine holds, and every one it has not taken
        yet, fails with it (nobody waits forever); later calls see ``error``."""
        message = f"the engine stopped: {error}"
        self._error, self._stopped = error, True
        for req in core.fail_all(message):
            self._finish_locked(req)
        for req in [*self._incoming, *self._pending_new]:
            if req.is_finished:
                continue
            req.error = message
            for r in core._end(req, RequestStatus.FAILED):
                self._finish_locked(r)
        self._incoming.clear()
        self._pending_new = []

    def _finish_locked(self, req: Request) -> _Delivery:
        self._live.pop(req.request_id, None)
        self._ended[req.status] = self._ended.get(req.status, 0) + 1
        delta = None
        if req.streaming or req.callback is not None:
            delta = req.output(delta=True)
            stream = self._streams.get(req.request_id)
            if stream is not None:
                stream.append(delta)
        final = req.output()
        self._results[req.request_id] = final
        while len(self._results) > self.max_unread_results:
            rid, _ = self._results.popitem(last=False)
            self._streams.pop(rid, None)
            self._forget_locked(rid, "dropped")
            if not self._dropped_warned:
                self._dropped_warned = True
                warnings.warn(f"more than max_unread_results={self.max_unread_results} results are unread: the "
                              "oldest are dropped. Read results with get_result(), or raise max_unread_results.",
                              stacklevel=2)
        self._cond.notify_all()
        return _Delivery(req, delta, final)

    def _cancel_queued_locked(self) -> list[_Delivery]:
        deliveries = []
        while self._incoming:
            deliveries += [self._finish_locked(r) for r in self._core.cancel(self._incoming.popleft())]
        return deliveries

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped" if self._stopped or self._stopping else "not started"
        return f"ContinuousBatchingManager({state}, live={len(self._live)}, unread={len(self._results)})"


class _Signals:
    """Flags the manager sets for its engine thread (the thread holds these, not the manager)."""

    __slots__ = ("stop", "drain")

    def __init__(self):
        self.stop, self.drain = False, True


def _shutdown(lock, cond, signals) -> None:
    with lock:
        signals.stop, signals.drain = True, False
        cond.notify_all()


def _call_back(deliveries) -> None:
    for d in deliveries:
        cb = d.request.callback
        if cb is not None and d.delta is not None:
            try:
                cb(d.delta)
            except Exception as err:  # a user's callback must not stop the engine
                warnings.warn(f"callback of request {d.request.request_id!r} raised {type(err).__name__}: {err}",
                              stacklevel=2)


def _engine_loop(manager_ref, core: EngineCore, lock, cond, signals) -> None:
    """The engine thread: between steps, take new requests and cancellations under the lock; run a step without it;
    hand out what the step produced. Holds the manager only by a weak reference."""
    error = None
    try:
        with torch.no_grad():
            while True:
                with lock:
                    manager = manager_ref()
                    if manager is None:
                        deliveries = []
                        for req in [*core.scheduler.running, *core.scheduler.waiting]:
                            core.cancel(req)
                        return
                    deliveries = manager._take_requests_locked()
                    if signals.stop and not signals.drain:
                        for req in [*core.scheduler.running, *core.scheduler.waiting]:
                            deliveries += [manager._finish_locked(r) for r in core.cancel(req)]
                    if signals.stop and not core.has_work:
                        manager._stopped = True
                        manager._waiting = 0
                        cond.notify_all()
                        break
                    if not core.has_work and not deliveries:
                        del manager
                        cond.wait()
                        continue
                    del manager
                _call_back(deliveries)
                if not core.has_work:
                    continue
                touched = core.step()
                t0 = time.perf_counter()
                with lock:
                    manager = manager_ref()
                    deliveries = manager._deliver_locked(touched) if manager is not None else []
                    del manager
                    if not core.last_batch_tokens and not deliveries:
                        cond.wait(IDLE_WAIT)  # nothing could run (a shared pool held by others): do not spin
                _call_back(deliveries)
                core.times.output += time.perf_counter() - t0
    except BaseException as err:  # an engine bug: fail every request so nobody waits forever, keep the message
        error = f"{type(err).__name__}: {err}"
        with lock:
            manager = manager_ref()
            if manager is not None:
                manager._engine_failed_locked(core, error)
            else:
                core.fail_all(f"the engine stopped: {error}")
            cond.notify_all()
        raise
    _call_back(deliveries)


# --------------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------------


def init_continuous_batching(model, generation_config=None, *, pool=None, max_batch_tokens: int | None = None,
                             max_queue_size: int | None = None, continuous_batching_config=None,
                             max_num_seqs: int | None = None, max_unread_results: int = DEFAULT_MAX_UNREAD,
                             watermark: float | None = None, backend: str = "auto",
                             cuda_graphs: bool | None = None, tensor_parallel: bool | None = None,
                             tp_timeout_s: float = 60.0, tp_heartbeat_s: float = 1.0) -> ContinuousBatchingManager:
    """A continuous-batching manager serving ``model`` from a shared block pool (start it, or use ``with``).

    Args:
        model: a causal LM of a family ``python -m hf_paged models`` lists; :func:`hf_paged.enable_paged_attention`
            is applied if it was not.
        generation_config: the requests' default settings (default ``model.generation_config``).
        pool: a :class:`~hf_paged.BlockPool` (its block size, cap, ``prefix_caching`` and ``kv_dtype`` apply).
            Default: a pool with prefix caching, capped from the memory free on the model's device (CUDA: 80% of
            free memory, taken whole at the first forward while ``cuda_graphs`` is on; CPU: 20% of available RAM, at
            most 2 GiB, taken as blocks are needed).
        max_batch_tokens: tokens per forward, decode tokens and prefill chunks together (default 512 on CPU,
            2048 on CUDA).
        max_queue_size: waiting requests past which ``add_request`` raises ``QueueFullError`` (default: no limit).
        continuous_batching_config: transformers' ``ContinuousBatchingConfig``; ``page_size``, ``num_blocks``,
            ``max_batch_tokens``, ``max_memory_percent``, ``max_requests_per_batch``, ``allow_block_sharing``,
            ``max_queue_size``, ``safety_margin`` and ``return_logprobs`` are honoured, other fields refused by name
            when set. Explicit arguments win over it.
        max_num_seqs: the most requests running at once (default ``max_batch_tokens``).
        max_unread_results: finished results kept until read; past it the oldest unread are dropped.
        watermark: share of the pool kept free when admitting new requests (default 1%).
        backend: ``"auto"`` (Triton on CUDA, torch on CPU; a model already paged keeps its backend), ``"torch"`` or
            ``"triton"``.
        cuda_graphs: replay decode-only steps from CUDA graphs, one per bucket of rows (1, 2, 4, ... 512) and
            block-table width; steps with prefill chunks run eagerly. ``None`` (default): on where it applies (a CUDA
            model and a pool with a cap, which is then preallocated); ``True``: required (``ValueError`` where it
            cannot apply); ``False``: off.
        tensor_parallel: run as one rank of a tensor-parallel engine (see ``hf_paged/engine/distributed.py``):
            requests are added on rank 0, every rank runs the same steps. ``None`` (default): when the model was
            loaded with ``tp_plan`` under torchrun (``model.tp_size > 1``). Call this on every rank.
        tp_timeout_s: (tensor parallel) seconds a rank waits for the others before the engine stops with an error.
        tp_heartbeat_s: (tensor parallel) how often an idle rank 0 tells the others it is alive.

    Requires transformers >= 5.24 (the attention plumbing the packed forward needs); ``generate()`` with a
    ``PagedCache`` works from 4.56.

    Example::

        manager = hf_paged.init_continuous_batching(model, max_batch_tokens=512)
        manager.start()
        rid = manager.add_request(tokenizer("Hello").input_ids, max_new_tokens=32)
        print(tokenizer.decode(manager.get_result(rid).generated_tokens))
        manager.stop()
    """
    from ..attention import enable_paged_attention, is_paged, paged_backend
    from ..groups import LayerGroups
    from ..patches import check_engine_supported, check_model, kv_geometry
    from .core import EngineCore
    from .kv import RequestKV
    from .options import (DEFAULT_WATERMARK, context_limit, default_batch_tokens, default_pool,
                          from_continuous_batching_config)
    from .runner import ModelRunner
    from .sampling import Sampler
    from .scheduler import Scheduler
    from .states import install as install_state_mixers

    from .. import compat

    if not compat.STEP_IN_ATTENTION_KWARGS:
        raise RuntimeError(f"the continuous-batching engine needs transformers >= 5.24 (this is "
                           f"{compat.TRANSFORMERS_VERSION}); generate() with a PagedCache works from 4.56.")
    options = from_continuous_batching_config(continuous_batching_config)
    if max_batch_tokens is not None:
        options["max_batch_tokens"] = max_batch_tokens
    if max_queue_size is not None:
        options["max_queue_size"] = max_queue_size
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    if watermark is not None:
        options["watermark"] = watermark
    check_model(model)
    check_engine_supported(model)
    if not is_paged(model) or backend != "auto":  # a model paged before keeps its backend unless one is asked
        enable_paged_attention(model, backend=backend)
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    device = model.device
    groups = LayerGroups.from_geometry(kv_geometry(config))
    num_layers = config.num_hidden_layers
    pool_options = {k: options.pop(k) for k in ("block_size", "num_blocks", "memory_fraction", "prefix_caching")
                    if k in options}
    if pool is None:
        pool = default_pool(device, **pool_options)
    elif pool_options:
        raise ValueError(f"continuous_batching_config sets {sorted(pool_options)} but pool= was given: size the "
                         "BlockPool itself instead.")
    _cap_pool(pool, config, model.dtype, groups)
    sync = make_sync(model, tensor_parallel, tp_timeout_s, tp_heartbeat_s)
    if sync is not None:
        agree_on_pool(pool, sync)
    batch_tokens = options.pop("max_batch_tokens", None) or default_batch_tokens(device)
    state_layers = kv_geometry(config).state_layers
    if state_layers:  # hybrid models: their state mixers run per group of requests (engine/states.py)
        install_state_mixers(model)
    kv = RequestKV(pool, groups, batch_tokens, state_layers)
    watermark = options.pop("watermark", None)
    scheduler = Scheduler(kv, batch_tokens, max_num_seqs=options.pop("max_num_seqs", None),
                          watermark=DEFAULT_WATERMARK if watermark is None else watermark)
    if cuda_graphs is not None:
        options["cuda_graphs"] = cuda_graphs
    wanted_graphs = options.pop("cuda_graphs", None)
    if state_layers and wanted_graphs:
        raise ValueError("cuda_graphs=True is not supported for models with state layers (their mixers run per group "
                         "of requests, outside a graph). Leave cuda_graphs unset.")
    runner = ModelRunner(model, kv, paged_backend(model), num_layers,
                         None if state_layers else _decode_graphs(wanted_graphs, device, pool, scheduler.max_num_seqs))
    if sync is not None:
        runner = AgreeingRunner(runner, sync)
    limit, reason = context_limit(config)
    core = EngineCore(scheduler, runner, Sampler(device=device), max_context=limit, context_reason=reason)
    defaults = {"logprobs": options.pop("logprobs")} if "logprobs" in options else {}
    return ContinuousBatchingManager(core, generation_config if generation_config is not None
                                     else model.generation_config, vocab_size=config.vocab_size,
                                     max_queue_size=options.pop("max_queue_size", None),
                                     max_unread_results=max_unread_results, default_options=defaults, sync=sync)


def _graph_stats(graphs) -> dict:
    if graphs is None:
        return {}
    return dict(graphs_captured=graphs.captured, graph_replays=graphs.replays, graph_capture_s=graphs.capture_s,
                graphs_off=graphs.disabled_reason)


def _decode_graphs(wanted: bool | None, device, pool, max_rows: int):
    """The runner's :class:`~hf_paged.engine.graphs.DecodeGraphs` (None: every step eager); preallocates the pool,
    whose tensors a graph reads at fixed addresses."""
    from . import graphs

    kind = graphs.graph_type(device)
    if wanted is False:
        return None
    if wanted and kind is None:
        raise ValueError(f"cuda_graphs=True needs a CUDA model; this one is on {device}. Leave cuda_graphs unset "
                         "(graphs apply where they can) or move the model to a GPU.")
    if not pool.fixed:
        if wanted:
            raise ValueError("cuda_graphs=True needs a pool with a cap (the graphs read its tensors at fixed "
                             "addresses): pass pool=BlockPool(num_blocks=N) or BlockPool(max_memory='8GiB'), or "
                             "leave pool unset.")
        return None
    if kind is None:
        return None
    pool.preallocate()
    return graphs.DecodeGraphs(device, max_rows, kind)


def _cap_pool(pool, config, dtype, groups) -> None:
    """A ``max_memory`` pool gets its block cap now, from the model's per-layer K/V shapes (``groups.tensor_shapes``,
    from ``hf_paged.patches.kv_geometry``), before any block is taken."""
    if pool.max_memory is None or pool.allocator.max_blocks is not None:
        return
    pool.apply_memory_cap_for([shape for _, shape in groups.tensor_shapes], dtype)


def generate_batch(model, inputs, generation_config=None, *, progress_bar: bool = True,
                   max_new_tokens: int | None = None, **options) -> dict[str, GenerationOutput]:
    """Generate for many prompts with continuous batching; returns ``{request_id: GenerationOutput}`` in input order.

    A drop-in for transformers' ``model.generate_batch(inputs, generation_config)``: ``inputs`` is a list of prompts
    (lists of token ids), ids are ``req_0``, ``req_1``, ... (forks of ``num_return_sequences`` follow their parent as
    ``req_0__child#0``, ...). A prompt that can never fit (too long for the pool or the context) or has a bad setting
    gets a ``FAILED`` result with the reason; the others run. ``progress_bar`` shows requests done and tokens/s.

    ``options``: those of :func:`init_continuous_batching` (``pool``, ``max_batch_tokens``, ``cuda_graphs``,
    ``continuous_batching_config``, ...) and per-request settings for every prompt (``do_sample``, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``eos_token_id``, ``stop_token_ids``,
    ``logprobs``, ``num_return_sequences``, ``ignore_eos``, ``min_tokens``, ``prompt_logprobs``, ``grammar``; see
    :meth:`ContinuousBatchingManager.add_request`).

    Example::

        outputs = hf_paged.generate_batch(model, [tok(p).input_ids for p in prompts], max_new_tokens=64)
        for out in outputs.values():
            print(tok.decode(out.generated_tokens))
    """
    from tqdm.auto import tqdm

    request_options = {k: options.pop(k) for k in _SAMPLING_KEYS if k in options}
    for name in ("persistent_manager", "warmup", "record_timestamps"):  # transformers' options with no meaning here
        options.pop(name, None)
    # Every rank of a tensor-parallel model calls generate_batch with the same prompts: each runs its own engine
    # (same events at the same steps, by construction), so no rank 0 driver is needed unless asked.
    options.setdefault("tensor_parallel", False)
    if not inputs:
        return {}
    manager = init_continuous_batching(model, generation_config, **options)
    results: dict[str, GenerationOutput] = {}
    order: list[list[str]] = []
    with manager:
        for i, prompt in enumerate(inputs):
            rid = f"req_{i}"
            try:
                manager.add_request(prompt, request_id=rid, max_new_tokens=max_new_tokens, **request_options)
                n = request_options.get("num_return_sequences") or getattr(
                    generation_config or model.generation_config, "num_return_sequences", None) or 1
                order.append([rid, *(f"{rid}__child#{j}" for j in range(n - 1))])
            except (ValueError, RuntimeError) as err:
                prompt_ids = list(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)
                now = time.perf_counter()
                results[rid] = GenerationOutput(rid, prompt_ids=prompt_ids, status=RequestStatus.FAILED,
                                                error=f"{type(err).__name__}: {err}", created_time=now, end_time=now)
                order.append([rid])
        total = sum(len(ids) for ids in order)
        start, tokens = time.perf_counter(), 0
        with tqdm(total=total, desc="generate_batch", unit="req", disable=not progress_bar, leave=False) as bar:
            bar.update(len(results))
            while len(results) < total:
                out = manager.get_result(timeout=1.0)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                results[out.request_id] = out
                tokens += len(out.generated_tokens)
                bar.update(1)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s")
    return {rid: results[rid] for ids in order for rid in ids if rid in results}
