"""The engine thread: between steps it takes what the user threads handed over (new requests, cancellations, a
stop) from the :class:`~hf_paged.engine.handoff.Handoff`, runs one step of the :class:`~hf_paged.engine.core.EngineCore`
without any lock, and hands out what the step produced. :func:`run_engine` is the single-process loop;
:func:`run_tp_engine` the tensor-parallel one, where rank 0 broadcasts what it took as one packet of events that every
rank applies before the same step (``distributed.py``). Both hold the handoff and the core, never the manager.
"""

from __future__ import annotations

import dataclasses
import secrets
import time

import torch

from .core import EngineCore
from .distributed import Events, NewRequest, TensorParallelSync
from .handoff import Handoff, Taken, call_back
from .request import Request

IDLE_WAIT = 0.005  # seconds the engine thread waits after a step that could run nothing


def run_engine(handoff: Handoff, core: EngineCore) -> None:
    """The engine thread of a single-process manager."""
    deliveries = []
    try:
        with torch.no_grad():
            while True:
                deliveries, go_on = handoff.take_requests()
                if not go_on:
                    break
                call_back(deliveries)
                if not core.has_work:
                    continue
                _hand_out(handoff, core, core.step(), IDLE_WAIT)
    except BaseException as err:  # an engine bug: fail every request so nobody waits forever, keep the message
        handoff.engine_failed(f"{type(err).__name__}: {err}")
        raise
    call_back(deliveries)


def run_tp_engine(handoff: Handoff, core: EngineCore, sync: TensorParallelSync) -> None:
    """The engine thread of a tensor-parallel manager, on every rank (see ``distributed.py``)."""
    known: dict[str, Request] = {}  # requests this rank's engine holds, by id (followers look cancels up here)
    try:
        with torch.no_grad():
            while True:
                taken = handoff.take_events(sync.heartbeat_s) if sync.is_driver else None
                ev = sync.broadcast(_events(taken, core) if taken is not None else None)
                if taken is not None:
                    new = taken.requests
                else:
                    new = [core.new_request(n.request_id, n.prompt, n.params) for n in ev.new]
                for req in new:
                    for r in (req, *req.children):
                        known[r.request_id] = r
                cancels = [known[rid] for rid in ev.cancels if rid in known]
                deliveries, ended, go_on = handoff.apply_events(new, cancels, ev.cancel_all, ev.stop,
                                                                register=not sync.is_driver)
                for r in ended:
                    known.pop(r.request_id, None)
                if not go_on:
                    break
                call_back(deliveries)
                if not core.has_work:
                    continue
                touched = core.step()
                for r in touched:
                    if r.is_finished:
                        known.pop(r.request_id, None)
                _hand_out(handoff, core, touched)
                if core.runner.fatal is not None:  # (after handing out the step's failed requests)
                    raise RuntimeError(core.runner.fatal)
                if not core.last_batch_tokens and not touched:
                    time.sleep(IDLE_WAIT)  # nothing could run (a shared pool held by others): every rank waits alike
    except BaseException as err:  # a lost rank, diverged ranks, an engine bug: fail everything, keep the message
        handoff.engine_failed(f"{type(err).__name__}: {err}")
        if not isinstance(err, Exception):
            raise


def _hand_out(handoff: Handoff, core: EngineCore, touched: list[Request], idle_wait: float = 0.0) -> None:
    t0 = time.perf_counter()
    call_back(handoff.deliver(touched, idle_wait))
    core.times.output += time.perf_counter() - t0


def _events(taken: Taken, core: EngineCore) -> Events:
    """Rank 0: the packet announcing what it took. An unseeded sampled request gets a seed here, so that every rank
    draws the same tokens."""
    ev = Events(cancels=taken.cancels, cancel_all=taken.stop and not taken.drain, stop=taken.stop)
    for req in taken.requests:
        params = req.params
        if params.do_sample and params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
            for i, r in enumerate((req, *req.children)):
                r.params, r.generator = params, core.sampler.new_generator(params, i)
        ev.new.append(NewRequest(req.request_id, list(req.tokens[: req.num_prompt]), params))
    return ev
