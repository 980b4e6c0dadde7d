"""Per-request sampling for the continuous-batching engine: what a request asked for, and one step of choosing tokens.

``SamplingParams`` is a request's settings, read from a transformers ``GenerationConfig`` (with ``generate()``'s
defaults for what it leaves unset) and validated once, at ``add_request``. ``Sampler`` turns the last-token logits of
the n requests sampled in a step into n tokens, in stages: the engine's masks (``min_tokens``, a grammar's bitmask);
the per-request processors that read a request's own ids (``processors.py``: sequence bias, repetition penalty,
n-gram blocking, bad words, min length, prefix-allowed tokens, forced BOS / EOS, inf/nan removal, length decay,
suppression, a request's own ``logits_processor``); the warpers, rows that share settings processed together by
transformers' own classes in ``generate()``'s order (temperature, top-h, top-k, top-p, min-p, typical, epsilon, eta);
then the choice: greedy rows one argmax, unseeded sampled rows one multinomial draw, and each seeded row a draw from
its own ``torch.Generator``, so a seeded request gets the same tokens whatever else shares its steps (and, alone, the
tokens ``generate()`` gives after ``torch.manual_seed(seed)``). Last, ``stopping.py`` tells which requests the new
tokens end (stop strings, ``max_time``, a request's own ``stopping_criteria``).

Served: everything a decoder-only ``generate()`` applies to one sequence without beams or an assistant: greedy and
multinomial sampling, every logits processor and warper above, EOS and stop token ids, stop strings (the engine is
given the tokenizer), ``max_new_tokens`` (or ``max_length`` less the prompt), ``min_new_tokens`` / ``min_tokens``,
``num_return_sequences`` (the engine forks the request; each fork gets its own generator), per-request ``seed``,
``logprobs``, ``ignore_eos``, ``prompt_logprobs`` (computed by the engine).
Refused with a ValueError naming the setting (see ``REFUSED``, each with its reason): beam search and its variants
(constrained, diverse), assisted / prompt-lookup / speculative decoding, contrastive search and DoLa (they read hidden
states the engine's step does not return), classifier-free guidance (a second, unconditional forward per request),
SynthID watermarking (its processor keeps whole-batch state; green-list watermarking is served), token healing (it
rewrites the prompt), encoder-decoder settings, and the per-step scores, attentions and hidden states of
``generate()``'s return value (ask for ``logprobs`` instead).
"""

from __future__ import annotations

import hashlib
import numbers
import time
from dataclasses import dataclass, field

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .. import compat
from . import features
from .processors import NGramIndex, Processors, ProcessorSettings, RequestState, token_ids
from .stopping import Stopping, StopSettings

# GenerationConfig fields read into SamplingParams (the processors' and stopping's through their settings).
PROCESSOR_FIELDS = frozenset({
    "sequence_bias", "no_repeat_ngram_size", "bad_words_ids", "min_length", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "watermarking_config",
})
STOP_FIELDS = frozenset({"stop_strings", "max_time"})
WARPERS = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
MAPPED = frozenset({
    "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "max_length",
    "eos_token_id", "num_return_sequences", "min_new_tokens", *WARPERS,
    "num_beams", "length_penalty", "early_stopping", "prompt_lookup_num_tokens",
}) | PROCESSOR_FIELDS | STOP_FIELDS
# Fields that never change the tokens a request gets (ids of special tokens, caching and compile choices, beam-only
# settings without beams, assistant settings without an assistant, the layout of generate()'s return value).
NO_EFFECT = frozenset({
    "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
    "compile_config", "disable_compile", "prefill_chunk_size", "low_memory", "max_cache_len", "renormalize_logits",
    "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
    "is_assistant", "return_dict_in_generate", "continuous_batching_config", "transformers_version",
})
# Settings refused when set to anything but generate()'s default, with the reason (features.py's table).
REFUSED = features.UNSERVED_SETTINGS
# Values of refusable settings that do nothing, where generate()'s default is None.
NEUTRAL = {"min_new_tokens": 0, "guidance_scale": 1.0, "diversity_penalty": 0.0, "num_beam_groups": 1}
# Options of the engine's add_request that are not GenerationConfig fields.
ENGINE_OPTIONS = frozenset({"seed", "logprobs", "stop_token_ids", "ignore_eos", "min_tokens", "prompt_logprobs",
                            "grammar"})
# Per-call callables generate() accepts, applied per request (see processors.py and stopping.py for their contract).
CALLABLES = frozenset({"logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn"})


def _enabled_eos(value):
    """``eos_token_id`` less transformers' "disabled" marker: its continuous batching writes -1 into a generation
    config that has none (``init_continuous_batching`` on a config without EOS), and ``generate()`` then never stops
    on it either; None when nothing is left."""
    if _is_int(value) and value == -1:
        return None
    if isinstance(value, (list, tuple)) and -1 in value:
        return [v for v in value if not (_is_int(v) and v == -1)] or None
    if isinstance(value, torch.Tensor) and bool((value == -1).any()):
        return _enabled_eos(value.reshape(-1).tolist())
    return value


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (validated on construction).

    ``do_sample=False`` is greedy (argmax, after the repetition penalty if set; the warpers do not apply).
    ``top_k=None`` / ``top_p=None`` / ``min_p=None`` / ``repetition_penalty=None`` mean off. Generation ends at any
    of ``eos_token_ids`` (finish reason "stop", the token is kept) or after ``max_new_tokens`` ("length").
    ``logprobs``: None for none, 0 for the sampled token's log-probability, k > 0 for the k most likely tokens' too.
    ``prompt_logprobs``: None for none, else every prompt token's log-probability under the model (the first has
    none) with the k most likely tokens at each position (k = 0: the token's own only).
    ``min_tokens``: EOS and stop token ids are masked out until that many tokens were generated.
    ``grammar``: a :class:`~hf_paged.engine.structured.CompiledGrammar` the output must match (structured output),
    applied as a token bitmask before the other processors.
    ``num_return_sequences`` > 1 (sampling only) asks the engine for that many forks of the request.
    ``top_h`` / ``typical_p`` / ``epsilon_cutoff`` / ``eta_cutoff``: the other warpers of ``generate()`` (None: off).
    ``processors``: the history-dependent processors (:class:`~hf_paged.engine.processors.ProcessorSettings`; None:
    none). ``stopping``: stop strings, ``max_time`` and own criteria
    (:class:`~hf_paged.engine.stopping.StopSettings`; None: none).

    Example::

        params = SamplingParams.from_generation_config(model.generation_config, do_sample=True, top_p=0.9, seed=7)
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int = 16
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    num_return_sequences: int = 1
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    grammar: object = None
    top_h: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    processors: ProcessorSettings | None = None
    stopping: StopSettings | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    prompt_lookup_num_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if not _is_number(self.temperature) or not self.temperature > 0:
            hint = "; for greedy decoding pass do_sample=False" if _is_number(self.temperature) else ""
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}{hint}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or 0 / None for no top-k), got {self.top_k!r}")
        if self.top_p is not None and (not _is_number(self.top_p) or not 0 <= self.top_p <= 1):
            raise ValueError(f"top_p must be a number in [0, 1], got {self.top_p!r}")
        if self.min_p is not None and (not _is_number(self.min_p) or not 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.top_h is not None and (not _is_number(self.top_h) or not 0 < self.top_h <= 1):
            raise ValueError(f"top_h must be a number in (0, 1], got {self.top_h!r}")
        if self.top_h is not None and compat.TopHLogitsWarper is None:
            raise ValueError(f"top_h needs a transformers with TopHLogitsWarper (this is {compat.TRANSFORMERS_VERSION}); "
                             "upgrade transformers or leave top_h unset")
        for name in ("typical_p", "epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not 0 < value < 1):
                raise ValueError(f"{name} must be a number in (0, 1) (or None for off), got {value!r}")
        if self.processors is not None and not isinstance(self.processors, ProcessorSettings):
            raise ValueError(f"processors must be a ProcessorSettings, got {type(self.processors).__name__}")
        if self.stopping is not None and not isinstance(self.stopping, StopSettings):
            raise ValueError(f"stopping must be a StopSettings, got {type(self.stopping).__name__}")
        if self.repetition_penalty is not None and (
                not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.eos_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a tuple of token ids >= 0, got {self.eos_token_ids!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0 (top alternatives), got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an integer >= 0 (top alternatives), got "
                             f"{self.prompt_logprobs!r}")
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            raise ValueError(f"grammar must be a CompiledGrammar (GrammarCompiler(tokenizer).compile(spec)), got "
                             f"{type(self.grammar).__name__}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_new_tokens={self.max_new_tokens}; "
                             "lower min_tokens or raise max_new_tokens")
        if not _is_int(self.num_return_sequences) or self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be an integer >= 1, got {self.num_return_sequences!r}")
        if not _is_int(self.num_beams) or self.num_beams < 1:
            raise ValueError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if not _is_number(self.length_penalty):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or \"never\", got {self.early_stopping!r}")
        if self.prompt_lookup_num_tokens is not None and (
                not _is_int(self.prompt_lookup_num_tokens) or self.prompt_lookup_num_tokens < 0):
            raise ValueError(f"prompt_lookup_num_tokens must be an integer >= 0 (0: no speculation for this request), "
                             f"got {self.prompt_lookup_num_tokens!r}")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences={self.num_return_sequences} is more than num_beams="
                             f"{self.num_beams}: beam search returns at most its num_beams best sequences")
        features.check(features.request_features(self))  # combinations (features.py's table)

    @classmethod
    def from_generation_config(cls, config=None, *, prompt_length: int | None = None,
                               **overrides) -> "SamplingParams":
        """The settings a request gets from ``config`` (a ``GenerationConfig`` or None) and ``overrides``.

        Unset values take ``generate()``'s defaults (so sampling without ``top_k`` keeps the 50 most likely tokens,
        as ``generate()`` does). ``overrides`` are GenerationConfig field names plus the engine's ``seed``,
        ``logprobs``, ``prompt_logprobs``, ``stop_token_ids`` (added to the config's EOS ids), ``ignore_eos`` (drop
        the config's EOS ids: only ``max_new_tokens`` and ``stop_token_ids`` end the request) and ``min_tokens``
        (also read from ``min_new_tokens``); None means "not given".
        ``max_new_tokens`` falls back to the config's ``max_length`` less ``prompt_length`` (when both are known),
        then to 16. Raises ValueError naming any setting the engine cannot apply (``REFUSED``, custom processors,
        unknown names) or a value out of range.

        Example::

            SamplingParams.from_generation_config(GenerationConfig(do_sample=True, temperature=0.7), seed=3)
        """
        given = {key: value for key, value in overrides.items() if value is not None}
        defaults = compat.generation_defaults()
        fields = dict(vars(config)) if config is not None else {}  # to_dict() would deep-copy it
        unknown = sorted(set(given) - set(defaults) - set(fields) - ENGINE_OPTIONS - CALLABLES)
        if unknown:
            raise ValueError(f"unknown generation setting(s) {unknown}; the engine reads GenerationConfig fields and "
                             f"{sorted(ENGINE_OPTIONS | CALLABLES)}")
        settings = {**defaults, **{k: v for k, v in fields.items() if v is not None}, **given}

        for key, value in settings.items():
            if key not in defaults or key in MAPPED or key in NO_EFFECT or key.startswith("_"):
                continue  # a custom entry of a model's config: generate() does not read it either
            if value is None or value is False or _same(value, defaults.get(key)) or _same(value, NEUTRAL.get(key)):
                continue
            raise features.setting_refused(key, value)

        do_sample = settings.get("do_sample") or False
        temperature = settings.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if _is_number(temperature) and temperature == 0 and do_sample:
            raise ValueError("temperature=0 with do_sample=True: for greedy decoding pass do_sample=False, "
                             "otherwise a temperature > 0")
        top_k = settings.get("top_k")
        top_p = settings.get("top_p")
        min_p = settings.get("min_p")
        penalty = settings.get("repetition_penalty")
        if _is_int(top_k) and top_k == 0:
            top_k = None
        if _is_number(top_p) and top_p == 1:
            top_p = None
        if _is_number(min_p) and min_p == 0:
            min_p = None
        if _is_number(penalty) and penalty == 1:
            penalty = None
        warpers = {name: settings.get(name) for name in WARPERS}
        if _is_number(warpers["typical_p"]) and warpers["typical_p"] == 1:
            warpers["typical_p"] = None  # generate() applies these only strictly inside (0, 1)
        for name in ("epsilon_cutoff", "eta_cutoff"):
            if _is_number(warpers[name]) and warpers[name] == 0:
                warpers[name] = None
        # the warpers are validated even where greedy decoding will not apply them (temperature=0 means greedy there)
        cls(do_sample=True, temperature=1.0 if temperature == 0 and not do_sample else temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, **warpers)
        if not do_sample:
            temperature, top_k, top_p, min_p = 1.0, None, None, None
            warpers = dict.fromkeys(WARPERS)

        max_new_tokens = settings.get("max_new_tokens")
        if max_new_tokens is None:
            max_length = given.get("max_length", fields.get("max_length"))
            if max_length is not None and prompt_length is not None:
                max_new_tokens = max_length - prompt_length
                if max_new_tokens < 1:
                    raise ValueError(f"max_length={max_length} leaves no room to generate after a {prompt_length}-"
                                     f"token prompt; set max_new_tokens")
            else:
                max_new_tokens = cls.max_new_tokens

        num_beams = settings.get("num_beams") or 1
        length_penalty, early_stopping = 1.0, False  # beam-only settings: no effect without beams
        if num_beams > 1:
            length_penalty = 1.0 if settings.get("length_penalty") is None else settings["length_penalty"]
            early_stopping = settings.get("early_stopping") or False
        eos = () if settings.get("ignore_eos") else token_ids(_enabled_eos(settings.get("eos_token_id")),
                                                              "eos_token_id")
        min_tokens = settings.get("min_tokens")
        if min_tokens is None:
            min_tokens = settings.get("min_new_tokens") or 0
        return cls(
            do_sample=do_sample, temperature=float(temperature) if _is_number(temperature) else temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty, max_new_tokens=max_new_tokens,
            eos_token_ids=eos + token_ids(settings.get("stop_token_ids"), "stop_token_ids"),
            seed=settings.get("seed"), logprobs=settings.get("logprobs"),
            num_return_sequences=settings.get("num_return_sequences") or 1,
            min_tokens=min_tokens, prompt_logprobs=settings.get("prompt_logprobs"), grammar=settings.get("grammar"),
            **warpers, processors=ProcessorSettings.from_settings(settings),
            stopping=StopSettings.from_settings(settings),
            num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
            prompt_lookup_num_tokens=settings.get("prompt_lookup_num_tokens"),
        )

    def finish_reason(self, token: int, num_generated: int) -> str | None:
        """"stop" if ``token`` ends the request, "length" if ``num_generated`` (``token`` included) is the limit."""
        if token in self.eos_token_ids:
            return "stop"
        if num_generated >= self.max_new_tokens:
            return "length"
        return None

    @property
    def uses_history(self) -> bool:
        """Whether ``Sampler`` reads this request's token history (its processors or stopping do)."""
        return self.repetition_penalty is not None or self.processors is not None or self.stopping is not None


def _same(value, default) -> bool:
    try:
        return bool(value == default)
    except Exception:  # tensors, configs: anything not comparable is a change
        return False


def _fork_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class SampleResult:
    """What one step chose for its n rows.

    ``logprobs[i]`` is row i's sampled token's log-probability and ``top_logprobs[i]`` its ``params[i].logprobs``
    most likely ``(token, log-probability)`` pairs, most likely first; both are None where no row asked, and
    ``None`` / ``[]`` for the rows that did not. ``stopped[i]``: row i's token ends it (a stop string, ``max_time``
    or its own stopping criteria; finish reason "stop"); None where no row has such settings. ``errors``: row ->
    why that request's own ``logits_processor`` / ``prefix_allowed_tokens_fn`` / ``stopping_criteria`` failed (the
    engine fails that request alone); empty when none did.
    """

    tokens: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stopped: list[bool] | None = None
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Chooses the next token of each request in a step.

    Log-probabilities are those of the distribution the token was drawn from, after processing: for sampled rows
    after the processors and warpers (tokens they removed have ``-inf``), for greedy rows the model's distribution
    after the processors. Logits are processed in float32, as in ``generate()``.

    Args:
        device: where seeded requests' generators live.
        tokenizer: the model's tokenizer, for requests with ``stop_strings`` (None: such requests are refused).

    Example::

        sampler = Sampler(device=model.device)
        params = [SamplingParams(), SamplingParams(do_sample=True, top_p=0.9, seed=1)]
        generators = [sampler.new_generator(p) for p in params]        # once per request, kept across steps
        states = [sampler.join(p) for p in params]                     # once per request, kept across steps
        result = sampler(logits, params, generators, histories, states=states)   # logits [2, vocab]
        result.tokens                                                   # [2] token ids
    """

    def __init__(self, device: torch.device | str | None = None, tokenizer=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._chains: dict[tuple, LogitsProcessorList] = {}
        self.processors = Processors()
        self.stopping = Stopping(tokenizer)

    def check(self, params: SamplingParams, vocab_size: int | None = None) -> None:
        """``ValueError`` if this engine cannot serve ``params`` (stop strings without a tokenizer, token ids past
        ``vocab_size``); call it when a request is added."""
        self.stopping.check(params.stopping)
        if params.processors is not None and vocab_size is not None:
            params.processors.check_vocab(vocab_size)

    @staticmethod
    def join(params: SamplingParams) -> RequestState | None:
        """The per-request state a request with ``params`` keeps across its steps (its n-gram index, the start of its
        ``max_time`` clock); None when it needs none. Keep it with the request; a fork takes ``state.fork()``."""
        settings = params.processors
        ngram = settings.no_repeat_ngram_size if settings is not None else 0
        timed = params.stopping is not None and params.stopping.max_time is not None
        if not ngram and not timed:
            return None
        return RequestState(ngrams=NGramIndex(ngram) if ngram else None, started=time.time() if timed else None)

    def new_generator(self, params: SamplingParams, index: int = 0,
                      device: torch.device | str | None = None) -> torch.Generator | None:
        """The random stream of a seeded sampled request (None for unseeded or greedy ones).

        ``index`` numbers the forks of a request with ``num_return_sequences`` > 1: fork 0 uses the seed itself,
        the others seeds derived from it. Keep the generator with the request across steps and preemptions.
        """
        if params.seed is None or not params.do_sample:
            return None
        generator = torch.Generator(device=torch.device(device) if device is not None else self.device)
        generator.manual_seed(_fork_seed(params.seed, index))
        return generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], histories: list[list[int]],
                 num_generated: list[int] | None = None, bitmask: torch.Tensor | None = None,
                 bitmask_rows: list[int] | None = None, states: list[RequestState | None] | None = None
                 ) -> SampleResult:
        """Tokens for ``logits`` ``[n, vocab]`` (the last-token logits of n rows).

        ``generators[i]`` is row i's ``new_generator`` (None: the global RNG); ``histories[i]`` its prompt +
        generated ids, read only when ``params[i].uses_history`` (others may pass ``[]``); ``num_generated[i]``: the
        tokens row i has generated so far (read for ``min_tokens`` and the processors that count generated tokens;
        default 0 for every row). ``bitmask`` ``int32 [r, ceil(vocab / 32)]``: the allowed tokens of rows
        ``bitmask_rows`` (structured output; bit j of word w set = token 32 w + j allowed); None when no row is
        constrained. ``states[i]``: row i's :meth:`join` state (default: a fresh one each call, which is exact but
        re-reads a no-repeat-n-gram row's whole history).
        """
        n, vocab = logits.shape
        if not len(params) == len(generators) == len(histories) == n:
            raise ValueError(f"logits hold {n} requests' scores but {len(params)} params, {len(generators)} generators "
                             f"and {len(histories)} histories were given; pass one of each per request")
        if states is None:
            states = [self.join(p) for p in params]
        errors: dict[int, str] = {}
        processed = self.process(logits, params, histories, num_generated, states, bitmask, bitmask_rows, errors)

        greedy = [row for row, p in enumerate(params) if not p.do_sample]
        if len(greedy) == n:
            tokens = processed.argmax(dim=-1)  # [n]
        else:
            tokens = torch.empty(n, dtype=torch.long, device=processed.device)  # [n]
            if greedy:
                index = torch.tensor(greedy, device=processed.device)
                tokens[index] = processed[index].argmax(dim=-1)
            self._draw(processed, params, generators, tokens)
        token_list = tokens.tolist()
        stopped = self.stopping([p.stopping for p in params],
                                [s.started if s is not None else None for s in states], histories, token_list,
                                processed, errors)
        if all(p.logprobs is None for p in params):
            return SampleResult(token_list, stopped=stopped, errors=errors)
        return SampleResult(token_list, *_logprobs(processed, tokens, params), stopped=stopped, errors=errors)

    def process(self, scores: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                num_generated: list[int] | None = None, states: list[RequestState | None] | None = None,
                bitmask: torch.Tensor | None = None, bitmask_rows: list[int] | None = None,
                errors: dict[int, str] | None = None) -> torch.Tensor:
        """``scores`` ``[n, vocab]`` after every stage before the choice of tokens, in float32 and ``generate()``'s
        order: the engine's masks, the processors, the warpers (sampled rows) and watermarks. What a row's token is
        chosen from (argmax, or a draw from its softmax); the engine's beam search passes log-probabilities (as
        ``generate()``'s beam search processes them), speculative verification the logits at each drafted position.
        Arguments as in :meth:`__call__`; ``errors`` collects the rows whose own callables failed.

        Example::

            probs = sampler.process(logits, params, histories, num_generated).softmax(-1)   # [n, vocab]
        """
        if states is None:
            states = [self.join(p) for p in params]
        errors = {} if errors is None else errors
        scores = _mask_min_tokens(scores.float(), params, num_generated)  # [n, vocab]
        if bitmask is not None:
            scores = apply_bitmask(scores, bitmask, bitmask_rows)
        scores = self.processors(scores, params, states, histories, num_generated, errors)  # [n, vocab]
        groups: dict[tuple, list[int]] = {}
        for row, p in enumerate(params):
            groups.setdefault(_chain_key(p), []).append(row)
        processed = scores
        active = [(self._chain(key), rows) for key, rows in groups.items() if self._chain(key)]
        if len(groups) == 1 and active:
            chain, _ = active[0]
            processed = chain(None, scores)
        elif active:
            processed = scores.clone()
            for chain, rows in active:
                index = torch.tensor(rows, device=scores.device)  # [g]
                processed[index] = chain(None, scores[index])  # [g, vocab]
        return self.processors.after_warpers(processed, params, histories)  # watermarks

    def _chain(self, key: tuple) -> LogitsProcessorList:
        chain = self._chains.get(key)
        if chain is None:
            do_sample, temperature, top_h, top_k, top_p, min_p, typical_p, epsilon, eta = key
            chain = LogitsProcessorList()
            if do_sample:  # generate()'s order
                if temperature != 1.0:
                    chain.append(TemperatureLogitsWarper(float(temperature)))
                if top_h is not None:
                    chain.append(compat.TopHLogitsWarper(top_h=float(top_h)))
                if top_k is not None:
                    chain.append(TopKLogitsWarper(top_k=int(top_k)))
                if top_p is not None:
                    chain.append(TopPLogitsWarper(top_p=float(top_p)))
                if min_p is not None:
                    chain.append(MinPLogitsWarper(min_p=float(min_p)))
                if typical_p is not None:
                    chain.append(TypicalLogitsWarper(mass=float(typical_p)))
                if epsilon is not None:
                    chain.append(EpsilonLogitsWarper(epsilon=float(epsilon)))
                if eta is not None:
                    chain.append(EtaLogitsWarper(epsilon=float(eta), device=self.device))
            self._chains[key] = chain
        return chain

    @staticmethod
    def _draw(processed: torch.Tensor, params, generators, tokens: torch.Tensor) -> None:
        sampled = [row for row, p in enumerate(params) if p.do_sample]
        index = torch.tensor(sampled, device=processed.device)
        probs = torch.softmax(processed[index], dim=-1)  # [s, vocab]
        shared = [j for j, row in enumerate(sampled) if generators[row] is None]
        if shared:
            at = torch.tensor(shared, device=processed.device)
            tokens[index[at]] = torch.multinomial(probs[at], num_samples=1).squeeze(1)
        for j, row in enumerate(sampled):
            generator = generators[row]
            if generator is None:
                continue
            row_probs = probs[j:j + 1]  # [1, vocab]
            if row_probs.device != generator.device:
                row_probs = row_probs.to(generator.device)
            tokens[row] = torch.multinomial(row_probs, num_samples=1, generator=generator).item()


def _mask_min_tokens(scores: torch.Tensor, params, num_generated) -> torch.Tensor:
    """``scores`` with the EOS / stop ids of rows still under their ``min_tokens`` set to -inf (a copy if any)."""
    rows, cols = [], []
    for row, p in enumerate(params):
        if p.min_tokens and p.eos_token_ids and (num_generated[row] if num_generated else 0) < p.min_tokens:
            rows.extend([row] * len(p.eos_token_ids))
            cols.extend(p.eos_token_ids)
    if not rows:
        return scores
    scores = scores.clone()
    scores[torch.tensor(rows, device=scores.device), torch.tensor(cols, device=scores.device)] = float("-inf")
    return scores


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of ``scores`` ``[n, vocab]`` with the tokens ``bitmask`` ``int32 [r, words]`` disallows in ``rows``
    set to -inf."""
    n, vocab = scores.shape
    bits = torch.arange(32, dtype=torch.int32, device=scores.device)  # [32]
    words = bitmask.to(scores.device)  # [r, words]
    allowed = ((words[:, :, None] >> bits) & 1).bool().reshape(len(rows), -1)[:, :vocab]  # [r, vocab]
    scores = scores.clone()
    index = torch.tensor(rows, device=scores.device)  # [r]
    scores[index] = scores[index].masked_fill(~allowed, float("-inf"))
    return scores


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Log-probabilities of ``targets`` under ``logits`` (the model's raw distribution, in float32).

    ``logits`` ``[m, vocab]`` at m positions, ``targets`` ``[m]`` the token that follows each. Returns
    ``(logprobs [m], ranks [m], top)``: each target's log-probability, its rank (1 = the most likely; ties rank
    the target first), and the k most likely ``(token, log-probability)`` pairs per row (``[]`` for k = 0).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, vocab]
    chosen = logp.gather(1, targets[:, None])  # [m, 1]
    ranks = (logp > chosen).sum(dim=-1) + 1  # [m]
    top: list[list[tuple[int, float]]] = [[] for _ in range(logits.shape[0])]
    if k > 0:
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [m, k]
        top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return chosen.squeeze(1).tolist(), ranks.tolist(), top


def _chain_key(p: SamplingParams) -> tuple:
    if not p.do_sample:
        return (False, 1.0, None, None, None, None, None, None, None)
    return (True, p.temperature, p.top_h, p.top_k, p.top_p, p.min_p, p.typical_p, p.epsilon_cutoff, p.eta_cutoff)


def _logprobs(processed: torch.Tensor, tokens: torch.Tensor, params):
    logp = torch.log_softmax(processed, dim=-1)  # [n, vocab]
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()  # [n]
    wanted = [p.logprobs is not None for p in params]
    top_k = min(max(p.logprobs or 0 for p in params), logp.shape[-1])
    tops: list[list[tuple[int, float]]] = [[] for _ in params]
    if top_k > 0:
        values, indices = logp.topk(top_k, dim=-1)  # [n, top_k]
        values, indices = values.tolist(), indices.tolist()
        for row, p in enumerate(params):
            k = min(p.logprobs or 0, top_k)
            tops[row] = list(zip(indices[row][:k], values[row][:k]))
    return [lp if want else None for lp, want in zip(chosen, wanted)], tops
