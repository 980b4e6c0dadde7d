"""Request parsing for ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's fields and the vLLM extensions that
benchmark and evaluation tools send, checked.

Honoured beyond OpenAI's own: ``presence_penalty`` and ``frequency_penalty`` (OpenAI's formula on the tokens generated
so far, as vLLM counts them), ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``stream_options.continuous_usage_stats``, ``prompt_logprobs``, ``top_k``, ``min_p``,
``repetition_penalty``, ``bad_words`` (vLLM's: each word's token sequences, with and without a leading space, never
generated), ``no_repeat_ngram_size`` (transformers'); OpenAI's ``logit_bias`` ({token id: bias in [-100, 100]},
added to the logits); completions' ``echo`` with ``logprobs`` (prompt logprobs) and ``max_tokens: 0`` with ``echo``;
chat's ``add_generation_prompt`` and ``chat_template_kwargs`` (passed to the chat template, as vLLM does). Sampling
without ``top_k`` keeps the whole vocabulary (OpenAI's and vLLM's semantics, not ``generate()``'s default top-k 50).
A field this server does not know is ignored and logged once per name (``UNKNOWN_LOGGED``); a known field of the
wrong type or out of range is a 400 naming it; a feature the engine does not have (``REFUSED_FIELDS``: ``suffix``,
allowed token ids, ...) is a 400 naming it rather than silently dropped; ``NO_EFFECT_FIELDS`` change nothing this
server computes and are accepted. Every list-valued field has a cap (:class:`RequestLimits`, overridable with
``--limit NAME=N``), so no request costs more than its caps allow whatever the body limit.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import features as engine_features
from ..engine.structured import GrammarSpec
from .errors import APIError
from .tools import NAMED, REQUIRED, ToolRequest, named_schema, parse_tools, required_schema

log = logging.getLogger("hf_paged.serve")

MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """Caps on the list-valued fields of a request (the CLI's ``--limit NAME=N`` overrides each); a request over one
    is a 400 naming the field and the cap.

    ``stop``: stop strings; ``logit_bias``: biased tokens; ``stop_token_ids``; ``bad_words`` (and
    ``bad_word_chars``: characters per word); ``prompts``: prompts in one completions request; ``messages``: chat
    messages; ``tools``: tool definitions; ``chat_template_kwargs``: keys; ``choice``: a structured choice's options.
    """

    stop: int = MAX_STOP
    logit_bias: int = 300
    stop_token_ids: int = 64
    bad_words: int = 64
    bad_word_chars: int = 256
    prompts: int = 64
    messages: int = 1024
    tools: int = 128
    chat_template_kwargs: int = 16
    choice: int = 256

    @classmethod
    def parse(cls, specs: list[str]) -> "RequestLimits":
        """``["logit_bias=1000", ...]`` (the CLI's ``--limit`` entries) over the defaults; ``ValueError`` naming a
        bad entry."""
        out = {}
        for spec in specs:
            key, sep, value = spec.partition("=")
            if not sep or key not in cls.__dataclass_fields__ or not value.isdigit() or int(value) < 1:
                raise ValueError(f"--limit takes NAME=N with N >= 1 and NAME one of "
                                 f"{', '.join(cls.__dataclass_fields__)}; got {spec!r}")
            out[key] = int(value)
        return cls(**out)


DEFAULT_LIMITS = RequestLimits()


def _cap(name: str, values, limit: int, what: str = "entries") -> None:
    if values is not None and len(values) > limit:
        raise APIError(400, f"'{name}' holds {len(values):,} {what}; this server takes at most {limit:,} "
                            f"(--limit {name.split('.')[0]}=N raises it).", param=name.split(".")[0])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions other servers (vLLM, SGLang) accept too.
    top_k: int | None = Field(None, ge=-1)  # -1 / 0: off (vLLM's and SGLang's "all tokens")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    bad_words: list[str] | None = None
    no_repeat_ngram_size: int | None = Field(None, ge=0)
    use_beam_search: bool | None = False  # vLLM's: beam search of width best_of (completions) or n
    length_penalty: float | None = None
    early_stopping: bool | str | None = None


class CompletionFields(_Common):
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt's logprobs, nothing generated
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class ChatFields(_Common):
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class SamplingParams:
    """What the engine is asked, per choice (``seed`` is offset by the choice index so ``n`` samples differ)."""

    max_tokens: int | None = None
    temperature: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and k alternatives
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    echo_logprobs: int | None = None  # completions' echo + logprobs: the prompt tokens' logprobs, k alternatives
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field
    grammar_spec: GrammarSpec | None = None  # structured output asked for (compiled by the app)
    grammar: object = None  # its CompiledGrammar
    generate: bool = True  # False: max_tokens 0 with echo (one token runs, none is returned)
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias added to its logit
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never generated
    bad_words_ids: list[list[int]] | None = None  # their token sequences (see bad_words_ids(), filled by the app)
    no_repeat_ngram_size: int | None = None
    num_beams: int = 1  # > 1: one beam search per prompt, its n best sequences the n choices
    num_return: int = 1  # beam search: the choices per prompt (n)
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    model_top_k: bool = False  # the model's generation config sets top_k: a request without one keeps it (vLLM's)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        asked = [k for k in (self.echo_logprobs, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    def engine_kwargs(self, index: int) -> dict:
        kwargs: dict[str, Any] = {}
        if self.num_beams > 1:  # deterministic beam search (vLLM's); beams score through the same processors
            kwargs.update(num_beams=self.num_beams, num_return_sequences=self.num_return, do_sample=False)
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    kwargs[name] = getattr(self, name)
            kwargs.update(self._processor_kwargs())
            return kwargs
        kwargs.update(self._processor_kwargs())
        if self.grammar is not None:
            kwargs["grammar"] = self.grammar
        if self.temperature is not None:
            kwargs["do_sample"] = self.temperature > 0
            if self.temperature > 0:
                kwargs["temperature"] = self.temperature
        for name in ("top_p", "min_p", "logprobs"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.top_k is not None:
            kwargs["top_k"] = max(self.top_k, 0)  # -1 / 0: off
        elif not self.model_top_k:
            kwargs["top_k"] = 0  # off, as OpenAI and vLLM sample (not generate()'s default 50)
        if self.seed is not None:
            kwargs["seed"] = self.seed + index
        return kwargs

    def _processor_kwargs(self) -> dict:
        """The settings sampled and beam requests share: what the engine's processor stage applies to every row
        (beams included), and the ends of a request."""
        kwargs: dict[str, Any] = {}
        if self.ignore_eos:
            kwargs["ignore_eos"] = True
        if self.min_tokens:
            kwargs["min_tokens"] = self.min_tokens
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = list(self.stop_token_ids)
        if self.engine_prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = self.engine_prompt_logprobs
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                kwargs[name] = getattr(self, name)
        if self.logit_bias:
            kwargs["sequence_bias"] = [[[token], bias] for token, bias in self.logit_bias.items()]
        if self.bad_words_ids:
            kwargs["bad_words_ids"] = self.bad_words_ids
        if self.no_repeat_ngram_size:
            kwargs["no_repeat_ngram_size"] = self.no_repeat_ngram_size
        return kwargs


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences of vLLM's ``bad_words``: each word alone and after a space (as it appears mid-text),
    without special tokens; the engine never completes one (transformers' ``bad_words_ids``)."""
    out: list[list[int]] = []
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids and ids not in out:
                out.append(ids)
    return out


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]  # text to tokenize, or token ids as given
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    continuous_usage: bool = False


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]  # {"role", "content": str}, ready for the chat template
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    tools: ToolRequest | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs: extra variables of the chat template


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying where it is malformed."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}.") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply.") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
    return body


def _validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        param = loc[0] if loc else None
        shown = repr(err.get("input"))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise APIError(400, f"invalid value for '{'.'.join(loc)}': {err['msg']} (got {shown}).", param=param) from None


# Fields read straight from the body (not model fields), per endpoint.
_STRUCTURED = {"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "response_format"}
_BODY_FIELDS = {"completion": {"prompt", "stop", *_STRUCTURED}, "chat": {"messages", "stop", "tools", "tool_choice",
                                                                        "parallel_tool_calls",
                                                                        *_STRUCTURED}}
# vLLM / OpenAI fields that change what is generated and that the engine cannot do: a 400 when set (truthy).
REFUSED_FIELDS = {
    "allowed_token_ids": "allowed token ids",
    "logits_processors": "custom logits processors", "truncate_prompt_tokens": "prompt truncation",
    "functions": "function calling", "audio": "audio output", "prediction": "predicted outputs",
    "modalities": "output modalities", "web_search_options": "web search", "continue_final_message":
    "continuing the final message", "documents": "documents for the chat template (RAG)",
}
# Known fields that change nothing this server computes, accepted and ignored: who sent the request and how it is
# stored or billed (``user``, ``metadata``, ``store``, ``service_tier``, ``request_id``, ``priority``), a reasoning
# model's effort (``reasoning_effort``: no served model reads it; send ``chat_template_kwargs`` for a template that
# does), and detokenization details the server already fixes (``spaces_between_special_tokens``,
# ``return_tokens_as_token_ids``, ``add_special_tokens`` on chat: the template places the special tokens).
NO_EFFECT_FIELDS = {"user", "metadata", "store", "service_tier", "request_id", "priority", "add_special_tokens",
                    "spaces_between_special_tokens", "return_tokens_as_token_ids", "reasoning_effort"}
# Names chat_template_kwargs may not set: apply_chat_template's own arguments and the variables the server passes.
TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                               "add_generation_prompt", "continue_final_message", "padding", "truncation",
                               "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                               "tokenizer_kwargs", "processor_kwargs"})
UNKNOWN_LOGGED: set[str] = set()
_unknown_lock = threading.Lock()


def _log_unknown(body: dict, model_cls, kind: str) -> None:
    """Log each field no part of this server reads, once per name for the process (it changes nothing here, so a
    benchmark relying on it should know)."""
    known = set(model_cls.model_fields) | _BODY_FIELDS[kind] | set(REFUSED_FIELDS) | NO_EFFECT_FIELDS
    for name in body.keys() - known:
        with _unknown_lock:
            if name in UNKNOWN_LOGGED:
                continue
            UNKNOWN_LOGGED.add(name)
        log.warning("request field %r is not known to this server and is ignored (logged once per name)", name)


def _unsupported(body: dict, fields: _Common) -> None:
    named = []
    for name in REFUSED_FIELDS:
        if body.get(name):
            named.append(name)
    if body.get("function_call") not in (None, "none"):
        named.append("function_call")
    if named:
        raise APIError(400, f"this server's engine does not support {', '.join(named)}; remove "
                            f"{'it' if len(named) == 1 else 'them'} from the request.", param=named[0])


def _stop(value, limit: int = MAX_STOP) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        _cap("stop", value, limit, "strings")
        return value
    raise APIError(400, f"'stop' must be a string or a list of strings, got {type(value).__name__}.", param="stop")


def _common(body: dict, fields: _Common, max_tokens: int | None, logprobs: int | None,
            limits: RequestLimits = DEFAULT_LIMITS) -> SamplingParams:
    _unsupported(body, fields)
    _cap("logit_bias", fields.logit_bias, limits.logit_bias)
    _cap("stop_token_ids", fields.stop_token_ids, limits.stop_token_ids)
    _cap("bad_words", fields.bad_words, limits.bad_words, "words")
    if fields.bad_words and max(len(w) for w in fields.bad_words) > limits.bad_word_chars:
        raise APIError(400, f"'bad_words' holds a word of {max(len(w) for w in fields.bad_words):,} characters; "
                            f"this server takes at most {limits.bad_word_chars:,} (--limit bad_word_chars=N).",
                       param="bad_words")
    if fields.stream_options is not None and not fields.stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true.", param="stream_options")
    if fields.min_tokens and max_tokens is not None and fields.min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' ({fields.min_tokens}) is more than max_tokens ({max_tokens}).",
                       param="min_tokens")
    if fields.stop_token_ids and not all(t >= 0 for t in fields.stop_token_ids):
        raise APIError(400, "'stop_token_ids' must hold token ids >= 0.", param="stop_token_ids")
    if fields.bad_words is not None and not all(w.strip() for w in fields.bad_words):
        raise APIError(400, "'bad_words' must hold non-empty words.", param="bad_words")
    params = SamplingParams(max_tokens=max_tokens, temperature=fields.temperature, top_p=fields.top_p,
                          top_k=fields.top_k, min_p=fields.min_p, repetition_penalty=fields.repetition_penalty,
                          seed=fields.seed, stop=_stop(body.get("stop"), limits.stop), logprobs=logprobs,
                          ignore_eos=bool(fields.ignore_eos), min_tokens=fields.min_tokens,
                          stop_token_ids=fields.stop_token_ids, include_stop=bool(fields.include_stop_str_in_output),
                          skip_special_tokens=fields.skip_special_tokens is not False,
                          prompt_logprobs=fields.prompt_logprobs)
    params.logit_bias = _logit_bias(fields.logit_bias)
    params.bad_words = list(fields.bad_words or [])
    params.no_repeat_ngram_size = fields.no_repeat_ngram_size or None
    params.presence_penalty = fields.presence_penalty or None
    params.frequency_penalty = fields.frequency_penalty or None
    return params


def _logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) -> a bias in [-100, 100]."""
    if not value:
        return None
    out = {}
    for key, bias in value.items():
        if not key.isdigit():
            raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r}.", param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(400, f"'logit_bias' values must be in [-100, 100], got {bias} for token {key}.",
                           param="logit_bias")
        out[int(key)] = float(bias)
    return out


# With beam search: the settings the engine's beams honour (they score through the sampler's processor stage, and
# end as any request does). What the engine's beams do not combine with (logprobs, a grammar, stop strings) is read
# from the engine's one rules table (``engine/features.py``); the sampling settings are the server's own rule: its
# beam search is vLLM's, deterministic (``do_sample=False``), so a sampling setting would be silently dropped.
BEAM_HONOURED = ("logit_bias", "bad_words", "no_repeat_ngram_size", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "prompt_logprobs", "echo",
                 "length_penalty", "early_stopping", "max_tokens")
BEAM_SAMPLING = {
    "temperature": "beam search is deterministic (send 0 or leave it out)",
    "top_p": "beam search keeps the best-scoring beams, it does not sample",
    "top_k": "beam search keeps the best-scoring beams, it does not sample",
    "min_p": "beam search keeps the best-scoring beams, it does not sample",
    "seed": "beam search is deterministic",
}
# engine feature -> the request field that asks for it
BEAM_FEATURE_FIELDS = {"logprobs": "logprobs", "grammar": "response_format", "stop_strings": "stop"}


def beam_refusals(params: SamplingParams) -> list[tuple[str, str]]:
    """``(field, why)`` for each setting of ``params`` that beam search would drop or cannot combine with; empty
    when every setting asked for is one the beams honour (``BEAM_HONOURED``)."""
    sampling = {
        "temperature": params.temperature not in (None, 0),
        "top_p": params.top_p not in (None, 1),
        "top_k": params.top_k not in (None, 0, -1),
        "min_p": params.min_p not in (None, 0),
        "seed": params.seed is not None,
    }
    out = [(name, BEAM_SAMPLING[name]) for name, asked in sampling.items() if asked]
    present = {"beams"} | {feature for feature, on in (("logprobs", params.logprobs is not None),
                                                       ("grammar", params.grammar_spec is not None),
                                                       ("stop_strings", bool(params.stop))) if on}
    decision = engine_features.decide(present)
    if decision.outcome == engine_features.REFUSED:
        for rule in decision.rules:
            for feature in sorted(rule.features - {"beams"}):
                out.append((BEAM_FEATURE_FIELDS[feature], rule.reason))
    return out


def _beams(params: SamplingParams, fields: _Common, n: int, width: int | None) -> None:
    """``use_beam_search``: one beam search of ``width`` (default ``n``) beams per prompt, its ``n`` best the
    choices; a setting it would drop is a 400 naming it and why."""
    if not fields.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(fields, name) is not None:
                raise APIError(400, f"'{name}' applies to beam search only; send 'use_beam_search': true.",
                               param=name)
        return
    refused = beam_refusals(params)
    if refused:
        names = [name for name, _ in refused]
        why = "; ".join(f"'{name}': {reason}" for name, reason in refused)
        raise APIError(400, f"use_beam_search does not apply {', '.join(names)} ({why}); remove "
                            f"{'it' if len(names) == 1 else 'them'} or turn beam search off.", param=names[0])
    params.num_beams, params.num_return = max(width or n, n), n
    params.length_penalty, params.early_stopping = fields.length_penalty, fields.early_stopping


def _schema_text(value, where: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"'{where}' is not valid JSON: {exc}.", param=where.split(".")[0]) from None
    if not isinstance(value, dict):
        raise APIError(400, f"'{where}' must be a JSON schema (an object), got {type(value).__name__}.",
                       param=where.split(".")[0])
    return json.dumps(value)  # property order kept: the model writes them in this order


def grammar_spec(body: dict, limits: RequestLimits = DEFAULT_LIMITS) -> GrammarSpec | None:
    """The structured output a request asks for: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
    vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or its older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; None for none. At most one."""
    asked: list[tuple[str, GrammarSpec]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | "
                                "\"json_schema\"}.", param="response_format")
        if fmt.get("type") == "json_object":
            asked.append(("response_format", GrammarSpec("json_object")))
        elif fmt.get("type") == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise APIError(400, "'response_format' of type json_schema needs 'json_schema': {\"name\", "
                                    "\"schema\"}.", param="response_format")
            asked.append(("response_format", GrammarSpec("json_schema",
                                                         _schema_text(inner["schema"], "response_format.schema"))))
    so = body.get("structured_outputs")
    guided = {key[len("guided_"):]: body[key] for key in ("guided_json", "guided_regex", "guided_choice",
                                                           "guided_grammar") if body.get(key) is not None}
    for where, options in (("structured_outputs", so), ("guided_*", guided or None)):
        if options is None:
            continue
        if not isinstance(options, dict):
            raise APIError(400, f"'{where}' must be an object.", param=where)
        for key, value in options.items():
            if value is None or value is False or key in ("disable_fallback", "disable_any_whitespace",
                                                          "disable_additional_properties", "whitespace_pattern"):
                continue
            if key == "json":
                asked.append((where, GrammarSpec("json_schema", _schema_text(value, f"{where}.json"))))
            elif key == "json_object":
                asked.append((where, GrammarSpec("json_object")))
            elif key in ("regex", "grammar") and isinstance(value, str):
                asked.append((where, GrammarSpec(key, value)))
            elif key == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
                _cap(f"{where}.choice", value, limits.choice, "options")
                asked.append((where, GrammarSpec("choice", json.dumps(value))))
            elif key in ("regex", "grammar", "choice"):
                raise APIError(400, f"'{where}.{key}' must be "
                                    f"{'a list of strings' if key == 'choice' else 'a string'}.", param=where)
            else:
                raise APIError(400, f"'{where}.{key}' is not supported; use json, regex, choice, grammar or "
                                    "json_object.", param=where)
    if len(asked) > 1:
        raise APIError(400, f"the request asks for {len(asked)} output constraints ({', '.join(w for w, _ in asked)}); "
                            "send one.", param=asked[0][0])
    return asked[0][1] if asked else None


def _include_usage(fields: _Common) -> bool:
    return bool(fields.stream_options and fields.stream_options.include_usage)


def _continuous_usage(fields: _Common) -> bool:
    return bool(fields.stream_options and fields.stream_options.continuous_usage_stats)


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompts(value) -> list[str | list[int]]:
    """``prompt`` as OpenAI allows it: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value):
        return list(value)
    if value is None:
        raise APIError(400, "'prompt' is required.", param="prompt")
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids (integers) or a list of "
                        f"token-id lists, got {type(value).__name__}{' (empty)' if value == [] else ''}.",
                   param="prompt")


def parse_completion(body: dict, limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    fields = _validate(CompletionFields, body)
    _log_unknown(body, CompletionFields, "completion")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise APIError(400, "tools are served on /v1/chat/completions, not /v1/completions.", param="tools")
    if fields.suffix:
        raise APIError(400, "this server's engine does not support 'suffix' (insertion); remove it.", param="suffix")
    n = fields.n or 1
    if fields.use_beam_search and fields.best_of is not None and fields.best_of < n:
        raise APIError(400, f"'best_of' ({fields.best_of}) is less than 'n' ({n}): beam search returns its best_of "
                            "beams' n best.", param="best_of")
    if not fields.use_beam_search and fields.best_of is not None and fields.best_of != n:
        raise APIError(400, f"'best_of' ({fields.best_of}) other than 'n' ({n}) is not supported: the engine does "
                            "not rank samples; use 'n'.", param="best_of")
    if fields.max_tokens == 0 and not fields.echo:
        raise APIError(400, "'max_tokens': 0 generates nothing; it is accepted only with 'echo': true (to score the "
                            "prompt with 'logprobs').", param="max_tokens")
    params = _common(body, fields, fields.max_tokens, fields.logprobs, limits)
    if fields.echo and fields.logprobs is not None:
        params.echo_logprobs = fields.logprobs
    if fields.max_tokens == 0:
        params.max_tokens, params.generate = 1, False
    params.grammar_spec = grammar_spec(body, limits)
    _beams(params, fields, n, fields.best_of)
    prompts = _prompts(body.get("prompt"))
    _cap("prompt", prompts, limits.prompts, "prompts")
    return CompletionRequest(fields.model, prompts, params, n, bool(fields.stream),
                             _include_usage(fields), bool(fields.echo), _continuous_usage(fields))


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(value, where: str) -> str | list[dict]:
    """A message's content: a string, or (with images) a list of ``{"type": "text", "text"}`` and ``{"type":
    "image", "url"}`` parts in order (``serve/media.py`` reads the images)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        if any(isinstance(p, dict) and p.get("type") == "image_url" for p in value):
            return _parts_with_images(value, where)
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                named = f"'{kind}' content parts are" if isinstance(kind, str) else "content parts other than text are"
                raise APIError(400, f"{where}.content[{i}]: {named} not supported; send "
                                    '{"type": "text", "text": "..."} parts or a string.', param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where}.content must be a string or a list of text parts, got {type(value).__name__}.",
                   param="messages")


def _parts_with_images(value: list, where: str) -> list[dict]:
    parts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            continue
        image = part.get("image_url") if kind == "image_url" else None
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise APIError(400, f"{where}.content[{i}]: send text parts and image_url parts "
                                '({"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}).',
                           param="messages")
        parts.append({"type": "image", "url": url})
    return parts


def parse_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects.",
                       param="messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise APIError(400, f"{where} must be an object, got {type(msg).__name__}.", param="messages")
        role = msg.get("role")
        if role not in _ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}.", param="messages")
        item = {"role": "system" if role == "developer" else role, "content": _content(msg.get("content"), where)}
        if role == "tool":
            if msg.get("tool_call_id") is not None:
                item["tool_call_id"] = str(msg["tool_call_id"])
        calls = msg.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise APIError(400, f"{where}.tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                                    "\"function\": {\"name\", \"arguments\"}} on an assistant message.",
                               param="messages")
            item["tool_calls"] = calls
        out.append(item)
    return out


def template_kwargs(value: dict | None, limits: RequestLimits = DEFAULT_LIMITS) -> dict:
    """``chat_template_kwargs`` checked: at most ``limits.chat_template_kwargs`` keys, none of the names the server
    passes itself (``TEMPLATE_RESERVED``: a request may not swap the template or its messages this way)."""
    if not value:
        return {}
    _cap("chat_template_kwargs", value, limits.chat_template_kwargs, "keys")
    reserved = sorted(set(value) & TEMPLATE_RESERVED)
    if reserved:
        raise APIError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)} (the server passes "
                            f"{'it' if len(reserved) == 1 else 'them'} itself); send template variables only, e.g. "
                            "{\"enable_thinking\": false}.", param="chat_template_kwargs")
    return dict(value)


def parse_chat(body: dict, limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    fields = _validate(ChatFields, body)
    _log_unknown(body, ChatFields, "chat")
    if fields.top_logprobs is not None and not fields.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    logprobs = (fields.top_logprobs or 0) if fields.logprobs else None
    max_tokens = fields.max_completion_tokens if fields.max_completion_tokens is not None else fields.max_tokens
    params = _common(body, fields, max_tokens, logprobs, limits)
    params.grammar_spec = grammar_spec(body, limits)
    if isinstance(body.get("tools"), list):
        _cap("tools", body["tools"], limits.tools, "tools")
    if isinstance(body.get("messages"), list):
        _cap("messages", body["messages"], limits.messages, "messages")
    tools = parse_tools(body)
    if tools is not None and tools.choice in (REQUIRED, NAMED):
        if params.grammar_spec is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the output itself; drop the other output "
                                "constraint (response_format / structured_outputs).", param="tool_choice")
        schema = required_schema(tools) if tools.choice == REQUIRED else named_schema(tools)
        params.grammar_spec = GrammarSpec("json_schema", json.dumps(schema))
    _beams(params, fields, fields.n or 1, None)
    return ChatRequest(fields.model, parse_messages(body.get("messages")), params, fields.n or 1, bool(fields.stream),
                       _include_usage(fields), _continuous_usage(fields), tools,
                       add_generation_prompt=fields.add_generation_prompt is not False,
                       template_kwargs=template_kwargs(fields.chat_template_kwargs, limits))
