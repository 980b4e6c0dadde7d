"""OpenAI response and stream-chunk shapes for completions and chat completions (plain dicts)."""

from __future__ import annotations

import json

from .engine_client import TokenLogprob

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict:
    """The legacy completions shape; ``offset``: characters of this choice's text before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


class Shape:
    """Builds one response's bodies and chunks (same ``id``, ``created`` and ``model`` in every one)."""

    def __init__(self, kind: str, response_id: str, created: int, model: str, include_usage: bool = False):
        assert kind in ("completion", "chat")
        self.kind, self.id, self.created, self.model = kind, response_id, created, model
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses -------------------------------------------------------------------------------------------
    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        """``choices``: dicts with index, text, finish_reason, logprobs (list of TokenLogprob or None)."""
        out = []
        for c in sorted(choices, key=lambda c: c["index"]):
            if self.kind == "completion":
                lp = completion_logprobs(c["logprobs"], c.get("offset", 0)) if c["logprobs"] is not None else None
                out.append({"index": c["index"], "text": c["text"], "logprobs": lp,
                            "finish_reason": c["finish_reason"]})
            else:
                lp = chat_logprobs(c["logprobs"]) if c["logprobs"] is not None else None
                out.append({"index": c["index"], "message": {"role": "assistant", "content": c["text"],
                                                             "refusal": None},
                            "logprobs": lp, "finish_reason": c["finish_reason"]})
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion")
        body.update(choices=out, usage=usage(prompt_tokens, completion_tokens))
        if self.kind == "completion":
            body["system_fingerprint"] = None
        return body

    # -- stream chunks ---------------------------------------------------------------------------------------------
    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] | None = None, offset: int = 0, role: bool = False) -> bytes:
        if self.kind == "completion":
            lp = completion_logprobs(logprobs, offset) if logprobs else None
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            body = self._head("text_completion")
        else:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            lp = chat_logprobs(logprobs) if logprobs else None
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        body.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
        return sse(body)
