"""End to end with the Triton kernels (CPU interpreter here): same greedy tokens as DynamicCache."""

from __future__ import annotations

import pytest
import torch
from conftest import dynamic, generate, left_padded, tiny_model

from hf_paged import PagedCache, enable_paged_attention, ops

pytestmark = pytest.mark.skipif(not ops.triton_available(), reason="triton is not importable here")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_triton_backend_generates_dynamic_cache_tokens(kind):
    model = tiny_model(kind, sliding_window=5) if kind == "mistral" else tiny_model(kind)
    inputs = left_padded([3, 9])
    expected = generate(model, inputs, dynamic(model), max_new_tokens=6)
    enable_paged_attention(model, backend="triton")
    cache = PagedCache(model.config, block_size=4)
    assert torch.equal(generate(model, inputs, cache, max_new_tokens=6), expected)
    assert cache._backend == "triton"


def test_triton_backend_beam_search_with_copy_on_write():
    model = tiny_model("llama", seed=2)
    inputs = left_padded([6])
    kw = dict(num_beams=2, num_return_sequences=2, max_new_tokens=4)
    expected = generate(model, inputs, dynamic(model), **kw)
    enable_paged_attention(model, backend="triton")
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=4), **kw), expected)


def test_triton_backend_extend_with_history():
    """A second turn and prompt-lookup verification run the prefill/extend kernel over cached history."""
    model = tiny_model("mistral", seed=3, sliding_window=7)
    first = left_padded([5])
    ref_cache = dynamic(model)
    ref = generate(model, first, ref_cache, max_new_tokens=3)
    turn2 = torch.cat([ref, torch.tensor([[7, 8, 9, 10, 11]])], 1)
    turn2 = {"input_ids": turn2, "attention_mask": torch.ones_like(turn2)}
    expected = generate(model, turn2, ref_cache, max_new_tokens=3)
    lookup = {"input_ids": torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])}
    lookup["attention_mask"] = torch.ones_like(lookup["input_ids"])
    expected_lookup = generate(model, lookup, dynamic(model), prompt_lookup_num_tokens=2, max_new_tokens=5)

    enable_paged_attention(model, backend="triton")
    cache = PagedCache(model.config, block_size=4)
    assert torch.equal(generate(model, first, cache, max_new_tokens=3), ref)
    assert torch.equal(generate(model, turn2, cache, max_new_tokens=3), expected)
    out = generate(model, lookup, PagedCache(model.config, block_size=4), prompt_lookup_num_tokens=2, max_new_tokens=5)
    assert torch.equal(out, expected_lookup)
