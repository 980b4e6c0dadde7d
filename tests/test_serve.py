"""The OpenAI-compatible server (``hf_paged.serve``) on the real continuous-batching engine.

Servers run in-process (uvicorn in a thread, on a loopback socket) over tiny random-weight Llama models and a tiny
byte-level BPE tokenizer trained here; clients are the real ``openai`` package (``max_retries=0``) and httpx.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from helpers.servers import ThreadedServer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from helpers.engine_shadow import one_thread  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import BlockPool  # noqa: E402
from hf_paged.serve import ServeSettings, create_app  # noqa: E402
from hf_paged.serve.detokenizer import IncrementalDetokenizer  # noqa: E402
from hf_paged.serve.stops import StopChecker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-123"
MODEL = "tiny"
BLOCK = 16
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["What is the capital of France?", "Write a haiku about autumn leaves.", "Explain why the sky is blue.",
          "Give me three tips for writing clean Python code.", "日本語のテキストです。", "café crème brûlée",
          "Привет, как дела?", "emoji 😀 and ü"] * 4
PROMPTS = ["What is the capital of France?", "Write a haiku about", "Explain the sky", "Three tips for",
           "clean Python code", "leaves in autumn", "the capital of", "Why is the sky blue?"]


# -- models, tokenizer, servers --------------------------------------------------------------------------------------
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte is a token, so multi-byte characters can split) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def byte_token(tokenizer, b: int) -> int:
    """The id of the single-byte token for byte ``b`` (GPT-2's byte-to-character map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [x for x in range(256) if x not in printable]
    char = chr(b) if b in printable else chr(256 + others.index(b))
    return tokenizer.convert_tokens_to_ids(char)


def tiny_lm(tokenizer, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    options = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(**{**options, **overrides})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def cycle_lm(tokenizer, cycle: list[int], **overrides) -> LlamaForCausalLM:
    """A Llama whose greedy output walks ``cycle`` (token ``cycle[i]`` is followed by ``cycle[i + 1]``, wrapping):
    attention and MLP outputs are zeroed so the residual stream carries the current token's embedding, cycle tokens
    have orthogonal embeddings, and each one's lm_head row is its predecessor's embedding."""
    model = tiny_lm(tokenizer, seed=1, **overrides)
    hidden = model.config.hidden_size
    assert len(cycle) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight  # [V, hidden]
        head = model.lm_head.weight  # [V, hidden]
        head.zero_()
        for i, t in enumerate(cycle):
            emb[t] = torch.nn.functional.one_hot(torch.tensor(i), hidden).float() * 4.0
        for i, t in enumerate(cycle):
            head[cycle[(i + 1) % len(cycle)]] = emb[t]
    model.generation_config.eos_token_id = None
    return model


class Switch(torch.nn.Module):
    """Wraps a decoder layer's MLP: when set, ``error`` is raised and ``delay`` seconds slept in each forward."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp, self.error, self.delay = mlp, None, 0.0

    def forward(self, x):
        if self.error is not None:
            raise self.error
        if self.delay:
            time.sleep(self.delay)
        return self.mlp(x)


class Server:
    """uvicorn serving a real engine in a background thread on a loopback socket; ``close()`` stops both."""

    def __init__(self, model, tokenizer, num_blocks: int, max_queue: int | None = None, api_key: str | None = KEY,
                 max_body_bytes: int = 2**20):
        self.model, self.tokenizer = model, tokenizer
        pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=True)
        self.manager = hf_paged.init_continuous_batching(model, pool=pool, max_queue_size=max_queue)
        settings = ServeSettings(model_name=MODEL, api_key=api_key, max_body_bytes=max_body_bytes, drain_timeout=5)
        app = create_app(self.manager, tokenizer, settings, vocab_size=model.config.vocab_size)
        served = ThreadedServer(app)
        self.url, self.server, self.thread = served.url, served.server, served.thread

    def client(self, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kwargs)

    def async_client(self) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", 120)
        return httpx.post(self.url + path, content=content, headers=headers, **kwargs)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    server = Server(tiny_lm(tokenizer), tokenizer, num_blocks=64)
    yield server
    server.close()


def greedy_reference(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
    """``model.generate()``'s greedy text and number of new tokens (EOS counted, as the engine counts it)."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(prompt_ids):].tolist()
    eos = tokenizer.eos_token_id
    if eos in new:
        new = new[:new.index(eos) + 1]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def wait_blocks_released(manager, seconds: float = 2.0):
    deadline = time.monotonic() + seconds
    while True:
        stats = manager.stats()
        if stats.blocks_in_use == 0 and stats.running == 0 and stats.waiting == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


# -- detokenizer and stop strings, without a server ------------------------------------------------------------
def test_detokenizer_pieces_are_whole_characters_and_join_to_decode(tokenizer):
    """Whatever the chunking of the ids, the pieces join to tokenizer.decode(ids); for valid UTF-8 no piece holds a
    replacement character (a split character waits for its last byte)."""
    g = torch.Generator().manual_seed(0)
    text = "Hello é日😀 world жa ü!"
    byte_ids = [byte_token(tokenizer, b) for b in text.encode()]
    bpe_ids = tokenizer(text)["input_ids"]
    for ids in (byte_ids, bpe_ids, torch.randint(3, len(tokenizer), (60,), generator=g).tolist()):
        for trial in range(5):
            detok, pieces, i = IncrementalDetokenizer(tokenizer), [], 0
            while i < len(ids):
                step = 1 + int(torch.randint(0, 4 if trial else 1, (1,), generator=g))
                pieces.append(detok.add(ids[i:i + step]))
                i += step
            pieces.append(detok.finish())
            assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
            if ids is not byte_ids or trial:
                continue
            assert all("\ufffd" not in p for p in pieces)
            assert [p for p in pieces if p] == list(text)  # one byte per step: each character once complete


def test_stop_checker_holds_back_a_possible_stop_and_cuts_at_the_earliest():
    """Text that may begin a stop string is held until it cannot; the output is the text before the earliest stop
    string, for every way of splitting the text into pieces."""
    text = "alpha beta\n\ngamma END delta"
    for stops, expected in ((["\n\n"], "alpha beta"), (["END", "ta\n"], "alpha be"), (["zzz"], text),
                            (["gamma E", "a E"], "alpha beta\n\n"), (["a\n\ngamma", "\n\n"], "alpha bet")):
        for cut in range(len(text) + 1):
            for cut2 in range(cut, len(text) + 1, 3):
                checker, out = StopChecker(stops), []
                for piece in (text[:cut], text[cut:cut2], text[cut2:]):
                    sent, stopped = checker.add(piece)
                    out.append(sent)
                    if stopped:
                        break
                out.append(checker.flush()[0])
                joined = "".join(out)
                assert joined == expected, (stops, cut, cut2)
                if checker.stopped:
                    assert not any(s in joined for s in stops)


def test_stop_strings_do_not_count_before_min_tokens():
    """With min_tokens (vLLM's field), a stop string in the first min_tokens tokens' text does not end the output
    and that text is not held back; one after them does."""
    pieces = ["a\n\n", "b", "c\n\n", "d"]  # one piece per token
    checker, out = StopChecker(["\n\n"], min_tokens=2), []
    for tokens, piece in enumerate(pieces, 1):
        sent, stopped = checker.add(piece, tokens)
        out.append(sent)
        if stopped:
            break
    assert "".join(out) == "a\n\nbc" and checker.stopped
    checker = StopChecker(["\n\n"])
    assert checker.add(pieces[0], 1) == ("a", True)


# -- completions and chat ----------------------------------------------------------------------------------------
def test_completion_greedy_equals_generate_streamed_or_not(served, tokenizer):
    """Greedy completions equal model.generate() on the same prompt, token counts included; the stream's text
    joins to the same text, ends with finish_reason and, with include_usage, the same usage."""
    client = served.client()
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        text, count = greedy_reference(served.model, tokenizer, ids, 12)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == ("length" if count == 12 else "stop")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), count,
                                                                                            len(ids) + count)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [r.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
    ids = tokenizer(PROMPTS[0])["input_ids"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == greedy_reference(served.model, tokenizer, ids, 12)[0]
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + r.choices[0].text


def test_chat_greedy_equals_generate_streamed_or_not(served, tokenizer):
    """Chat renders the tokenizer's chat template (system message and text-part content included) and its greedy
    answer equals model.generate() on the rendered prompt, streamed (role first, then content) or not."""
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "You are terse."},
                                              {"role": "user", "content": "What is 2+2?"}],
                                             tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text, count = greedy_reference(served.model, tokenizer, ids, 10)
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), count)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_choices_and_seeded_sampling(served, tokenizer):
    """n=2 gives two indexed choices whose usage adds up; greedy choices are equal; seeded sampling is
    reproducible and choice i uses seed + i."""
    client = served.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text
    ids = tokenizer(PROMPTS[1])["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 2 * greedy_reference(served.model, tokenizer, ids, 8)[1]

    def sample(n, seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=n,
                                         seed=seed)

    a, b, one = sample(2, 7), sample(2, 7), sample(1, 8)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[1].text == one.choices[0].text
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, n=2, stream=True))
    by_index = {0: "", 1: ""}
    for c in chunks:
        by_index[c.choices[0].index] += c.choices[0].delta.content or ""
    assert by_index[0] == by_index[1]


def test_stop_strings_end_the_text_before_them(served, tokenizer):
    """A stop string (found in the greedy text, spanning tokens) ends the choice just before it, with
    finish_reason "stop", streamed or not; the stream never sends a character of the stop string."""
    client = served.client()
    prompt = PROMPTS[0]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    cut = next((i for i in range(2, len(full) - 3) if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i), None)
    if cut is None:
        pytest.skip("the greedy text has no unique three-character stretch to stop on")
    stop = full[cut:cut + 3]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                                   temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == full[:cut]
    assert r.usage.completion_tokens < 24


def test_logprobs_follow_the_tokens(served, tokenizer):
    """logprobs (completions: k alternatives; chat: logprobs + top_logprobs) come per generated token, the
    greedy token's logprob is the best of its alternatives, and the tokens join to the text."""
    client = served.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and value <= 0 and value >= max(top.values()) - 1e-4
    assert "".join(lp.tokens).replace(tokenizer.eos_token, "").startswith(r.choices[0].text[:1])
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob >= max(x.logprob for x in t.top_logprobs) - 1e-4
               for t in content)


def test_models_health_and_metrics(served):
    """/v1/models lists the served id; /health is 200 while the engine runs; /metrics parses as Prometheus text
    and counts what was served (tokens, TTFT observations, KV blocks by state)."""
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0,
                                                      extra_headers={"X-Request-Id": "my-id-42"})
    assert raw.headers["x-request-id"] == "my-id-42" and raw.parse().id == "cmpl-my-id-42"
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200
    text = httpx.get(served.url + "/metrics", timeout=30).text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    stats = served.manager.stats()
    assert samples[("hf_paged_generation_tokens_total", ())] >= 4
    assert samples[("hf_paged_kv_blocks_capacity", ())] == stats.num_blocks
    assert {("state", s) for s in ("in_use", "cached", "free")} <= {
        lbl for (name, labels), _ in samples.items() if name == "hf_paged_kv_blocks" for lbl in labels}
    assert samples[("hf_paged_time_to_first_token_seconds_count", ())] >= 1
    assert families["hf_paged_inter_token_latency_seconds"].type == "histogram"
    assert "hf_paged_requests_running" in families and "hf_paged_preemptions" in families
    assert "hf_paged_decode_graph_replays" in families
    assert samples[("hf_paged_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1


# -- errors ------------------------------------------------------------------------------------------------------
def test_bad_requests_get_their_4xx_and_the_server_keeps_serving(served, tokenizer):
    """Malformed JSON, wrong types and ranges, unsupported features (named), an unknown model, a prompt that can
    never fit (sizes in the message), an oversized body and a wrong or missing key each get their status in the
    OpenAI error shape; a normal request (with an unknown field, ignored) still succeeds after them."""
    client = served.client()

    def status_of(**kwargs):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(**{"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs})
        return info.value.status_code, info.value.body

    assert status_of(max_tokens=-3)[0] == 400
    status, body = status_of(extra_body={"max_tokens": "5"})
    assert status == 400 and body["param"] == "max_tokens" and body["type"] == "invalid_request_error"
    assert status_of(temperature=3.5)[0] == 400
    assert status_of(n=0)[0] == 400
    status, body = status_of(logit_bias={"5": 101.0})
    assert status == 400 and "logit_bias" in body["message"]
    assert status_of(presence_penalty=2.5)[0] == 400  # served in [-2, 2] (tests/test_serve_fields.py)
    status, body = status_of(model="no-such-model")
    assert status == 404 and "no-such-model" in body["message"]
    status, body = status_of(prompt=[5, 999_999])
    assert status == 400 and "999999" in body["message"]
    status, body = status_of(prompt=" hello" * 100_000)
    n_tokens = len(tokenizer(" hello" * 100_000)["input_ids"])
    assert status == 400 and f"{n_tokens:,}" in body["message"] and "512" in body["message"]
    with pytest.raises(openai.APIStatusError) as info:  # a vLLM field the engine cannot do is refused by name
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"allowed_token_ids": [5]})
    assert info.value.status_code == 400 and "allowed_token_ids" in info.value.body["message"]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert info.value.status_code == 400 and "image_url" in info.value.body["message"]

    r = served.post("/v1/completions", b'{"model": "tiny", "prompt": ')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = served.post("/v1/completions", {"model": MODEL, "prompt": "x" * (2**20 + 10)})
    assert r.status_code == 413 and "1,048,576" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"

    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                   extra_body={"a_field_from_the_future": {"x": 1}})  # unknown fields are ignored
    assert ok.usage.completion_tokens >= 1
    stats = wait_blocks_released(served.manager)
    assert stats.blocks_in_use == 0 and stats.failed == 0


def _stream_lines(server, prompt: str, after_first=None) -> list[str]:
    with server.client().completions.with_streaming_response.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                                    temperature=0, stream=True) as response:
        lines = response.iter_lines()
        out = [next(line for line in lines if line.startswith("data: {"))]
        if after_first is not None:
            after_first()
        return out + [line for line in lines if line]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's death
def test_queue_full_engine_failures_and_a_dead_engine(tokenizer):
    """Past max_queue waiting requests a new one gets 429 with Retry-After while the accepted ones finish; a forward
    that fails mid-stream ends that stream with an SSE error event then [DONE] (a 500 when not streamed) and the
    server keeps serving; if the engine thread dies, open streams end the same way, /health answers 503 and new
    requests 503."""
    model = tiny_lm(tokenizer, seed=3)
    model.generation_config.eos_token_id = None
    breaker = model.model.layers[1].mlp = Switch(model.model.layers[1].mlp)
    server = Server(model, tokenizer, num_blocks=4, max_queue=1)
    try:
        async def flood():
            client = server.async_client()

            async def one(i):
                try:
                    r = await client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)],
                                                        max_tokens=40, temperature=0)
                    return r.choices[0].finish_reason
                except openai.RateLimitError as exc:
                    assert exc.response.headers["Retry-After"] == "1"
                    assert exc.body["type"] == "rate_limit_error"
                    return 429

            return await asyncio.gather(*(one(i) for i in range(6)))

        results = asyncio.run(flood())
        assert 429 in results and "length" in results
        assert wait_blocks_released(server.manager).blocks_in_use == 0

        lines = _stream_lines(server, PROMPTS[0], after_first=lambda: setattr(breaker, "error", RuntimeError("x")))
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["type"] == "server_error" and "failed" in error["message"]
        with pytest.raises(openai.InternalServerError):
            server.client().completions.create(model=MODEL, prompt="hi", max_tokens=4)
        breaker.error = None
        assert server.client().completions.create(model=MODEL, prompt="hi", max_tokens=4).usage.completion_tokens == 4
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200

        lines = _stream_lines(server, PROMPTS[1], after_first=lambda: setattr(breaker, "error", SystemExit()))
        assert lines[-1] == "data: [DONE]" and "engine thread stopped" in lines[-2]
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        with pytest.raises(openai.APIStatusError) as info:
            server.client().completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert info.value.status_code == 503
    finally:
        server.close()


# -- streams: multi-byte text, load, disconnects ---------------------------------------------------------------
def test_multibyte_stream_never_splits_a_character(tokenizer):
    """A model that emits multi-byte characters one byte-token at a time: every streamed piece is whole
    characters (no U+FFFD), and the pieces join to the non-streamed text, which equals the tokenizer's decode."""
    text = "é日😀жa"
    cycle = [byte_token(tokenizer, b) for b in text.encode()]
    assert len(set(cycle)) == len(cycle)
    server = Server(cycle_lm(tokenizer, cycle, max_position_embeddings=48), tokenizer, num_blocks=16)
    try:
        client = server.client()
        prompt = [cycle[-1]]
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3 * len(cycle), temperature=0)
        assert whole.choices[0].text == text * 3
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3 * len(cycle), temperature=0, stream=True)]
        assert "".join(pieces) == whole.choices[0].text
        assert all("\ufffd" not in p for p in pieces)
        assert sum(1 for p in pieces if p) >= 3 * len(text)  # streamed as characters complete, not at the end
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=len(cycle) + 3, temperature=0)
        assert cut.choices[0].text == text + "é\ufffd"  # the end flushes bytes that never completed
        unbounded = client.completions.create(model=MODEL, prompt=prompt, temperature=0)  # no max_tokens
        assert unbounded.usage.completion_tokens == 47 and unbounded.choices[0].finish_reason == "length"
    finally:
        server.close()


def test_load_concurrent_streams_on_a_small_pool_then_disconnects_free_blocks(tokenizer):
    """32 concurrent streaming clients x 4 requests (max_tokens 32) on a pool holding a third of their KV: no
    failures, every stream ends with [DONE] and carries its 32 tokens. Then 8 clients go away midway (6 streamed,
    2 not): their requests are cancelled and every block in use goes back within 2 s (cached prefixes aside)."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(32)]
    kv_tokens = sum(len(tokenizer(p)["input_ids"]) + 32 for p in prompts)
    num_blocks = -(-kv_tokens // 3 // BLOCK)
    model = tiny_lm(tokenizer, seed=5, num_hidden_layers=1)
    model.generation_config.eos_token_id = None  # every request runs its 32 tokens
    slow = model.model.layers[0].mlp = Switch(model.model.layers[0].mlp)
    server = Server(model, tokenizer, num_blocks=num_blocks)

    async def one_client(client, i) -> list[str]:
        problems = []
        for k in range(4):
            if (i + k) % 2:
                call = client.completions.with_streaming_response.create(
                    model=MODEL, prompt=prompts[i], max_tokens=32, temperature=0, stream=True,
                    stream_options={"include_usage": True})
            else:
                call = client.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=32, temperature=0,
                    stream=True, stream_options={"include_usage": True})
            async with call as response:
                lines = [line async for line in response.iter_lines() if line]
            if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                problems.append(f"client {i} request {k}: ends {lines[-2:]}")
                continue
            usage = json.loads(lines[-2][len("data: "):])["usage"]
            if usage["completion_tokens"] != 32:
                problems.append(f"client {i} request {k}: {usage}")
        return problems

    async def load():
        client = server.async_client()
        return await asyncio.gather(*(one_client(client, i) for i in range(32)), return_exceptions=True)

    try:
        results = asyncio.run(load())
        assert [r for r in results if not isinstance(r, list) or r] == []
        stats = wait_blocks_released(server.manager)
        assert stats.blocks_in_use == 0 and stats.failed == 0 and stats.finished == 128
        assert server.manager.get_result(timeout=0) is None  # no engine result is left unread (kept forever)

        slow.delay = 0.02  # >= 8 s for 400 tokens: every leaving client's request is still running when it leaves
        streams = []
        for i in range(6):
            call = server.client().completions.with_streaming_response.create(
                model=MODEL, prompt=prompts[i], max_tokens=400, temperature=0, stream=True)
            response = call.__enter__()
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            streams.append((call, response))
        for i in range(2):
            with pytest.raises(httpx.ReadTimeout):
                server.post("/v1/completions", {"model": MODEL, "prompt": prompts[10 + i], "max_tokens": 400},
                            timeout=httpx.Timeout(30, read=0.5))
        assert server.manager.stats().blocks_in_use > 0
        for call, response in streams:
            call.__exit__(None, None, None)
        stats = wait_blocks_released(server.manager, 2.0)
        assert stats.blocks_in_use == 0 and stats.running == 0, stats
        assert stats.cancelled == 8 and stats.finished == 128, stats
    finally:
        server.close()


# -- the command line: subprocess, drain on SIGTERM, log lines ------------------------------------------------------
def test_cli_serves_a_model_directory_and_drains_on_sigterm(tmp_path, tokenizer):
    """`python -m hf_paged serve --model DIR` serves the directory's name as the model id; SIGTERM during a stream
    lets it finish with [DONE] and the process exits 0; each request logs one line with its counts and never its
    text."""
    model_dir = tmp_path / "tiny-served"
    lm = tiny_lm(tokenizer, seed=2)
    lm.generation_config.eos_token_id = None
    lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_PAGED_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--model", str(model_dir), "--port",
                             str(port), "--max-memory", "8MiB", "--drain-timeout", "60", "--threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-served"]
        secret = "zebra lantern"
        with client.completions.with_streaming_response.create(model="tiny-served", prompt=secret, max_tokens=24,
                                                               temperature=0, stream=True) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in [first, *rest[:-1]]]
        assert finishes[-1] == "length"
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal once it has drained
        assert "Application shutdown complete" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    request_lines = [line for line in out.splitlines() if "hf_paged.serve" in line and " request " in line]
    assert len(request_lines) == 2  # /v1/models and the completion
    completion_line = next(line for line in request_lines if "/v1/completions" in line)
    assert "status=200" in completion_line and "output_tokens=24" in completion_line
    assert f"prompt_tokens={len(tokenizer(secret)['input_ids'])}" in completion_line
    assert "zebra" not in out and "lantern" not in out
