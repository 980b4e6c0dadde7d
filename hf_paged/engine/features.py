"""Which request features combine, and what happens where they do not: the engine's one rules table.

Every refusal of a *combination* (beams with a grammar, an adapter under tensor parallelism, ...) and every case
where a feature is quietly not applied (speculation for a request that asks for logprobs decodes plainly) is a row
of :data:`RULES`; the engine (``sampling.py``, ``speculative.py``, ``factory.py``, ``manager.py``, ...) asks this
module instead of deciding on its own, the server should too (it calls :func:`check` on the features of a request
it builds), and a randomized tester reads it to draw only the combinations that are served.

Public API (small on purpose, stable for the tester)::

    FEATURES                      # frozenset of the feature names below
    decide(features) -> Decision  # Decision(outcome, reason, dropped): outcome "served" | "plain" | "refused"
    served(features) -> bool      # decide(features).outcome != "refused"
    check(features) -> Decision   # FeatureRefused (a ValueError naming the combination and why) if refused
    request_features(params, ...) # the features of one request (a SamplingParams) in an engine
    REQUEST_FEATURES              # the names a request itself has (the rest: engine conditions, the server's tools)
    RULES, table()                # the rules, and as (features, outcome, reason) rows
    SETTINGS, describe(names)     # the user-facing setting behind each name ("num_beams > 1")
    UNSERVED_SETTINGS             # GenerationConfig fields refused alone (setting_refused(key, value) is the error)
    UNSERVED_ENGINE_SETTINGS      # ContinuousBatchingConfig fields refused alone

``outcome``: "served" (every feature applies, and a greedy request gets the tokens of ``generate()`` alone),
"plain" (served, but the features in ``dropped`` are not applied: speculation, which never changes what a greedy
request gets, is skipped and the request decodes one token a step), "refused" (``add_request`` raises). Rules
are matched on subsets: a rule applies to a request whose features include all of the rule's ``features`` and none
of its ``unless``; a refusal wins over "plain", whose dropped features add up.

Feature names (a request's, then the engine's conditions it runs under):

    sampled             do_sample=True (else greedy)
    seeded              a per-request seed (the guarantee: alone, the tokens of generate() after torch.manual_seed)
    n                   num_return_sequences > 1 (sampled: forks; with beams: the best n)
    beams               num_beams > 1
    ngram               the request's own prompt_lookup_num_tokens > 0
    speculative         the engine speculates by default (init_continuous_batching(speculative="ngram" / a model))
    logprobs            logprobs of the generated tokens
    prompt_logprobs     logprobs of the prompt's tokens
    grammar             structured output (a grammar, response_format, tool_choice)
    processors          history processors (repetition penalty, no_repeat_ngram, bad words, min_length, ...)
    logits_processor    the request's own callables (logits_processor, prefix_allowed_tokens_fn)
    watermark           green-list watermarking (its processor reads the whole history every call)
    stop_strings        stop strings (need the tokenizer)
    max_time            a time limit
    stopping_criteria   the request's own stopping criteria
    min_tokens          EOS / stop ids masked until that many tokens
    eos_ids             several EOS / stop token ids
    images              a prompt with images (processor outputs)
    videos              a prompt with videos
    adapter             a LoRA adapter for this request
    tools               server: tool definitions in a chat request
    tensor_parallel     the engine runs sharded over several ranks
    state_layers        the model has state layers (hybrids: Mamba, GatedDeltaNet, ...)
    cuda_graphs         the engine replays decode steps as CUDA graphs

Example::

    from hf_paged.engine import features
    features.decide({"beams", "images"})          # Decision(outcome='served', ...)
    features.decide({"speculative", "seeded", "sampled"}).dropped   # frozenset({'speculative'})
    features.check({"beams", "grammar"})          # FeatureRefused: beams + grammar: ...
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FEATURES = frozenset({
    "sampled", "seeded", "n", "beams", "ngram", "speculative", "logprobs", "prompt_logprobs", "grammar",
    "processors", "logits_processor", "watermark", "stop_strings", "max_time", "stopping_criteria", "min_tokens",
    "eos_ids", "images", "videos", "adapter", "tools", "tensor_parallel", "state_layers", "cuda_graphs",
})
# the features of a request itself (the rest are the engine's conditions, or the server's)
REQUEST_FEATURES = FEATURES - {"speculative", "tensor_parallel", "state_layers", "cuda_graphs", "tools"}
SPECULATION = frozenset({"ngram", "speculative"})
SERVED, PLAIN, REFUSED = "served", "plain", "refused"


class FeatureRefused(ValueError):
    """A combination of request features the engine does not serve (the message names it and why)."""


@dataclass(frozen=True)
class Rule:
    """``features`` together (and none of ``unless``) give ``outcome``, for ``reason``; a "plain" rule drops the
    speculation features it names."""

    features: frozenset
    outcome: str
    reason: str
    unless: frozenset = frozenset()

    def applies(self, present: frozenset) -> bool:
        return self.features <= present and not (self.unless & present)


@dataclass(frozen=True)
class Decision:
    outcome: str  # "served" | "plain" | "refused"
    reason: str  # "" when served; else the matched rules' reasons, joined
    dropped: frozenset = frozenset()  # features not applied ("plain")
    rules: tuple = ()  # the rules that matched


# what a user sets for each feature (refusals name these)
SETTINGS = {
    "sampled": "do_sample=True", "seeded": "seed", "n": "num_return_sequences > 1", "beams": "num_beams > 1",
    "ngram": "prompt_lookup_num_tokens", "speculative": "speculative (the engine's)", "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs", "grammar": "structured output (a grammar, response_format, tool_choice)",
    "processors": "history processors", "logits_processor": "logits_processor / prefix_allowed_tokens_fn",
    "watermark": "watermarking_config", "stop_strings": "stop_strings", "max_time": "max_time",
    "stopping_criteria": "stopping_criteria", "min_tokens": "min_tokens", "eos_ids": "several eos_token_id",
    "images": "images", "videos": "videos", "adapter": "a LoRA adapter per request", "tools": "tools",
    "tensor_parallel": "tensor parallelism", "state_layers": "a model with state layers",
    "cuda_graphs": "cuda_graphs=True",
}
_CONTEXT = ("beams", "speculative", "state_layers", "tensor_parallel")  # named last: "X with num_beams > 1"


def describe(names) -> str:
    """The settings behind feature ``names``, as a user wrote them ("logprobs with num_beams > 1")."""
    order = sorted(names, key=lambda n: (n in _CONTEXT, _CONTEXT.index(n) if n in _CONTEXT else 0, n))
    return " with ".join(SETTINGS[n] for n in order)


def _rule(names: str, outcome: str, reason: str, unless: str = "") -> Rule:
    return Rule(frozenset(names.split()), outcome, reason, frozenset(unless.split()))


_SPEC_PLAIN = ("its tokens are verified one position at a time only where every processor and stopping rule is a "
               "function of the request's ids alone")
_BEAM_ROWS = "beam search reorders the request's rows every step"

RULES: tuple[Rule, ...] = (
    # ---- refused: what the engine cannot serve together
    _rule("beams grammar", REFUSED, f"{_BEAM_ROWS}, and a grammar's matcher advances with one row's tokens"),
    _rule("beams logprobs", REFUSED, f"{_BEAM_ROWS}: a token's logprob belongs to a row that may be dropped "
                                     "(generate() gives beam scores, not per-token logprobs)"),
    _rule("beams ngram", REFUSED, "generate() does not combine assisted decoding with beam search either"),
    _rule("beams stop_strings", REFUSED, f"{_BEAM_ROWS}; stop strings and time limits end one sequence, not a "
                                         "beam hypothesis"),
    _rule("beams max_time", REFUSED, f"{_BEAM_ROWS}; stop strings and time limits end one sequence, not a "
                                     "beam hypothesis"),
    _rule("beams stopping_criteria", REFUSED, f"{_BEAM_ROWS}; a request's own stopping criteria judge one "
                                              "sequence, not a beam hypothesis"),
    _rule("n", REFUSED, "with greedy decoding it would return identical sequences; pass do_sample=True (as "
                        "generate() requires)", unless="sampled beams"),
    _rule("videos", REFUSED, "not yet: send images (or frames as images)"),
    _rule("grammar tensor_parallel", REFUSED, "the other ranks have no tokenizer to compile the grammar with; serve "
                                              "structured output from a single-process engine"),
    _rule("adapter tensor_parallel", REFUSED, "per-request LoRA adapters are not sharded; merge the adapter into the "
                                              "weights (peft's merge_and_unload) and serve that model"),
    _rule("images tensor_parallel", REFUSED, "the vision encoder is not run on the sharded ranks; serve image "
                                             "prompts from a single-process engine"),
    _rule("speculative state_layers", REFUSED, "a state layer's state cannot be cut back after a rejected draft; "
                                               "leave speculative unset"),
    _rule("speculative tensor_parallel", REFUSED, "rows cannot be cut back in step on every rank; leave speculative "
                                                  "unset"),
    _rule("cuda_graphs state_layers", REFUSED, "state layers' mixers run per group of requests, outside a graph; "
                                               "leave cuda_graphs unset"),
    _rule("tools images", REFUSED, "tools together with images are not served yet; send one or the other"),
    # ---- plain: served, speculation not applied (greedy tokens are the same either way)
    _rule("speculative beams", PLAIN, "beam rows decode one token a step"),
    *(_rule(f"{spec} {other}", PLAIN, f"{other}: {why}")
      for spec in sorted(SPECULATION)
      for other, why in (
          ("logprobs", "the logprobs are of the tokens sampled one at a time"),
          ("grammar", "a grammar's matcher advances one sampled token at a time"),
          ("stop_strings", _SPEC_PLAIN), ("max_time", _SPEC_PLAIN), ("stopping_criteria", _SPEC_PLAIN),
          ("logits_processor", "a request's own callables are called once per step, by contract"),
          ("watermark", "the watermark's processor is called once per step"),
          ("state_layers", "a state layer's state cannot be cut back after a rejected draft"),
          ("seeded", "a seeded request keeps its guarantee (alone, the tokens of generate() after "
                     "torch.manual_seed(seed)): acceptance draws would consume its generator, and whether a step "
                     "drafts depends on measured timings"),
      )),
)


_HUB = "moved out of transformers to the Hub (custom_generate) in transformers 5; not served by the engine"
_SPECULATION = ("is not one of the engine's speculation modes; use prompt_lookup_num_tokens or "
                "init_continuous_batching(speculative=...)")
_RETURN = ("is part of generate()'s return value, which the engine does not build; ask for logprobs=k (the "
           "processed distribution's top k) instead")
# GenerationConfig settings refused alone, when set to anything but generate()'s default, with the reason: what a
# decoder-only engine step cannot apply.
UNSERVED_SETTINGS = {
    "num_beam_groups": _HUB, "diversity_penalty": _HUB, "constraints": _HUB, "force_words_ids": _HUB,
    "penalty_alpha": ("contrastive search re-ranks candidates by the model's hidden states, which the engine's "
                      "packed step does not return; run model.generate() with a PagedCache for it"),
    "dola_layers": ("DoLa contrasts early-exit layers' logits, which the engine's packed step does not compute; "
                    "run model.generate() with a PagedCache for it"),
    "guidance_scale": ("classifier-free guidance needs a second, unconditional forward per request and step; run "
                       "model.generate() with a PagedCache for it"),
    "encoder_no_repeat_ngram_size": "applies to encoder-decoder models only (the engine serves decoder-only models)",
    "encoder_repetition_penalty": "applies to encoder-decoder models only (the engine serves decoder-only models)",
    "token_healing": ("token healing rewrites the prompt's last tokens with the tokenizer before generating; heal "
                      "the prompt before add_request, or run model.generate() with a PagedCache"),
    "assistant_early_exit": _SPECULATION,
    "speculation_type": _SPECULATION,
    "use_mtp": "multi-token prediction is not served by the engine",
    "output_scores": "per-step scores " + _RETURN,
    "output_logits": "per-step logits " + _RETURN,
    "output_attentions": "attentions are not returned by the engine",
    "output_hidden_states": "hidden states are not returned by the engine",
}
# transformers ContinuousBatchingConfig fields the engine refuses when set away from their default, with the reason
UNSERVED_ENGINE_SETTINGS = {
    "use_cuda_graph": "this engine graphs decode-only steps only; steps with prefill chunks run eagerly",
    "q_padding_interval_size": "this engine pads graphed decode steps to power-of-two row buckets",
    "kv_padding_interval_size": "this engine pads graphed decode steps' block tables to power-of-two widths",
    "varlen_compile_config": "this engine runs its forwards eagerly",
    "decode_compile_config": "this engine runs its forwards eagerly",
    "default_compile_level": "this engine runs its forwards eagerly",
    "scheduler_type": "this engine schedules first come, first served only",
    "seed": "pass seed= per request (add_request(..., seed=...)) instead",
    "use_async_batching": "this engine runs one step at a time",
    "cpu_offload_space": "preempted requests are recomputed (their cached prefix blocks make that cheap), not "
                         "offloaded",
}


def setting_refused(key: str, value) -> FeatureRefused:
    """The error for a GenerationConfig setting the engine does not serve (``UNSERVED_SETTINGS``, or any other that
    changes generate()'s output), set to ``value``."""
    why = UNSERVED_SETTINGS.get(key, "changes the output in generate() and the engine cannot apply it")
    return FeatureRefused(f"{key}={value!r} is not supported by the engine: {why}; remove it from the generation "
                          f"config / request")


def decide(features: Iterable[str]) -> Decision:
    """What the engine does with a request of ``features`` (names from :data:`FEATURES`)."""
    present = frozenset(features)
    unknown = present - FEATURES
    if unknown:
        raise ValueError(f"unknown feature name(s) {sorted(unknown)}; the names are {sorted(FEATURES)}")
    matched = tuple(r for r in RULES if r.applies(present))
    refused = [r for r in matched if r.outcome == REFUSED]
    if refused:
        return Decision(REFUSED, "; ".join(f"{describe(r.features)} is not served by the engine: {r.reason}"
                                           for r in refused),
                        rules=tuple(refused))
    plain = [r for r in matched if r.outcome == PLAIN]
    if plain:
        dropped = frozenset().union(*(r.features & SPECULATION for r in plain))
        return Decision(PLAIN, "; ".join(r.reason for r in plain), dropped, tuple(plain))
    return Decision(SERVED, "")


def served(features: Iterable[str]) -> bool:
    """Whether a request of ``features`` is served (plainly or in full)."""
    return decide(features).outcome != REFUSED


def check(features: Iterable[str]) -> Decision:
    """The decision for ``features``; :class:`FeatureRefused` naming the combination and why if it is refused."""
    decision = decide(features)
    if decision.outcome == REFUSED:
        raise FeatureRefused(decision.reason + ".")
    return decision


def request_features(params, *, images: bool = False, videos: bool = False, adapter: bool = False,
                     speculative: bool = False, tensor_parallel: bool = False, state_layers: bool = False,
                     cuda_graphs: bool = False) -> frozenset:
    """The features of a request with ``params`` (a :class:`~hf_paged.engine.sampling.SamplingParams`, or None for
    the engine's defaults) in an engine under the given conditions (``speculative``: the engine speculates by
    default)."""
    out = set()
    if params is not None:
        def get(name, default=None):  # a SamplingParams; anything with some of its fields (a missing one: unset)
            return getattr(params, name, default)

        lookup = get("prompt_lookup_num_tokens")
        out |= {name for name, on in (
            ("sampled", get("do_sample", False)), ("seeded", get("seed") is not None),
            ("n", (get("num_return_sequences") or 1) > 1), ("beams", (get("num_beams") or 1) > 1),
            ("ngram", bool(lookup)), ("logprobs", get("logprobs") is not None),
            ("prompt_logprobs", get("prompt_logprobs") is not None), ("grammar", get("grammar") is not None),
            ("min_tokens", (get("min_tokens") or 0) > 0), ("eos_ids", len(get("eos_token_ids") or ()) > 1),
            ("processors", get("repetition_penalty") is not None)) if on}
        settings = get("processors")
        if settings is not None:
            if settings.logits_processor or settings.prefix_allowed_tokens_fn is not None:
                out.add("logits_processor")
            if settings.watermarking_config is not None:
                out.add("watermark")
            out.add("processors")
        stopping = get("stopping")
        if stopping is not None:
            out |= {name for name, on in (("stop_strings", stopping.stop_strings),
                                          ("max_time", stopping.max_time is not None),
                                          ("stopping_criteria", stopping.stopping_criteria)) if on}
        # a request that turns speculation off for itself (prompt_lookup_num_tokens=0) is not speculated
        speculative = speculative and lookup != 0
    out |= {name for name, on in (("images", images), ("videos", videos), ("adapter", adapter),
                                  ("speculative", speculative), ("tensor_parallel", tensor_parallel),
                                  ("state_layers", state_layers), ("cuda_graphs", cuda_graphs)) if on}
    return frozenset(out)


def table() -> list[tuple[str, str, str]]:
    """The rules as ``(features, outcome, reason)`` rows (docs, the tester's report)."""
    return [(" + ".join(sorted(r.features)) + (f" (unless {' / '.join(sorted(r.unless))})" if r.unless else ""),
             r.outcome, r.reason) for r in RULES]
