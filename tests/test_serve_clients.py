"""What evaluation harnesses and benchmark tools send the server, on loopback with the real ``openai`` client and
httpx: lm-eval's loglikelihood requests (both versions) and vLLM's ``prompt_logprobs`` equal a direct forward;
``ignore_eos`` / ``min_tokens`` / ``stop_token_ids`` / ``include_stop_str_in_output`` /
``continuous_usage_stats``; ``/tokenize``, ``/detokenize``, ``/tokenizer_info``; ``/v1/models``; unknown fields logged
once per name."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from test_serve import KEY, MODEL, Server, byte_token, cycle_lm, tiny_lm, tiny_tokenizer  # noqa: F401

from helpers.engine_shadow import one_thread
from hf_paged.serve import protocol

TOL = 1e-4  # fp32: the engine's packed paged forward against a plain forward


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    server = Server(tiny_lm(tokenizer, seed=5), tokenizer, num_blocks=64)
    yield server
    server.close()


@pytest.fixture(scope="module")
def cycled(tokenizer):
    """A model walking x -> y -> EOS -> z -> x ... greedily (EOS on), so a prompt "x" stops after "y"."""
    cycle = [byte_token(tokenizer, ord(c)) for c in "xy"] + [tokenizer.eos_token_id, byte_token(tokenizer, ord("z"))]
    model = cycle_lm(tokenizer, cycle)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    server = Server(model, tokenizer, num_blocks=64)
    yield server
    server.close()


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, vocab]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- prompt logprobs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["lm-eval >= 0.4.3", "lm-eval older"])
def test_lm_eval_loglikelihood_requests_equal_a_direct_forward(served, tokenizer, shape):
    """lm-eval's local-completions loglikelihood request (new: max_tokens 1, logprobs 1; old: max_tokens 0,
    logprobs 10; both echo, temperature 0, token-id prompts, several per request): the continuation's summed
    token_logprobs equal a direct forward's within 1e-4, the first token's is null, and is_greedy (each
    continuation token is the most likely of its top_logprobs) agrees with the argmax of the forward."""
    pairs = [("The capital of France is", " Paris"), ("Why is the sky", " blue?"), ("clean Python", " code")]
    prompts, contexts = [], []
    for context, continuation in pairs:
        ctx = ids_of(tokenizer, context)
        prompts.append(ctx + ids_of(tokenizer, continuation))
        contexts.append(len(ctx))
    new = shape.startswith("lm-eval >=")
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1 if new else 0, "logprobs": 1 if new else 10,
            "echo": True, "temperature": 0, "seed": 1234}
    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for choice, ids, ctxlen in zip(choices, prompts, contexts):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(ids) + (1 if new else 0)
        values = lp["token_logprobs"][ctxlen:len(ids)]
        ref = direct_logprobs(served.model, ids)
        want = [ref[p - 1, ids[p]].item() for p in range(ctxlen, len(ids))]
        assert abs(sum(values) - sum(want)) < TOL * len(want)
        for p, (v, w) in enumerate(zip(values, want)):
            assert abs(v - w) < TOL
            top = lp["top_logprobs"][ctxlen + p]
            greedy = max(top.values()) <= v + TOL
            assert greedy == (ref[ctxlen + p - 1].max().item() <= w + TOL)
        if not new:
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
            assert all(len(t) <= 11 for t in lp["top_logprobs"][1:])


def test_vllm_prompt_logprobs_and_streamed_echo(served, tokenizer):
    """vLLM's prompt_logprobs=k (completions: in each choice; chat: top level) gives per prompt token None (the
    first) or the k most likely tokens and the prompt token with logprob and rank, equal to a direct forward; a
    streamed echo + logprobs request carries the same prompt logprobs in its first chunk; max_tokens 0 without echo
    is a 400 naming it."""
    text = "Explain why the sky is blue."
    ids = tokenizer(text)["input_ids"]
    ref = direct_logprobs(served.model, ids)
    r = served.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0,
                                        "prompt_logprobs": 3})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for p in range(1, len(ids)):
        row = entries[p]
        assert abs(row[str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) < TOL
        top = ref[p - 1].topk(3)
        for rank, t in enumerate(top.indices.tolist(), 1):
            assert abs(row[str(t)]["logprob"] - ref[p - 1, t].item()) < TOL and row[str(t)]["rank"] == rank
    chat = served.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])

    lines = []
    with served.client().completions.with_streaming_response.create(
            model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True) as resp:
        lines = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    first = lines[0]["choices"][0]
    assert first["text"] == text and first["logprobs"]["token_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert abs(first["logprobs"]["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOL
    streamed = "".join(c["choices"][0]["text"] for c in lines)
    whole = served.client().completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True)
    assert streamed == whole.choices[0].text

    r = served.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# -- fields benchmark tools send -----------------------------------------------------------------------------------
def test_ignore_eos_gives_exactly_max_tokens_with_continuous_usage(cycled):
    """guidellm / vllm bench serve's request: a prompt whose greedy text reaches EOS after 2 tokens gives exactly
    max_tokens tokens with ignore_eos (streamed, every chunk carrying the usage so far, the last usage chunk the
    total); without it, 2 tokens."""
    client = cycled.client()
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=12, temperature=0)
    assert plain.usage.completion_tokens == 2 and plain.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(
        model=MODEL, prompt="x", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 9


def test_min_tokens_stop_token_ids_and_include_stop_str(cycled, tokenizer):
    """min_tokens keeps EOS out until that many tokens; a stop token id ends the text (with ignore_eos too);
    include_stop_str_in_output keeps the stop string that ended the text."""
    client = cycled.client()
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                                  extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens >= 5
    z = byte_token(tokenizer, ord("z"))
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [z]})
    assert r.usage.completion_tokens == 3 and r.choices[0].text == "yz" and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0, stop=["zx"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == "y"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0, stop=["zx"],
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == "yzx"


def test_tokenizer_endpoints_models_and_unknown_fields_logged_once(served, tokenizer, caplog):
    """/tokenize (prompt or messages), /detokenize and /tokenizer_info in vLLM's shapes; /v1/models entries with
    root and max_model_len; a field the server does not know is logged once per name and changes nothing."""
    text = "café crème brûlée"
    r = served.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == ids_of(tokenizer, text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert served.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = served.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert chat["tokens"] == ids_of(tokenizer, rendered)
    assert served.post("/detokenize", {"tokens": [10**7]}).status_code == 400
    info = httpx.get(served.url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == 512
    model = served.client().models.list().data[0]
    assert model.id == MODEL and model.root == MODEL and model.max_model_len == 512

    protocol.UNKNOWN_LOGGED.discard("a_field_from_the_future")
    with caplog.at_level(logging.WARNING, logger="hf_paged.serve"):
        outs = [served.client().completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                                   extra_body={"a_field_from_the_future": 1, "ignore_eos": True})
                for _ in range(2)]
    logged = [r for r in caplog.records if "a_field_from_the_future" in r.getMessage()]
    assert len(logged) == 1 and outs[0].choices[0].text == outs[1].choices[0].text
    assert all(o.usage.completion_tokens == 3 for o in outs)
