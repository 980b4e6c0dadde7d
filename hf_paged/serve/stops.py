"""Stop strings checked on decoded text, with hold-back for a stream.

A stop string can arrive split over several tokens (``"\\n\\n"`` as two ``"\\n"``), so text that could still become
the start of a stop string is held back until the next piece shows whether it does. The stop string itself is never
returned (OpenAI's behaviour).
"""

from __future__ import annotations


class StopChecker:
    """Feed text pieces in order; get back the text that is safe to send and whether a stop string was hit.

    Example::

        stops = StopChecker(["\\n\\n", "END"])
        stops.add("Hello\\n")     # -> ("Hello", False): "\\n" is held back, it may start "\\n\\n"
        stops.add("\\nmore")      # -> ("", True): the text ends before the stop string
        stops.flush()            # -> ("", True): nothing is held once stopped
    """

    def __init__(self, stop: list[str] | None, include: bool = False, min_tokens: int = 0):
        self.stop = [s for s in (stop or []) if s]
        self.include = include  # vLLM's include_stop_str_in_output: the stop string ends the text
        self.min_tokens = min_tokens  # vLLM's min_tokens: no stop string counts before this many tokens
        self.held = ""
        self.stopped = False

    def add(self, piece: str, tokens: int | None = None) -> tuple[str, bool]:
        """``(text to send, stopped)`` after appending ``piece``. The stop string that starts first wins, however
        the text was split: a complete match waits while a longer stop string starting earlier may still complete.
        ``tokens``: the tokens generated so far, ``piece``'s included; below ``min_tokens`` nothing stops (as in
        vLLM, the text sent before then is not searched later)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return piece, False
        if tokens is not None and tokens < self.min_tokens:
            text, self.held = self.held + piece, ""
            return text, False
        text = self.held + piece
        hit = self._first_hit(text)
        keep_from = len(text) - self._partial_suffix(text)
        if hit is not None and hit <= keep_from:
            self.stopped, self.held = True, ""
            return text[:self._end(text, hit)], True
        self.held = text[keep_from:]
        return text[:keep_from], False

    def _first_hit(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _end(self, text: str, hit: int) -> int:
        """Where the text ends for a stop string found at ``hit``: before it, or after it with ``include``."""
        if not self.include:
            return hit
        return hit + max(len(s) for s in self.stop if text.startswith(s, hit))

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> tuple[str, bool]:
        """``(held-back text, stopped)`` at the end of generation: the text before a stop string still held, or all
        of it."""
        text, self.held = ("" if self.stopped else self.held), ""
        hit = self._first_hit(text) if self.stop else None
        if hit is not None:
            self.stopped = True
            return text[:self._end(text, hit)], True
        return text, self.stopped
