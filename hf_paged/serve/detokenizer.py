"""Incremental detokenization: token ids in, text out, never a split character.

A token of a byte-level vocabulary can hold part of a UTF-8 character (``"日"`` is three bytes, often three tokens);
decoding it alone gives ``"\\ufffd"``. :class:`IncrementalDetokenizer` decodes a short window of recent tokens and emits
only the text the newest tokens add once it no longer ends in a replacement character, so every piece it returns is
whole characters, and the pieces always join to ``tokenizer.decode(all_ids)`` whatever the chunking of the ids.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text pieces.

    Two offsets into the ids: ``read`` (ids up to here have been emitted as text) and ``prefix`` (where the decoding
    window starts, one emitted stretch before ``read``, so tokenizers whose pieces depend on their left neighbour,
    like SentencePiece's leading-space marker, decode the new ids in context).

    Example::

        detok = IncrementalDetokenizer(tokenizer)
        for ids in deltas:               # e.g. one list of new ids per engine step
            piece = detok.add(ids)       # "" while a character is still incomplete
        piece = detok.finish()           # whatever was held back (incomplete bytes decode to "\\ufffd")
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; returns the text they complete (possibly ``""``)."""
        self.ids.extend(new_ids)
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def finish(self) -> str:
        """The text still held back at the end of generation (may end in ``"\\ufffd"`` if the bytes never completed)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
