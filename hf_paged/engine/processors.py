"""Per-request logits processors: every processor ``generate()`` applies before its warpers, each on its request's own
prompt + generated ids (no padding seen, the prompt's length known).

``ProcessorSettings`` are what a request asked for (read from its generation config by ``SamplingParams``).
``Processors`` is the stage the ``Sampler`` runs each step, before the warpers: it takes the rows that have settings,
in ``generate()``'s order (sequence bias, repetition penalty, OpenAI's presence / frequency penalties, n-gram blocking, bad words, min length, prefix-allowed
tokens, forced BOS / EOS, inf/nan removal, length decay, suppression, begin-suppression, then the request's own
``logits_processor``; after the warpers, a green-list watermark), and leaves the others untouched: a step whose
requests set none of them pays one attribute check per row. Where rows agree on a setting they are processed
together: the repetition penalty (on each row's distinct ids only) and the masks (n-gram, min length, suppression,
forced tokens) in one indexed write across rows; the bias, bad-word and watermark processors (which read only the last
few ids) on one ``[g, w]`` window of the rows' last ids. The others run per row on that row's ids ``[1, n]`` with
transformers' own classes, so each row gets exactly what ``generate()`` computes for it alone.

A request's own state (its n-gram index) is a :class:`RequestState`, made when the request joins the engine
(``Sampler.join``), copied when it forks (``RequestState.fork``), kept across preemptions, and dropped with the request
when it leaves. The index grows with the request's committed tokens only: rows that share one state in a step are
either a request's drafted positions (speculative verification: different lengths, the shortest is committed) or a
beam search's beams (the same length, different tokens: only the prompt is common); the rest of each row's ids is
scanned without being stored, so a step costs the new or uncommitted tokens, not the whole history.

Contract of a custom ``logits_processor`` (any callable, as ``generate()`` takes): called once per step for each
request that has it, as ``processor(ids, scores)`` with ``ids`` ``LongTensor [1, n]`` (that request's prompt +
generated ids, no padding) and ``scores`` ``float32 [1, vocab]`` (after the processors before it); it returns the new
scores ``[1, vocab]``. It runs on the engine thread; the forks of a request (``num_return_sequences``) call the same
object, each with its own row, so keep per-request state keyed by what ``ids`` shows, or none.
"""

from __future__ import annotations

import numbers
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
from transformers import (
    ExponentialDecayLengthPenalty,
    WatermarkingConfig,
    InfNanRemoveLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

NEG_INF = float("-inf")
SHARED_CACHE = 1024  # prepared processors kept per engine (a server sees many distinct biases and bad-word lists)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _sequences(value, name: str) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(seq, (list, tuple)) and seq and all(_is_int(t) and t >= 0 for t in seq) for seq in value):
        raise ValueError(f"{name} must be a non-empty list of non-empty lists of token ids >= 0, got {value!r}")
    return tuple(tuple(int(t) for t in seq) for seq in value)


def _bias(value) -> tuple[tuple[tuple[int, ...], float], ...]:
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(seq, bias) for seq, bias in items]
    except (TypeError, ValueError):
        raise ValueError(f"sequence_bias must be a dict {{(token ids): bias}} or a list of [token ids, bias], got "
                         f"{value!r}") from None
    sequences = _sequences([list(seq) if isinstance(seq, (list, tuple)) else [seq] for seq, _ in pairs],
                           "sequence_bias's keys")
    if not all(isinstance(b, numbers.Real) and not isinstance(b, bool) for _, b in pairs):
        raise ValueError(f"sequence_bias's biases must be numbers, got {value!r}")
    return tuple((seq, float(b)) for seq, (_, b) in zip(sequences, pairs))


def token_ids(value, name: str) -> tuple[int, ...]:
    """``value`` (a token id, a list of them or a 1-D tensor; None: none) as a tuple of ids; ``ValueError`` naming
    ``name`` otherwise."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    items = [value] if not isinstance(value, (list, tuple)) else list(value)
    if not all(_is_int(t) and t >= 0 for t in items):
        raise ValueError(f"{name} must be a token id or a list of token ids >= 0, got {value!r}")
    return tuple(int(t) for t in items)


def _callables(value, name: str) -> tuple:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(callable(item) for item in items):
        raise ValueError(f"{name} must be a callable or a list of callables (e.g. a LogitsProcessorList), got "
                         f"{value!r}")
    return tuple(items)


@dataclass(frozen=True)
class ProcessorSettings:
    """A request's history-dependent logits processors, as ``generate()`` reads them from a ``GenerationConfig``.

    Token ids are tuples; ``sequence_bias`` is ``((ids, bias), ...)``; ``forced_eos_token_id`` a tuple of ids;
    ``exponential_decay_length_penalty`` ``(start, factor)``; ``logits_processor`` a tuple of callables (see the
    module's contract). ``repetition_penalty`` stays in ``SamplingParams`` (the stage reads it there).
    ``presence_penalty`` / ``frequency_penalty``: OpenAI's, in [-2, 2], on the tokens the request generated (not its
    prompt, as vLLM counts them): a token's logit less ``frequency_penalty`` times its count, less ``presence_penalty``
    if it occurred.

    Example::

        ProcessorSettings.from_settings({"no_repeat_ngram_size": 3, "bad_words_ids": [[42], [7, 8]]})
    """

    sequence_bias: tuple = ()
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple = ()
    min_length: int = 0
    prefix_allowed_tokens_fn: object = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] = ()
    remove_invalid_values: bool = False
    exponential_decay_length_penalty: tuple | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    logits_processor: tuple = ()
    watermarking_config: object = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def from_settings(cls, settings: dict) -> "ProcessorSettings | None":
        """The settings ``settings`` (GenerationConfig field names; None / 0 / empty = unset) ask for; None when they
        ask for none. Raises ValueError naming a bad value."""
        out = {}
        for name in ("presence_penalty", "frequency_penalty"):
            value = settings.get(name)
            if value:
                if not isinstance(value, numbers.Real) or isinstance(value, bool) or not -2 <= value <= 2:
                    raise ValueError(f"{name} must be a number in [-2, 2] (OpenAI's range), got {value!r}")
                out[name] = float(value)
        if settings.get("sequence_bias"):
            out["sequence_bias"] = _bias(settings["sequence_bias"])
        n = settings.get("no_repeat_ngram_size")
        if n:
            if not _is_int(n) or n < 0:
                raise ValueError(f"no_repeat_ngram_size must be an integer >= 0, got {n!r}")
            out["no_repeat_ngram_size"] = int(n)
        if settings.get("bad_words_ids"):
            out["bad_words_ids"] = _sequences(settings["bad_words_ids"], "bad_words_ids")
        min_length = settings.get("min_length")
        if min_length:
            if not _is_int(min_length) or min_length < 0:
                raise ValueError(f"min_length must be an integer >= 0, got {min_length!r}")
            out["min_length"] = int(min_length)
        fn = settings.get("prefix_allowed_tokens_fn")
        if fn is not None:
            if not callable(fn):
                raise ValueError(f"prefix_allowed_tokens_fn must be callable (batch_id, ids) -> allowed ids, got "
                                 f"{fn!r}")
            out["prefix_allowed_tokens_fn"] = fn
        if settings.get("forced_bos_token_id") is not None:
            bos = settings["forced_bos_token_id"]
            if not _is_int(bos) or bos < 0:
                raise ValueError(f"forced_bos_token_id must be a token id >= 0, got {bos!r}")
            out["forced_bos_token_id"] = int(bos)
        if settings.get("forced_eos_token_id") is not None:
            out["forced_eos_token_id"] = token_ids(settings["forced_eos_token_id"], "forced_eos_token_id")
        if settings.get("remove_invalid_values"):
            out["remove_invalid_values"] = True
        decay = settings.get("exponential_decay_length_penalty")
        if decay is not None:
            if (not isinstance(decay, (list, tuple)) or len(decay) != 2 or not _is_int(decay[0]) or decay[0] < 0
                    or not isinstance(decay[1], numbers.Real) or not decay[1] >= 1):
                raise ValueError(f"exponential_decay_length_penalty must be (start index >= 0, decay factor >= 1), "
                                 f"got {decay!r}")
            out["exponential_decay_length_penalty"] = (int(decay[0]), float(decay[1]))
        if settings.get("suppress_tokens") is not None and len(settings["suppress_tokens"]):
            out["suppress_tokens"] = token_ids(settings["suppress_tokens"], "suppress_tokens")
        if settings.get("begin_suppress_tokens") is not None and len(settings["begin_suppress_tokens"]):
            out["begin_suppress_tokens"] = token_ids(settings["begin_suppress_tokens"], "begin_suppress_tokens")
        if settings.get("logits_processor"):
            out["logits_processor"] = _callables(settings["logits_processor"], "logits_processor")
        mark = settings.get("watermarking_config")
        if mark is not None:
            if isinstance(mark, dict):
                mark = WatermarkingConfig.from_dict(mark)
            if type(mark) is not WatermarkingConfig:
                raise ValueError(f"watermarking_config: only transformers' WatermarkingConfig (green-list "
                                 f"watermarking) is served by the engine, got {type(mark).__name__} (SynthID's "
                                 f"processor keeps state across a whole batch's steps); run model.generate() for it")
            mark.validate()
            out["watermarking_config"] = mark
        return cls(**out) if out else None

    def check_vocab(self, vocab_size: int) -> None:
        """``ValueError`` naming the first token id at or past ``vocab_size`` (checked when a request is added, so
        it never reaches the engine's step)."""
        named = [("sequence_bias", [t for seq, _ in self.sequence_bias for t in seq]),
                 ("bad_words_ids", [t for seq in self.bad_words_ids for t in seq]),
                 ("forced_bos_token_id", [] if self.forced_bos_token_id is None else [self.forced_bos_token_id]),
                 ("forced_eos_token_id", list(self.forced_eos_token_id)),
                 ("suppress_tokens", list(self.suppress_tokens)),
                 ("begin_suppress_tokens", list(self.begin_suppress_tokens))]
        for name, ids in named:
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab_size})")


class NGramIndex:
    """The n-grams of one request's ids, grown as tokens are appended: ``banned(ids)`` is the set of tokens that would
    repeat an n-gram (``NoRepeatNGramLogitsProcessor``'s rule), in time proportional to the new tokens."""

    def __init__(self, n: int):
        self.n = n
        self.seen = 0  # ids indexed so far
        self.next_of: dict[tuple[int, ...], set[int]] = {}

    def banned(self, ids: list[int], upto: int | None = None) -> set[int]:
        """The tokens that would repeat an n-gram of ``ids``. The index grows to ``ids[:upto]`` (default all of
        them); n-grams past ``upto`` are scanned without being stored (uncommitted drafts, one beam's own tokens)."""
        n = self.n
        upto = len(ids) if upto is None else upto
        if upto < self.seen:  # the ids were cut back (tokens withdrawn): index them again
            self.seen, self.next_of = 0, {}
        for start in range(max(self.seen - n + 1, 0), upto - n + 1):
            self.next_of.setdefault(tuple(ids[start:start + n - 1]), set()).add(ids[start + n - 1])
        self.seen = upto
        if len(ids) < n:
            return set()
        key = tuple(ids[len(ids) - n + 1:])
        out = self.next_of.get(key, set())
        tail = [ids[start + n - 1] for start in range(max(upto - n + 1, 0), len(ids) - n + 1)
                if tuple(ids[start:start + n - 1]) == key]
        return out | set(tail) if tail else out

    def fork(self) -> "NGramIndex":
        copy = NGramIndex(self.n)
        copy.seen, copy.next_of = self.seen, {k: set(v) for k, v in self.next_of.items()}
        return copy


@dataclass
class RequestState:
    """One request's own sampling state, kept with it across steps and preemptions: its n-gram index
    (``no_repeat_ngram_size``) and the ``time.time()`` its ``max_time`` clock started at. Requests that need neither
    have none (``Sampler.join`` returns None)."""

    ngrams: NGramIndex | None = None
    started: float | None = None

    def fork(self) -> "RequestState":
        """A copy for a fork of the request (same ids so far, its own state from now on)."""
        return RequestState(self.ngrams.fork() if self.ngrams is not None else None, self.started)


class Processors:
    """The per-request processor stage (one per engine).

    Example::

        stage = Processors()
        states = [sampler.join(p) for p in params]                 # once per request, kept with it
        scores = stage(scores, params, states, histories)          # scores [n, vocab] float32; histories: ids lists
    """

    def __init__(self):
        # transformers processors shared by the rows with the same setting, the most recently used kept
        self._shared: OrderedDict[tuple, object] = OrderedDict()

    def __call__(self, scores: torch.Tensor, params: list, states: list, histories: list[list[int]],
                 num_generated: list[int] | None = None, errors: dict[int, str] | None = None) -> torch.Tensor:
        """``scores`` ``[n, vocab]`` with each row's processors applied (the same tensor when no row has any, else a
        new one). ``histories[i]``: row i's prompt + generated ids; ``num_generated[i]``: how many of them it
        generated (default 0); ``states[i]``: its ``Sampler.join`` state. A request's own callable that raises
        leaves that row's scores as they were and records ``errors[i]`` (the engine fails that request alone); without
        ``errors`` it raises."""
        rows = [i for i, p in enumerate(params) if p.processors is not None or p.repetition_penalty is not None]
        if not rows:
            return scores
        step = _Step(scores.clone(), histories, num_generated, errors)
        with_settings = [(i, params[i].processors) for i in rows if params[i].processors is not None]
        self._sequence_bias(step, [(i, s) for i, s in with_settings if s.sequence_bias])
        self._repetition_penalty(step, [(i, params[i].repetition_penalty) for i in rows
                                        if params[i].repetition_penalty is not None])
        if not with_settings:
            return step.scores
        self._openai_penalties(step, [(i, s) for i, s in with_settings if s.presence_penalty or s.frequency_penalty])
        ngram_rows = [i for i, s in with_settings if s.no_repeat_ngram_size]
        upto = _committed(ngram_rows, states, histories, step)
        step.mask([(i, t) for i in ngram_rows for t in states[i].ngrams.banned(histories[i], upto[i])])
        self._bad_words(step, [(i, s, params[i].eos_token_ids) for i, s in with_settings if s.bad_words_ids])
        step.mask([(i, t) for i, s in with_settings if s.min_length and len(histories[i]) < s.min_length
                   for t in params[i].eos_token_ids])
        for i, s in with_settings:
            if s.prefix_allowed_tokens_fn is not None:
                step.per_row(i, self._get(("prefix", s.prefix_allowed_tokens_fn),
                                          lambda: PrefixConstrainedLogitsProcessor(s.prefix_allowed_tokens_fn, 1)),
                             users=True)
        step.force([(i, (s.forced_bos_token_id,)) for i, s in with_settings
                    if s.forced_bos_token_id is not None and len(histories[i]) == 1])
        step.force([(i, s.forced_eos_token_id) for i, s in with_settings if s.forced_eos_token_id
                    and step.generated(i) == params[i].max_new_tokens - 1])
        invalid = [i for i, s in with_settings if s.remove_invalid_values]
        if invalid:
            step.group(invalid, self._get(("infnan",), InfNanRemoveLogitsProcessor), width=0)
        for i, s in with_settings:
            decay = s.exponential_decay_length_penalty
            if decay is not None and params[i].eos_token_ids and step.generated(i) > decay[0]:
                prompt = len(histories[i]) - step.generated(i)
                step.per_row(i, ExponentialDecayLengthPenalty(decay, list(params[i].eos_token_ids), prompt))
        step.mask([(i, t) for i, s in with_settings for t in s.suppress_tokens])
        step.mask([(i, t) for i, s in with_settings if s.begin_suppress_tokens
                   and len(histories[i]) == _begin_index(s, len(histories[i]) - step.generated(i))
                   for t in s.begin_suppress_tokens])
        for i, s in with_settings:
            for processor in s.logits_processor:
                step.per_row(i, processor, users=True)
        return step.scores

    def after_warpers(self, scores: torch.Tensor, params: list, histories: list[list[int]]) -> torch.Tensor:
        """``scores`` with the rows' watermarks applied (``generate()`` applies them after the warpers); the same
        tensor when no row has one. Rows with the same watermark settings share one processor, on a window of their
        last ``context_width`` ids (all it reads)."""
        rows = [i for i, p in enumerate(params) if p.processors is not None and p.processors.watermarking_config]
        if not rows:
            return scores
        step = _Step(scores.clone(), histories, None, None)
        vocab, device = scores.shape[-1], scores.device
        groups: dict[tuple, list[int]] = {}
        for i in rows:
            config = params[i].processors.watermarking_config
            groups.setdefault(tuple(sorted(config.to_dict().items())), []).append(i)
        for key, members in groups.items():
            config = params[members[0]].processors.watermarking_config
            processor = self._get(("watermark", key, vocab), lambda: config.construct_processor(vocab, device))
            step.windowed(members, processor, processor.context_width)
        return step.scores

    def _get(self, key: tuple, make):
        processor = self._shared.get(key)
        if processor is None:
            processor = self._shared[key] = make()
            if len(self._shared) > SHARED_CACHE:
                self._shared.popitem(last=False)
        else:
            self._shared.move_to_end(key)
        return processor

    def _sequence_bias(self, step: "_Step", rows: list) -> None:
        groups: dict[tuple, list[int]] = {}
        for i, s in rows:
            groups.setdefault(s.sequence_bias, []).append(i)
        for bias, members in groups.items():
            processor = self._get(("bias", bias), lambda: SequenceBiasLogitsProcessor([[list(k), v] for k, v in bias]))
            step.windowed(members, processor, max(len(k) for k, _ in bias) - 1)

    def _bad_words(self, step: "_Step", rows: list) -> None:
        groups: dict[tuple, list[int]] = {}
        for i, s, eos in rows:
            groups.setdefault((s.bad_words_ids, eos), []).append(i)
        for (words, eos), members in groups.items():
            processor = self._get(("bad", words, eos), lambda: NoBadWordsLogitsProcessor(
                [list(w) for w in words], list(eos) or None))
            step.windowed(members, processor, max(len(w) for w in words) - 1)

    @staticmethod
    def _openai_penalties(step: "_Step", rows: list) -> None:
        """OpenAI's presence and frequency penalties (vLLM's arithmetic: ``logits -= frequency * count``, then
        ``logits -= presence * (count > 0)``, in float32) on each row's generated tokens, one indexed write for all
        rows."""
        rows_at, cols, counts, freq, pres = [], [], [], [], []
        vocab = step.scores.shape[-1]
        for i, s in rows:
            generated = step.generated(i)
            if generated <= 0:
                continue
            for token, count in Counter(step.histories[i][len(step.histories[i]) - generated:]).items():
                if token < vocab:
                    rows_at.append(i)
                    cols.append(token)
                    counts.append(count)
                    freq.append(s.frequency_penalty)
                    pres.append(s.presence_penalty)
        if not rows_at:
            return
        device = step.scores.device
        index = (torch.tensor(rows_at, device=device), torch.tensor(cols, device=device))  # [m], [m]
        score = step.scores[index]  # [m]
        score = score - torch.tensor(freq, dtype=torch.float32, device=device) * torch.tensor(
            counts, dtype=torch.float32, device=device)
        step.scores[index] = score - torch.tensor(pres, dtype=torch.float32, device=device)

    @staticmethod
    def _repetition_penalty(step: "_Step", rows: list) -> None:
        """``RepetitionPenaltyLogitsProcessor``'s arithmetic (the same float32 operations, the penalty a Python
        float) on just the (row, token) pairs of each row's distinct ids: one gather and one write per penalty value,
        not a pass over ``[g, vocab]``."""
        groups: dict[float, list[int]] = {}
        for i, penalty in rows:
            groups.setdefault(float(penalty), []).append(i)
        vocab, device = step.scores.shape[-1], step.scores.device
        for penalty, members in groups.items():
            pairs = [(i, t) for i in members for t in set(step.histories[i]) if t < vocab]
            if not pairs:
                continue
            index = (torch.tensor([i for i, _ in pairs], device=device),
                     torch.tensor([t for _, t in pairs], device=device))  # [m], [m]
            score = step.scores[index]  # [m]
            step.scores[index] = torch.where(score < 0, score * penalty, score / penalty)


def _committed(rows: list[int], states: list, histories: list[list[int]], step: "_Step") -> dict[int, int]:
    """How far each n-gram row's state may index its ids (the module's rule for rows sharing one state): alone, all
    of them; drafts of one request (several lengths), the shortest; beams (one length), the prompt."""
    sharing: dict[int, list[int]] = {}
    for i in rows:
        sharing.setdefault(id(states[i]), []).append(i)
    upto = {}
    for members in sharing.values():
        lengths = {len(histories[i]) for i in members}
        if len(members) == 1:
            limit = len(histories[members[0]])
        elif len(lengths) > 1:
            limit = min(lengths)
        else:
            limit = len(histories[members[0]]) - max(step.generated(i) for i in members)
        for i in members:
            upto[i] = limit
    return upto


def _begin_index(settings: ProcessorSettings, prompt_length: int) -> int:
    """The length at which ``generate()`` suppresses ``begin_suppress_tokens``: the first token's (one later when a
    one-token prompt is followed by a forced BOS)."""
    if prompt_length > 1 or settings.forced_bos_token_id is None:
        return prompt_length
    return prompt_length + 1


class _Step:
    """One step's scores (written in place) and the ways a processor reaches its rows."""

    def __init__(self, scores: torch.Tensor, histories: list[list[int]], num_generated: list[int] | None,
                 errors: dict[int, str] | None):
        self.scores = scores  # [n, vocab], a copy the stage owns
        self.histories = histories
        self.num_generated = num_generated
        self.errors = errors
        self._row_ids: dict[int, torch.Tensor] = {}

    def generated(self, row: int) -> int:
        return self.num_generated[row] if self.num_generated is not None else 0

    def ids(self, row: int) -> torch.Tensor:
        ids = self._row_ids.get(row)
        if ids is None:
            ids = self._row_ids[row] = torch.tensor([self.histories[row]], dtype=torch.long,
                                                    device=self.scores.device)  # [1, n]
        return ids

    def per_row(self, row: int, processor, users: bool = False) -> None:
        """``processor`` on the row's whole ids ``[1, n]`` and its scores ``[1, vocab]`` (``users``: the request's
        own callable, whose failure fails that request only)."""
        if users and self.errors is not None:
            if row in self.errors:
                return
            try:
                out = processor(self.ids(row), self.scores[row:row + 1])
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, self.scores.shape[-1]):
                    raise ValueError(f"it returned {type(out).__name__} "
                                     f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}, not scores "
                                     f"[1, {self.scores.shape[-1]}]")
            except Exception as err:
                self.errors[row] = f"this request's logits processor {processor!r} failed: {type(err).__name__}: {err}"
                return
            self.scores[row:row + 1] = out
            return
        self.scores[row:row + 1] = processor(self.ids(row), self.scores[row:row + 1])

    def windowed(self, rows: list[int], processor, window: int) -> None:
        """``processor`` (one that reads only the last ``window`` ids, and the ids' length only up to ``window``) on
        the rows grouped by ``min(len(ids), window)``: exactly what each row alone gets."""
        by_width: dict[int, list[int]] = {}
        for row in rows:
            by_width.setdefault(min(len(self.histories[row]), window), []).append(row)
        for width, members in by_width.items():
            self.group(members, processor, width)

    def group(self, rows: list[int], processor, width: int) -> None:
        """``processor`` on ``rows`` at once, with their last ``width`` ids."""
        if width == 0:
            ids = torch.empty((len(rows), 0), dtype=torch.long)  # [g, 0]
        else:
            ids = torch.tensor([self.histories[row][-width:] for row in rows], dtype=torch.long)  # [g, width]
        ids = ids.to(self.scores.device)
        if len(rows) == self.scores.shape[0]:
            self.scores = processor(ids, self.scores)
            return
        index = torch.tensor(rows, device=self.scores.device)  # [g]
        self.scores[index] = processor(ids, self.scores[index])  # [g, vocab]

    def mask(self, pairs: list[tuple[int, int]]) -> None:
        """-inf at each ``(row, token)``."""
        if not pairs:
            return
        rows, cols = zip(*pairs)
        vocab = self.scores.shape[-1]
        keep = [j for j, c in enumerate(cols) if c < vocab]  # ids past the logits cannot be sampled anyway
        if len(keep) != len(cols):
            rows, cols = [rows[j] for j in keep], [cols[j] for j in keep]
            if not rows:
                return
        device = self.scores.device
        self.scores[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = NEG_INF

    def force(self, rows: list[tuple[int, tuple[int, ...]]]) -> None:
        """Each row's scores -inf but at its tokens, which get 0 (as ``ForcedBOS`` / ``ForcedEOS`` do)."""
        if not rows:
            return
        device = self.scores.device
        index = torch.tensor([row for row, _ in rows], device=device)
        self.scores[index] = NEG_INF
        pairs = [(row, t) for row, tokens in rows for t in tokens]
        self.scores[torch.tensor([r for r, _ in pairs], device=device),
                    torch.tensor([t for _, t in pairs], device=device)] = 0.0
