"""Block sharing: beams, parallel sampling, assisted decoding, prefix forks and shared pools."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from helpers import dynamic, generate, left_padded, live_blocks_expected, ones_mask, tiny_model
from hf_paged import BlockPool, OutOfBlocksError, PagedCache, compat, enable_paged_attention


@pytest.fixture
def model():
    return enable_paged_attention(tiny_model("llama", seed=2), backend="torch")


def _ref(m, inputs, **kw):
    return generate(m, inputs, dynamic(m), **kw)


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beam_search_matches_dynamic(model, num_beams):
    inputs = left_padded([5, 9])
    kw = dict(num_beams=num_beams, max_new_tokens=10, num_return_sequences=num_beams)
    expected = _ref(model, inputs, **kw)
    cache = PagedCache(model.config, block_size=4)
    assert torch.equal(generate(model, inputs, cache, **kw), expected)
    cache.pool.allocator.check_invariants()


def test_sampling_num_return_sequences_matches_dynamic(model):
    inputs = left_padded([6, 3])
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=10, top_k=30)
    torch.manual_seed(7)
    expected = _ref(model, inputs, **kw)
    torch.manual_seed(7)
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=4), **kw), expected)


def _watch_crops(cache) -> list[tuple[int, int, int]]:
    """Record (blocks in use before, after, blocks the rows' lengths need after) around each crop() of ``cache``."""
    seen, crop = [], cache.crop

    def watched(max_length):
        before = cache.pool.memory_stats().blocks_in_use
        crop(max_length)
        seen.append((before, cache.pool.memory_stats().blocks_in_use, live_blocks_expected(cache)))

    cache.crop = watched
    return seen


def _assert_crops_freed_blocks(crops):
    assert crops, "no crop() happened: the test needs rejected candidate tokens"
    for before, after, needed in crops:
        assert after == needed, (before, after, needed)  # emptied blocks went back to the pool at once
    assert any(after < before for before, after, _ in crops), crops  # some crop emptied whole blocks


def test_prompt_lookup_decoding_matches_dynamic(model):
    # A repetitive prompt so lookups hit and crop() has rejected tokens to drop.
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    inputs = ones_mask(ids)
    kw = dict(prompt_lookup_num_tokens=3, max_new_tokens=20)
    expected = _ref(model, inputs, **kw)
    cache = PagedCache(model.config, block_size=2)
    crops = _watch_crops(cache)
    assert torch.equal(generate(model, inputs, cache, **kw), expected)
    _assert_crops_freed_blocks(crops)
    assert cache.memory_stats().blocks_in_use == live_blocks_expected(cache)
    assert cache.seq_lens() == [expected.shape[1] - 1]
    cache.pool.allocator.check_invariants()


def test_assisted_decoding_matches_dynamic(model):
    assistant = tiny_model("llama", seed=9, num_hidden_layers=1)
    inputs = left_padded([8])
    kw = dict(assistant_model=assistant, max_new_tokens=12)
    expected = _ref(model, inputs, **kw)
    cache = PagedCache(model.config, block_size=1)
    crops = _watch_crops(cache)
    assert torch.equal(generate(model, inputs, cache, **kw), expected)
    _assert_crops_freed_blocks(crops)
    assert cache.memory_stats().blocks_in_use == live_blocks_expected(cache) == expected.shape[1] - 1
    cache.pool.allocator.check_invariants()


@pytest.mark.parametrize("mode", ["beams", "samples"])
def test_sliding_window_with_beams_and_sampling(mode):
    """Mistral's window on the torch backend with shared rows: same tokens, blocks outside the window returned."""
    window, new = 6, 24
    m = enable_paged_attention(tiny_model("mistral", seed=5, sliding_window=window), backend="torch")
    inputs = left_padded([9, 4], seed=3)
    kw = dict(max_new_tokens=new, min_new_tokens=new, num_return_sequences=2)
    kw.update(num_beams=2) if mode == "beams" else kw.update(do_sample=True, top_k=20)
    torch.manual_seed(0)
    expected = _ref(m, inputs, **kw)
    cache = PagedCache(m.config, block_size=2)
    torch.manual_seed(0)
    assert torch.equal(generate(m, inputs, cache, **kw), expected)
    stats = cache.memory_stats()
    rows = len(cache.seq_lens())
    assert stats.logical_tokens > rows * new  # every row went well past the window...
    assert stats.blocks_in_use <= rows * (window // 2 + 1)  # ...and holds only the blocks the window still sees
    cache.pool.allocator.check_invariants()


@pytest.mark.parametrize("mode", ["beams", "samples"])
def test_sharing_saves_memory_on_long_prompt(model, mode):
    prompt, new, width = 200, 64, 4
    inputs = left_padded([prompt])
    kw = dict(max_new_tokens=new, min_new_tokens=new)
    kw.update(num_beams=width, num_return_sequences=width) if mode == "beams" else kw.update(
        do_sample=True, num_return_sequences=width)
    torch.manual_seed(0)
    expected = _ref(model, inputs, **kw)
    cache = PagedCache(model.config, block_size=16)
    torch.manual_seed(0)
    assert torch.equal(generate(model, inputs, cache, **kw), expected)
    unshared = width * math.ceil((prompt + new - 1) / 16)
    ratio = cache.memory_stats().peak_blocks_in_use / unshared
    assert ratio <= 0.6, ratio


def test_prompt_shared_once_across_returned_sequences(model):
    cache = PagedCache(model.config, block_size=4, release_finished=False)
    generate(model, left_padded([16]), cache, do_sample=True, num_return_sequences=4, max_new_tokens=1)
    stats = cache.memory_stats()
    assert stats.logical_tokens == 4 * 16
    assert stats.tokens_stored == 16 and stats.blocks_in_use == 4


def test_fork_prefix_reuse_without_copy(model):
    prefix = left_padded([21], seed=1)  # block 4: the last prefix block is partly filled, so forks must copy it
    base = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(**prefix, **{compat.FORWARD_CACHE_KWARG: base})
    before = base.memory_stats().blocks_in_use
    forks = [base.fork() for _ in range(2)]  # several forks alive at once
    assert base.memory_stats().blocks_in_use == before  # nothing copied
    assert all(f.block_tables() == base.block_tables() for f in forks)

    def turn(cache, ref_cache, ids, new=6):
        got = generate(model, ones_mask(ids), cache, max_new_tokens=new)
        want = generate(model, ones_mask(ids), ref_cache, max_new_tokens=new)
        assert torch.equal(got, want)
        return got

    refs = [dynamic(model) for _ in forks]
    with torch.no_grad():
        for ref in refs:
            model(**prefix, **{compat.FORWARD_CACHE_KWARG: ref})
    # Each fork writes into the shared, partly filled last block's positions; then the base writes there too.
    outs = [turn(f, r, torch.cat([prefix["input_ids"], torch.tensor([s])], 1))
            for f, r, s in zip(forks, refs, ([11, 12, 13], [40, 41]))]
    base_ref = dynamic(model)
    with torch.no_grad():
        model(**prefix, **{compat.FORWARD_CACHE_KWARG: base_ref})
    turn(base, base_ref, torch.cat([prefix["input_ids"], torch.tensor([[60, 61, 62, 63]])], 1))
    # Every cache still reads its own tokens: the forks continue after the base wrote.
    for fork, ref, out in zip(forks, refs, outs):
        turn(fork, ref, torch.cat([out, torch.tensor([[7, 8]])], 1))
    # The prefix's full blocks are still shared by the base and both forks; the partly filled one was copied.
    full = 21 // 4
    tables = [c.block_tables()[0] for c in (base, *forks)]
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({t[full] for t in tables}) == 3
    assert base.pool.memory_stats().blocks_in_use == sum(live_blocks_expected(c) for c in (base, *forks)) - 2 * full
    base.pool.allocator.check_invariants()


def test_fork_batch_of_prompts_sharing_a_prefix(model):
    prefix = left_padded([12], seed=4)
    base = PagedCache(model.config, block_size=4)
    generate(model, prefix, base, max_new_tokens=1)
    seen = base.get_seq_length()
    prefix_ids = prefix["input_ids"]
    # Suffixes of different lengths, padded *after* the prefix (the mask marks the gap).
    s1, s2 = [20, 21, 22, 23], [30]
    ids = torch.zeros(2, seen + 4, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, :seen] = torch.cat([prefix_ids, torch.zeros(1, seen - prefix_ids.shape[1], dtype=torch.long)], 1)
    full = generate(model, prefix, dynamic(model), max_new_tokens=1)
    ids[:, :seen] = full[:, :seen]
    mask[:, :seen] = 1
    ids[0, seen:] = torch.tensor(s1)
    mask[0, seen:] = 1
    ids[1, -1:] = torch.tensor(s2)
    mask[1, -1:] = 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    forked = base.fork(batch_size=2)
    out = generate(model, inputs, forked, max_new_tokens=6)
    for row, suffix in enumerate([s1, s2]):
        alone = torch.cat([full[:, :seen], torch.tensor([suffix])], 1)
        ref = _ref(model, {"input_ids": alone, "attention_mask": torch.ones_like(alone)}, max_new_tokens=6)
        assert out[row, -6:].tolist() == ref[0, -6:].tolist()


def test_shared_pool_many_caches_across_threads(model):
    pool = BlockPool(block_size=4)
    prompts = [left_padded([3 + i, 7], seed=i) for i in range(4)]
    expected = [_ref(model, p, max_new_tokens=8) for p in prompts]
    results, errors = [None] * 4, []

    def work(i):
        try:
            results[i] = generate(model, prompts[i], PagedCache(model.config, pool=pool), max_new_tokens=8)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for got, want in zip(results, expected):
        assert torch.equal(got, want)
    pool.allocator.check_invariants()


def test_shared_pool_stats_cover_all_caches(model):
    pool = BlockPool(block_size=4)
    a, b = PagedCache(model.config, pool=pool), PagedCache(model.config, pool=pool)
    generate(model, left_padded([5]), a, max_new_tokens=4)
    generate(model, left_padded([9]), b, max_new_tokens=4)
    assert pool.memory_stats().blocks_in_use == a.memory_stats().blocks_in_use + b.memory_stats().blocks_in_use
    a.reset()
    assert pool.memory_stats().blocks_in_use == b.memory_stats().blocks_in_use
    b.reset()
    assert pool.memory_stats().blocks_in_use == 0


def test_out_of_blocks_leaves_pool_consistent(model):
    pool = BlockPool(block_size=4, num_blocks=6)
    other = PagedCache(model.config, pool=pool)
    generate(model, left_padded([6]), other, max_new_tokens=2)  # 7 tokens -> 2 blocks
    used = pool.allocator.blocks_in_use
    cache = PagedCache(model.config, pool=pool)
    with pytest.raises(OutOfBlocksError, match=r"needed \d+ blocks.*\d+ of 6 free"):
        generate(model, left_padded([10, 12]), cache, max_new_tokens=20)
    # Nothing leaked, the other user is intact, and the failed cache can be reset and reused.
    cache.reset()
    assert pool.allocator.blocks_in_use == used
    pool.allocator.check_invariants()
    out = generate(model, left_padded([3]), cache, max_new_tokens=2)
    assert torch.equal(out, _ref(model, left_padded([3]), max_new_tokens=2))


def test_max_memory_caps_the_pool(model):
    cache = PagedCache(model.config, block_size=4, max_memory="40KiB")
    # 2 layers x 2 (K, V) x 4 tokens x 2 kv heads x 16 dims x 4 bytes = 2 KiB per block -> 20 blocks
    generate(model, left_padded([5]), cache, max_new_tokens=3)
    stats = cache.memory_stats()
    assert stats.bytes_per_block == 2 * 1024
    assert stats.max_blocks in (19, 20)  # the core may keep one of the 20 as its scratch block
    assert stats.bytes_reserved <= 40 * 1024
    with pytest.raises(OutOfBlocksError):
        generate(model, left_padded([200]), PagedCache(model.config, block_size=4, max_memory="40KiB"),
                 max_new_tokens=3)
