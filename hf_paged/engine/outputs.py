"""What the engine hands back: per-request results, request states, engine figures, and its errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class RequestStatus(IntEnum):
    """Where a request is in its life. ``FINISHED`` and above are final (numbers as transformers' where shared)."""

    PENDING = 0  # waiting for admission (also after a preemption)
    RUNNING = 1  # admitted: its K/V is in the pool
    FINISHED = 3  # ended by EOS / a stop token ("stop") or max_new_tokens / the context ("length")
    FAILED = 4  # a forward it took part in raised, or the engine stopped on an error
    CANCELLED = 5  # cancel_request(), or stop(drain=False)


@dataclass
class GenerationOutput:
    """One request's result (final), or one step's new tokens (a streamed delta).

    The fields of transformers' per-request output (``request_id``, ``prompt_ids``, ``generated_tokens``,
    ``logprobs``, ``error``, ``status``, ``created_time``, ``timestamps``, ``lifespan``), plus ``finish_reason``,
    ``top_logprobs``, ``prompt_logprobs``, ``prompt_ranks``, ``prompt_top_logprobs``, ``first_token_time``,
    ``end_time`` and ``cached_tokens`` (prompt tokens its first admission found in the prefix cache: the prefix hit
    a server reports as ``usage.prompt_tokens_details.cached_tokens``). Times are ``time.perf_counter()`` values.

    A streamed delta carries only the tokens (and their logprobs and timestamps) generated since the previous
    delta; the last delta of a request has its final status. Prompt logprobs come whole, in the first delta.

    Example::

        out = manager.get_result(rid)
        if out.status == RequestStatus.FINISHED:
            print(tokenizer.decode(out.generated_tokens), out.finish_reason)
    """

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # per generated token, when asked (logprobs=0 or k)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token, k alternatives (logprobs=k)
    # prompt_logprobs=k: per prompt token (the first None) its log-probability under the model's own distribution,
    # its rank (1 = most likely) and the k most likely (token, log-probability) pairs at its position
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None  # "stop" (EOS / stop token), "length" (max_new_tokens or context), else None
    error: str | None = None
    created_time: float = 0.0
    first_token_time: float | None = None
    end_time: float | None = None
    timestamps: list[float] = field(default_factory=list)  # when each token of generated_tokens was generated
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission (0 before it)

    def is_finished(self) -> bool:
        """Whether the status is final (finished, failed or cancelled); a method, as on transformers' output."""
        return self.status >= RequestStatus.FINISHED

    @property
    def lifespan(self) -> tuple[float, float]:
        """``(created_time, end_time)``, ``-1`` for an end not reached yet (transformers' field)."""
        return self.created_time, -1.0 if self.end_time is None else self.end_time

    @property
    def ttft(self) -> float | None:
        """Seconds from ``add_request`` to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.created_time


@dataclass
class EngineStats:
    """A snapshot of the engine (``manager.stats()``).

    Attributes:
        running / waiting: requests admitted (K/V in the pool) / queued (new or preempted).
        finished / cancelled / failed: requests that ended so, since the engine started.
        preemptions: times a running request gave its blocks back to make room (recomputed later).
        recomputed_tokens: tokens computed again after preemptions (prefix-cache hits excluded).
        prompt_tokens: prompt tokens of the requests admitted; prompt_tokens_computed: prompt positions that went
            through a forward (recomputes included); prefix_hit_tokens: tokens served from cached blocks.
        generated_tokens: tokens sampled.
        blocks_in_use / blocks_cached / blocks_free / num_blocks: the pool (``blocks_free`` counts room the pool
            may still take; cached blocks are reusable prefixes nobody holds, evicted on demand).
        steps: forwards run. ttft / inter_token: recent times to first token / between tokens (seconds).
        host_time_s: seconds the engine thread spent outside the forward (= schedule + plan + sample + output);
            forward_time_s: inside the model's forward (logits included).
        graphs_captured / graph_replays / graph_capture_s: CUDA graphs recorded for decode-only steps / steps served
            by a replay / seconds spent capturing (each capture's own eager step included); graphs_off: why they were
            turned off (a failed or disagreeing capture), None while on or never used.
        encoder_calls / encoder_cache_hits: (vision-language models) image sets run through the vision encoder /
            served from the encoder cache (a prefix-cache hit covering a request's images needs neither).
    """

    running: int = 0
    waiting: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    blocks_in_use: int = 0
    blocks_cached: int = 0
    blocks_free: int = 0
    num_blocks: int = 0
    steps: int = 0
    ttft: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    host_time_s: float = 0.0
    forward_time_s: float = 0.0
    schedule_time_s: float = 0.0
    plan_time_s: float = 0.0
    sample_time_s: float = 0.0
    output_time_s: float = 0.0
    tokens_computed: int = 0  # tokens through forwards (prompt, recompute and decode)
    uptime_s: float = 0.0
    graphs_captured: int = 0
    graph_replays: int = 0
    graph_capture_s: float = 0.0
    graphs_off: str | None = None
    encoder_calls: int = 0  # image sets run through a vision-language model's encoder
    encoder_cache_hits: int = 0  # image sets whose features came from the encoder cache

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix-hit tokens over prompt tokens admitted (0 when none)."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_fraction(self) -> float:
        """Share of the engine's busy time spent on the host side (schedule, plan, sample, output)."""
        busy = self.host_time_s + self.forward_time_s
        return self.host_time_s / busy if busy else 0.0


class QueueFullError(RuntimeError):
    """``add_request`` past ``max_queue_size`` waiting requests."""


class RequestTooLargeError(ValueError):
    """A request whose prompt + ``max_new_tokens`` could never fit the pool or the model's context."""
