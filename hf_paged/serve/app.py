"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, vLLM's ``/tokenize``,
``/detokenize`` and ``/tokenizer_info``, plus ``/health`` and ``/metrics``, over one continuous-batching manager."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import features as engine_features
from .engine_client import AsyncEngine, Generation, prompt_ids
from .errors import APIError, error_body
from .media import MediaLoader, MediaPolicy, has_images
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import DEFAULT_MAX_BODY_BYTES, ServeMiddleware
from .protocol import (
    DEFAULT_LIMITS,
    RequestLimits,
    SamplingParams,
    bad_words_ids,
    parse_chat,
    parse_completion,
    parse_json,
    parse_messages,
    template_kwargs,
)
from .responses import DONE, Shape, echo_logprobs, sse, usage, vllm_prompt_logprobs
from .tools import MISTRAL, NAMED, REQUIRED, ToolCallParser, template_reads_tools, tool_format

ARGUMENT_FRAGMENT = 24  # characters of a tool call's arguments per streamed delta

log = logging.getLogger("hf_paged.serve")

UNBOUNDED_CONTEXT = 1 << 20  # a model without max_position_embeddings: the pool is the only limit
NOT_AN_ADAPTER = ("'lora_path' must name an adapter directory (adapter_config.json and weights saved by peft) under "
                  "the server's LoRA root (--lora-root), relative to it.")


@dataclass
class ServeSettings:
    """Server options (the CLI's flags).

    ``model_name``: the id clients send as ``model``; ``api_key``: required on ``/v1`` when set; ``max_body_bytes``:
    larger bodies get a 413; ``drain_timeout``: seconds a shutdown waits for running requests before cancelling them;
    ``cors_origins``: origins allowed to call from a browser; ``owns_engine``: stop the manager when the app shuts down;
    ``media``: the image policy of chat requests (remote domains, a file root, count and pixel limits).
    ``lora_loading``: serve vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (off: 404);
    ``lora_paths``: where each adapter loaded at start came from (``/v1/models`` reports it as the adapter's root).
    ``limits``: caps on the list-valued fields of a request (:class:`~hf_paged.serve.protocol.RequestLimits`).
    Run-time adapter loads (``lora_loading``) read only directories under ``lora_root`` (one error whatever is wrong
    with a path, so a caller learns nothing of what exists), refuse ranks over ``max_lora_rank``, and never replace,
    unload or evict the adapters loaded at start (``lora_paths``: pinned); past ``max_loras`` resident adapters the
    least recently loaded run-time adapter that no request uses is unloaded first.
    Requests choose a loaded adapter by naming it as their ``model`` (vLLM's convention).
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = 30.0
    cors_origins: tuple[str, ...] = ()
    owns_engine: bool = True
    media: MediaPolicy = MediaPolicy()  # where chat images may come from, how many and how large (serve/media.py)
    lora_loading: bool = False
    lora_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    limits: RequestLimits = DEFAULT_LIMITS  # caps on list-valued request fields (protocol.py)
    lora_root: Path | None = None  # run-time loads only from directories under it
    max_lora_rank: int | None = None  # run-time loads of a higher rank are refused
    max_loras: int | None = None  # adapters resident at once (the engine's max_loras)


def create_app(manager, tokenizer, settings: ServeSettings, *, pool_tokens: int | None = None,
               vocab_size: int | None = None, processor=None) -> FastAPI:
    """An ASGI app serving ``manager`` (from ``hf_paged.init_continuous_batching``) with ``tokenizer``.

    ``pool_tokens``: tokens the KV pool can hold at most (caps the default ``max_tokens``); default: read from
    ``manager.pool`` (none for a pool that grows). ``vocab_size``: token-id prompts must be below it; default the
    manager's ``vocab_size``, else ``len(tokenizer)``. ``processor``: a vision-language model's processor (its chat
    template and image processor): chat messages may then hold ``image_url`` parts (``serve/media.py``).

    Example::

        manager = hf_paged.init_continuous_batching(model, pool=BlockPool(max_memory="1GiB", prefix_caching=True))
        manager.start()
        app = create_app(manager, tokenizer, ServeSettings(model_name="my-model"))
        uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    metrics = ServerMetrics(manager)
    engine = AsyncEngine(manager, tokenizer, metrics, vocab_size)
    name = settings.model_name
    takes_images = processor is not None and getattr(manager, "takes_images", False)
    caps = settings.limits
    media = MediaLoader(settings.media)
    # a top_k the model's generation config sets is kept for requests without one (vLLM's); otherwise top-k is off
    model_top_k = getattr(getattr(manager, "generation_config", None), "top_k", None) is not None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        manager.start()
        watchdog = asyncio.ensure_future(engine.watch())
        try:
            yield
        finally:
            watchdog.cancel()
            if settings.owns_engine:
                # uvicorn has already waited (up to drain_timeout) for open responses; what is left is cancelled.
                await asyncio.to_thread(manager.stop, block=True, timeout=settings.drain_timeout, drain=False)
            engine.close()
            media.close()

    app = FastAPI(title="hf_paged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"), status_code=500)

    @app.get("/health")
    async def health():
        if not manager.is_running():
            why = f" ({manager.error})" if getattr(manager, "error", None) else ""
            return JSONResponse(error_body(503, f"the engine thread is not running{why}; restart the server."),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    lora_paths = dict(settings.lora_paths)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        base = {"id": name, "object": "model", "created": created, "owned_by": "hf_paged", "root": name,
                "parent": None, "max_model_len": engine.max_context, "permission": []}
        base["input_modalities"] = ["text", "image"] if takes_images else ["text"]
        loras = [{**base, "id": lora, "root": lora_paths.get(lora, lora), "parent": name} for lora in adapters()]
        return {"object": "list", "data": [base, *loras]}

    # -- vLLM's LoRA adapter endpoints (only with --enable-lora-loading) -----------------------------------------------
    pinned = frozenset(settings.lora_paths)  # loaded at start: never replaced, unloaded or evicted
    loaded_at_run_time: list[str] = []  # oldest first: the first to make room
    lora_lock = asyncio.Lock()  # one load or unload at a time (the room made is the room used)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = lora_body(await engine.run(parse_json, await request.body()), "lora_path")
        lora, given = body["lora_name"], body["lora_path"]
        if lora == name:
            raise APIError(400, f"'{lora}' is the base model's name; give the adapter another.", param="lora_name")
        if lora in pinned:
            raise APIError(409, f"adapter '{lora}' was loaded at start (--lora-modules) and is pinned: it is not "
                                "replaced at run time; load under another name.", param="lora_name")
        path = await engine.run(adapter_dir, given)
        async with lora_lock:
            await make_room(lora)
            try:
                await engine.run(manager.load_adapter, lora, str(path))
            except RuntimeError as exc:  # every slot holds an adapter in use
                raise APIError(409, str(exc), param="lora_name") from None
            except Exception:
                log.warning("run-time load of adapter %r failed", lora, exc_info=True)
                raise APIError(400, f"could not load adapter '{lora}': {NOT_AN_ADAPTER}", param="lora_path") from None
            if lora in loaded_at_run_time:
                loaded_at_run_time.remove(lora)
            loaded_at_run_time.append(lora)
        lora_paths[lora] = given
        return Response(f"Success: LoRA adapter '{lora}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        lora = lora_body(await engine.run(parse_json, await request.body()))["lora_name"]
        if lora in pinned:
            raise APIError(409, f"adapter '{lora}' was loaded at start (--lora-modules) and is pinned: it is not "
                                "unloaded at run time.", param="lora_name")
        if lora not in adapters():
            raise APIError(404, f"no adapter '{lora}' is loaded; loaded: {adapters() or 'none'}.", param="lora_name",
                           code="model_not_found")
        async with lora_lock:
            try:
                await engine.run(manager.unload_adapter, lora)
            except RuntimeError as exc:
                raise APIError(409, str(exc), param="lora_name") from None
            if lora in loaded_at_run_time:
                loaded_at_run_time.remove(lora)
        lora_paths.pop(lora, None)
        return Response(f"Success: LoRA adapter '{lora}' removed successfully.", media_type="text/plain")

    def adapter_dir(given: str) -> Path:
        """``lora_path`` as a directory under the LoRA root with an adapter config of an allowed rank; one message
        for every way it can be wrong (outside the root, missing, not an adapter), so nothing about the server's
        files leaks; the rank cap is named (it is a property of an adapter the caller chose)."""
        if settings.lora_root is None:
            raise APIError(400, "this server loads adapters at run time only from under a LoRA root; start it with "
                                "--lora-root DIR.", param="lora_path")
        root = Path(settings.lora_root).resolve()
        config = None
        try:
            path = (root / given).resolve()  # an absolute lora_path replaces root, then must still be under it
            if path.is_relative_to(root):
                with open(path / "adapter_config.json") as f:
                    config = json.load(f)
        except (OSError, ValueError, RuntimeError):
            config = None
        if not isinstance(config, dict):
            raise APIError(400, f"could not load the adapter: {NOT_AN_ADAPTER}", param="lora_path")
        rank = max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()], default=0)
        if settings.max_lora_rank is not None and rank > settings.max_lora_rank:
            raise APIError(400, f"the adapter's rank is {rank}; this server loads ranks up to {settings.max_lora_rank} "
                                "(--max-lora-rank).", param="lora_path")
        return path

    async def make_room(lora: str) -> None:
        """Unload the oldest run-time adapter no request uses when the slots are full (never a pinned one)."""
        if settings.max_loras is None or lora in adapters() or len(adapters()) < settings.max_loras:
            return
        for victim in list(loaded_at_run_time):
            try:
                await engine.run(manager.unload_adapter, victim)
            except (RuntimeError, KeyError, ValueError):
                continue  # in use (or already gone): try the next
            loaded_at_run_time.remove(victim)
            lora_paths.pop(victim, None)
            return
        raise APIError(409, f"all {settings.max_loras} adapter slots (--max-loras) hold adapters loaded at start or "
                            "in use; unload one, or start the server with a larger --max-loras.", param="lora_name")

    def lora_body(body, *more: str) -> dict:
        if not settings.lora_loading:
            raise APIError(404, "loading adapters at run time is off on this server; start it with "
                                "--enable-lora-loading (or load them at start with --lora-modules name=path).")
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object.")
        for key in ("lora_name", *more):
            if not isinstance(body.get(key), str) or not body[key]:
                raise APIError(400, f"'{key}' is required (a non-empty string).", param=key)
        return body

    def adapters() -> list[str]:
        return list(getattr(manager, "adapters", []))

    # -- vLLM's tokenizer endpoints (lm-eval's and benchmark tools' tokenizer detection) ------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await engine.run(parse_json, await request.body())
        check_model(body.get("model"))
        special = body.get("add_special_tokens")
        if "messages" in body:
            messages = await engine.run(parse_messages, body["messages"])
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            extra = template_kwargs(body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"),
                                                                                  dict) else None, caps)
            if has_images(messages):
                ids = prompt_ids(await image_prompt(messages, None, add_generation_prompt, extra))
            else:
                ids = await engine.chat_prompt(messages, add_generation_prompt=add_generation_prompt,
                                               template_kwargs=extra)
        elif isinstance(body.get("prompt"), str):
            ids = await engine.encode(body["prompt"], add_special_tokens=special is not False)
        else:
            raise APIError(400, "'/tokenize' needs 'prompt' (a string) or 'messages'.", param="prompt")
        out = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = await engine.run(tokenizer.convert_ids_to_tokens, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await engine.run(parse_json, await request.body())
        check_model(body.get("model"))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < engine.vocab_size for t in ids):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {engine.vocab_size}).", param="tokens")
        return {"prompt": await engine.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        info = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": engine.max_context,
                "chat_template": getattr(tokenizer, "chat_template", None), "vocab_size": engine.vocab_size}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tokenizer, key, None)
            info[key] = value if isinstance(value, str) or value is None else str(value)
        info["eos_token_id"] = getattr(tokenizer, "eos_token_id", None)
        info["add_bos_token"] = getattr(tokenizer, "add_bos_token", None)
        return info

    def check_model(model: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 naming what is served."""
        if model is None or model == name:
            return None
        loaded = adapters()
        if model in loaded:
            return model
        served = f"'{name}'" + (f" and the adapters {loaded}" if loaded else "")
        raise APIError(404, f"the model '{model}' does not exist on this server; it serves {served}.",
                       param="model", code="model_not_found")

    if pool_tokens is None:
        pool_tokens = _pool_tokens(manager)

    def budgets(prompts: list[list[int]], max_tokens: int | None) -> list[int]:
        """max_new_tokens per prompt: as asked, or the context left after the prompt (within what the pool holds)."""
        ctx = engine.max_context if engine.max_context is not None else UNBOUNDED_CONTEXT
        vocab = engine.vocab_size
        out = []
        for p, ids in enumerate(prompts):
            where = f"prompt {p}" if len(prompts) > 1 else "the prompt"
            if not ids:
                raise APIError(400, f"{where} is empty; send at least one token.", param="prompt")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{where} holds token id {bad}, outside the vocabulary [0, {vocab}).",
                               param="prompt")
            if max_tokens is None:
                room = ctx - len(ids)
                if pool_tokens is not None:
                    room = min(room, pool_tokens - len(ids))
                if room < 1:
                    raise APIError(400, f"{where} has {len(ids):,} tokens, leaving no room to generate: the model's "
                                        f"context holds {ctx:,} tokens" + (f" and the KV pool {pool_tokens:,}"
                                        if pool_tokens is not None else "") + ". Shorten the prompt.",
                                   param="prompt", code="context_length_exceeded")
                out.append(room)
            elif len(ids) + max_tokens > ctx:
                raise APIError(400, f"{where} has {len(ids):,} tokens and max_tokens asks for {max_tokens:,} more "
                                    f"({len(ids) + max_tokens:,} in all), but the model's context holds {ctx:,} "
                                    "tokens. Shorten the prompt or lower max_tokens.", param="max_tokens",
                               code="context_length_exceeded")
            else:
                out.append(max_tokens)
        return out

    @app.post("/v1/completions")
    async def completions(request: Request):
        record = request.state.record
        req = await engine.run(lambda raw: parse_completion(parse_json(raw), caps), await request.body())
        req.params.model_top_k = model_top_k
        adapter = check_model(req.model)
        prompts = [p if isinstance(p, list) else await engine.encode(p) for p in req.prompts]
        limits = await engine.run(budgets, prompts, req.params.max_tokens)
        if req.params.bad_words:
            req.params.bad_words_ids = await engine.run(bad_words_ids, engine.tokenizer, req.params.bad_words)
        if req.params.grammar_spec is not None:
            req.params.grammar = await engine.compile_grammar(req.params.grammar_spec)
        gen = engine.generate(prompts, req.params, req.n, limits, record.start, adapter=adapter)
        record.generation = gen
        echoes = None
        if req.echo:
            echoes = [p if isinstance(p, str) else await engine.decode(p) for p in req.prompts]
        shape = Shape("completion", f"cmpl-{record.id}", int(time.time()), adapter or name, req.include_usage)
        if req.stream:
            return _stream(gen, shape, record, req.n, echoes, req.params, req.continuous_usage)
        return await _collect(gen, shape, request, record, req.n, echoes, req.params)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        record = request.state.record
        req = await engine.run(lambda raw: parse_chat(parse_json(raw), caps), await request.body())
        req.params.model_top_k = model_top_k
        adapter = check_model(req.model)
        if has_images(req.messages):
            prompt = await image_prompt(req.messages, req.tools, req.add_generation_prompt, req.template_kwargs)
        else:
            prompt = await engine.chat_prompt(req.messages, req.add_generation_prompt, tools=req.tools,
                                              template_kwargs=req.template_kwargs)
        limits = await engine.run(budgets, [prompt_ids(prompt)], req.params.max_tokens)
        if req.params.bad_words:
            req.params.bad_words_ids = await engine.run(bad_words_ids, engine.tokenizer, req.params.bad_words)
        parser = tool_parser(req.tools, req.params)
        if req.params.grammar_spec is not None:
            req.params.grammar = await engine.compile_grammar(req.params.grammar_spec)
        gen = engine.generate([prompt], req.params, req.n, limits, record.start, adapter=adapter)
        record.generation = gen
        shape = Shape("chat", f"chatcmpl-{record.id}", int(time.time()), adapter or name, req.include_usage)
        if req.stream:
            return _stream(gen, shape, record, req.n, None, req.params, req.continuous_usage, parser)
        return await _collect(gen, shape, request, record, req.n, None, req.params, parser)

    async def image_prompt(messages, tools, add_generation_prompt: bool = True, extra: dict | None = None):
        """Chat messages with image_url parts: one prompt's processor outputs (ids and image tensors)."""
        if not takes_images:
            raise APIError(400, f"'{name}' takes no images (image_url content parts): send text parts only.",
                           param="messages")
        if tools is not None and tools.choice != "none":
            try:
                engine_features.check({"tools", "images"})
            except engine_features.FeatureRefused as exc:
                raise APIError(400, str(exc), param="tools") from None
        return await engine.chat_inputs(messages, processor, media, add_generation_prompt, extra or {})

    def tool_parser(tools, params: SamplingParams):
        """A factory of per-choice tool-call parsers (None: the output is all content)."""
        if tools is None or tools.choice == "none":
            return None
        if tools.choice in (REQUIRED, NAMED):
            mode = tools.choice
        else:
            template = str(getattr(tokenizer, "chat_template", "") or "")
            mode = tool_format(template) if template_reads_tools(template) else tool_format(None)
        drop = None
        if mode == MISTRAL:  # [TOOL_CALLS] is a special token: keep special tokens, drop the EOS text
            params.skip_special_tokens = False
            drop = tokenizer.eos_token
        return lambda: ToolCallParser(mode, tools.name, drop)

    routes = frozenset(getattr(route, "path", None) for route in app.routes)  # any other path counts as "other"
    app.add_middleware(ServeMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       on_done=lambda r: metrics.count_request(r.path if r.path in routes else "other",
                                                               r.status or 499))
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    return app


def _pool_tokens(manager) -> int | None:
    """Tokens a capped pool holds (one request can never hold more); None for a pool that grows."""
    pool = getattr(manager, "pool", None)
    blocks = getattr(getattr(pool, "allocator", None), "max_blocks", None)
    return None if blocks is None else blocks * pool.block_size


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompt_views(entries, params: SamplingParams) -> tuple[dict | None, list | None]:
    """The prompt logprobs a request asked for: completions' echoed logprobs (legacy shape) and vLLM's list."""
    if entries is None:
        return None, None
    echo = echo_logprobs(entries, params.echo_logprobs) if params.echo_logprobs is not None else None
    vllm = None
    if params.prompt_logprobs is not None:
        k = params.prompt_logprobs
        vllm = vllm_prompt_logprobs([dataclasses.replace(e, top=e.top[:k]) for e in entries])
    return echo, vllm


async def _collect(gen: Generation, shape: Shape, request: Request, record, n: int, echoes, params: SamplingParams,
                   parser=None):
    """A whole (non-streamed) response; a client that goes away meanwhile cancels its choices. ``parser``: a
    factory of :class:`ToolCallParser` (chat with tools)."""
    prompts: dict[int, list | None] = {c.index: None for c in gen.choices}
    texts: dict[int, list[str]] = {c.index: [] for c in gen.choices}
    logprobs: dict[int, list | None] = {c.index: None for c in gen.choices}
    finish: dict[int, str] = {}

    async def gather():
        async for piece in gen.pieces():
            if piece.error is not None:
                raise APIError(500, f"generation failed: {piece.error}")
            texts[piece.index].append(piece.text)
            if piece.prompt_logprobs is not None:
                prompts[piece.index] = piece.prompt_logprobs
            if piece.logprobs:
                logprobs[piece.index] = (logprobs[piece.index] or []) + piece.logprobs
            if piece.finish_reason is not None:
                finish[piece.index] = piece.finish_reason

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
        gen.cancel()  # choices still running (client gone, or another choice failed); no-op for ended ones
    if not work.done() or work.cancelled():
        record.outcome = "disconnected"
        return Response(status_code=499)
    work.result()  # raises the engine's error, if any
    choices = []
    for c in gen.choices:
        prefix = echoes[c.index // n] if echoes else ""
        want = c.want_logprobs
        echo_lp, vllm_lp = _prompt_views(prompts[c.index], params)
        text, reason, calls = prefix + "".join(texts[c.index]), finish.get(c.index, "stop"), None
        if parser is not None:
            tools = parser()
            text = tools.feed(text)
            rest, found = tools.finish()
            text += rest
            if found:  # a response cut by max_tokens keeps "length" (its complete calls are returned)
                calls, reason = [call.openai() for call in found], "length" if reason == "length" else "tool_calls"
        choices.append({"index": c.index, "text": text, "finish_reason": reason,
                        "logprobs": (logprobs[c.index] or []) if want else None, "offset": len(prefix),
                        "echo_logprobs": echo_lp, "prompt_logprobs": vllm_lp, "tool_calls": calls})
    return JSONResponse(shape.full(choices, gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))


def _stream(gen: Generation, shape: Shape, record, n: int, echoes, params: SamplingParams,
            continuous_usage: bool = False, parser=None) -> StreamingResponse:
    """Server-sent chunks. The echoed prompt goes first, or, when its logprobs are asked, with the first piece
    (which carries them); ``continuous_usage``: every chunk carries the usage so far. With tools (``parser``), text
    that may open a tool call is held back; the calls go out at the choice's end as OpenAI streams them (a delta
    with index, id and name, then fragments of the arguments), with ``finish_reason: "tool_calls"``."""
    late_echo = echoes is not None and params.echo_logprobs is not None

    async def events():
        offsets = {c.index: 0 for c in gen.choices}
        tools = {c.index: parser() for c in gen.choices} if parser is not None else {}

        def now():
            return usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens) if continuous_usage else None

        try:
            for c in gen.choices:
                if shape.kind == "chat":
                    yield shape.chunk(c.index, "", role=True, usage_now=now())
                elif echoes and not late_echo:
                    offsets[c.index] = len(echoes[c.index // n])
                    yield shape.chunk(c.index, echoes[c.index // n], usage_now=now())
            async for piece in gen.pieces():
                if piece.error is not None:
                    record.outcome = "error"
                    yield sse(error_body(500, f"generation failed: {piece.error}"))
                    yield DONE
                    return
                echo_lp, vllm_lp = _prompt_views(piece.prompt_logprobs, params)
                if echo_lp is not None or vllm_lp is not None:
                    text = echoes[piece.index // n] if late_echo else ("" if shape.kind == "completion" else None)
                    yield shape.chunk(piece.index, text, echo_lp=echo_lp, prompt_logprobs=vllm_lp, usage_now=now())
                    if late_echo:
                        offsets[piece.index] = len(text)
                text, reason = piece.text, piece.finish_reason
                if tools:
                    text = tools[piece.index].feed(text)
                if text or piece.logprobs:
                    yield shape.chunk(piece.index, text, logprobs=piece.logprobs, offset=offsets[piece.index],
                                      usage_now=now())
                    offsets[piece.index] += len(text)
                if reason is not None and tools:
                    rest, calls = tools[piece.index].finish()
                    if rest:
                        yield shape.chunk(piece.index, rest, usage_now=now())
                    for i, call in enumerate(calls):
                        yield shape.chunk(piece.index, None, usage_now=now(), tool_calls=[{
                            "index": i, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}])
                        for at in range(0, len(call.arguments), ARGUMENT_FRAGMENT):
                            yield shape.chunk(piece.index, None, usage_now=now(), tool_calls=[{
                                "index": i, "function": {"arguments": call.arguments[at:at + ARGUMENT_FRAGMENT]}}])
                    if calls and reason != "length":
                        reason = "tool_calls"
                if reason is not None:
                    yield shape.chunk(piece.index, None if shape.kind == "chat" else "", reason, usage_now=now())
            if shape.include_usage:
                yield shape.usage_chunk(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
            yield DONE
        except BaseException:
            record.outcome = "disconnected"
            raise
        finally:
            gen.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
