"""Structured output: grammars compiled once per (kind, spec) for a tokenizer, and one matcher per request.

The engine applies a request's grammar as a token bitmask in its sampler (``sampling.apply_bitmask``): each step,
every constrained request's matcher fills its row of an ``int32 [n, ceil(vocab / 32)]`` bitmask (bit set = token
allowed), the sampler sets the other tokens' logits to -inf, and the sampled token advances the matcher. Requests
without a grammar pay nothing (no bitmask is built when no request in the step has one).

Library: xgrammar (chosen over llguidance by measured per-token mask cost on CPU, see docs/guide/serving-clients.md),
an optional extra: ``pip install 'hf_paged[structured]'``.

Example::

    grammars = hf_paged.engine.structured.GrammarCompiler(tokenizer, vocab_size=model.config.vocab_size)
    grammar = grammars.compile(GrammarSpec("json_schema", json.dumps(schema)))
    rid = manager.add_request(ids, max_new_tokens=128, grammar=grammar)
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

try:
    import xgrammar as xgr
except ImportError:  # the optional extra is not installed: GrammarCompiler says how to get it
    xgr = None

EXTRA_HINT = "structured output needs the 'structured' extra: pip install 'hf_paged[structured]' (xgrammar)"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


def require_library() -> None:
    """``ImportError`` naming the extra when xgrammar is missing."""
    if xgr is None:
        raise ImportError(EXTRA_HINT)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` one of ``KINDS``, ``value`` a string (a JSON schema as JSON
    text, a regex, an EBNF grammar, or a JSON list of choices; ignored for ``json_object``). Hashable: the cache
    key. ``compact``: JSON without free whitespace between tokens (what a model emits anyway; stops a sampled
    model from padding its output with spaces until max_tokens)."""

    kind: str
    value: str = ""
    compact: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; use one of {', '.join(KINDS)}")


class CompiledGrammar:
    """A grammar compiled for one tokenizer; ``matcher()`` gives a fresh per-request state."""

    def __init__(self, spec: GrammarSpec, compiled, stop_token_ids: list[int]):
        self.spec = spec
        self._compiled = compiled
        self._stop = stop_token_ids

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop or None))


class GrammarMatcher:
    """One request's position in its grammar (owned by the request; advanced by the engine thread only)."""

    def __init__(self, matcher):
        self._m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``int32 [n, words]``)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it."""
        return bool(self._m.accept_token(int(token)))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return bool(self._m.is_terminated())


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for ``tokenizer`` (thread-safe; a cache keyed by spec).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (its logits' width; may exceed ``len(tokenizer)``).
        stop_token_ids: the tokens that end a request (default the tokenizer's EOS); a grammar allows them only
            where its text is complete.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None):
        require_library()
        self.vocab_size = vocab_size or len(tokenizer)
        if stop_token_ids is None:
            stop_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for ``spec`` (cached). ``ValueError`` naming what is wrong with an invalid spec."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"the {spec.kind} could not be compiled into a grammar: {exc}") from None
        grammar = CompiledGrammar(spec, compiled, self.stop_token_ids)
        with self._lock:
            self.compiles += 1
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: GrammarSpec):
        separators = (",", ":") if spec.compact else None
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.value, any_whitespace=not spec.compact,
                                                      separators=separators, strict_mode=True)
        if spec.kind == "json_object":
            if spec.compact:
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          separators=separators, strict_mode=False)
            return self._compiler.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            pattern = "|".join(_regex_escape(str(c)) for c in choices)
            return self._compiler.compile_regex(f"({pattern})")
        return self._compiler.compile_grammar(spec.value)


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)
