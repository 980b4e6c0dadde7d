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
from .beams import BeamSearch
from .outputs import RequestStatus, RequestTooLargeError
from .request import Request
from .sampling import Sampler, prompt_logprobs
from .scheduler import Batch, Chunk, Scheduler
from .speculative import Speculation

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
        speculation: the :class:`~hf_paged.engine.speculative.Speculation` stage (default: one with no engine-wide
            proposer, serving requests that set ``prompt_lookup_num_tokens``).

    Beam requests (``num_beams`` > 1) run as groups of rows (``beams.py``); their logits go to their
    :class:`~hf_paged.engine.beams.BeamSearch` instead of the sampler, and they are handed out once, finished.
    """

    def __init__(self, scheduler: Scheduler, runner, sampler=None, max_context: int | None = None,
                 context_reason: str = "max_position_embeddings", speculation: Speculation | None = None):
        self.scheduler = scheduler
        self.speculation = speculation if speculation is not None else Speculation()
        self.runner = runner
        self.sampler = sampler if sampler is not None else Sampler()
        self.max_context = max_context
        self.context_reason = context_reason
        self.times = StepTimes()
        self.steps = 0
        self.failed_steps = 0
        self.generated_tokens = 0
        self.last_batch_tokens = 0  # tokens the last step ran (0: it could run nothing, e.g. a pool held by others)
        # Seconds of quiet the engine waits for more arrivals before an idle engine's first step (engine/handoff.py:
        # requests that come together are prefilled together); at most ARRIVAL_WAIT_CAP times it in all. 0: none.
        self.arrival_window_s = 0.0
        self.ttft: deque[float] = deque(maxlen=RECENT)
        self.inter_token: deque[float] = deque(maxlen=RECENT)
        self.started = time.perf_counter()

    @property
    def kv(self):
        return self.scheduler.kv

    # ------------------------------------------------------------- admission
    def check_fits(self, prompt_len: int, max_new_tokens: int, num_beams: int = 1) -> None:
        """``RequestTooLargeError`` if a request of this size could never run: past the model's context, or more
        blocks than the whole empty pool holds (a beam request: its ``num_beams`` rows at full length)."""
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
            if num_beams > 1:
                need += (num_beams - 1) * (need - min(prompt_len // self.kv.block_size, need))
            if need > capacity:
                bs = self.kv.block_size
                beams = f" with {num_beams} beams" if num_beams > 1 else ""
                raise RequestTooLargeError(
                    f"a request of {prompt_len} prompt + {max_new_tokens} new tokens{beams} needs {need} KV blocks of "
                    f"{bs} "
                    f"tokens at once ({self.kv.groups.num_groups} layer group(s)), but the whole pool holds "
                    f"{capacity}. Lower max_new_tokens, shorten the prompt, or give the engine a larger pool "
                    f"(BlockPool(num_blocks=...) or max_memory=...).")

    def new_request(self, request_id: str, prompt: list[int], params, streaming: bool = False,
                    callback=None, media=None) -> Request:
        """A request ready for :meth:`add` (sizes already checked); ``media``: its images (a
        :class:`~hf_paged.engine.multimodal.MediaPrompt` of this prompt), if any."""
        max_length = self.max_context if self.max_context is not None else len(prompt) + params.max_new_tokens

        request = Request(
            request_id=request_id, tokens=list(prompt), num_prompt=len(prompt),
            max_new_tokens=params.max_new_tokens, max_length=max_length,
            eos_token_ids=frozenset(params.eos_token_ids), params=params,
            generator=self.sampler.new_generator(params, 0), streaming=streaming, callback=callback,
            logprobs=[] if params.logprobs is not None else None,
            top_logprobs=[] if params.logprobs else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            prompt_ranks=[None] if params.prompt_logprobs is not None else None,
            prompt_top_logprobs=[None] if params.prompt_logprobs is not None else None,
            matcher=params.grammar.matcher() if params.grammar is not None else None, media=media,
            bidirectional_spans=list(media.bidirectional_spans) if media is not None else [],
            sampling_state=self.sampler.join(params),
        )
        # transformers' names for the forks of num_return_sequences (with beams: the 2nd, 3rd ... best sequences);
        # each its own generator, filled again from the request when its prompt is in (Scheduler.add_fork)
        request.children = [request.fork(f"{request_id}__child#{i}",
                                         generator=self.sampler.new_generator(params, i + 1))
                            for i in range(getattr(params, "num_return_sequences", 1) - 1)]
        if getattr(params, "num_beams", 1) > 1:
            request.beam = BeamSearch(params, len(prompt), min(len(prompt) + params.max_new_tokens, max_length),
                                      request.generator)
            request.beam.requests.append(request)
            request.forked = True  # its children are filled by the search, never forked
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
        if req.beam is not None:  # a beam request ends with all its rows
            for beam in req.beam.hidden:
                if not beam.is_finished:
                    self.scheduler.finish(beam, status, keep=None if keep is None else beam.num_computed)
            req = req.beam.requests[0]
            if req.is_finished:
                return []
        self.speculation.forget(req)
        self.scheduler.finish(req, status, keep=keep)
        req.end_time = now
        ended = [req]
        if not req.forked or req.beam is not None:
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
        self.speculation.propose(self.scheduler.running)
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
        self.speculation.observe_step(batch, getattr(self.runner, "forward_time", 0.0))
        self.steps += 1
        num_sampled = sum(c.num_logits for c in batch.chunks)
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
        """``logits``: the sampling chunks' (``Chunk.num_logits`` each, in batch order). Plain requests go through
        the sampler, requests with a draft through speculation's verify, beam rows through their beam search."""
        plain, at, verify, beams = [], [], [], {}
        offset = 0
        for chunk in batch.chunks:
            if not chunk.sample:
                continue
            req = chunk.request
            if req.beam is not None:
                beams.setdefault(id(req.beam), (req.beam, []))[1].append(offset)
            elif chunk.draft:
                verify.append((chunk, offset))
            else:
                plain.append(chunk)
                at.append(offset)
            offset += chunk.num_logits
        touched = []
        if plain:
            index = torch.tensor(at, device=logits.device)
            touched += self._sample_plain(plain, logits if len(at) == logits.shape[0] else logits[index])
        for chunk, offset in verify:
            touched += self._verify(chunk, logits[offset: offset + chunk.num_logits])
        for search, offsets in beams.values():
            touched += self._step_beams(search, logits[torch.tensor(offsets, device=logits.device)])
        return touched

    def _sample_plain(self, chunks: list[Chunk], logits) -> list[Request]:
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
            self.speculation.observe_token(req, token)
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

    def _verify(self, chunk: Chunk, logits) -> list[Request]:
        """Speculation: accept a prefix of ``chunk.draft`` (``logits`` ``[len(draft) + 1, vocab]``), add the
        target's next token, cut the rejected tokens' K/V off the row."""
        req = chunk.request
        tokens = self.speculation.verify(req, logits, chunk.draft, self.sampler)
        self.scheduler.rollback(req, chunk.start + len(tokens))  # the last known token + the accepted drafts
        now = time.perf_counter()
        for token in tokens:
            if req.timestamps:
                self.inter_token.append(now - req.timestamps[-1])
            else:
                self.ttft.append(now - req.created_time)
            req.append(token, now)
            self.generated_tokens += 1
            if req.finish_reason is not None:
                self.end(req, RequestStatus.FINISHED)
                break
        return [req]

    def _step_beams(self, search: BeamSearch, logits) -> list[Request]:
        """One step of a beam request: ``logits`` ``[k, vocab]`` of its k rows (``[1, vocab]``: its prompt's, at
        the first step). Its rows are re-pointed (or it ends, handing out its best sequences)."""
        rows = search.requests
        params = [r.params for r in rows]
        log_probs = self.sampler.process(torch.log_softmax(logits.float(), dim=-1), params, [r.tokens for r in rows],
                                         [r.num_generated for r in rows],
                                         [rows[0].sampling_state] * len(rows))  # [k, vocab]
        started = search.started
        plan = search.step(log_probs)
        if search.done:
            return self._finish_beams(search)
        if not started:
            parent = rows[0]
            beams = [parent.fork(f"{parent.request_id}#beam{i}") for i in range(1, search.num_beams)]
            search.requests.extend(beams)
            self.scheduler.add_beams(parent, beams)
        self.scheduler.apply_beams(search.requests, plan.sources, plan.tokens)
        return []

    def _finish_beams(self, search: BeamSearch) -> list[Request]:
        """The search is over: the request and its children (``num_return_sequences``) take the best sequences."""
        parent = search.requests[0]
        now = time.perf_counter()
        results = [parent, *parent.children]
        for req, (generated, _) in zip(results, search.best()):
            req.tokens = req.tokens[: req.num_prompt] + generated
            req.timestamps = [now] * len(generated)
            req.first_token_time = now if generated else None
            req.finish_reason = "stop" if generated and generated[-1] in req.eos_token_ids else "length"
            self.generated_tokens += len(generated)
        self.ttft.append(now - parent.created_time)
        return self.end(parent, RequestStatus.FINISHED)

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
