"""The engine under tensor parallelism: rank 0 drives, every other rank follows the same steps.

Under ``torchrun`` with a model loaded with ``tp_plan="auto"``, every rank holds a share of each layer's heads and
every forward is a collective: all ranks must run the same step (the same chunks of the same requests) at the same
time, or they hang in the model's first all-reduce. Requests arrive on rank 0 only (a server, a user's threads), at
moments no other rank sees.

Design: each rank runs its own :class:`~hf_paged.engine.core.EngineCore` (scheduler, pool of its local KV heads,
sampler) and is fed the same *events* at the same step, as transformers' continuous batching does. Once per loop
iteration rank 0 takes what its manager queued (new requests with their prompts and settings, cancellations, a stop)
from its :class:`~hf_paged.engine.handoff.Handoff`, and broadcasts it as one :class:`Events` packet over a gloo (CPU)
group; every rank, rank 0 included, applies exactly that packet, then runs one step (the loop is
``loop.run_tp_engine``; this module holds the channel, the packet and the checks). The scheduler is deterministic
(FCFS, host integers only) and its prefix-cache keys are blake2b digests of the token ids (no salted ``hash``), so
the same events give the same batches on every rank.
Only events cross the wire (a few hundred bytes a step), never block tables or tensors; the alternative — rank 0
schedules and broadcasts its schedule — would need the followers' allocators driven from outside, a second code path
through the scheduler. Sampling is the same on every rank because greedy rows take the argmax of logits that are
identical after the tensor-parallel gather, and sampled rows draw from a per-request ``torch.Generator``: an
unseeded sampled request gets a seed drawn on rank 0, carried in its event.

Two checks per step keep the ranks honest (both over the gloo group, with its timeout):

- before the forward, every rank's batch digest (request ids, chunk starts and sizes, each chunk's last token) is
  gathered: ranks that would run different steps stop the engine with an error instead of hanging;
- after planning and before the forward (the runner's ``before_forward`` hook), and again after the forward, every
  rank's outcome is gathered: planning or a forward that raised on any rank fails that step's requests on every
  rank, and the engine goes on. (A rank raising *inside* the forward, between two of the model's collectives, leaves
  the others in that collective until the process group's timeout.)

A rank that dies or stops answering makes the next broadcast or gather raise (the connection closes, or the group's
``timeout_s`` passes), which stops the engine on every surviving rank with an error. An idle rank 0 sends an empty
packet every ``heartbeat_s`` so that followers waiting in the broadcast do not time out.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from . import features


DEFAULT_TIMEOUT_S = 60.0
DEFAULT_HEARTBEAT_S = 1.0


@dataclass
class NewRequest:
    """What a follower needs to make a request rank 0 queued: its id, prompt and settings (seed filled in)."""

    request_id: str
    prompt: list[int]
    params: object  # SamplingParams


@dataclass
class Events:
    """One loop iteration's events, broadcast by rank 0 and applied by every rank in this order."""

    new: list[NewRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    cancel_all: bool = False  # stop(drain=False): everything running and waiting is cancelled
    stop: bool = False  # stop once nothing is left to run


class RankFailure(RuntimeError):
    """The step failed on another rank (its requests fail here too)."""


class TensorParallelSync:
    """The control channel of a tensor-parallel engine: a gloo group over the default group's ranks.

    Made by :func:`~hf_paged.init_continuous_batching` on every rank (creating the group is a collective).

    Args:
        timeout_s: how long a broadcast or gather waits for the other ranks before the engine stops with an error
            (a lost rank). It bounds how long rank 0 may take between two loop iterations: keep it well above the
            slowest step (a long prefill on a big model).
        heartbeat_s: how often an idle rank 0 tells the followers it is alive (must be below ``timeout_s``).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, heartbeat_s: float = DEFAULT_HEARTBEAT_S):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("tensor-parallel serving needs an initialized torch.distributed process group (run "
                             "under torchrun and load the model with tp_plan='auto').")
        if not 0 < heartbeat_s < timeout_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be > 0 and below timeout_s ({timeout_s}).")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # memory_stats(all_ranks=True) from users' threads: its own group, never interleaved with the engine's
        self.stats_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast(self, events: Events | None) -> Events:
        box = [events if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: int) -> list[int]:
        """Every rank's int64 ``value``, in rank order."""
        mine = torch.tensor([value], dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]


def check_broadcastable(params) -> None:
    """``ValueError`` now (in the caller's thread) for settings the other ranks could not receive: structured output
    (its compiled grammar lives on rank 0, beside the tokenizer), or anything else that does not pickle."""
    features.check(features.request_features(params, tensor_parallel=True))
    try:
        pickle.dumps(params)
    except Exception as err:
        raise ValueError(f"these request settings cannot be sent to the other tensor-parallel ranks "
                         f"({type(err).__name__}: {err}); use plain values.") from None


def batch_digest(batch) -> int:
    """A signed 64-bit digest of what a step runs: each chunk's request id, start, size and last token."""
    h = hashlib.blake2b(digest_size=8)
    for c in batch.chunks:
        req = c.request
        h.update(f"{req.request_id}:{c.start}:{c.num_tokens}:{req.tokens[c.start + c.num_tokens - 1]};".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


class AgreeingRunner:
    """Wraps the engine's runner: the ranks agree on the batch before planning, on the planning's outcome before the
    forward (the runner's ``before_forward`` hook), and on the forward's outcome after it. A failure on any rank
    raises :class:`RankFailure` on every rank, so the engine fails the step's requests everywhere alike."""

    def __init__(self, inner, sync: TensorParallelSync):
        self.inner = inner
        self.sync = sync
        self.fatal: str | None = None  # set when the ranks diverged: the engine must stop
        self._planned = False  # this step's planning outcome was agreed on
        inner.before_forward = self._agree_planned

    def __getattr__(self, name):  # plan_time, forward_time, graphs, ...: the inner runner's
        return getattr(self.inner, name)

    def _agree_planned(self, ok: bool = True) -> None:
        planned = self.sync.gather(1 if ok else 0)
        self._planned = True
        failed = [r for r, good in enumerate(planned) if not good]
        if failed and ok:  # another rank could not plan: nobody starts the forward's collectives
            raise RankFailure(f"planning the step failed on rank(s) {failed}")

    def run(self, batch):
        digests = self.sync.gather(batch_digest(batch))
        if len(set(digests)) > 1:
            self.fatal = (f"the tensor-parallel ranks scheduled different steps (batch digests per rank {digests}); "
                          "their states diverged and the engine stops.")
            raise RankFailure(self.fatal)
        self._planned = False
        error = logits = None
        try:
            logits = self.inner.run(batch)
        except Exception as err:
            error = err
            if not self._planned:  # it failed before the forward: join the planning agreement as failed
                self._agree_planned(ok=False)
        own = error is not None and not isinstance(error, RankFailure)
        outcomes = self.sync.gather(1 if own else 0)
        failed = [r for r, bad in enumerate(outcomes) if bad]
        if failed or error is not None:
            detail = f": {type(error).__name__}: {error}" if own else ""
            raise RankFailure(f"the step failed on rank(s) {failed}{detail}") from error
        return logits


def agree_on_pool(pool, sync: TensorParallelSync) -> None:
    """Give every rank's pool the same block cap (the smallest): the schedulers count blocks, and a rank with more
    room than another would admit or preempt differently. A cap from free memory differs from rank to rank."""
    mine = pool.allocator.max_blocks
    caps = sync.gather(-1 if mine is None else mine)
    if len(set(caps)) == 1:
        return
    if -1 in caps:
        raise ValueError(f"the ranks' KV pools disagree on having a cap (blocks per rank {caps}, -1: none): give "
                         "every rank the same pool settings (BlockPool(num_blocks=...) or max_memory=...).")
    pool.allocator.set_limit(min(caps))


def make_sync(model, tensor_parallel: bool | None, timeout_s: float, heartbeat_s: float) -> TensorParallelSync | None:
    """The control channel when ``model`` is tensor-parallel (``tensor_parallel=None``: when ``model.tp_size > 1``
    in an initialized process group), else None."""
    on = tensor_parallel
    if on is None:
        on = (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
              and (getattr(model, "tp_size", None) or 1) > 1)
    if not on:
        return None
    return TensorParallelSync(timeout_s=timeout_s, heartbeat_s=heartbeat_s)


__all__ = ["AgreeingRunner", "Events", "NewRequest", "RankFailure", "TensorParallelSync", "agree_on_pool",
           "batch_digest", "check_broadcastable", "make_sync"]

