"""One request's state inside the engine: its tokens, how many of them the pool holds, its row, its timings.

The scheduler changes a request's place (waiting, running) and ``num_computed``; the engine appends sampled tokens
and ends it. Nothing here touches tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .outputs import GenerationOutput, RequestStatus


@dataclass(eq=False)
class Request:
    request_id: str
    tokens: list[int]  # prompt + generated ids
    num_prompt: int
    max_new_tokens: int
    max_length: int  # the context limit: the request ends ("length") when it holds this many tokens
    eos_token_ids: frozenset[int] = frozenset()
    params: object = None  # SamplingParams
    generator: object = None  # torch.Generator of a seeded request: kept across preemptions
    streaming: bool = False
    callback: object = None
    status: RequestStatus = RequestStatus.PENDING
    num_computed: int = 0  # tokens whose K/V the pool holds for this request
    row: object = None  # its KV row while running (see kv.py)
    admitted_at: int = -1  # admission counter: the most recently admitted is preempted first
    ever_admitted: bool = False
    preemptions: int = 0
    lost_tokens: int = 0  # tokens computed before the last preemption (recomputed unless the prefix cache has them)
    prefix_keys: list[bytes] | None = None  # keys of the prompt's full blocks (prefix caching)
    pending_keys: int = 0  # of those, how many this request is computing (others wait for them), from pending_from
    pending_from: int = 0
    cancel_requested: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    end_time: float | None = None
    timestamps: list[float] = field(default_factory=list)
    emitted: int = 0  # generated tokens already handed out as stream deltas
    children: list["Request"] = field(default_factory=list)  # num_return_sequences > 1: the forks to come
    forked: bool = False  # its forks were made (or it is one): never fork again

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def remaining(self) -> int:
        """Tokens to run before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def append(self, token: int, now: float, logprob: float | None = None,
               top: list[tuple[int, float]] | None = None) -> None:
        """A sampled token; ends the request ("stop" / "length") when it should."""
        self.tokens.append(int(token))
        self.timestamps.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(float(logprob))
        if self.top_logprobs is not None and top is not None:
            self.top_logprobs.append(list(top))
        if int(token) in self.eos_token_ids:
            self.finish_reason = "stop"
        elif self.num_generated >= self.max_new_tokens or len(self.tokens) >= self.max_length:
            self.finish_reason = "length"

    def output(self, delta: bool = False) -> GenerationOutput:
        """The result so far (``delta``: only what was generated since the last delta, which it marks as handed out)."""
        start = self.emitted if delta else 0
        if delta:
            self.emitted = self.num_generated
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=self.tokens[: self.num_prompt],
            generated_tokens=self.tokens[self.num_prompt + start:],
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            top_logprobs=None if self.top_logprobs is None else self.top_logprobs[start:],
            status=self.status,
            finish_reason=self.finish_reason if self.is_finished else None,
            error=self.error,
            created_time=self.created_time,
            first_token_time=self.first_token_time,
            end_time=self.end_time,
            timestamps=self.timestamps[start:],
        )
