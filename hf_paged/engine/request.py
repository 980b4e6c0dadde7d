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
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (set by the scheduler)
    prefix_keys: list[bytes] | None = None  # keys of the prompt's full blocks (prefix caching)
    # What made this request's K/V besides its token ids, folded into its blocks' keys (see ``allocator.root_key``):
    # the root of its key chain (an adapter's content digest; the weights' fingerprint is chained in by the KV) ...
    cache_root: bytes = b""
    adapter: object = None  # the LoadedAdapter (engine/lora.py) its tokens run with; None: the base model
    # Half-open token ranges [start, end) of the prompt whose tokens attend to each other both ways (Gemma 3's image
    # tokens, from token_type_ids); a chunk never ends inside one. Empty for causal-only prompts.
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)
    # A prompt with images: its image tensors, content digest, key ids and positions (engine/multimodal.py's
    # MediaPrompt, shared by the request's forks); None for a prompt of token ids only.
    media: object = None
    _key_ids: list[int] | None = field(default=None, repr=False)  # key_tokens of a request with images
    pending_keys: int = 0  # of those, how many this request is computing (others wait for them), from pending_from
    pending_from: int = 0
    cancel_requested: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # prompt logprobs (params.prompt_logprobs set): one entry per prompt token, the first None (nothing predicts it);
    # filled as the prompt's chunks run, position p's logits giving token p + 1's entry
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    matcher: object = None  # structured output: its GrammarMatcher (advanced by each sampled token)
    sampling_state: object = None  # the sampler's per-request state (Sampler.join; a fork takes state.fork())
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    end_time: float | None = None
    timestamps: list[float] = field(default_factory=list)
    emitted: int = 0  # generated tokens already handed out as stream deltas
    children: list["Request"] = field(default_factory=list)  # num_return_sequences > 1: the forks to come
    forked: bool = False  # its forks were made (or it is one): never fork again
    beam: object = None  # beam search (num_beams > 1): the BeamSearch of its group of rows (engine/beams.py)
    draft: list[int] = field(default_factory=list)  # speculation: tokens proposed to follow ``tokens``, verified
    # by the next step (engine/speculative.py); empty for none

    def fork(self, request_id: str | None = None, *, generator=None, into: "Request | None" = None) -> "Request":
        """Another row of this request: everything a row needs to continue from here, copied (lists) or shared
        (settings, images, adapter), and nothing of where this one is (its status, KV row, timings, forks). The one
        way a request's state is copied: the forks of ``num_return_sequences`` (made at ``add_request``, filled at
        admission with ``into``), beam search's rows, and any later stage that needs a row of the same request.

        ``request_id``: the new row's id (with ``into``: that request's own); ``generator``: its random stream (a
        seeded fork's own, ``Sampler.new_generator(params, i)``; None: none); ``into``: fill that request (not
        running) instead of making one. Its grammar matcher, if any, is a new one advanced over the generated
        tokens; the sampler's per-request state is ``state.fork()``."""
        row = into if into is not None else Request(request_id=request_id, tokens=[], num_prompt=self.num_prompt,
                                                    max_new_tokens=self.max_new_tokens, max_length=self.max_length)
        row.tokens = list(self.tokens)
        row.num_prompt, row.max_new_tokens, row.max_length = self.num_prompt, self.max_new_tokens, self.max_length
        row.eos_token_ids, row.params = self.eos_token_ids, self.params
        row.generator = generator if into is None or generator is not None else into.generator
        row.streaming, row.callback = self.streaming, self.callback
        row.cache_root, row.adapter, row.media = self.cache_root, self.adapter, self.media
        row.bidirectional_spans = list(self.bidirectional_spans)
        row._key_ids = None if self._key_ids is None else list(self._key_ids)
        row.prefix_keys = None if self.prefix_keys is None else list(self.prefix_keys)
        for name in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_ranks", "prompt_top_logprobs"):
            value = getattr(self, name)
            setattr(row, name, None if value is None else list(value))
        row.matcher = None
        grammar = getattr(self.params, "grammar", None)
        if self.matcher is not None and grammar is not None:
            row.matcher = grammar.matcher()
            for token in self.generated:
                row.matcher.accept(token)
        row.sampling_state = self.sampling_state.fork() if self.sampling_state is not None else None
        row.beam = self.beam
        row.created_time = self.created_time
        return row

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def key_tokens(self) -> list[int]:
        """The ids its blocks are keyed by (prefix caching): its tokens, where an input other than ids stands at a
        position (an image's content) a stand-in derived from that content."""
        if self.media is None:
            return self.tokens
        if self._key_ids is None or len(self._key_ids) > len(self.tokens):
            self._key_ids = list(self.media.key_ids)
        if len(self._key_ids) < len(self.tokens):  # its generated tokens key as themselves
            self._key_ids.extend(self.tokens[len(self._key_ids):])
        return self._key_ids

    @property
    def remaining(self) -> int:
        """Tokens to run before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def prompt_logits_done(self) -> int:
        """Prompt positions whose logits were taken for prompt logprobs (positions ``0 .. num_prompt - 2`` need
        them); ``num_prompt - 1`` when the request asks for none."""
        if self.prompt_logprobs is None:
            return self.num_prompt - 1
        return len(self.prompt_logprobs) - 1

    @property
    def cache_limit(self) -> int:
        """Tokens this request may take from the prefix cache at admission: all but the last known one (whose
        logits give the next token), and none past the prompt positions whose logits it still needs for prompt
        logprobs (a cached position runs no forward, so it would give no logits)."""
        return min(len(self.tokens) - 1, self.prompt_logits_done)

    def add_prompt_logprobs(self, logprobs: list[float], ranks: list[int], top: list[list[tuple[int, float]]]) -> None:
        """The entries of the next prompt tokens, in order."""
        self.prompt_logprobs.extend(logprobs)
        self.prompt_ranks.extend(ranks)
        self.prompt_top_logprobs.extend(top)

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
            prompt_logprobs=None if self.prompt_logprobs is None or start else list(self.prompt_logprobs),
            prompt_ranks=None if self.prompt_ranks is None or start else list(self.prompt_ranks),
            prompt_top_logprobs=None if self.prompt_top_logprobs is None or start else list(self.prompt_top_logprobs),
            status=self.status,
            finish_reason=self.finish_reason if self.is_finished else None,
            error=self.error,
            created_time=self.created_time,
            first_token_time=self.first_token_time,
            end_time=self.end_time,
            timestamps=self.timestamps[start:],
            cached_tokens=self.cached_tokens,
        )
