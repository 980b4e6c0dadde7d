"""The server's beam search (vLLM's ``use_beam_search`` with ``n`` / ``best_of``): one beam request per prompt, its
n best sequences the n choices, equal to ``generate(num_beams=best_of, num_return_sequences=n)`` alone; beam-only
fields without beams are refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("httpx")

from transformers import DynamicCache  # noqa: E402

from hf_paged import compat, enable_paged_attention  # noqa: E402
from test_serve import Server, tiny_lm, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_tokenizer()
    model = tiny_lm(tokenizer, seed=5)
    server = Server(model, tokenizer, num_blocks=256)
    yield server
    server.close()


def test_completion_with_beam_search_returns_the_n_best_sequences(served):
    prompt = served.tokenizer("Why is the sky blue?").input_ids
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "n": 2, "best_of": 3, "use_beam_search": True,
            "length_penalty": 0.5}
    response = served.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
    model = served.model
    enable_paged_attention(model, backend="torch")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=6, num_beams=3,
                             num_return_sequences=2, length_penalty=0.5, do_sample=False,
                             return_dict_in_generate=True, output_logits=True,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    expected = []
    for j in range(2):
        length = int((out.beam_indices[j] != -1).sum())
        expected.append(served.tokenizer.decode(out.sequences[j, len(prompt): len(prompt) + length],
                                                skip_special_tokens=True))
    assert texts == expected


def test_beam_fields_without_beam_search_are_refused(served):
    response = served.post("/v1/completions", {"model": "tiny", "prompt": "hi", "length_penalty": 0.5})
    assert response.status_code == 400 and "length_penalty" in response.text
    response = served.post("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2, "best_of": 1,
                                               "use_beam_search": True})
    assert response.status_code == 400 and "best_of" in response.text
