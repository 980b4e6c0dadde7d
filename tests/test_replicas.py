"""Replicas of the server on Ray Serve (``hf_paged/serve/replicas.py``), and the prefix hit every response reports.

The fast test pins ``usage.prompt_tokens_details.cached_tokens`` on the single-process server: the prompt tokens the
engine found in its prefix cache for that request (0 the first time, the prompt's full blocks the second time), the
same count the engine adds to its ``prefix_hit_tokens``, streamed or not.

The slow tests start a local Ray instance (no dashboard, half a CPU per replica) with two replicas of a tiny Llama
saved to a directory, behind one endpoint.
"""

from __future__ import annotations

import json

from test_serve import BLOCK, MODEL, Server, tiny_lm, tiny_tokenizer


def _prefix_hits(server) -> int:
    return server.manager.stats().prefix_hit_tokens


def test_cached_tokens_report_each_requests_prefix_hit():
    """A repeated prompt reports its full blocks as cached (the engine's own count); a new one reports 0; the
    streamed usage chunk and the chat endpoint carry the same field."""
    tokenizer = tiny_tokenizer()
    server = Server(tiny_lm(tokenizer), tokenizer, num_blocks=64)
    try:
        client = server.client()
        prompt = "Explain why the sky is blue. " * 6
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) > 2 * BLOCK
        seen = []
        for _ in range(2):
            before = _prefix_hits(server)
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
            seen.append(r.usage.prompt_tokens_details.cached_tokens)
            assert seen[-1] == _prefix_hits(server) - before
        assert seen == [0, (len(ids) - 1) // BLOCK * BLOCK]

        other = client.completions.create(model=MODEL, prompt="Write a haiku about autumn leaves. " * 5, max_tokens=2)
        assert other.usage.prompt_tokens_details.cached_tokens == 0

        messages = [{"role": "system", "content": "You answer briefly and kindly. " * 6},
                    {"role": "user", "content": "Why is the sky blue?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        before = _prefix_hits(server)
        lines = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                     "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[len("data: "):]) for line in lines.text.splitlines()
                  if line.startswith("data: {")]
        cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == _prefix_hits(server) - before
        assert cached == (first.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    finally:
        server.close()
