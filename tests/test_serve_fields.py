"""What the server honours and guards, through the real ``openai`` client and httpx: one guard for every route that
costs work (only ``/health`` and ``/metrics`` open), OpenAI's presence / frequency penalties equal to a reference
decoding loop, top-k off unless asked, ``add_generation_prompt`` and ``chat_template_kwargs`` reaching the chat
template, beam search honouring the processor fields and refusing the rest by name, caps on list-valued fields."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_engine_penalties import greedy_with_penalties  # noqa: E402
from test_serve import KEY, MODEL, Server, tiny_lm, tiny_tokenizer  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from hf_paged import compat  # noqa: E402
from hf_paged.engine.sampling import SamplingParams as EngineParams  # noqa: E402
from hf_paged.serve.protocol import DEFAULT_LIMITS, RequestLimits, parse_chat, parse_completion  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if greeting %}{{ greeting }}\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    server = Server(tiny_lm(tokenizer, seed=4), tokenizer, num_blocks=128)
    yield server
    server.close()


def test_every_route_but_health_and_metrics_needs_the_key(served):
    """/tokenize, /detokenize, /tokenizer_info, /v1/models and unknown paths answer 401 without the key (before the
    body is read); /tokenize's body is capped (413); /health and /metrics stay open."""
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                         ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/no/such/route")):
        r = httpx.request(method, served.url + path, json={"prompt": "hi", "tokens": [1]}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
    r = served.post("/tokenize", {"prompt": "x" * (2**20 + 10)})
    assert r.status_code == 413
    assert served.post("/tokenize", {"prompt": "hello"}).status_code == 200
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200
    assert httpx.get(served.url + "/metrics", timeout=30).status_code == 200
    metrics = httpx.get(served.url + "/metrics", timeout=30).text
    assert "/no/such/route" not in metrics  # unknown paths share one label: a caller cannot grow the metric


def test_presence_and_frequency_penalties_equal_the_reference(served):
    """Greedy completions with presence / frequency penalties, sent concurrently with a plain one: each text equals
    the reference decoding loop (OpenAI's formula on the model's logits, generated tokens only)."""
    tokenizer, model = served.tokenizer, served.model
    prompt = tokenizer("Why is the sky blue? The sky")["input_ids"]
    cases = [(0.0, 0.0), (0.0, 2.0), (1.5, 0.5), (-1.0, 0.0)]
    want = []
    for presence, frequency in cases:
        ids = greedy_with_penalties(model, prompt, 12, presence, frequency)
        if tokenizer.eos_token_id in ids:
            ids = ids[:ids.index(tokenizer.eos_token_id) + 1]
        want.append(tokenizer.decode(ids, skip_special_tokens=True))
    assert len(set(want)) > 2, "the penalties do not change the text: the test would not see them dropped"
    client = served.client()

    def ask(case):
        presence, frequency = case
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         presence_penalty=presence, frequency_penalty=frequency).choices[0].text

    with ThreadPoolExecutor(len(cases)) as pool:
        assert list(pool.map(ask, cases)) == want


def test_top_k_is_off_unless_asked():
    """A sampled request without top_k keeps the whole vocabulary (OpenAI / vLLM), not generate()'s top-50; top_k
    as sent is kept, -1 means off."""
    for body, expected in (({}, None), ({"top_k": 5}, 5), ({"top_k": -1}, None), ({"top_k": 0}, None)):
        req = parse_completion({"prompt": "hi", "temperature": 0.8, **body})
        engine = EngineParams.from_generation_config(None, **req.params.engine_kwargs(0))
        assert engine.do_sample and engine.top_k == expected, body
    req = parse_completion({"prompt": "hi", "temperature": 0.8})
    req.params.model_top_k = True  # the model's generation config sets a top_k: a request without one keeps it
    assert "top_k" not in req.params.engine_kwargs(0)


def test_chat_template_kwargs_and_add_generation_prompt(served):
    """``add_generation_prompt: false`` and ``chat_template_kwargs`` change the rendered prompt, in /tokenize and in
    chat completions alike; names the server passes itself are refused."""
    messages = [{"role": "user", "content": "hi"}]
    tokenizer = served.tokenizer

    def rendered(**kwargs):
        return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs),
                         add_special_tokens=False)["input_ids"]

    plain = served.post("/tokenize", {"messages": messages}).json()["tokens"]
    bare = served.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    greeted = served.post("/tokenize", {"messages": messages,
                                        "chat_template_kwargs": {"greeting": "hello there"}}).json()["tokens"]
    assert plain == rendered(add_generation_prompt=True)
    assert bare == rendered(add_generation_prompt=False) != plain
    assert greeted == rendered(add_generation_prompt=True, greeting="hello there")
    client = served.client()
    for extra, ids in (({"add_generation_prompt": False}, bare),
                       ({"chat_template_kwargs": {"greeting": "hello there"}}, greeted)):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        assert out.usage.prompt_tokens == len(ids), extra
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}})
    assert "chat_template" in info.value.body["message"]


def test_beam_search_honours_processor_fields_and_refuses_the_rest(served):
    """use_beam_search with logit_bias, bad_words, no_repeat_ngram_size and the penalties: the n best sequences of
    generate(num_beams) with the same processors; temperature, top_p, top_k, seed, logprobs, stop: 400 naming each."""
    tokenizer, model = served.tokenizer, served.model
    prompt = tokenizer("Why is the sky blue?")["input_ids"]
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=6, num_beams=3,
                              do_sample=False)[0, len(prompt):].tolist()
    bias = {str(free[0]): -100.0, str(free[1]): 5.0}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "n": 2, "best_of": 3, "use_beam_search": True,
            "logit_bias": bias, "no_repeat_ngram_size": 2, "repetition_penalty": 1.2}
    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=6, num_beams=3,
                             num_return_sequences=2, do_sample=False, no_repeat_ngram_size=2,
                             repetition_penalty=1.2, sequence_bias=[[[int(k)], v] for k, v in bias.items()],
                             return_dict_in_generate=True, output_logits=True,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    expected = []
    for j in range(2):
        length = int((out.beam_indices[j] != -1).sum())
        expected.append(tokenizer.decode(out.sequences[j, len(prompt): len(prompt) + length],
                                         skip_special_tokens=True))
    assert texts == expected
    assert texts[0] != tokenizer.decode(free, skip_special_tokens=True)  # the fields changed the beams
    for field, value in (("temperature", 0.7), ("top_p", 0.5), ("top_k", 5), ("seed", 3), ("logprobs", 1),
                         ("stop", ["x"]), ("min_p", 0.1)):
        r = served.post("/v1/completions", {**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.text, (field, r.text)
    ok = served.post("/v1/completions", {**body, "temperature": 0, "presence_penalty": 0.5})
    assert ok.status_code == 200, ok.text


def test_list_fields_are_capped():
    """logit_bias, stop_token_ids, bad_words, stop, prompts, messages, tools, chat_template_kwargs and a choice list
    over their caps are 400s naming the field and the cap; RequestLimits.parse raises one."""
    big = DEFAULT_LIMITS
    cases = [
        (parse_completion, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(big.logit_bias + 1)}},
         "logit_bias"),
        (parse_completion, {"prompt": "hi", "stop_token_ids": list(range(big.stop_token_ids + 1))}, "stop_token_ids"),
        (parse_completion, {"prompt": "hi", "bad_words": ["w"] * (big.bad_words + 1)}, "bad_words"),
        (parse_completion, {"prompt": "hi", "bad_words": ["w" * (big.bad_word_chars + 1)]}, "bad_words"),
        (parse_completion, {"prompt": "hi", "stop": ["s"] * (big.stop + 1)}, "stop"),
        (parse_completion, {"prompt": ["p"] * (big.prompts + 1)}, "prompt"),
        (parse_completion, {"prompt": "hi", "structured_outputs": {"choice": ["a"] * (big.choice + 1)}},
         "structured_outputs"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}] * (big.messages + 1)}, "messages"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(big.tools + 1)]}, "tools"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {
            f"k{i}": 1 for i in range(big.chat_template_kwargs + 1)}}, "chat_template_kwargs"),
    ]
    for parse, body, field in cases:
        with pytest.raises(Exception) as info:
            parse(json.loads(json.dumps(body)))
        err = info.value
        assert getattr(err, "status", None) == 400 and err.body()["error"]["param"] == field, (field, err)
        assert "at most" in err.body()["error"]["message"]
    roomy = RequestLimits.parse(["logit_bias=1000"])
    assert parse_completion(cases[0][1], roomy).params.logit_bias is not None
    with pytest.raises(ValueError, match="--limit"):
        RequestLimits.parse(["nothing=3"])
    assert KEY  # the module's server runs with the shared test key
