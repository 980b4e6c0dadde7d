"""Exhaustion, bad input and a threaded soak on one shared pool: clear errors, no leaks, no corruption."""

from __future__ import annotations

import contextlib
import random
import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from helpers import dynamic, generate, left_padded, ones_mask, tiny_config, tiny_model
from hf_paged import BlockPool, OutOfBlocksError, PagedCache, compat, enable_paged_attention
from hf_paged.compat import running_cache


@pytest.fixture
def model():
    return enable_paged_attention(tiny_model("llama", seed=4), backend="torch")


class _Snapshot(StoppingCriteria):
    """After every step: the cache's block tables, lengths and columns, i.e. its state before the next step."""

    def __init__(self, cache):
        self.cache, self.states = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        c = self.cache
        self.states.append((c.block_tables(), c.seq_lens(), c.get_seq_length()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_exhaustion_mid_generation_then_reset_and_reuse(model):
    pool = BlockPool(block_size=4, num_blocks=10)
    neighbour = PagedCache(model.config, pool=pool)
    neighbour_inputs = left_padded([5], seed=1)
    generate(model, neighbour_inputs, neighbour, max_new_tokens=3)  # 7 tokens -> 2 blocks, kept
    neighbour_blocks = pool.memory_stats().blocks_in_use
    neighbour_tables = neighbour.block_tables()
    assert neighbour_blocks == 2

    cache = PagedCache(model.config, pool=pool)
    inputs = left_padded([6, 6], seed=2)  # prefill fits (4 blocks); decoding needs more than the 8 left
    snapshot = _Snapshot(cache)
    with pytest.raises(OutOfBlocksError) as err:
        generate(model, inputs, cache, max_new_tokens=40, min_new_tokens=40,
                 stopping_criteria=StoppingCriteriaList([snapshot]))
    message = str(err.value)
    assert "free" in message and "max_new_tokens=40" in message and err.value.fix in message
    assert err.value.needed > err.value.free
    # The advice is the shared pool's constructor (the cache was built with pool=), sized for the whole request
    # (2 rows x ceil((6 + 40 - 1) / 4) blocks) beside what the neighbour holds.
    assert err.value.request_needed == 2 * 12
    assert err.value.fix == "BlockPool(block_size=4, num_blocks=26)"
    assert running_cache() is None  # the forward's hook state was unwound (transformers < 5.24 uses it)
    # It failed while decoding: the prefill and several decoding steps completed first.
    assert len(snapshot.states) >= 2
    tables, lens, columns = snapshot.states[-1]
    assert lens[0] > 6 and lens[1] > 6 and columns > 6
    # The failed step changed nothing: same tables, lengths and columns as after the last good step.
    assert cache.block_tables() == tables and cache.seq_lens() == lens and cache.get_seq_length() == columns
    # Every block is accounted for: the neighbour's, the failed cache's, and the free ones the error reported.
    stats = pool.memory_stats()
    assert stats.blocks_in_use == neighbour_blocks + cache.memory_stats().blocks_in_use
    assert cache.memory_stats().blocks_in_use == sum(-(-n // 4) for n in lens)
    assert f"keeps the {cache.memory_stats().blocks_in_use} blocks" in message and "cache.reset()" in message
    assert err.value.free == 10 - stats.blocks_in_use
    assert neighbour.block_tables() == neighbour_tables
    pool.allocator.check_invariants()

    # reset() gives all of the failed cache's blocks back.
    cache.reset()
    assert pool.memory_stats().blocks_in_use == neighbour_blocks
    # The neighbour is intact: it continues exactly like a DynamicCache would.
    ref_cache = dynamic(model)
    ref = generate(model, neighbour_inputs, ref_cache, max_new_tokens=3)
    turn2 = torch.cat([ref, torch.tensor([[9, 10]])], 1)
    # The advised pool fits the request that failed.
    roomy = PagedCache(model.config, pool=eval(err.value.fix, {"BlockPool": BlockPool}))
    generate(model, inputs, roomy, max_new_tokens=40, min_new_tokens=40)
    turn2 = {"input_ids": turn2, "attention_mask": torch.ones_like(turn2)}
    assert torch.equal(generate(model, turn2, neighbour, max_new_tokens=4),
                       generate(model, turn2, ref_cache, max_new_tokens=4))
    # The failed cache is reusable after reset().
    small = left_padded([4, 3], seed=3)
    assert torch.equal(generate(model, small, cache, max_new_tokens=4), generate(model, small, dynamic(model), max_new_tokens=4))


def test_prefill_that_cannot_fit_changes_nothing(model):
    cache = PagedCache(model.config, block_size=4, num_blocks=3)
    with pytest.raises(OutOfBlocksError, match=r"needed 4 blocks of 4 tokens, 3 of 3 free"):
        generate(model, left_padded([16]), cache, max_new_tokens=2)
    assert cache.pool.memory_stats().blocks_in_use == 0 and cache.memory_stats().num_sequences == 0
    assert cache.get_seq_length() == 0 and cache.batch_size == -1
    out = generate(model, left_padded([5]), cache, max_new_tokens=2)
    assert torch.equal(out, generate(model, left_padded([5]), dynamic(model), max_new_tokens=2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(block_size=2.5), "block_size must be a positive int"),
        (dict(num_blocks=0), "num_blocks must be a positive int"),
        (dict(num_blocks=-3), "num_blocks must be a positive int"),
        (dict(max_memory="lots"), "write it like '2GiB'"),
        (dict(max_memory=-5), "max_memory must be positive"),
        (dict(num_blocks=4, max_memory="1GiB"), "not both"),
    ],
)
def test_invalid_sizing_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedCache(tiny_config(), **kwargs)


def test_max_memory_too_small_for_one_block(model):
    """A cap below one block of the model's shape is refused when the cache is built, with the minimum."""
    with pytest.raises(ValueError, match="holds no block"):
        PagedCache(model.config, max_memory=100)
    with pytest.raises(ValueError, match="holds no block"):
        PagedCache(model.config, max_memory=2 * 16 * 2 * 16 * 2)  # one fp16 block of one layer: not all layers


def test_cache_from_another_model_shape_is_rejected(model):
    cache = PagedCache(model.config, block_size=4)
    out = generate(model, left_padded([4]), cache, max_new_tokens=2)
    other = enable_paged_attention(tiny_model("llama", num_key_value_heads=4), backend="torch")
    more = torch.cat([out, torch.randint(3, 90, (1, 3))], dim=1)  # the cache's own tokens, continued
    with pytest.raises(ValueError, match="different model, dtype or device"):
        generate(other, ones_mask(more), cache, max_new_tokens=2)


def test_cache_in_another_dtype_is_rejected(model):
    cache = PagedCache(model.config, block_size=4)
    out = generate(model, left_padded([4]), cache, max_new_tokens=2)
    half = enable_paged_attention(tiny_model("llama", seed=4).to(torch.bfloat16), backend="torch")
    more = torch.cat([out, torch.randint(3, 90, (1, 3))], dim=1)  # the cache's own tokens, continued
    with pytest.raises(ValueError, match=r"torch.float32.*torch.bfloat16"):
        generate(half, ones_mask(more), cache, max_new_tokens=2)


def test_cache_config_with_fewer_layers_is_rejected(model):
    cache = PagedCache(tiny_config(num_hidden_layers=1), block_size=4)
    with pytest.raises(ValueError, match="1 layers"):
        generate(model, left_padded([4]), cache, max_new_tokens=2)


def test_reuse_with_another_batch_size_is_rejected_then_reset_works(model):
    cache = PagedCache(model.config, block_size=4)
    generate(model, left_padded([4, 5]), cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="holds 2 rows but the model got a batch of 3"):
        generate(model, left_padded([8, 9, 10]), cache, max_new_tokens=2)
    cache.pool.allocator.check_invariants()
    cache.reset()
    three = left_padded([4, 5, 6])
    assert torch.equal(generate(model, three, cache, max_new_tokens=3), generate(model, three, dynamic(model), max_new_tokens=3))


def test_switching_paged_mode_midway_is_rejected(model):
    cache = PagedCache(model.config, block_size=4)
    generate(model, left_padded([4]), cache, max_new_tokens=2)
    plain = tiny_model("llama", seed=4)
    with pytest.raises(RuntimeError, match="enable_paged_attention"):
        with torch.no_grad():
            plain(input_ids=torch.tensor([[5]]), **{compat.FORWARD_CACHE_KWARG: cache})


def test_enable_with_bad_backend(model):
    with pytest.raises(ValueError, match="backend must be one of"):
        enable_paged_attention(model, backend="cuda")


def _strategy(rng: random.Random):
    name = rng.choice(["greedy", "sample", "beams", "lookup", "returns"])
    new = rng.randint(1, 10)
    if name == "lookup":
        return name, 1, dict(prompt_lookup_num_tokens=2, max_new_tokens=new)
    batch = rng.randint(1, 3)
    if name == "sample":
        return name, batch, dict(do_sample=True, top_k=10, max_new_tokens=new)
    if name == "beams":
        return name, batch, dict(num_beams=rng.choice([2, 3]), max_new_tokens=new)
    if name == "returns":
        return name, batch, dict(do_sample=True, num_return_sequences=2, max_new_tokens=new)
    return name, batch, dict(max_new_tokens=new)


def test_soak_threads_on_one_pool():
    """Hundreds of generate() calls on one shared pool, four threads, random strategies: all equal DynamicCache."""
    model = enable_paged_attention(tiny_model("llama", seed=6, num_hidden_layers=1), backend="torch")
    pool = BlockPool(block_size=4)
    # torch's RNG is global and generate() draws from it even when greedy, so a seeded sampling pair runs alone;
    # every other call runs concurrently with the rest.
    rng_lock = _SharedExclusiveLock()
    failures = []
    done = [0] * 4  # calls finished, one counter per thread
    count_lock, calls, reserved = threading.Lock(), [0], {}

    def worker(tid: int, n: int):
        rng = random.Random(tid)
        for i in range(n):
            name, batch, kw = _strategy(rng)
            inputs = left_padded([rng.randint(1, 12) for _ in range(batch)], seed=tid * 1000 + i)
            seed = rng.randint(0, 2**31)
            try:
                with rng_lock.exclusive() if kw.get("do_sample") else rng_lock.shared():
                    torch.manual_seed(seed)
                    want = generate(model, inputs, dynamic(model), **kw)
                    torch.manual_seed(seed)
                    cache = PagedCache(model.config, pool=pool)
                    got = generate(model, inputs, cache, **kw)
                stats = cache.memory_stats()
                cache.reset()
                if not torch.equal(got, want):
                    failures.append((tid, i, name))
                if not (stats.blocks_in_use > 0 and 0 < stats.utilization <= 1
                        and stats.utilization == stats.tokens_stored / (stats.blocks_in_use * 4)
                        and stats.tokens_stored <= stats.logical_tokens):
                    failures.append((tid, i, name, stats))
            except Exception as exc:  # pragma: no cover - reported by the assertion below
                failures.append((tid, i, name, repr(exc)))
            done[tid] += 1
            with count_lock:
                calls[0] += 1
                if calls[0] == 100:
                    reserved["half"] = pool.bytes_reserved()

    threads = [threading.Thread(target=worker, args=(t, 50)) for t in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert done == [50] * 4 and calls[0] == 200
    assert not failures, failures[:5]
    end = pool.memory_stats()
    assert end.blocks_in_use == 0 and end.tokens_stored == 0 and end.utilization == 1.0
    pool.allocator.check_invariants()
    # Memory is flat: the pool stopped growing once it was large enough for the concurrent peak.
    assert pool.bytes_reserved() <= 2 * reserved["half"]


class _SharedExclusiveLock:
    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def test_second_model_on_the_same_config_object_still_generates():
    """Two models built on one config object: enable_paged_attention on one changes the attention name both read; the
    other (never enabled) still computes what it did, through its family's own attention, with or without a cache."""
    from transformers import DynamicCache, LlamaForCausalLM

    config = tiny_config("llama", attn_implementation="eager")
    torch.manual_seed(0)
    plain, paged = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    paged.load_state_dict(plain.state_dict())
    inputs = left_padded([5, 9])
    before = generate(plain, inputs, DynamicCache(), max_new_tokens=6)
    enable_paged_attention(paged, backend="torch")
    assert plain.config._attn_implementation == paged.config._attn_implementation  # one object: both renamed
    assert torch.equal(generate(plain, inputs, DynamicCache(), max_new_tokens=6), before)
    assert torch.equal(generate(paged, inputs, PagedCache(paged.config), max_new_tokens=6), before)
