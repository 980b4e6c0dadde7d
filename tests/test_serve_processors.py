"""The server's per-request processor fields through the real ``openai`` client: OpenAI's ``logit_bias`` and vLLM's
``bad_words``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_tokens`` (``extra_body``), sent concurrently so
they share the engine's steps; each completion's text equals model.generate() alone with the same settings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from test_serve import MODEL, Server, tiny_lm, tiny_tokenizer

from hf_paged.serve.protocol import bad_words_ids

NEW = 10


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    server = Server(tiny_lm(tokenizer), tokenizer, num_blocks=96)
    yield server
    server.close()


def reference(model, tokenizer, prompt_ids: list[int], **settings) -> str:
    """generate()'s greedy text alone (to the first EOS, which the engine keeps and the text drops)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                   dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, **settings)
    new = out[0, len(prompt_ids):].tolist()
    eos = tokenizer.eos_token_id
    if eos in new:
        new = new[:new.index(eos) + 1]
    return tokenizer.decode(new, skip_special_tokens=True)


def test_processor_fields_equal_generate_concurrently(served, tokenizer):
    model = served.model
    prompt = tokenizer("Why is the sky blue?")["input_ids"]
    with torch.no_grad():
        plain = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    word = tokenizer.decode(plain[:1]).strip() or "e"
    cases = [  # (request fields, generate() settings)
        (dict(logit_bias={str(plain[0]): -100, str(plain[2]): 30}),
         dict(sequence_bias=[[[plain[0]], -100.0], [[plain[2]], 30.0]])),
        (dict(extra_body={"bad_words": [word]}), dict(bad_words_ids=bad_words_ids(tokenizer, [word]))),
        (dict(extra_body={"repetition_penalty": 1.3}), dict(repetition_penalty=1.3)),
        (dict(extra_body={"no_repeat_ngram_size": 3}), dict(no_repeat_ngram_size=3)),
        (dict(extra_body={"min_tokens": 6, "no_repeat_ngram_size": 2, "bad_words": [word]},
              logit_bias={str(plain[1]): -50}),
         dict(min_new_tokens=6, no_repeat_ngram_size=2, bad_words_ids=bad_words_ids(tokenizer, [word]),
              sequence_bias=[[[plain[1]], -50.0]])),
        (dict(), dict()),
    ]
    want = [reference(model, tokenizer, prompt, **settings) for _, settings in cases]
    assert len(set(want)) == len(want), "a field does not change the text: the test would not see it ignored"
    client = served.client()

    def ask(fields):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, **fields)

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(ask, [fields for fields, _ in cases]))
    assert [r.choices[0].text for r in got] == want
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(plain[0]): -100},
                                          extra_body={"bad_words": [word], "no_repeat_ngram_size": 2})
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_bad_processor_fields_get_a_400_naming_them(served):
    client = served.client()
    for fields, named in ((dict(logit_bias={"5": 300}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
                          (dict(logit_bias={"999999": 1}), "sequence_bias"),
                          (dict(extra_body={"bad_words": [" "]}), "bad_words"),
                          (dict(extra_body={"no_repeat_ngram_size": -1}), "no_repeat_ngram_size"),
                          (dict(extra_body={"allowed_token_ids": [3]}), "allowed_token_ids")):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=3, **fields)
        assert info.value.status_code == 400 and named in info.value.body["message"], fields
