"""Prefix caching when generate() expands the batch (beams, returned sequences) on a prompt the pool already holds."""

from __future__ import annotations

import pytest
import torch

from helpers import dynamic, generate, tiny_model
from hf_paged import BlockPool, PagedCache, enable_paged_attention

BLOCK = 4
NEW = 6


def prompt(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (1, length), generator=g)


MODES = {
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3, top_k=0),
    "num_beams": dict(num_beams=3),
    "num_beams+num_return_sequences": dict(num_beams=3, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_expanded_batch_on_a_cached_prompt_matches_dynamic_cache(mode):
    """A batch of one prompt that an earlier call left in the pool's prefix cache, expanded by generate() into
    beams or returned sequences: the rows start from the cached blocks (hits counted), share them and one copy of
    the uncached rest, give DynamicCache's tokens, and every block goes back afterwards."""
    model = tiny_model("llama", seed=3)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=BLOCK, num_blocks=128, prefix_caching=True)
    first = prompt(17, seed=1)
    generate(model, {"input_ids": first}, PagedCache(model.config, pool=pool), max_new_tokens=2)

    ids = torch.cat([first, prompt(5, seed=2)], dim=1)  # 22 tokens: 16 of them cached (4 whole blocks)
    options = dict(MODES[mode], max_new_tokens=NEW)
    torch.manual_seed(7)
    expected = generate(model, {"input_ids": ids}, dynamic(model), **options)
    cache = PagedCache(model.config, pool=pool)
    peak_before = pool.allocator.peak_blocks_in_use
    pool.allocator.peak_blocks_in_use = pool.allocator.blocks_in_use
    torch.manual_seed(7)
    out = generate(model, {"input_ids": ids}, cache, **options)
    assert torch.equal(out, expected)
    assert cache.prefix_hits == expected_rows(options) * 16
    rows = expected_rows(options)
    prompt_blocks = -(-ids.shape[1] // BLOCK)
    own_blocks = -(-(ids.shape[1] + NEW) // BLOCK) - ids.shape[1] // BLOCK  # the partly filled block and beyond
    assert pool.allocator.peak_blocks_in_use <= prompt_blocks + rows * own_blocks, \
        "the rows should share the cached prefix and one copy of the rest of the prompt"
    pool.allocator.peak_blocks_in_use = max(peak_before, pool.allocator.peak_blocks_in_use)
    del cache
    assert pool.allocator.blocks_in_use == 0
    pool.allocator.check_invariants()


def expected_rows(options: dict) -> int:
    return max(options.get("num_beams", 1), options.get("num_return_sequences", 1))


def test_memory_stats_report_the_caches_own_lookup_beside_the_pools_total():
    """Two calls, each on a new cache on one prefix-caching pool: the second cache's figures give its own lookup
    and hits, the pool's the sum over both calls."""
    model = tiny_model("llama", seed=3)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=BLOCK, num_blocks=128, prefix_caching=True)
    ids = prompt(17, seed=1)
    first = PagedCache(model.config, pool=pool)
    generate(model, {"input_ids": ids}, first, max_new_tokens=2)
    second = PagedCache(model.config, pool=pool)
    generate(model, {"input_ids": torch.cat([ids, prompt(4, seed=2)], 1)}, second, max_new_tokens=2)
    a, b = first.memory_stats(), second.memory_stats()
    assert (a.cache_prefix_query_tokens, a.cache_prefix_hit_tokens) == (16, 0)
    assert (b.cache_prefix_query_tokens, b.cache_prefix_hit_tokens) == (20, 16)
    assert (b.prefix_query_tokens, b.prefix_hit_tokens) == (36, 16)  # the pool's, over both calls
