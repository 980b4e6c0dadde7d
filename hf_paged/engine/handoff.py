"""The state the user threads and the engine thread share: requests on their way in, cancellations, results on their
way out, streams, the stop flags and the engine thread itself. One object owns it (:class:`Handoff`); the manager
(user threads) and the engine loops (``loop.py``) change it only through its methods."""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterator

from .core import EngineCore
from .outputs import GenerationOutput, QueueFullError, RequestStatus
from .request import Request

FORGOTTEN = 10_000  # ids of results read or dropped, remembered to say so (not "unknown")


class Delivery:
    """What the engine thread hands out after a step: stream deltas, callbacks, final results."""

    __slots__ = ("request", "delta", "final")

    def __init__(self, request: Request, delta: GenerationOutput | None, final: GenerationOutput | None):
        self.request, self.delta, self.final = request, delta, final


def call_back(deliveries: list[Delivery]) -> None:
    """Hand each delivery's delta to its request's callback (outside the handoff's lock; a raising callback warns)."""
    for d in deliveries:
        cb = d.request.callback
        if cb is not None and d.delta is not None:
            try:
                cb(d.delta)
            except Exception as err:  # a user's callback must not stop the engine
                warnings.warn(f"callback of request {d.request.request_id!r} raised {type(err).__name__}: {err}",
                              stacklevel=2)


ARRIVAL_WAIT_CAP = 5  # an idle engine's first step waits at most this many arrival windows (see take_requests)


@dataclass
class Taken:
    """(tensor parallelism, rank 0) What one loop iteration takes to broadcast: the new requests, the ids of the
    requests to cancel, and the stop flags."""

    requests: list[Request]
    cancels: list[str]
    stop: bool
    drain: bool


class Handoff:
    """Requests, cancellations, results and stop flags passed between user threads and the engine thread.

    User threads (through :class:`~hf_paged.engine.manager.ContinuousBatchingManager`) call :meth:`start`,
    :meth:`stop`, :meth:`cancel_rest`, :meth:`join`, :meth:`add`, :meth:`cancel`, :meth:`get_result`,
    :meth:`deltas` and the read-only queries; the manager's finalizer calls :meth:`abandon`. The engine thread
    (``loop.py``) calls :meth:`take_requests`, :meth:`deliver` and :meth:`engine_failed`; under tensor parallelism
    :meth:`take_events` (rank 0) and :meth:`apply_events` instead of :meth:`take_requests`.

    Locking rule: one lock guards every field here; each method that changes the state or waits on it takes the lock
    itself and returns with it released, so no caller ever holds it (the read-only queries ``started``,
    ``is_running``, ``error``, ``stopped``, ``has_unread``, ``sizes`` and :meth:`join` read single fields without it,
    a snapshot). The engine thread calls in only between steps, never while the model runs; what a
    method does to the engine (adding, cancelling, failing requests in ``core``) it does under the lock, so a user
    thread sees the queues and the engine agree. Methods that end requests return :class:`Delivery` lists: the
    caller hands them to :func:`call_back`, outside the lock, so a callback may call back into the manager.

    Args:
        core: the engine (its scheduler's queues, its ``cancel`` / ``end`` / ``fail_all``).
        max_unread_results: finished results kept until read; past it the oldest unread are dropped.
    """

    def __init__(self, core: EngineCore, max_unread_results: int):
        self.max_unread_results = max_unread_results
        self._core = core
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._incoming: deque[Request] = deque()  # added, not yet in the engine
        self._cancels: list[Request] = []  # in the engine, to cancel between steps
        self._pending: list[Request] = []  # (tensor parallel, rank 0) broadcast, not yet in the engine
        self._live: dict[str, Request] = {}  # added, not yet finished
        self._results: OrderedDict[str, GenerationOutput] = OrderedDict()  # finished, unread
        self._streams: dict[str, deque] = {}
        self._forgotten: OrderedDict[str, str] = OrderedDict()  # id -> "read" / "dropped"
        self._ids = itertools.count()
        self._ended = {RequestStatus.FINISHED: 0, RequestStatus.CANCELLED: 0, RequestStatus.FAILED: 0}
        self._dropped_warned = False
        self._waiting = 0  # requests in the scheduler's queue (as of the last step)
        self._thread: threading.Thread | None = None
        self._stopping = False  # stop() was called (or the manager was dropped)
        self._drain = True  # finish what is queued before stopping (else cancel it)
        self._abandoned = False  # the manager was dropped: nobody reads results any more
        self._stopped = False  # the engine thread ended its loop (or never started and was stopped)
        self._error: str | None = None

    # ======================================================== user threads
    # -------------------------------------------------------------- lifecycle
    def start(self, target: Callable, *args) -> None:
        """Start the engine thread running ``target(*args)`` (no-op if it was started)."""
        with self._lock:
            if self._stopped or self._stopping:
                raise RuntimeError("this manager was stopped; create a new one with init_continuous_batching().")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=target, args=args, name="hf_paged-engine", daemon=True)
            self._thread.start()

    def stop(self, drain: bool) -> list[Delivery]:
        """Ask the engine thread to stop once it has finished (``drain``) or cancelled what it holds. A thread never
        started: what was queued is cancelled now (returned)."""
        with self._lock:
            self._stopping, self._drain = True, drain
            deliveries = []
            if self._thread is None:  # never started: nothing runs, cancel what was queued
                self._stopped = True
                while self._incoming:
                    deliveries += [self._finish_locked(r) for r in self._core.cancel(self._incoming.popleft())]
            self._cond.notify_all()
        return deliveries

    def cancel_rest(self) -> None:
        """A draining stop that took too long: cancel what is left instead."""
        with self._lock:
            self._drain = False
            self._cond.notify_all()

    def abandon(self) -> None:
        """The manager was dropped without ``stop()``: the engine thread cancels what it holds and ends."""
        with self._lock:
            self._stopping, self._drain, self._abandoned = True, False, True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to end; True when it has ended or was never started, False when ``timeout``
        passed first or when called from the engine thread itself (a callback: no self-join)."""
        thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def on_engine_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def is_running(self) -> bool:
        """Whether the engine thread is alive and not stopping."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def stopped(self) -> bool:
        """Whether a stop was asked or has happened."""
        return self._stopped or self._stopping

    # --------------------------------------------------------------- requests
    def add(self, prepared: list[tuple[list[int], object, str | None]],
            new_request: Callable[[str, list[int], object], Request], max_queue_size: int | None) -> list[str]:
        """Queue ``prepared`` (prompt, params, request id or None) all at once, each made by
        ``new_request(id, prompt, params)``; returns their ids. ``QueueFullError`` past ``max_queue_size`` waiting
        requests, ``ValueError`` for an id in use, ``RuntimeError`` once stopped or failed (nothing is queued)."""
        with self._lock:
            self._check_accepting_locked()
            if max_queue_size is not None and self._queued_locked() + len(prepared) > max_queue_size:
                raise QueueFullError(
                    f"{self._queued_locked()} requests are waiting and max_queue_size is {max_queue_size}: "
                    f"cannot queue {len(prepared)} more. Retry later, or raise max_queue_size.")
            ids = []
            for _, _, request_id in prepared:
                ids.append(self._new_id_locked(request_id, ids))
            for (prompt, params, _), rid in zip(prepared, ids):
                req = new_request(rid, prompt, params)
                for r in (req, *req.children):
                    self._live[r.request_id] = r
                    self._forgotten.pop(r.request_id, None)
                    if r.streaming:
                        self._streams[r.request_id] = deque()
                self._incoming.append(req)
            self._cond.notify_all()
        return ids

    def cancel(self, request_id: str) -> list[Delivery]:
        """Cancel a request: one the engine has not taken ends now (returned), one it holds at its next step. No-op
        for a request that already ended; ``KeyError`` for an unknown id."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None:
                if request_id in self._results or request_id in self._forgotten:
                    return []
                raise KeyError(f"no request with id {request_id!r}.")
            if req in self._incoming:  # never reached the engine: end it here
                self._incoming.remove(req)
                return [self._finish_locked(r) for r in self._core.cancel(req)]
            req.cancel_requested = True
            self._cancels.append(req)
            self._cond.notify_all()
            return []

    # ---------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """A finished request's result, once (see ``ContinuousBatchingManager.get_result``)."""
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

    def deltas(self, request_id: str) -> Iterator[GenerationOutput] | None:
        """The step-by-step outputs of a streaming request as they come, the last one final; None for a request that
        does not stream. ``KeyError`` for an unknown id (or a result already read or dropped)."""
        with self._lock:
            self._check_known_locked(request_id)
            stream = self._streams.get(request_id)
        if stream is None:
            return None
        return self._stream(request_id, stream)

    def _stream(self, request_id: str, stream: deque) -> Iterator[GenerationOutput]:
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

    def has_unread(self) -> bool:
        return bool(self._results)

    def counts(self) -> tuple[dict, int]:
        """(requests ended by status, requests waiting: queued here or in the scheduler's queue)."""
        with self._lock:
            return dict(self._ended), self._queued_locked()

    def sizes(self) -> tuple[int, int]:
        """(live requests, unread results)."""
        return len(self._live), len(self._results)

    # ==================================================== the engine thread
    def take_requests(self) -> tuple[list[Delivery], bool]:
        """Between steps: move new requests into the engine, apply cancellations (and a ``stop(drain=False)``).
        Returns the deliveries and whether the loop goes on; with nothing to do it waits for a request or a stop."""
        core = self._core
        with self._lock:
            if self._abandoned:
                for req in [*core.scheduler.running, *core.scheduler.waiting]:
                    core.cancel(req)
                return [], False
            if self._take_incoming_locked() and core.arrival_window_s > 0 and not core.scheduler.running:
                self._gather_arrivals_locked(core.arrival_window_s)
            deliveries = []
            for req in self._cancels:
                deliveries += [self._finish_locked(r) for r in core.cancel(req)]
            self._cancels.clear()
            self._waiting = len(core.scheduler.waiting)
            if self._stopping and not self._drain:
                for req in [*core.scheduler.running, *core.scheduler.waiting]:
                    deliveries += [self._finish_locked(r) for r in core.cancel(req)]
            if self._stopping and not core.has_work:
                self._stop_locked()
                return deliveries, False
            if not core.has_work and not deliveries:
                self._cond.wait()
            return deliveries, True

    def _take_incoming_locked(self) -> int:
        taken = len(self._incoming)
        while self._incoming:
            self._core.add(self._incoming.popleft())
        return taken

    def _gather_arrivals_locked(self, window: float) -> None:
        """An idle engine given new requests: take those that follow within ``window`` seconds of the last (at most
        ``ARRIVAL_WAIT_CAP`` windows in all) into the same first step. Clients of a batch send their requests a few
        ms apart; one that misses the first prefill step is prefilled alone in the next while the others wait to
        decode, and every later wave inherits the offset (a stall in each request's inter-token latency)."""
        deadline = time.monotonic() + ARRIVAL_WAIT_CAP * window
        while not (self._cancels or self._stopping or self._abandoned):
            remaining = min(window, deadline - time.monotonic())
            if remaining <= 0:
                return
            self._cond.wait(remaining)
            if not self._take_incoming_locked():
                return

    def deliver(self, touched: list[Request], idle_wait: float = 0.0) -> list[Delivery]:
        """After a step: the deliveries of the requests it ``touched`` (a token or an end). When the step could run
        nothing and nothing is handed out, waits up to ``idle_wait`` seconds for a request (no spinning)."""
        with self._lock:
            out = []
            if not self._abandoned:
                for req in touched:
                    if req.is_finished:
                        out.append(self._finish_locked(req))
                    elif req.streaming or req.callback is not None:
                        delta = req.output(delta=True)
                        if req.streaming:
                            self._streams[req.request_id].append(delta)
                        out.append(Delivery(req, delta, None))
                self._waiting = len(self._core.scheduler.waiting)
                if out:
                    self._cond.notify_all()
            if idle_wait and not self._core.last_batch_tokens and not out:
                self._cond.wait(idle_wait)  # nothing could run (a shared pool held by others): do not spin
            return out

    def engine_failed(self, error: str) -> None:
        """The engine thread stops on ``error``: every request the engine holds, and every one it has not taken
        yet, fails with it (nobody waits forever); later calls see ``error``."""
        message = f"the engine stopped: {error}"
        core = self._core
        with self._lock:
            if self._abandoned:
                core.fail_all(message)
            else:
                self._error, self._stopped = error, True
                for req in core.fail_all(message):
                    self._finish_locked(req)
                for req in [*self._incoming, *self._pending]:
                    if req.is_finished:
                        continue
                    req.error = message
                    for r in core.end(req, RequestStatus.FAILED):
                        self._finish_locked(r)
                self._incoming.clear()
                self._pending = []
            self._cond.notify_all()

    # ------------------------------------------- the engine thread, tensor parallel
    def take_events(self, idle_wait: float) -> Taken:
        """(rank 0) Take the new requests (kept as pending until :meth:`apply_events`, to fail them if the broadcast
        fails), the cancellations and the stop flags. With nothing to do, waits up to ``idle_wait`` seconds first."""
        with self._lock:
            if self._abandoned:
                return Taken([], [], stop=True, drain=False)
            if not self._core.has_work and not self._incoming and not self._cancels and not self._stopping:
                self._cond.wait(idle_wait)
            requests = list(self._incoming)
            self._incoming.clear()
            self._pending = list(requests)
            cancels = [req.request_id for req in self._cancels]
            self._cancels.clear()
            return Taken(requests, cancels, stop=self._stopping, drain=self._drain)

    def apply_events(self, new: list[Request], cancels: list[Request], cancel_all: bool, stop: bool,
                     register: bool) -> tuple[list[Delivery], list[Request], bool]:
        """(every rank) Apply one broadcast packet: ``new`` requests into the engine (``register``: made on this rank
        from the packet, so they are recorded as live here), ``cancels``, ``cancel_all``, ``stop``. Returns the
        deliveries, the requests that ended, and whether the loop goes on."""
        core = self._core
        with self._lock:
            if register and not self._abandoned:
                for req in new:
                    for r in (req, *req.children):
                        self._live[r.request_id] = r
            for req in new:
                core.add(req)
            self._pending = []
            ended = []
            for req in cancels:
                ended += core.cancel(req)
            if cancel_all:
                for req in [*core.scheduler.running, *core.scheduler.waiting]:
                    ended += core.cancel(req)
            deliveries = []
            if not self._abandoned:
                deliveries = [self._finish_locked(r) for r in ended]
                self._waiting = len(core.scheduler.waiting)
            if stop and not core.has_work:
                if not self._abandoned:
                    self._stop_locked()
                self._cond.notify_all()
                return deliveries, ended, False
            return deliveries, ended, True

    # ================================================================ locked
    def _stop_locked(self) -> None:
        self._stopped = True
        self._waiting = 0
        self._cond.notify_all()

    def _check_accepting_locked(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine stopped on an error and takes no more requests: {self._error}")
        if self._stopping or self._stopped:
            raise RuntimeError("this manager was stopped and takes no more requests; create a new one with "
                               "init_continuous_batching().")

    def _queued_locked(self) -> int:
        return len(self._incoming) + self._waiting

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
        while len(self._forgotten) > FORGOTTEN:
            self._forgotten.popitem(last=False)

    def _finish_locked(self, req: Request) -> Delivery:
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
        return Delivery(req, delta, final)
