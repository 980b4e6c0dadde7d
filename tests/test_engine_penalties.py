"""OpenAI's presence and frequency penalties as per-request processors (vLLM's semantics: the tokens the request
generated, not its prompt), checked against a reference of OpenAI's formula on the logits a request's step saw; and the
n-gram index that grows with a request's committed tokens only (speculative drafts and beams are scanned, not stored),
equal to transformers' ``NoRepeatNGramLogitsProcessor`` on every row."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from helpers.engine_shadow import one_thread
from helpers.models import EOS, VOCAB, tiny_model
from transformers import DynamicCache, NoRepeatNGramLogitsProcessor

import hf_paged
from hf_paged import BlockPool, compat, generate_batch
from hf_paged.engine.processors import NGramIndex, Processors, ProcessorSettings
from hf_paged.engine.sampling import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


def openai_penalized(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c the counts in the generated tokens."""
    out = logits.clone().double()
    for token, count in Counter(generated).items():
        out[token] -= count * frequency + presence
    return out


def test_penalties_equal_openai_formula_on_random_rows():
    """Rows with different penalties, prompt lengths and generated tokens (repeats included), in one step: each row's
    scores equal the formula's on its generated tokens alone; the prompt's tokens are untouched."""
    rng = random.Random(0)
    stage = Processors()
    params, histories, generated, expected = [], [], [], []
    logits = torch.randn(6, VOCAB)
    for row in range(6):
        presence, frequency = rng.uniform(-2, 2), rng.uniform(-2, 2)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        new = [rng.randrange(8) for _ in range(row * 3)]  # few distinct ids: counts above 1
        params.append(SamplingParams.from_generation_config(None, presence_penalty=presence,
                                                            frequency_penalty=frequency))
        histories.append(prompt + new)
        generated.append(len(new))
        expected.append(openai_penalized(logits[row], new, presence, frequency))
    out = stage(logits, params, [None] * 6, histories, generated)
    for row in range(6):
        torch.testing.assert_close(out[row].double(), expected[row], atol=1e-5, rtol=0)
    assert torch.equal(out[0], logits[0])  # nothing generated yet: no penalty, whatever the prompt holds


def test_penalties_validated():
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        ProcessorSettings.from_settings({"presence_penalty": 2.5})
    assert ProcessorSettings.from_settings({"frequency_penalty": 0.0}) is None


def greedy_with_penalties(model, prompt: list[int], new: int, presence: float, frequency: float) -> list[int]:
    """The reference: the model's logits at each step (DynamicCache), the formula applied, argmax."""
    ids, out = list(prompt), []
    cache = DynamicCache(config=model.config)
    feed = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new):
            logits = model(feed, past_key_values=cache, use_cache=True).logits[0, -1].float()
            token = int(openai_penalized(logits, out, presence, frequency).argmax())
            out.append(token)
            ids.append(token)
            feed = torch.tensor([[token]])
    return out


def test_engine_penalties_equal_reference_decoding(model):
    """Greedy requests with presence / frequency penalties, mixed in one engine with a plain one: each gets the
    tokens of the reference decoding loop (the formula on the model's logits), and the penalties change them."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 11, 8)]
    settings = [(0.0, 0.0), (0.0, 1.5), (1.2, 0.4)]
    with hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=4, num_blocks=64)) as manager:
        for i, (prompt, (presence, frequency)) in enumerate(zip(prompts, settings)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=16, do_sample=False, eos_token_id=[],
                                presence_penalty=presence or None, frequency_penalty=frequency or None)
        results = {f"r{i}": manager.get_result(f"r{i}", timeout=120).generated_tokens for i in range(3)}
    for i, (prompt, (presence, frequency)) in enumerate(zip(prompts, settings)):
        assert results[f"r{i}"] == greedy_with_penalties(model, prompt, 16, presence, frequency)
    assert results["r1"] != greedy_with_penalties(model, prompts[1], 16, 0.0, 0.0)


def banned_by_transformers(n: int, ids: list[int]) -> set[int]:
    scores = NoRepeatNGramLogitsProcessor(n)(torch.tensor([ids]), torch.zeros(1, 8))
    return set(torch.isinf(scores[0]).nonzero().flatten().tolist())


def test_ngram_index_scans_uncommitted_tails_without_storing_them():
    """``banned(ids, upto)`` equals transformers' processor on the whole ids while indexing only ``ids[:upto]``:
    drafts that are later rejected, and beams that differ after the prompt, leave the index as the committed ids
    alone would; the index never re-reads the committed history."""
    rng = random.Random(1)
    for n in (2, 3, 4):
        index = NGramIndex(n)
        ids = [rng.randrange(5) for _ in range(4)]
        for _ in range(30):
            draft = [rng.randrange(5) for _ in range(rng.randrange(0, 5))]
            for i in range(len(draft) + 1):  # a verification step: every drafted position, committed = ids
                assert index.banned(ids + draft[:i], len(ids)) == banned_by_transformers(n, ids + draft[:i])
            assert index.seen == len(ids)
            beams = [ids + [rng.randrange(5) for _ in range(3)] for _ in range(3)]
            for beam in beams:  # beams: only the common part is indexed
                assert index.banned(beam, len(ids)) == banned_by_transformers(n, beam)
            before = dict(index.next_of)
            ids.append(rng.randrange(5))  # the step's committed token
            assert index.banned(ids) == banned_by_transformers(n, ids)
            assert all(before[k] <= index.next_of[k] for k in before)  # grown, never rebuilt


def test_speculative_and_beam_requests_with_ngram_blocking_equal_generate(model):
    """Prompt-lookup speculation and beam search on requests with ``no_repeat_ngram_size``: the tokens generate()
    gives each alone (the shared index sees drafts and beams without storing them)."""
    rng = random.Random(5)
    base = [rng.randrange(3, VOCAB) for _ in range(6)]
    prompts = [base * 3, base[:4] * 4 + [7]]
    out = generate_batch(model, prompts, max_new_tokens=12, prompt_lookup_num_tokens=4, no_repeat_ngram_size=3,
                         eos_token_id=[], progress_bar=False, pool=BlockPool(block_size=4, num_blocks=128))
    beams = generate_batch(model, prompts, max_new_tokens=8, num_beams=3, no_repeat_ngram_size=2, eos_token_id=EOS,
                           progress_bar=False, pool=BlockPool(block_size=4, num_blocks=128))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=12, do_sample=False,
                                 no_repeat_ngram_size=3, eos_token_id=[], pad_token_id=0,
                                 **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
            ref_beams = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=8, num_beams=3,
                                       no_repeat_ngram_size=2, eos_token_id=EOS, pad_token_id=0,
                                       **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
        assert out[f"req_{i}"].generated_tokens == ref[0, len(prompt):].tolist()
        assert beams[f"req_{i}"].generated_tokens == ref_beams[0, len(prompt):].tolist()
