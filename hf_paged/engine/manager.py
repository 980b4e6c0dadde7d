"""The user-facing :class:`ContinuousBatchingManager`: transformers' continuous-batching API over one engine thread,
with any number of threads adding requests and reading results.

Thread-safety: every public method may be called from any thread. The state those threads share with the engine
thread is the :class:`~hf_paged.engine.handoff.Handoff`'s (its docstring states the locking rule); the manager
checks and prepares requests outside it, and calls request callbacks outside its lock.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Iterator

import torch

from .. import compat
from ..distributed import sum_over_ranks
from . import features, openmp
from .core import EngineCore
from .distributed import check_broadcastable
from .handoff import Handoff, call_back
from .lora import AdapterSet
from .loop import run_engine, run_tp_engine
from .multimodal import MediaPrompt
from .outputs import EngineStats, GenerationOutput, RequestStatus
from .sampling import CALLABLES, SamplingParams

DEFAULT_MAX_UNREAD = 100_000  # finished results kept until read; the oldest unread are dropped past it
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                 "eos_token_id", "stop_token_ids", "logprobs", "num_return_sequences", "ignore_eos", "min_tokens",
                 "prompt_logprobs", "grammar", "num_beams", "length_penalty", "early_stopping",
                 "prompt_lookup_num_tokens")


def is_request_setting(name: str) -> bool:
    """Whether ``name`` is a per-request setting: the engine's own (``SAMPLING_KEYS``), a ``GenerationConfig`` field,
    or one of generate()'s per-call callables (``logits_processor``, ``stopping_criteria``,
    ``prefix_allowed_tokens_fn``)."""
    return name in SAMPLING_KEYS or name in CALLABLES or name in compat.generation_defaults()


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
                 default_options: dict | None = None, sync=None, media=None,
                 adapters: AdapterSet | None = None):
        if max_queue_size is not None and (not isinstance(max_queue_size, int) or max_queue_size < 1):
            raise ValueError(f"max_queue_size must be a positive int or None (unlimited), got {max_queue_size!r}.")
        self._core = core
        self.generation_config = generation_config
        self.vocab_size = vocab_size
        self.max_queue_size = max_queue_size
        self._defaults = dict(default_options or {})
        self._sync = sync  # tensor parallelism: the ranks' control channel (engine/distributed.py), else None
        self._media = media  # a vision-language model's image stage (engine/multimodal.py), else None
        self._adapters = adapters  # LoRA adapters served per request (engine/lora.py), shared with the runner
        # The engine thread holds the handoff and the core, never the manager: a manager dropped without stop() is
        # collected, its handoff is abandoned, the thread ends (cancelling what is left), then the pool is freed.
        self._handoff = Handoff(core, max_unread_results)
        self._finalizer = weakref.finalize(self, self._handoff.abandon)
        self._kept = False  # stopped with keep_for_next_session: start() opens a new session on the same engine
        self._asleep = False  # sleep() released the pool's tensors
        self.warmed_up = True  # (transformers' flag: nothing to warm here, decode graphs are captured as they run)
        # Called with this manager by stop(keep_for_next_session=True): the model's transformers-facing methods set it
        # to keep the manager for their next call (engine/transformers_api.py).
        self.keeper = None

    @property
    def max_unread_results(self) -> int:
        """Finished results kept until read; past it the oldest unread are dropped."""
        return self._handoff.max_unread_results

    @max_unread_results.setter
    def max_unread_results(self, value: int) -> None:
        self._handoff.max_unread_results = value

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread (no-op if it runs). Requests added before ``start`` wait for it. A manager stopped
        with ``keep_for_next_session=True`` starts a new session on the same engine (pool, prefix cache, graphs;
        results of the last session not read are dropped); one asleep is woken first."""
        if self._kept and self._handoff.stopped:
            self._handoff.join()
            self._finalizer.detach()
            self._handoff = Handoff(self._core, self._handoff.max_unread_results)
            self._finalizer = weakref.finalize(self, self._handoff.abandon)
        self._kept = False
        if self._asleep:
            self.wake()
        if not self.is_running():  # (engine thread not running) a walk of the model: replaced weights are seen too
            self._core.kv.check_weights(rewalk=True)
        device = getattr(self._core.runner, "device", None)  # (a test's stand-in runner has none)
        if device is not None and device.type == "cpu" and not self._handoff.started:
            openmp.release_caller_threads()  # this thread's idle OpenMP pool would slow the engine thread's (openmp.py)
        if self._sync is None:
            self._handoff.start(run_engine, self._handoff, self._core)
        else:
            self._handoff.start(run_tp_engine, self._handoff, self._core, self._sync)

    def stop(self, block: bool = True, timeout: float | None = None, drain: bool = True,
             keep_for_next_session: bool = False, hard_stop: bool = False) -> None:
        """Stop serving. ``drain=True`` finishes the running and waiting requests first; ``drain=False`` (or
        transformers' ``hard_stop=True``) cancels them. With ``block``, waits for the engine thread: when ``timeout``
        seconds pass while draining, what is left is cancelled and the thread is joined (one more step at most).
        Every request ends with a final status; ``add_request`` raises afterwards, until a ``start()`` when
        ``keep_for_next_session=True`` (transformers' name: the engine, its pool and prefix cache are kept for a next
        session; a manager made by ``model.init_continuous_batching()`` is then the model's persistent manager)."""
        if hard_stop:
            drain = False
        if keep_for_next_session:
            self._kept = True
            if self.keeper is not None:
                self.keeper(self)
        handoff = self._handoff
        call_back(handoff.stop(drain))
        if not block or not handoff.started or handoff.on_engine_thread():  # (from a callback: no self-join)
            return
        if not handoff.join(timeout):
            handoff.cancel_rest()
            handoff.join()

    def destroy(self) -> None:
        """transformers' name: stop for good (cancelling what is left) and forget being kept for a next session."""
        self._kept = False
        self.stop(block=True, drain=False)

    def warmup(self) -> None:
        """transformers' name; nothing to do (decode graphs are captured as decode steps first run)."""

    # ------------------------------------------------------- weights, memory
    def weights_updated(self) -> None:
        """Forget every cached prefix now (their blocks return to the free list). Not needed for correctness: every
        block key's root holds the model's weights fingerprint (``hf_paged.weights``: their values, however written),
        the adapter's content digest and PEFT's switches, so K/V of other weights is never found; call it to free the
        old weights' blocks at once."""
        self._core.kv.reset_prefix_cache()

    def sleep(self) -> int:
        """Give the KV memory back between uses (e.g. to the trainer between RL rollouts): frees the pool's K/V
        tensors (the prefix cache goes with them) and the decode steps' CUDA graphs; returns the pool's bytes freed.
        The manager must not be running: call it after ``stop(keep_for_next_session=True)`` (or between
        ``generate_batch`` calls of a persistent manager). :meth:`wake` (or the next ``start()``) takes the memory
        again; a pool shared with other users must be idle too (``ValueError`` while rows hold blocks).

        Example::

            manager = hf_paged.keep_engine(model)          # model.generate_batch() runs on it from now on
            outputs = model.generate_batch(prompts, max_new_tokens=256)
            freed = manager.sleep()                       # bytes of K/V back for the backward pass
            loss.backward(); optimizer.step()
            manager.wake()
        """
        if self.is_running():
            raise RuntimeError("cannot sleep while the engine runs: stop it first with "
                               "manager.stop(keep_for_next_session=True), then sleep().")
        freed = self.pool.release_tensors()
        graphs = getattr(self._core.runner, "graphs", None)
        if graphs is not None:
            graphs.release()
        if self.pool.layer_shapes and next(iter(self.pool.layer_shapes.values())).device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True
        return freed

    def wake(self) -> int:
        """Take the KV memory back after :meth:`sleep` now (instead of at the next forward); returns the pool's
        bytes. No-op while awake."""
        if not self._asleep:
            return self.pool.bytes_reserved()
        self._asleep = False
        return self.pool.make_tensors()

    @property
    def asleep(self) -> bool:
        """Whether :meth:`sleep` released the pool's tensors and nothing took them again."""
        return self._asleep

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to end (after :meth:`stop`, or when the engine stopped on an error). Returns
        True once it has ended (or was never started), False when ``timeout`` seconds passed first."""
        return self._handoff.join(timeout)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called (the engine thread may have ended since)."""
        return self._handoff.started

    def __enter__(self) -> "ContinuousBatchingManager":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(block=True, drain=exc_type is None)

    def is_running(self) -> bool:
        """Whether the engine thread is alive and not stopping."""
        return self._handoff.is_running()

    @property
    def error(self) -> str | None:
        """Why the engine stopped, if it stopped on an error (a lost tensor-parallel rank, an engine bug)."""
        return self._handoff.error

    def memory_stats(self, all_ranks: bool = False):
        """The pool's :class:`~hf_paged.MemoryStats`. Under tensor parallelism each rank's pool holds its own KV
        heads; ``all_ranks=True`` sums the byte figures over the ranks (a collective: call it on every rank at a
        moment their pools agree, e.g. after ``stop()``; ``ValueError`` if their block counts differ)."""
        stats = self.pool.memory_stats()
        if self._adapters is not None:
            stats = dataclasses.replace(stats, adapter_bytes=self._adapters.nbytes,
                                        adapter_bytes_reserved=self._adapters.bytes_reserved)
        if all_ranks and self._sync is not None:
            return sum_over_ranks(stats, group=self._sync.stats_group)
        return stats

    @property
    def max_context(self) -> int | None:
        """The most tokens (prompt + generated) one request may hold (the model's ``max_position_embeddings``, or
        lower where its rotary embedding needs it)."""
        return self._core.max_context

    @property
    def takes_images(self) -> bool:
        """Whether requests may carry images (a vision-language model: ``add_request`` takes processor outputs)."""
        return self._media is not None

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
                    record_timestamps: bool | None = None, adapter: str | None = None, **settings) -> str:
        """Queue one request; returns its id.

        Args:
            input_ids: the prompt's token ids (a list of ints or a 1-D tensor); for a vision-language model also one
                prompt's processor outputs (a mapping or ``BatchFeature`` of batch 1: ``input_ids`` and the model's
                image tensors, e.g. ``processor(text=..., images=[image], return_tensors="pt")``). Its images are
                encoded once, at its first prefill chunk that needs them; prefix caching keys its blocks by the
                images' content.
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
                ``num_beams`` > 1: beam search (with ``length_penalty``, ``early_stopping``; ``num_return_sequences``
                best sequences, the 2nd and later as ``{id}__child#i``), handed out once finished.
                ``prompt_lookup_num_tokens``: n-gram speculation with that many draft tokens (0: none for this
                request, whatever the engine's ``speculative``).
            callback: called from the engine thread with each step's :class:`GenerationOutput` delta (keep it short).
            record_timestamps: accepted for transformers' signature; timestamps are always recorded.
            adapter: the name of a loaded LoRA adapter (:meth:`load_adapter`) to run this request with; None: the
                base model. Requests of different adapters share the engine's steps.
            settings: any other ``GenerationConfig`` field for this request (``no_repeat_ngram_size``,
                ``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``, ``typical_p``, ``stop_strings`` (needs the
                engine's ``tokenizer=``), ``max_time``, ...), and generate()'s ``logits_processor``,
                ``stopping_criteria`` and ``prefix_allowed_tokens_fn``, applied to this request alone with its own
                ids (contracts in ``hf_paged/engine/processors.py`` and ``stopping.py``).

        Raises:
            QueueFullError: ``max_queue_size`` requests are already waiting.
            RequestTooLargeError: the prompt + ``max_new_tokens`` could never fit the pool or the model's context.
            ValueError: a bad prompt or setting (named), or a request id in use.
            AdapterNotLoadedError: (a ValueError) ``adapter`` names no loaded adapter; the message lists them.
            RuntimeError: the manager was stopped, or its engine failed.
        """
        return self._add([(input_ids, request_id)], max_new_tokens, streaming, generation_config, callback,
                         dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed, eos_token_id=eos_token_id,
                              stop_token_ids=stop_token_ids, logprobs=logprobs,
                              num_return_sequences=num_return_sequences, ignore_eos=ignore_eos,
                              min_tokens=min_tokens, prompt_logprobs=prompt_logprobs, grammar=grammar,
                              **settings), adapter)[0]

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
        adapter = options.pop("adapter", None)
        unknown = [name for name in options if not is_request_setting(name)]
        if unknown:
            raise TypeError(f"add_requests got unexpected options {sorted(unknown)}.")
        return self._add(list(zip(inputs, ids)), max_new_tokens, streaming, generation_config, callback, options,
                         adapter)

    def _add(self, items, max_new_tokens, streaming, generation_config, callback, sampling: dict,
             adapter: str | None = None) -> list[str]:
        config = generation_config if generation_config is not None else self.generation_config
        overrides = {**self._defaults, **{k: v for k, v in sampling.items() if v is not None}}
        prepared = []
        for input_ids, request_id in items:
            prompt = self._prompt(input_ids)  # token ids, or a MediaPrompt (ids and images)
            length = len(prompt.tokens) if isinstance(prompt, MediaPrompt) else len(prompt)
            params = SamplingParams.from_generation_config(config, prompt_length=length,
                                                           max_new_tokens=max_new_tokens, **overrides)
            self._core.check_fits(length, params.max_new_tokens, params.num_beams)
            self._core.sampler.check(params, self.vocab_size)
            if self._sync is not None:
                check_broadcastable(params)
            prepared.append((prompt, params, request_id))
        self._check_driver()
        new_request = partial(_new_request, self._core, streaming=streaming, callback=callback)
        if adapter is None:
            return self._handoff.add(prepared, new_request, self.max_queue_size)
        held = self._adapter_set().hold(adapter)  # not evicted until its requests are attached
        try:
            return self._handoff.add(prepared, partial(_with_adapter, new_request, self._adapters, held),
                                     self.max_queue_size)
        finally:
            self._adapters.release(held)

    def _prompt(self, input_ids) -> list[int] | MediaPrompt:
        if isinstance(input_ids, Mapping):  # one prompt's processor outputs
            if self._media is None:
                raise ValueError("this request is a mapping of processor outputs, but the model takes no images "
                                 "here (no get_image_features, or a tensor-parallel engine): pass token ids.")
            media = self._media.prepare(input_ids)
            if media is None:
                input_ids = input_ids["input_ids"]
            else:
                self._prompt(media.tokens)  # the ids' own checks
                return media
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

    def _check_driver(self) -> None:
        if self._sync is not None and not self._sync.is_driver:
            raise ValueError(f"this is tensor-parallel rank {self._sync.rank}: requests are added and cancelled on "
                             "rank 0 only (the other ranks follow its steps).")

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its blocks go back at the next step, its result has status ``CANCELLED`` (with the
        tokens generated so far). No-op for a request that already ended; ``KeyError`` for an unknown id."""
        self._check_driver()
        call_back(self._handoff.cancel(request_id))

    # --------------------------------------------------------------- adapters
    def load_adapter(self, name: str, source, adapter_name: str | None = None) -> None:
        """Load a LoRA adapter under ``name`` for requests to name (``add_request(..., adapter=name)``).

        ``source``: a directory saved by peft's ``save_pretrained`` (``adapter_config.json`` +
        ``adapter_model.safetensors``), a ``PeftModel`` (its adapter ``adapter_name``, default its active one), or a
        ``(LoraConfig, state_dict)`` pair. Loading a name again replaces it (its cached KV is never reused). Past
        ``max_loras`` the least recently used idle adapter is unloaded; ``RuntimeError`` if all are in use.

        Example::

            manager.load_adapter("sql", "adapters/sql")
            rid = manager.add_request(ids, max_new_tokens=32, adapter="sql")
        """
        self._adapter_set().load(name, source, adapter_name)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (``AdapterNotLoadedError`` if not loaded; ``RuntimeError`` while live requests
        use it)."""
        self._adapter_set().unload(name)

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return self._adapters.names if self._adapters is not None else []

    def _adapter_set(self) -> AdapterSet:
        if self._sync is not None:
            features.check({"adapter", "tensor_parallel"})
        if self._adapters is None:
            raise ValueError("this manager was built without adapter support (max_loras=0); build it with "
                             "init_continuous_batching(model, max_loras=N).")
        return self._adapters

    # ---------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """A finished request's result, once (it is forgotten when read).

        With ``request_id``: waits until that request ends and returns its result (never another's); ``KeyError``
        if the id is unknown, or its result was already read or dropped (``max_unread_results``). Without: the
        oldest unread result of any request. ``None`` when ``timeout`` seconds pass first, or when the engine is not
        running and nothing is left to wait for.
        """
        return self._handoff.get_result(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Results as they finish, until the engine stops and none are left."""
        while True:
            out = self.get_result(timeout=0.1)
            if out is not None:
                yield out
            elif not self.is_running() and not self._handoff.has_unread():
                return

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of one request as they come. A streaming request yields one :class:`GenerationOutput` per
        step carrying only that step's new tokens (``generated_tokens``, ``logprobs``, ``timestamps``), the last one
        with the final status; a non-streaming request yields its final result once."""
        deltas = self._handoff.deltas(request_id)
        if deltas is None:
            out = self.get_result(request_id)
            if out is not None:
                yield out
            return
        yield from deltas

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
        ended, waiting = self._handoff.counts()
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
            **({} if self._media is None else dict(encoder_calls=self._media.encoder_calls,
                                                    encoder_cache_hits=self._media.encoder_hits)),
        )

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped" if self._handoff.stopped else "not started"
        live, unread = self._handoff.sizes()
        return f"ContinuousBatchingManager({state}, live={live}, unread={unread})"


def _new_request(core: EngineCore, request_id: str, prompt, params, **options):
    """The handoff's request maker: a prompt with images carries its :class:`MediaPrompt` into the request."""
    if isinstance(prompt, MediaPrompt):
        return core.new_request(request_id, prompt.tokens, params, media=prompt, **options)
    return core.new_request(request_id, prompt, params, **options)


def _graph_stats(graphs) -> dict:
    if graphs is None:
        return {}
    return dict(graphs_captured=graphs.captured, graph_replays=graphs.replays, graph_capture_s=graphs.capture_s,
                graphs_off=graphs.disabled_reason)


def _with_adapter(new_request, adapters: AdapterSet, adapter, request_id, prompt, params):
    """``new_request``'s request, attached to ``adapter`` (its KV chain rooted at the adapter)."""
    request = new_request(request_id, prompt, params)
    adapters.attach(adapter, request)
    return request
