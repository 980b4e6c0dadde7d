"""The embedded SmolLM2-135M-Instruct: PagedCache gives DynamicCache's tokens for every decoding strategy."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_paged import PagedCache, compat, disable_paged_attention, embedded, enable_paged_attention

@pytest.fixture(scope="module")
def smollm():
    try:
        embedded.gguf_path()
    except FileNotFoundError as exc:  # pragma: no cover - the test setup installs it
        pytest.skip(f"the embedded model is not installed: {exc}")
    model, tokenizer = embedded.load()
    return model, tokenizer


def test_cache_directory_follows_hf_paged_cache(monkeypatch, tmp_path):
    """HF_PAGED_CACHE moves the converted model; the loader looks there and nowhere else."""
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    target = embedded.cache_dir()
    assert target.parent == tmp_path
    target.mkdir()
    (target / "config.json").write_text("{}")  # an already converted copy: nothing is converted again
    assert embedded.local_model_dir() == target
    monkeypatch.delenv("HF_PAGED_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir().parent == tmp_path / "xdg" / "hf_paged"


def _pair(model, inputs, seed=None, release_finished=True, **kw):
    """(DynamicCache tokens on the unpatched model, PagedCache tokens on the paged path)."""
    kw.setdefault("max_new_tokens", 8)
    disable_paged_attention(model)
    if seed is not None:
        torch.manual_seed(seed)
    ref = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)}, **kw)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, release_finished=release_finished)
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
    # Exactly the real tokens of the rows still held: prompt without padding, plus all new tokens but the last.
    new = out.shape[1] - inputs["input_ids"].shape[1]
    prompt_lens = inputs["attention_mask"].sum(1).tolist()
    lens = cache.seq_lens()
    live = [row for row, n in enumerate(lens) if n is not None]
    assert live and all(lens[row] == prompt_lens[row] + new - 1 for row in live)
    stats = cache.memory_stats()
    assert stats.tokens_stored == sum(prompt_lens[row] + new - 1 for row in live)
    assert stats.blocks_in_use == sum(-(-lens[row] // stats.block_size) for row in live)
    assert stats.utilization == stats.tokens_stored / (stats.blocks_in_use * stats.block_size) > 0.5


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


@pytest.mark.parametrize("release_finished", [True, False])
def test_logits_equal_dynamic_when_a_row_ends_early(smollm, release_finished):
    """The new user's check: per-step logits and scores of a batch where one chat answer ends first."""
    model, tokenizer = smollm
    inputs = embedded.chat_batch(tokenizer, 2)
    kw = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_logits=True,
              output_scores=True)
    ref, out, _ = _pair(model, inputs, release_finished=release_finished, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert (ref.sequences[:, -1] == tokenizer.pad_token_id).any()  # one answer ended before the other
    for got, want in zip(out.logits + out.scores, ref.logits + ref.scores):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    transition = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    torch.testing.assert_close(transition, model.compute_transition_scores(ref.sequences, ref.scores,
                                                                           normalize_logits=True), rtol=1e-4, atol=1e-3)
