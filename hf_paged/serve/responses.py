"""OpenAI response and stream-chunk shapes for completions and chat completions (plain dicts)."""

from __future__ import annotations

import json

from .engine_client import PromptLogprob, TokenLogprob

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache (the prefix hit)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict:
    """The legacy completions shape; ``offset``: characters of this choice's text before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def echo_logprobs(entries: list[PromptLogprob], k: int) -> dict:
    """The legacy completions shape over the echoed prompt tokens: the first token's logprob and alternatives are
    None; each other position's alternatives are the k most likely tokens plus the prompt token itself (as vLLM)."""
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
        values.append(e.logprob)
        if e.logprob is None:
            tops.append(None)
        else:
            top = {text: lp for _, text, lp in e.top[:k]}
            top.setdefault(e.token, e.logprob)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the generated tokens')."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(entries: list[PromptLogprob]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token_id: {logprob, rank,
    decoded_token}}`` for the k most likely tokens and the prompt token."""
    out: list[dict | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        row = {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": text} for i, (t, text, lp) in enumerate(e.top)}
        row.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token})
        out.append(row)
    return out


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
    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """``choices``: dicts with index, text, finish_reason, logprobs (list of TokenLogprob or None), and
        optionally ``echo_logprobs`` (a legacy logprobs dict of the echoed prompt) and ``prompt_logprobs`` (vLLM's
        list)."""
        out = []
        prompt_logprobs = None
        for c in sorted(choices, key=lambda c: c["index"]):
            if self.kind == "completion":
                lp = completion_logprobs(c["logprobs"], c.get("offset", 0)) if c["logprobs"] is not None else None
                choice = {"index": c["index"], "text": c["text"], "logprobs": joined_logprobs(c.get("echo_logprobs"), lp),
                          "finish_reason": c["finish_reason"]}
                if c.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = c["prompt_logprobs"]
                out.append(choice)
            else:
                lp = chat_logprobs(c["logprobs"]) if c["logprobs"] is not None else None
                message = {"role": "assistant", "content": c["text"], "refusal": None}
                if c.get("tool_calls"):
                    message["content"] = c["text"] or None
                    message["tool_calls"] = c["tool_calls"]
                out.append({"index": c["index"], "message": message, "logprobs": lp,
                            "finish_reason": c["finish_reason"]})
                if prompt_logprobs is None:
                    prompt_logprobs = c.get("prompt_logprobs")
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion")
        body.update(choices=out, usage=usage(prompt_tokens, completion_tokens, cached_tokens))
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if self.kind == "completion":
            body["system_fingerprint"] = None
        return body

    # -- stream chunks ---------------------------------------------------------------------------------------------
    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] | None = None, offset: int = 0, role: bool = False,
              echo_lp: dict | None = None, prompt_logprobs: list | None = None,
              usage_now: dict | None = None, tool_calls: list[dict] | None = None) -> bytes:
        """One stream chunk. ``echo_lp``: legacy logprobs of echoed prompt tokens (before ``logprobs``);
        ``prompt_logprobs``: vLLM's list (completions: in the choice, chat: top level); ``usage_now``: the usage so
        far (``continuous_usage_stats``); ``tool_calls``: chat delta entries (``index``, ``id``, ``function``)."""
        if self.kind == "completion":
            lp = completion_logprobs(logprobs, offset) if logprobs else None
            choice = {"index": index, "text": text or "", "logprobs": joined_logprobs(echo_lp, lp),
                      "finish_reason": finish_reason}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            body = self._head("text_completion")
        else:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            lp = chat_logprobs(logprobs) if logprobs else None
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
            if prompt_logprobs is not None:
                body["prompt_logprobs"] = prompt_logprobs
        body["choices"] = [choice]
        if usage_now is not None:
            body["usage"] = usage_now
        elif self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        body = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        body.update(choices=[], usage=usage(prompt_tokens, completion_tokens, cached_tokens))
        return sse(body)
