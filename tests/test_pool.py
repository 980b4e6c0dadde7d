"""BlockPool sizing: a cap bounds the memory and is reached on demand; preallocation; sizes checked when the pool is
built; the out-of-blocks error's figures and fix; memory figures of mixed-window caches."""

from __future__ import annotations

import pytest
import torch
from helpers import dynamic, generate, left_padded, tiny_model

from hf_paged import BlockPool, MemoryStats, OutOfBlocksError, PagedCache, enable_paged_attention, parse_memory

# tiny_model: 2 layers x 2 KV heads x 16 dims, fp32 -> K+V of one 4-token block = 2 x 2 x 4 x 2 x 16 x 4 bytes
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def paged_model():
    return enable_paged_attention(tiny_model("llama"), backend="torch")


def pool_ptrs(pool) -> list[int]:
    return [t.data_ptr() for t in (*pool.key_caches.values(), *pool.value_caches.values())]


@pytest.mark.parametrize("cap", [dict(num_blocks=40), dict(max_memory="40KiB")])
def test_capped_pool_grows_with_use_up_to_its_cap(model, paged_model, cap):
    """A capped pool's tensors follow the blocks in use (same tokens as DynamicCache) and never pass the cap; at the
    cap a step that does not fit raises instead of growing."""
    pool = BlockPool(block_size=4, **cap)
    limit = 41 * BLOCK_BYTES if "num_blocks" in cap else parse_memory(cap["max_memory"])
    reserved = []
    for length in (3, 9, 24, 40):
        inputs = left_padded([length, max(1, length // 3)], seed=length)
        cache = PagedCache(paged_model.config, pool=pool)
        out = generate(paged_model, inputs, cache, max_new_tokens=6)
        cache.reset()
        assert torch.equal(out, generate(model, inputs, dynamic(model), max_new_tokens=6))
        reserved.append(pool.bytes_reserved())
        assert pool.memory_stats().bytes_reserved == reserved[-1] <= limit
    print("bytes reserved after each call:", reserved, "cap:", limit)
    assert reserved == sorted(reserved) and reserved[0] <= limit // 4 < reserved[-1]
    assert pool.memory_stats().num_blocks == pool.allocator.capacity <= pool.allocator.max_blocks
    with pytest.raises(OutOfBlocksError):
        generate(paged_model, left_padded([200]), PagedCache(paged_model.config, pool=pool), max_new_tokens=2)
    assert pool.bytes_reserved() <= limit
    pool.allocator.check_invariants()


def test_preallocate_takes_the_full_size_once_and_keeps_the_contents(model, paged_model):
    """preallocate() grows the tensors to the cap once (a cache holding rows continues exactly); afterwards nothing
    moves. preallocate=True takes the full size at the first write."""
    pool = BlockPool(block_size=4, num_blocks=32)
    cache = PagedCache(paged_model.config, pool=pool, release_finished=False)
    inputs = left_padded([7, 3], seed=4)
    first = generate(paged_model, inputs, cache, max_new_tokens=4)
    assert pool.bytes_reserved() < 33 * BLOCK_BYTES and not pool.preallocated
    pool.preallocate()
    assert pool.preallocated and pool.bytes_reserved() == 33 * BLOCK_BYTES
    assert all(k.shape[0] == 33 for k in pool.key_caches.values())
    ptrs = pool_ptrs(pool)
    pool.preallocate()  # a second call does nothing
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)
    turn = {"input_ids": first, "attention_mask": mask}
    reference = dynamic(model)
    generate(model, inputs, reference, max_new_tokens=4)
    assert torch.equal(generate(paged_model, turn, cache, max_new_tokens=5),
                       generate(model, turn, reference, max_new_tokens=5))
    generate(paged_model, left_padded([20, 9], seed=5), PagedCache(paged_model.config, pool=pool), max_new_tokens=8)
    assert pool_ptrs(pool) == ptrs and pool.bytes_reserved() == 33 * BLOCK_BYTES

    eager = BlockPool(block_size=4, max_memory="16KiB", preallocate=True)
    generate(paged_model, left_padded([3]), PagedCache(paged_model.config, pool=eager), max_new_tokens=2)
    assert eager.allocator.max_blocks == 16 * 1024 // BLOCK_BYTES - 1
    assert eager.bytes_reserved() == (eager.allocator.max_blocks + 1) * BLOCK_BYTES <= 16 * 1024


def test_preallocate_needs_a_cap():
    with pytest.raises(ValueError, match=r"preallocate=True needs a cap.*num_blocks=N or max_memory="):
        BlockPool(preallocate=True)
    with pytest.raises(ValueError, match=r"without a cap cannot be preallocated"):
        BlockPool().preallocate()


def test_scratch_block_is_the_last_row_as_the_pool_grows(paged_model):
    pool = BlockPool(block_size=4, num_blocks=64)
    for length in (2, 30):
        generate(paged_model, left_padded([length]), PagedCache(paged_model.config, pool=pool), max_new_tokens=2)
        assert pool.scratch_block == pool.allocator.capacity == next(iter(pool.key_caches.values())).shape[0] - 1
    pool.preallocate()
    assert pool.scratch_block == 64 and pool.tensor_blocks == 65


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_a_grown_pool_keeps_its_tokens_and_holds_zeros_elsewhere(model, paged_model, monkeypatch, kv_dtype):
    """Growth copies the written blocks and zeroes the rest (fresh memory poisoned with NaN here: an unwritten slot
    read as NaN would turn masked attention scores into NaN); the tokens stay DynamicCache's."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0x7F)  # 0x7F: an fp8 NaN

    monkeypatch.setattr(torch, "empty", poisoned)
    pool = BlockPool(block_size=4, kv_dtype=kv_dtype)
    cache = PagedCache(paged_model.config, pool=pool, release_finished=False)
    inputs = left_padded([3, 13], seed=8)
    out = generate(paged_model, inputs, cache, max_new_tokens=12)
    monkeypatch.undo()
    grown = pool.allocator.capacity
    assert grown >= 8  # the pool grew several times during the call
    if kv_dtype is None:
        assert torch.equal(out, generate(model, inputs, dynamic(model), max_new_tokens=12))
    used = {b for row in cache.rows.live for seq in row.seqs for b in pool.allocator.block_table(seq) if b >= 0}
    unused = [b for b in range(grown + 1) if b not in used]
    for caches in (pool.key_caches, pool.value_caches, pool.k_scale_caches, pool.v_scale_caches):
        for t in caches.values():
            assert not t[unused].view(torch.uint8).any(), "a block no row holds is not all zeros"
            nan = t.isnan() if t.is_floating_point() else t == 0x7F
            assert not nan.any(), "poisoned memory survived the growth"


@pytest.mark.parametrize("max_memory, minimum", [(10, "64 bytes"), ("60B", "64 bytes")])
def test_max_memory_below_any_block_is_refused_at_construction(max_memory, minimum):
    with pytest.raises(ValueError, match=rf"holds no block of any model .*at least {minimum}"):
        BlockPool(max_memory=max_memory)
    with pytest.raises(ValueError, match=r"at least 64 bytes"):
        PagedCache(None, max_memory=max_memory)


def test_a_small_byte_count_suggests_the_unit():
    with pytest.raises(ValueError, match=r"did you mean max_memory='4GiB'\?"):
        BlockPool(max_memory=4)


def test_max_memory_below_one_block_of_the_shape_is_refused_with_the_minimum():
    """As soon as the shape is known (a caller that has the config, or the first layer's keys), with the numbers."""
    pool = BlockPool(max_memory="100KB")
    with pytest.raises(ValueError, match=r"K and V of 30 layers x 3 KV heads x 64, float32\): a block of 16 tokens "
                                         r"takes 737,280 bytes .*at least 1,474,560 bytes \(1.5MiB\)"):
        pool.check_memory_fits(3, 64, 30, torch.float32)
    with pytest.raises(ValueError, match=r"at least 737,280 bytes"):  # dtype unknown: checked at 2 bytes a value
        pool.check_memory_fits(3, 64, 30)
    BlockPool(max_memory="100KB", kv_dtype=torch.float8_e4m3fn).check_memory_fits(1, 64, 10)  # 21,120 x 2 fit

    pool = BlockPool(block_size=4, max_memory="8KiB")  # the first layer's keys [B, Hkv, S, D] give the shape
    with pytest.raises(ValueError, match=r"holds no block of this model .*takes 8,192 bytes .*at least 16,384 bytes"):
        pool.bind_layer(0, 2, torch.zeros(1, 2, 1, 64))
    assert pool.layer_shapes == {} and pool.allocator.max_blocks is None  # nothing recorded: a retry fails again
    with pytest.raises(ValueError, match=r"holds no block"):
        pool.bind_layer(0, 2, torch.zeros(1, 2, 1, 64))
    pool.bind_layer(0, 2, torch.zeros(1, 2, 1, 32))  # half the head size: one block and the scratch block fit
    assert pool.allocator.max_blocks == 1


def test_sizing_call_builds_a_pool_that_fits():
    """The call OutOfBlocksError suggests keeps the pool's settings and, run as written, gives the blocks asked."""
    pool = BlockPool(block_size=4, num_blocks=8, prefix_caching=True)
    assert pool.sizing_call(20) == "BlockPool(block_size=4, num_blocks=20, prefix_caching=True)"
    assert pool.sizing_call(20, cache=True) == (
        "PagedCache(model.config, block_size=4, num_blocks=20, prefix_caching=True)")
    fp8 = BlockPool(num_blocks=8, kv_dtype=torch.float8_e4m3fn, preallocate=True)
    assert fp8.sizing_call(9) == "BlockPool(num_blocks=9, kv_dtype=torch.float8_e4m3fn, preallocate=True)"

    by_bytes = BlockPool(block_size=4, max_memory="40KiB")
    by_bytes.bind_layer(0, 2, torch.zeros(1, 2, 1, 16))
    call = by_bytes.sizing_call(100)
    assert call.startswith("BlockPool(block_size=4, max_memory='") and call.endswith("')")
    bigger = eval(call, {"BlockPool": BlockPool, "torch": torch})
    bigger.bind_layer(0, 2, torch.zeros(1, 2, 1, 16))
    assert 100 <= bigger.allocator.max_blocks < 110


def test_out_of_blocks_error_figures_plurals_and_fix():
    err = OutOfBlocksError(1, 0, 16, 8)  # positional, as before
    assert "needed 1 block of 16 tokens, 0 of 8 free" in str(err) and "num_blocks" in str(err)
    assert (err.needed, err.free, err.block_size, err.capacity) == (1, 0, 16, 8)
    assert err.request_needed is None and err.fix is None
    err = OutOfBlocksError(needed=3, free=2, block_size=4, capacity=10, request_needed=25, max_new_tokens=64,
                           fix="BlockPool(block_size=4, num_blocks=25)")
    text = str(err)
    assert "needed 3 blocks of 4 tokens, 2 of 10 free" in text
    assert "The whole request holds up to 25 blocks at max_new_tokens=64" in text
    assert "To fit it: BlockPool(block_size=4, num_blocks=25)" in text and "max_memory='4GiB'" not in text
    assert "1 blocks" not in str(OutOfBlocksError(2, 1, 16, request_needed=1))


# ---------------------------------------------------------------------------------------------- mixed windows
def two_group_rows(block_size=4):
    """A pool with two rows in a full group (0) and a sliding group (1, keeps the blocks holding its last 4 tokens),
    as a mixed-window cache holds them: an 8-token prompt shared by both rows, 3 appends of 4 tokens; then the
    second row finishes and the first takes 2 more tokens."""
    pool = BlockPool(block_size=block_size)
    pool.bind_layer(0, 1, torch.zeros(1, 1, 1, 8))
    a = pool.allocator
    first = [a.new_sequence(group=g) for g in (0, 1)]
    a.append([(s, 8) for s in first])
    rows = [first, [a.fork(s) for s in first]]
    for _ in range(3):
        a.append([(row[g], 4) for row in rows for g in (0, 1)])
        for row in rows:
            a.release_outside_window(row[1], a.seq_len(row[1]) - block_size)
    a.free(rows[1][0])  # the second row finishes: its full-group blocks go back, peaks stay
    a.free(rows[1][1])
    row = rows[0]
    a.append([(row[0], 2), (row[1], 2)])  # 22 tokens: a partly filled last block
    a.release_outside_window(row[1], a.seq_len(row[1]) - block_size)
    return pool, [row]


def test_mixed_window_stats_count_the_whole_cache_once_with_group_detail():
    pool, rows = two_group_rows()
    a = pool.allocator
    stats = MemoryStats.for_rows(pool, rows, (None, 8))
    full, sliding = stats.groups
    assert (full.window, sliding.window) == (None, 8)
    assert full.tokens_stored == full.logical_tokens == 22 and sliding.tokens_stored == 4 + 2
    assert stats.logical_tokens == 22 and stats.tokens_stored == 22  # each token once, not 22 + 6
    assert stats.num_sequences == 1 == full.num_sequences == sliding.num_sequences
    assert stats.blocks_in_use == full.blocks_in_use + sliding.blocks_in_use == 6 + 2
    assert stats.bytes_in_use == 8 * stats.bytes_per_block
    assert stats.utilization == (22 + 6) / (8 * 4)
    # peaks: each group's own (full: the shared prompt's 2 blocks + 2 rows x 3; sliding: 2 rows x 2 before the
    # slid-out blocks went back), the top level the pool's (both groups at the third append: 8 + 4)
    assert full.peak_blocks_in_use == a.peak_by_group[0] == 8
    assert sliding.peak_blocks_in_use == a.peak_by_group[1] == 4
    assert stats.peak_blocks_in_use == a.peak_blocks_in_use == 12
    assert MemoryStats.for_rows(pool, rows, (None, 8), detail=False).groups == ()

    whole_pool = pool.memory_stats()  # the pool sees sequences, not rows: groups by the allocator's group tags
    assert (whole_pool.tokens_stored, whole_pool.logical_tokens, whole_pool.blocks_in_use,
            whole_pool.num_sequences) == (22, 22, 8, 1)


def test_single_group_stats_are_unchanged_by_the_group_logic():
    pool = BlockPool(block_size=4)
    pool.bind_layer(0, 1, torch.zeros(1, 1, 1, 8))
    a = pool.allocator
    rows = [[a.new_sequence()], [a.new_sequence()]]
    a.append([(rows[0][0], 5), (rows[1][0], 9)])
    stats = MemoryStats.for_rows(pool, rows, (None,))
    assert stats.groups == () and stats.window is None
    assert (stats.tokens_stored, stats.logical_tokens, stats.blocks_in_use, stats.num_sequences) == (14, 14, 5, 2)
    assert stats == pool.memory_stats()


def test_mixed_window_cache_stats_after_generate():
    """A Gemma3-style model (sliding and full layers) after generate(): the cache's top-level figures count each
    token once against the rows' logical tokens, and each group reports its own peak."""
    from helpers import tiny_family_model

    model = enable_paged_attention(tiny_family_model("gemma3_text"), backend="torch")  # window 8
    cache = PagedCache(model.config, block_size=4)
    generate(model, left_padded([3, 13], seed=1), cache, max_new_tokens=12)
    stats = cache.memory_stats()
    full, sliding = sorted(stats.groups, key=lambda g: g.window or 0)
    assert (full.window, sliding.window) == (None, 8) and stats.num_sequences == 2
    assert stats.logical_tokens == full.logical_tokens == sum(cache.seq_lens())
    assert stats.tokens_stored == full.tokens_stored <= stats.logical_tokens < full.tokens_stored + sliding.tokens_stored
    assert stats.blocks_in_use == full.blocks_in_use + sliding.blocks_in_use
    assert sliding.peak_blocks_in_use < full.peak_blocks_in_use <= stats.peak_blocks_in_use
    assert stats.peak_blocks_in_use == cache.pool.memory_stats().peak_blocks_in_use


def test_capped_pool_growing_between_a_plan_and_its_forward_keeps_the_write(model, paged_model):
    """Another cache on the pool (another thread, in a server) grows it after this cache's step was planned and
    before its forward ran: the step's K/V must land in the grown tensors, so the next steps still see them."""
    from helpers import forward

    pool = BlockPool(block_size=4, num_blocks=64)
    cache, reference = PagedCache(paged_model.config, pool=pool), dynamic(model)
    ids = left_padded([6], seed=8)["input_ids"]
    steps = []
    for step in range(4):
        if step == 1:  # plan this step, let another cache grow the pool, then run the planned forward
            cache.plan(ids[:, -1:], None, 1, 1, "torch", torch.float32)
            generate(paged_model, left_padded([40], seed=9), PagedCache(paged_model.config, pool=pool),
                     max_new_tokens=2)
        new = ids if step == 0 else ids[:, -1:]
        logits = forward(paged_model, new, cache).logits[:, -1]
        expected = forward(model, new, reference).logits[:, -1]
        steps.append(torch.allclose(logits, expected, atol=1e-5))
        ids = torch.cat([ids, expected.argmax(-1, keepdim=True)], 1)
    assert steps == [True] * 4
