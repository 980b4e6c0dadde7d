"""Per-request stopping beyond EOS and length: stop strings, a time limit, and a request's own ``stopping_criteria``,
checked on each sampled token with that request's ids.

``StopSettings`` are what a request asked for (read from its generation config by ``SamplingParams``); ``Stopping``
(one per engine, inside the ``Sampler``, holding the engine's tokenizer) tells, after a step's tokens are chosen, which
requests they end. A request that ends this way finishes with reason "stop" and keeps every token it generated, the
stop string included, as ``generate()`` does. Stop strings use transformers' ``StopStringCriteria`` (its semantics: a
stop string matches when the text of the last tokens ends with it, the last token contributing to it, wherever it
started, even in the prompt); rows with the same stop strings are checked together on a window of their last ids.

Contract of a custom ``stopping_criteria`` entry (any callable, as ``generate()`` takes): called after each token of
each request that has it, as ``criterion(ids, scores)`` with ``ids`` ``LongTensor [1, n]`` (that request's prompt +
generated ids, the new token last) and ``scores`` ``float32 [1, vocab]`` (the processed scores the token was chosen
from); a true result (a bool, or a ``BoolTensor [1]``) ends the request. It runs on the engine thread.
"""

from __future__ import annotations

import numbers
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import StopStringCriteria

CRITERIA_CACHE = 64  # StopStringCriteria kept per engine, one per set of stop strings (each a pass over the vocab)


@dataclass(frozen=True)
class StopSettings:
    """A request's stop strings, time limit (seconds from when it was queued) and own criteria.

    Example::

        StopSettings.from_settings({"stop_strings": ["\\n\\n", "###"], "max_time": 30.0})
    """

    stop_strings: tuple[str, ...] = ()
    max_time: float | None = None
    stopping_criteria: tuple = ()

    @classmethod
    def from_settings(cls, settings: dict) -> "StopSettings | None":
        """The settings ``settings`` (GenerationConfig field names, plus ``stopping_criteria``) ask for; None when
        none. Raises ValueError naming a bad value."""
        out = {}
        strings = settings.get("stop_strings")
        if strings:
            items = [strings] if isinstance(strings, str) else strings
            if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
                raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {strings!r}")
            out["stop_strings"] = tuple(items)
        max_time = settings.get("max_time")
        if max_time is not None:
            if not isinstance(max_time, numbers.Real) or isinstance(max_time, bool) or not max_time >= 0:
                raise ValueError(f"max_time must be a number of seconds >= 0, got {max_time!r}")
            out["max_time"] = float(max_time)
        criteria = settings.get("stopping_criteria")
        if criteria:
            items = list(criteria) if isinstance(criteria, (list, tuple)) else [criteria]
            if not all(callable(c) for c in items):
                raise ValueError(f"stopping_criteria must be a callable or a list of callables (e.g. a "
                                 f"StoppingCriteriaList), got {criteria!r}")
            out["stopping_criteria"] = tuple(items)
        return cls(**out) if out else None


class Stopping:
    """The stopping stage (one per engine).

    Args:
        tokenizer: the model's tokenizer, needed by requests with ``stop_strings`` (None: such requests are refused).

    Example::

        stopping = Stopping(tokenizer)
        stopping.check(settings)                                        # when a request is added: ValueError if not
        ended = stopping(settings, started, histories, tokens, scores)  # after a step: [n] bools (None: none can end)
    """

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._criteria: OrderedDict[tuple[str, ...], StopStringCriteria] = OrderedDict()

    def check(self, settings: StopSettings | None) -> None:
        """``ValueError`` if ``settings`` cannot be served here; prepares its stop strings (a pass over the vocab the
        first time a set is seen) so the engine's steps do not."""
        if settings is None or not settings.stop_strings:
            return
        if self.tokenizer is None:
            raise ValueError(f"stop_strings={list(settings.stop_strings)!r} needs the model's tokenizer: pass "
                             f"tokenizer= to init_continuous_batching / generate_batch (or stop_token_ids instead)")
        self.criteria(settings.stop_strings)

    def criteria(self, strings: tuple[str, ...]) -> StopStringCriteria:
        found = self._criteria.get(strings)
        if found is None:
            found = self._criteria[strings] = StopStringCriteria(self.tokenizer, list(strings))
            if len(self._criteria) > CRITERIA_CACHE:
                self._criteria.popitem(last=False)
        else:
            self._criteria.move_to_end(strings)
        return found

    def __call__(self, settings: list, started: list, histories: list[list[int]], tokens: list[int],
                 scores: torch.Tensor, errors: dict[int, str] | None = None) -> list[bool] | None:
        """Which rows end on ``tokens`` (one per row, not yet in ``histories``): ``[n]`` bools, or None when no row
        has stop settings. ``settings[i]``: row i's ``StopSettings`` or None; ``started[i]``: the ``time.time()`` its
        clock started at (read for ``max_time``); ``scores`` ``[n, vocab]``: the processed scores. A request's own
        criterion that raises records ``errors[i]`` (without ``errors`` it raises)."""
        rows = [i for i, s in enumerate(settings) if s is not None]
        if not rows:
            return None
        ended = [False] * len(tokens)
        groups: dict[tuple, list[int]] = {}
        for i in rows:
            s = settings[i]
            if s.stop_strings:
                width = min(len(histories[i]) + 1, self.criteria(s.stop_strings).maximum_token_len)
                groups.setdefault((s.stop_strings, width), []).append(i)
            if s.max_time is not None and time.time() - started[i] > s.max_time:
                ended[i] = True
            for criterion in s.stopping_criteria:
                if ended[i] or (errors is not None and i in errors):
                    continue
                ids = torch.tensor([[*histories[i], tokens[i]]], dtype=torch.long, device=scores.device)  # [1, n]
                if errors is None:
                    ended[i] = _true(criterion(ids, scores[i:i + 1]))
                    continue
                try:
                    ended[i] = _true(criterion(ids, scores[i:i + 1]))
                except Exception as err:
                    errors[i] = f"this request's stopping criterion {criterion!r} failed: {type(err).__name__}: {err}"
        for (strings, width), members in groups.items():
            tails = [[*histories[i][len(histories[i]) - width + 1:], tokens[i]] for i in members]
            hits = self.criteria(strings)(torch.tensor(tails, dtype=torch.long), None)  # [g]
            for i, hit in zip(members, hits.tolist()):
                ended[i] = ended[i] or bool(hit)
        return ended


def _true(result) -> bool:
    if isinstance(result, torch.Tensor):
        return bool(result.reshape(-1)[0]) if result.numel() else False
    return bool(result)
