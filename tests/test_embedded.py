"""The embedded SmolLM2-135M-Instruct: PagedCache gives DynamicCache's tokens for every decoding strategy."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_paged import PagedCache, compat, disable_paged_attention, embedded, enable_paged_attention

try:
    embedded.gguf_path()
except FileNotFoundError as exc:  # pragma: no cover - the test setup installs it
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module")
def smollm():
    model, tokenizer = embedded.load()
    return model, tokenizer


def _pair(model, inputs, seed=None, **kw):
    """(DynamicCache tokens on the unpatched model, PagedCache tokens on the paged path)."""
    kw.setdefault("max_new_tokens", 8)
    disable_paged_attention(model)
    if seed is not None:
        torch.manual_seed(seed)
    ref = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)}, **kw)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: cache}, **kw)
    disable_paged_attention(model)
    return ref, out, cache


def test_greedy_batch_of_four_chat_prompts(smollm):
    model, tokenizer = smollm
    inputs = embedded.chat_batch(tokenizer, 4)
    assert (inputs["attention_mask"] == 0).any()  # the batch really is left-padded
    ref, out, cache = _pair(model, inputs, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.memory_stats().tokens_stored <= int(inputs["attention_mask"].sum()) + 4 * 7


def test_beam_search(smollm):
    model, tokenizer = smollm
    inputs = embedded.chat_batch(tokenizer, 1)
    ref, out, cache = _pair(model, inputs, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=6)
    assert torch.equal(out, ref)
    cache.pool.allocator.check_invariants()


def test_sampling_with_returned_sequences(smollm):
    model, tokenizer = smollm
    inputs = embedded.chat_batch(tokenizer, 2)
    ref, out, cache = _pair(model, inputs, seed=11, do_sample=True, num_return_sequences=2, max_new_tokens=6)
    assert torch.equal(out, ref)
    stats = cache.memory_stats()
    assert stats.tokens_stored < stats.logical_tokens  # the prompts are stored once per pair


def test_prompt_lookup_decoding(smollm):
    model, tokenizer = smollm
    text = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    inputs = tokenizer(text, return_tensors="pt")
    ref, out, _ = _pair(model, inputs, prompt_lookup_num_tokens=4, do_sample=False, max_new_tokens=10)
    assert torch.equal(out, ref)
