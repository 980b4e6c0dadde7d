"""The bridge between the engine thread and the asyncio server.

The engine calls back from its own thread with each step's new tokens. Those deltas go to one detokenizer thread
(a single worker keeps each request's deltas in order), which turns ids into whole characters, checks stop strings,
formats logprobs, and posts :class:`Piece` objects to the request's asyncio queue. Tokenizing prompts runs on a small
thread pool. The event loop only moves finished pieces into HTTP chunks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..engine.lora import AdapterNotLoadedError
from ..engine.outputs import QueueFullError
from ..engine.structured import GrammarCompiler, GrammarSpec
from .detokenizer import IncrementalDetokenizer
from .errors import APIError
from .media import MediaLoader, processor_inputs
from .protocol import SamplingParams
from .stops import StopChecker
from .tools import ToolRequest, template_messages, template_reads_tools

log = logging.getLogger("hf_paged.serve")

RETRY_AFTER_S = 1
_FINAL = ("FINISHED", "CANCELLED", "FAILED")


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class PromptLogprob:
    """One prompt token's entry (the first token's ``logprob`` / ``rank`` are None: nothing predicts it)."""

    token_id: int
    token: str
    logprob: float | None
    rank: int | None
    top: list[tuple[int, str, float]]  # the k most likely (id, text, logprob) at its position


@dataclass
class Piece:
    """What one engine delta adds to a choice: text safe to send, how many tokens it covers, and the end."""

    index: int  # the choice's index in the response
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # set on a choice's last piece: "stop" / "length"
    error: str | None = None  # set when the engine failed the request
    prompt_logprobs: list[PromptLogprob] | None = None  # on the choice's first piece, when asked
    cached_tokens: int = 0  # the engine request's prompt tokens found in the prefix cache


@dataclass
class _Choice:
    """One engine request's output state; touched only by the detokenizer thread after submission."""

    index: int
    request_id: str
    detok: IncrementalDetokenizer
    stops: StopChecker
    want_logprobs: bool
    sink: "Generation"
    want_prompt_logprobs: bool = False
    generate: bool = True  # False: max_tokens 0 (the one token the engine runs is not returned)
    num_tokens: int = 0
    done: bool = False
    last_token_time: float | None = None


@dataclass
class Generation:
    """The choices of one HTTP request (``n`` per prompt) and the queue their pieces arrive on."""

    loop: asyncio.AbstractEventLoop
    engine: "AsyncEngine"
    start_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    choices: list[_Choice] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_time: float | None = None
    pending: int = 0  # choices not finished yet (event-loop side)
    n: int = 1  # choices per prompt
    cached: dict[int, int] = field(default_factory=dict)  # choice index -> its prompt tokens found in the cache

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache, over the prompts (each prompt's first choice: the others of the
        same prompt reuse what it computed), as ``usage.prompt_tokens_details.cached_tokens`` reports them."""
        return sum(v for index, v in self.cached.items() if index % self.n == 0)

    async def pieces(self):
        """Pieces in arrival order until every choice has finished (its ``finish_reason`` or ``error`` piece)."""
        while self.pending:
            piece = await self.queue.get()
            self.completion_tokens += piece.num_tokens
            if piece.cached_tokens:
                self.cached[piece.index] = piece.cached_tokens
            if piece.finish_reason is not None or piece.error is not None:
                self.pending -= 1
            yield piece

    def cancel(self) -> None:
        """Cancel every choice still running (a client went away); their blocks go back at the next step."""
        for choice in self.choices:
            self.engine.cancel(choice)

    def _post(self, piece: Piece) -> None:
        if piece.num_tokens and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.queue.put_nowait(piece)


class AsyncEngine:
    """Submits requests to a continuous-batching manager and streams their text back to the event loop.

    Args:
        manager: the engine (``hf_paged.init_continuous_batching(model, ...)``), started by the caller.
        tokenizer: the model's tokenizer (a ``PreTrainedTokenizerBase``).
        vocab_size: the model's vocabulary (prompt token ids must be below it); default the manager's, else
            ``len(tokenizer)``.
        metrics: a :class:`~hf_paged.serve.metrics.ServerMetrics` or ``None``.
        tokenize_workers: threads for request parsing, prompt tokenization and chat templates (default 1: a fast
            tokenizer's encode can refuse concurrent use of one instance).

    Example::

        engine = AsyncEngine(manager, tokenizer)
        ids = await engine.encode("Hello")
        gen = engine.generate([ids], SamplingParams(), n=1, max_new_tokens=[8])
        async for piece in gen.pieces(): print(piece.text, end="")
    """

    def __init__(self, manager, tokenizer, metrics=None, vocab_size: int | None = None, tokenize_workers: int = 1):
        self.manager = manager
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or getattr(manager, "vocab_size", None) or len(tokenizer)
        self.metrics = metrics
        self._tokenize_pool = ThreadPoolExecutor(tokenize_workers, thread_name_prefix="hf_paged-tokenize")
        self._detok_pool = ThreadPoolExecutor(1, thread_name_prefix="hf_paged-detok")
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="hf_paged-grammar")
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        self._serial = itertools.count()
        self._token_text: dict[int, str] = {}
        self._live: dict[str, _Choice] = {}  # submitted, not ended (added on the loop, removed by the detok thread)

    @property
    def max_context(self) -> int:
        return self.manager.max_context

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._detok_pool.shutdown(wait=True, cancel_futures=False)

    # -- tokenization (thread pool) --------------------------------------------------------------------------------
    async def _offload(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def run(self, fn, *args):
        """``fn(*args)`` on the tokenizer threads (request parsing, anything that may take a while)."""
        return await self._offload(fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._offload(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def decode(self, ids: list[int]) -> str:
        return await self._offload(lambda: self.tokenizer.decode(ids, skip_special_tokens=True))

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: ToolRequest | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The prompt's ids: ``messages`` through the chat template, with ``tools`` (see ``tools.py``) and the
        request's ``chat_template_kwargs`` (``template_kwargs``: extra template variables, checked by
        ``protocol.template_kwargs``)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt.")
        reads_tools = template_reads_tools(template if isinstance(template, str) else str(template))
        messages = template_messages(messages, tools, reads_tools)
        extra = {**(template_kwargs or {})}
        if tools is not None and tools.choice != "none" and reads_tools:
            extra["tools"] = tools.tools

        def render():
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

        return await self._offload(render)

    async def chat_inputs(self, messages: list[dict], processor, media: MediaLoader,
                          add_generation_prompt: bool = True, template_kwargs: dict | None = None):
        """One prompt's processor outputs (``input_ids`` and image tensors, batch 1) for ``messages`` holding images
        (``{"type": "image", "url"}`` parts): fetched and decoded by ``media`` (its own threads, ``media.py``), then
        run through ``processor``'s chat template on the tokenizer threads."""
        loaded = await media.load(messages)
        return await self._offload(lambda: processor_inputs(processor, loaded, add_generation_prompt,
                                                            template_kwargs))

    def stop_token_ids(self) -> list[int]:
        """The ids that end a request by default (the generation config's EOS and the tokenizer's)."""
        eos = getattr(getattr(self.manager, "generation_config", None), "eos_token_id", None)
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    async def compile_grammar(self, spec: GrammarSpec):
        """The compiled grammar for ``spec`` (cached by spec), compiled on the grammar thread, never the engine's."""

        def compile_():
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids())
            return self._grammars.compile(spec)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._grammar_pool, compile_)
        except ImportError as exc:
            raise APIError(400, f"this server cannot constrain output: {exc}.") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from None

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams, n: int, max_new_tokens: list[int],
                 start_time: float | None = None, adapter: str | None = None) -> Generation:
        """Submit ``n`` choices per prompt (token ids, or one prompt's processor outputs with images; choice index
        ``prompt * n + i``), run with LoRA ``adapter`` (None: the base model). All or nothing: if the engine refuses
        one (queue full, too large, stopped, adapter unloaded), those already submitted are cancelled and an
        :class:`APIError` raised."""
        gen = Generation(asyncio.get_running_loop(), self, start_time or time.perf_counter())
        gen.prompt_tokens = sum(len(prompt_ids(p)) for p in prompts)
        gen.n = n
        serial = next(self._serial)
        beams = params.num_beams > 1  # one beam request per prompt: its n best sequences are the n choices
        try:
            for p, ids in enumerate(prompts):
                first = None
                for i in range(n):
                    index = p * n + i
                    rid = f"srv-{serial}-{index}-{uuid.uuid4().hex[:8]}" if first is None else \
                        f"{first.request_id}__child#{i - 1}"  # the engine's name for the i-th best
                    choice = _Choice(index, rid,
                                     IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                                     StopChecker(params.stop, params.include_stop, params.min_tokens or 0),
                                     params.logprobs is not None and params.generate, gen,
                                     params.engine_prompt_logprobs is not None, params.generate)
                    gen.choices.append(choice)
                    gen.pending += 1
                    self._live[choice.request_id] = choice
                    if beams:
                        first = first or choice
                        if i < n - 1:
                            continue  # submitted once every choice of the prompt is known
                        choice = first
                    try:
                        self.manager.add_request(ids if isinstance(ids, Mapping) else list(ids),
                                                 request_id=choice.request_id,
                                                 max_new_tokens=max_new_tokens[p], callback=self._callback(choice),
                                                 **params.engine_kwargs(i), **({"adapter": adapter} if adapter else {}))
                    except Exception:
                        self._live.pop(choice.request_id, None)
                        raise
        except QueueFullError as exc:
            gen.cancel()
            raise APIError(429, f"the server's queue is full ({exc}); retry in {RETRY_AFTER_S} s.",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except AdapterNotLoadedError as exc:  # unloaded (or evicted) since the request was checked
            gen.cancel()
            raise APIError(404, str(exc), param="model", code="model_not_found") from None
        except ValueError as exc:  # RequestTooLargeError is one
            gen.cancel()
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:
            gen.cancel()
            raise APIError(503, f"the engine is not running: {exc}") from None
        return gen

    async def watch(self, period_s: float = 0.5) -> None:
        """Runs beside the server: if the engine thread dies, every choice still waiting ends with an error (an
        engine that died cannot be trusted to report its requests), and /health answers 503."""
        while True:
            await asyncio.sleep(period_s)
            if self._live and not self.manager.is_running():
                for choice in list(self._live.values()):
                    self._submit(self._fail, choice, "the engine thread stopped; restart the server")

    def _submit(self, fn, *args) -> None:
        try:
            self._detok_pool.submit(fn, *args)
        except RuntimeError:  # shutting down
            pass

    def _fail(self, choice: _Choice, message: str) -> None:
        if choice.done:
            return
        choice.done = True
        self._live.pop(choice.request_id, None)
        choice.sink.loop.call_soon_threadsafe(choice.sink._post, Piece(choice.index, "", 0, error=message))

    def cancel(self, choice: _Choice) -> None:
        """Cancel a choice the client no longer waits for (no-op once it has ended)."""
        if not choice.done:
            self._cancel_now(choice)

    def _cancel_now(self, choice: _Choice) -> None:
        try:
            self.manager.cancel_request(choice.request_id)
        except KeyError:  # never queued, or already ended and read: nothing to give back
            pass

    def _callback(self, choice: _Choice):
        def on_output(output) -> None:  # engine thread: hand over and return at once
            # (a beam request's 2nd and later sequences come through its callback, under their own ids)
            target = choice if output.request_id == choice.request_id else self._live.get(output.request_id, choice)
            self._submit(self._process, target, output, time.perf_counter())

        return on_output

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _process(self, choice: _Choice, output, now: float) -> None:
        """Detokenizer thread: one engine delta -> one Piece posted to the event loop."""
        final = getattr(output.status, "name", str(output.status)).upper() in _FINAL
        if choice.done:  # ended here already (a stop string): only the engine's result is left to drop
            if final:
                self._drop_result(choice)
                self._live.pop(choice.request_id, None)
            return
        try:
            piece = self._piece(choice, output, now)
        except Exception as exc:  # a tokenizer failure ends this choice, never the thread
            log.exception("output processing failed for %s", choice.request_id)
            choice.done = True
            self._cancel_now(choice)
            piece = Piece(choice.index, "", 0, error=f"output processing failed: {exc}")
        if final:
            self._drop_result(choice)
        if choice.done:
            self._live.pop(choice.request_id, None)
        if piece is not None:
            choice.sink.loop.call_soon_threadsafe(choice.sink._post, piece)

    def _drop_result(self, choice: _Choice) -> None:
        """The engine keeps each ended request's result until it is read; the pieces already carried it."""
        try:
            self.manager.get_result(choice.request_id, timeout=0)
        except KeyError:  # already read or never queued
            pass

    def _piece(self, choice: _Choice, output, now: float) -> Piece | None:
        piece = self._make_piece(choice, output, now)
        if piece is not None:
            piece.cached_tokens = getattr(output, "cached_tokens", 0)
        return piece

    def _make_piece(self, choice: _Choice, output, now: float) -> Piece | None:
        prompt = None
        if choice.want_prompt_logprobs and output.prompt_logprobs is not None:
            prompt = self._prompt_logprobs(output)
        new = list(output.generated_tokens or []) if choice.generate else []
        status = getattr(output.status, "name", str(output.status)).upper()
        if new and self.metrics is not None:
            if choice.last_token_time is None:
                self.metrics.observe_ttft(now - choice.sink.start_time)
            else:
                self.metrics.observe_inter_token(now - choice.last_token_time, len(new))
        if new:
            choice.last_token_time = now
        choice.num_tokens += len(new)
        logprobs = self._logprobs(output, new) if choice.want_logprobs and new else None
        text, stopped = choice.stops.add(choice.detok.add(new), choice.num_tokens)
        if stopped:
            choice.done = True
            self._cancel_now(choice)
            return Piece(choice.index, text, len(new), logprobs, finish_reason="stop", prompt_logprobs=prompt)
        if status in _FINAL:
            choice.done = True
            tail, stopped = choice.stops.add(choice.detok.finish(), choice.num_tokens)
            rest, stopped = choice.stops.flush()
            text += tail + rest
            if status == "FAILED":
                return Piece(choice.index, text, len(new), logprobs, error=output.error or "the engine failed")
            reason = "stop" if stopped else (output.finish_reason or ("length" if status == "FINISHED" else "stop"))
            if not choice.generate:
                reason = "length"
            return Piece(choice.index, text, len(new), logprobs, finish_reason=reason, prompt_logprobs=prompt)
        if not new and prompt is None:
            return None
        return Piece(choice.index, text, len(new), logprobs, prompt_logprobs=prompt)

    def _prompt_logprobs(self, output) -> list[PromptLogprob]:
        ids = output.prompt_ids
        return [PromptLogprob(t, self._token_str(t), lp, rank, [(a, self._token_str(a), float(b)) for a, b in top or ()])
                for t, lp, rank, top in zip(ids, output.prompt_logprobs, output.prompt_ranks,
                                            output.prompt_top_logprobs)]


    def _logprobs(self, output, new: list[int]) -> list[TokenLogprob] | None:
        values = output.logprobs
        if not values:
            return None
        values = values[-len(new):]
        tops = (output.top_logprobs or [])[-len(new):] or [[] for _ in new]
        return [TokenLogprob(self._token_str(t), float(lp), [(self._token_str(a), float(b)) for a, b in top])
                for t, lp, top in zip(new, values, tops)]


def prompt_ids(prompt) -> list[int]:
    """A prompt's token ids: the prompt itself, or the ``input_ids`` of one prompt's processor outputs."""
    if isinstance(prompt, Mapping):
        return [int(t) for t in prompt["input_ids"].reshape(-1).tolist()]
    return prompt
