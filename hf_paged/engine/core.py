"""One engine step: schedule, run the forward, sample, record. Single-threaded: the engine thread (``loop.py``) runs
the steps, and the handoff (``handoff.py``) adds, cancels and ends requests between them.

A request's path: ``add`` -> waiting -> admitted by the scheduler (a row on the pool) -> chunks through forwards
(``runner.run``) -> a token sampled whenever its chunk reaches the end of its known tokens -> finished, cancelled or
failed (its blocks back to the pool). ``step`` returns the requests that got a token or ended, for the engine thread to
hand out.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import OutOfBlocksError
from .outputs import RequestStatus, RequestTooLargeError
from .request import Request
from .sampling import Sampler, prompt_logprobs
from .scheduler import Batch, Chunk, Scheduler

RECENT = 2048  # recent TTFT / inter-token figures kept for stats()


@dataclass
class StepTimes:
    """Seconds the engine spent, summed over steps."""

    schedule: float = 0.0
    plan: float = 0.0  # building the step's inputs (packing and the planner)
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0  # handing results out (the engine loop adds to it)

    @property
    def host(self) -> float:
        return self.schedule + self.plan + self.sample + self.output


class EngineCore:
    """The engine's state and its step, without threads.

    Args:
        scheduler: decides each step (owns the queues and the rows).
        runner: ``runner.run(batch) -> logits [k, vocab]`` for the batch's k sampling chunks (in batch order); it
            plans and runs the forward, and publishes the rows' new full blocks. ``runner.plan_time`` /
            ``runner.forward_time``: seconds of its last call.
        sampler: ``sampler(logits, params, generators, histories)`` (see ``sampling.py``).
        max_context: the model's context (prompt + generated tokens), for requests' ``max_length``.
    """

    def __init__(self, scheduler: Scheduler, runner, sampler=None, max_context: int | None = None,
                 context_reason: str = "max_position_embeddings"):
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler if sampler is not None else Sampler()
        self.max_context = max_context
        self.context_reason = context_reason
        self.times = StepTimes()
        self.steps = 0
        self.failed_steps = 0
        self.generated_tokens = 0
        self.last_batch_tokens = 0  # tokens the last step ran (0: it could run nothing, e.g. a pool held by others)
        self.ttft: deque[float] = deque(maxlen=RECENT)
        self.inter_token: deque[float] = deque(maxlen=RECENT)
        self.started = time.perf_counter()

    @property
    def kv(self):
        return self.scheduler.kv

    # ------------------------------------------------------------- admission
    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """``RequestTooLargeError`` if a request of this size could never run: past the model's context, or more
        blocks than the whole empty pool holds."""
        total = prompt_len + max_new_tokens
        if self.max_context is not None and prompt_len >= self.max_context:
            raise RequestTooLargeError(
                f"the prompt has {prompt_len} tokens but the model's context is {self.max_context} "
                f"({self.context_reason}): nothing can be generated. Shorten the prompt.")
        capacity = self.kv.capacity
        if capacity is not None:
            # The context caps what a request can hold: it ends ("length") when it reaches it.
            held = min(total, self.max_context) if self.max_context is not None else total
            need = self.kv.worst_case_blocks(held)
            if need > capacity:
                bs = self.kv.block_size
                raise RequestTooLargeError(
                    f"a request of {prompt_len} prompt + {max_new_tokens} new tokens needs {need} KV blocks of {bs} "
                    f"tokens at once ({self.kv.groups.num_groups} layer group(s)), but the whole pool holds "
                    f"{capacity}. Lower max_new_tokens, shorten the prompt, or give the engine a larger pool "
                    f"(BlockPool(num_blocks=...) or max_memory=...).")

    def new_request(self, request_id: str, prompt: list[int], params, streaming: bool = False,
                    callback=None, media=None) -> Request:
        """A request ready for :meth:`add` (sizes already checked); ``media``: its images (a
        :class:`~hf_paged.engine.multimodal.MediaPrompt` of this prompt), if any."""
        max_length = self.max_context if self.max_context is not None else len(prompt) + params.max_new_tokens

        def make(rid, index):
            return Request(
                request_id=rid, tokens=list(prompt), num_prompt=len(prompt),
                max_new_tokens=params.max_new_tokens, max_length=max_length,
                eos_token_ids=frozenset(params.eos_token_ids), params=params,
                generator=self.sampler.new_generator(params, index), streaming=streaming, callback=callback,
                logprobs=[] if params.logprobs is not None else None,
                top_logprobs=[] if params.logprobs else None,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                prompt_ranks=[None] if params.prompt_logprobs is not None else None,
                prompt_top_logprobs=[None] if params.prompt_logprobs is not None else None,
                matcher=params.grammar.matcher() if params.grammar is not None else None, media=media,
                bidirectional_spans=list(media.bidirectional_spans) if media is not None else [],
                sampling_state=self.sampler.join(params),
            )

        request = make(request_id, 0)
        # transformers' names for the forks of num_return_sequences
        request.children = [make(f"{request_id}__child#{i}", i + 1)
                            for i in range(getattr(params, "num_return_sequences", 1) - 1)]
        return request

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def cancel(self, request: Request) -> list[Request]:
        """End ``request`` as cancelled; its blocks go back now (between steps). Returns the requests that ended
        (with its forks not made yet)."""
        if request.is_finished:
            return []
        return self.end(request, RequestStatus.CANCELLED)

    def end(self, req: Request, status: RequestStatus, keep: int | None = None) -> list[Request]:
        """End ``req`` with ``status`` (and its forks not made yet, with the same status and error); its blocks go
        back to the pool (``keep``: after a failed forward, the tokens its row holds validly; see
        ``Scheduler.finish``). Returns the requests that ended."""
        now = time.perf_counter()
        self.scheduler.finish(req, status, keep=keep)
        req.end_time = now
        ended = [req]
        if not req.forked:
            for child in req.children:
                if not child.is_finished:
                    child.status, child.error, child.end_time = status, req.error, now
                    ended.append(child)
        return ended

    def fail_all(self, error: str) -> list[Request]:
        """End every waiting and running request as failed (the engine cannot go on)."""
        ended = []
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            req.error = error
            ended += self.end(req, RequestStatus.FAILED, keep=req.num_computed)
        return ended

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one step. Returns the requests that got a token or ended in it (preempted ones are not listed)."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.times.schedule += t1 - t0
        self.last_batch_tokens = batch.num_tokens
        if not batch.chunks:
            return []
        try:
            logits = self.runner.run(batch)
        except OutOfBlocksError:
            # The planner found the pool shorter than the scheduler counted (it should not): nothing was taken,
            # so make room and let the next step decide again.
            self._add_runner_times()
            self._preempt_last()
            return []
        except Exception as err:  # a failing forward fails only its step's requests
            self._add_runner_times()
            return self._fail_batch(batch, err)
        self._add_runner_times()
        self.steps += 1
        num_sampled = sum(1 for c in batch.chunks if c.sample)
        t2 = time.perf_counter()
        try:
            self._record_prompt_logprobs(batch, logits[num_sampled:])
        except Exception as err:
            self.scheduler.advance(batch)
            self.times.sample += time.perf_counter() - t2
            return self._fail_batch(batch, err, computed=True)
        self.scheduler.advance(batch)
        try:
            touched = self._sample(batch, logits[:num_sampled])
        except Exception as err:
            touched = self._fail_batch(batch, err, computed=True)
        self.times.sample += time.perf_counter() - t2
        return touched

    def _add_runner_times(self) -> None:
        self.times.plan += getattr(self.runner, "plan_time", 0.0)
        self.times.forward += getattr(self.runner, "forward_time", 0.0)

    def _record_prompt_logprobs(self, batch: Batch, logits) -> None:
        """``logits`` ``[m, vocab]``: those at the batch's ``prompt_positions``, chunk by chunk (see ``pack``)."""
        wanting = [(c, c.prompt_positions) for c in batch.chunks if c.prompt_positions]
        if not wanting:
            return
        targets = [c.request.tokens[p + 1] for c, positions in wanting for p in positions]
        k = max(c.request.params.prompt_logprobs for c, _ in wanting)
        values, ranks, tops = prompt_logprobs(logits, torch.tensor(targets, device=logits.device), k)
        at = 0
        for chunk, positions in wanting:
            n, own_k = len(positions), chunk.request.params.prompt_logprobs
            chunk.request.add_prompt_logprobs(values[at:at + n], ranks[at:at + n],
                                              [top[:own_k] for top in tops[at:at + n]])
            at += n

    def _sample(self, batch: Batch, logits) -> list[Request]:
        chunks = [c for c in batch.chunks if c.sample]
        if not chunks:
            return []
        reqs, sources = [], []  # the requests sampled, and the index of the logits each draws from
        for i, chunk in enumerate(chunks):
            req = chunk.request
            reqs.append(req)
            sources.append(i)
            if req.children and not req.forked:  # its prompt is in: the forks start here, each drawing its own token
                req.forked = True
                for child in req.children:
                    if not child.is_finished:
                        self.scheduler.add_fork(req, child)
                        reqs.append(child)
                        sources.append(i)
        if len(sources) != len(chunks):
            logits = logits[torch.tensor(sources, device=logits.device)]  # [k + forks, vocab]
        bitmask, constrained = self._bitmask(reqs, logits.shape[-1])
        result = self.sampler(logits, [r.params for r in reqs], [r.generator for r in reqs],
                              [r.tokens for r in reqs], [r.num_generated for r in reqs], bitmask, constrained,
                              states=[r.sampling_state for r in reqs])
        now = time.perf_counter()
        lps = result.logprobs or [None] * len(reqs)
        tops = result.top_logprobs or [None] * len(reqs)
        stopped = result.stopped or [False] * len(reqs)
        for i, (req, token, lp, top, stop) in enumerate(zip(reqs, result.tokens, lps, tops, stopped)):
            if i in result.errors:  # its own processor or criterion failed: it alone fails
                req.error = result.errors[i]
                self.end(req, RequestStatus.FAILED)
                continue
            if req.timestamps:
                self.inter_token.append(now - req.timestamps[-1])
            else:
                self.ttft.append(now - req.created_time)
            req.append(token, now, lp, top)
            if stop:  # a stop string, max_time or the request's own stopping criteria (see stopping.py)
                req.finish_reason = "stop"
            self.generated_tokens += 1
            if req.matcher is not None and req.finish_reason is None:
                if not req.matcher.accept(token):
                    req.error = f"the sampled token {token} does not continue the request's grammar"
                    self.end(req, RequestStatus.FAILED)
                    continue
                if req.matcher.is_terminated:  # the grammar's text is complete: nothing more may follow
                    req.finish_reason = "stop"
            if req.finish_reason is not None:
                self.end(req, RequestStatus.FINISHED)
        return reqs

    @staticmethod
    def _bitmask(reqs: list[Request], vocab: int):
        """``(int32 [r, words] allowed tokens, their indices in reqs)`` of the r requests with a grammar; ``(None, None)``
        if none."""
        constrained = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not constrained:
            return None, None
        bitmask = torch.full((len(constrained), (vocab + 31) // 32), -1, dtype=torch.int32)  # [r, words]
        for j, i in enumerate(constrained):
            reqs[i].matcher.fill(bitmask, j)
        return bitmask, constrained

    def _fail_batch(self, batch: Batch, err: Exception, computed: bool = False) -> list[Request]:
        self.failed_steps += 1
        message = f"the forward of this request's step failed: {type(err).__name__}: {err}"
        ended = []
        forks = [child for c in batch.chunks for child in c.request.children
                 if child.status == RequestStatus.RUNNING and child.num_generated == 0]  # made in this step
        for chunk in [*batch.chunks, *(Chunk(child, 0, 0) for child in forks)]:
            req = chunk.request
            if req.is_finished:
                continue
            req.error = message
            # keep: what the row held validly before this step (its new blocks may be half written)
            ended += self.end(req, RequestStatus.FAILED, keep=None if computed else chunk.start)
        return ended

    def _preempt_last(self) -> None:
        running = self.scheduler.running
        if running:
            self.scheduler.preempt(running[-1])
