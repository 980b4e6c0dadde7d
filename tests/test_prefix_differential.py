"""Randomised differential runs over shared prefix-caching pools.

Many ``generate()`` configurations (greedy, sampled, beams, returned sequences, beams with returned sequences;
batches of one to three prompts that share leading tokens with earlier prompts; then prompt-lookup and assisted
decoding, which feed their first forward the whole sequence) run one after the other on two
capped prefix-caching pools, so later prompts start from blocks earlier ones left cached and the pools keep evicting.
Each call is compared token for token with ``DynamicCache``; after each, the allocator's invariants hold and no block
is held. The configurations are drawn once from a fixed seed; the last test checks the run really hit cached prefixes
and evicted blocks.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from helpers import PAD, VOCAB, dynamic, generate, tiny_model

from hf_paged import BlockPool, PagedCache, enable_paged_attention

NUM_CASES = 36
POOLS = {4: 20, 8: 12}  # block_size -> num_blocks: room for the largest call (14 / 9 blocks), not for what is cached
STEM_LEN = 20


def _cases() -> list[dict]:
    rng = random.Random(2026)
    g = torch.Generator().manual_seed(2026)
    stems = [torch.randint(3, VOCAB, (STEM_LEN,), generator=g).tolist() for _ in range(3)]
    cases = []
    for i in range(NUM_CASES):
        mode = rng.choice(["greedy", "greedy", "sample", "returns", "beams", "beams_returns"])
        expand = {"returns": rng.choice([2, 3]), "beams": rng.choice([2, 3]), "beams_returns": 2}.get(mode, 1)
        batch = rng.choice([1, 1, 2, 3] if expand == 1 else [1, 1, 2][: 3 if expand == 2 else 2])
        same_length = rng.random() < 0.5  # rows of one length have no padding: only then can they start from cache
        stem, keep, tail = rng.choice(stems), rng.randint(0, STEM_LEN), rng.randint(1, 6)
        rows = []
        for _ in range(batch):
            if not same_length:
                stem, keep, tail = rng.choice(stems), rng.randint(0, STEM_LEN), rng.randint(1, 6)
            rows.append(stem[:keep] + [rng.randint(3, VOCAB - 1) for _ in range(tail)])
        kw = {"max_new_tokens": rng.randint(1, 4)}
        if mode == "sample":
            kw.update(do_sample=True, top_k=20)
        elif mode == "returns":
            kw.update(do_sample=True, top_k=20, num_return_sequences=expand)
        elif mode == "beams":
            kw.update(num_beams=expand)
        elif mode == "beams_returns":
            kw.update(num_beams=expand, num_return_sequences=expand)
        block_size = rng.choice(sorted(POOLS))
        cases.append(dict(id=f"{i:02d}-{mode}-b{batch}-bs{block_size}", rows=rows, kw=kw, block_size=block_size,
                          seed=rng.randint(0, 2**31)))
    return cases


def _assisted_cases() -> list[dict]:
    """Prompt-lookup and assisted decoding (batches of one), drawn apart from the cases above so theirs stay the same.
    Each prompt repeats a stretch of itself, so the lookup finds candidates."""
    rng = random.Random(2027)
    g = torch.Generator().manual_seed(2027)
    stems = [torch.randint(3, VOCAB, (STEM_LEN,), generator=g).tolist() for _ in range(3)]
    cases = []
    for i in range(NUM_ASSISTED_CASES):
        mode = rng.choice(["lookup", "lookup", "lookup_sample", "assisted"])
        stem, keep = rng.choice(stems), rng.randint(4, STEM_LEN)
        start = rng.randint(0, keep - 3)
        row = stem[:keep] + [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 4))] + stem[start:start + 4]
        kw = {"max_new_tokens": rng.randint(3, 8)}
        if mode.startswith("lookup"):
            kw["prompt_lookup_num_tokens"] = rng.choice([2, 5])
        if mode == "lookup_sample":
            kw.update(do_sample=True, top_k=20)
        block_size = rng.choice(sorted(POOLS))
        cases.append(dict(id=f"{i:02d}-{mode}-bs{block_size}", rows=[row], kw=kw, block_size=block_size,
                          seed=rng.randint(0, 2**31), release_finished=rng.random() < 0.5))
    return cases


NUM_ASSISTED_CASES = 16
CASES = _cases() + _assisted_cases()


def _left_padded(rows: list[list[int]]) -> dict:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _starts_from_cached_prefix(pool: BlockPool, inputs: dict, model) -> bool:
    """Whether every row finds cached whole blocks within the columns all rows hold real tokens in, short of the last
    (what lets a new PagedCache on the pool skip them), under the model's weights fingerprint (their keys' root)."""
    limit = inputs["input_ids"].shape[1] - 1
    padded = inputs["attention_mask"][:, :limit] == 0
    if bool(padded.any()):
        limit = int(padded.any(0).nonzero()[0])
    root = pool.weights_root(model)
    return all(pool.allocator.match_prefix(row[:limit], root=root) for row in inputs["input_ids"].tolist())


@pytest.fixture(scope="module")
def model():
    return enable_paged_attention(tiny_model("llama", seed=3, num_hidden_layers=1), backend="torch")


@pytest.fixture(scope="module")
def assistant():
    return tiny_model("llama", seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def run():
    """The shared pools and what the cases saw on them."""
    return {"pools": {bs: BlockPool(block_size=bs, num_blocks=n, prefix_caching=True) for bs, n in POOLS.items()},
            "ran": set(), "hit_tokens": 0, "expanded_hits": 0, "assisted_hits": 0}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_generate_on_a_shared_prefix_caching_pool_matches_dynamic(model, assistant, run, case):
    pool = run["pools"][case["block_size"]]
    run["ran"].add(case["id"])
    inputs = _left_padded(case["rows"])
    kw = dict(case["kw"], **({"assistant_model": assistant} if "assisted" in case["id"] else {}))
    expanded = kw.get("num_beams", 1) > 1 or kw.get("num_return_sequences", 1) > 1
    cached = _starts_from_cached_prefix(pool, inputs, model)
    if expanded and cached:
        run["expanded_hits"] += 1
    torch.manual_seed(case["seed"])
    want = generate(model, inputs, dynamic(model), **kw)
    hits_before = pool.memory_stats().prefix_hit_tokens
    torch.manual_seed(case["seed"])
    cache = PagedCache(model.config, pool=pool, release_finished=case.get("release_finished", True))
    error = None
    try:
        got = generate(model, inputs, cache, **kw)
    except Exception as err:
        error = err.with_traceback(None)  # the traceback's frames would keep the cache alive
    del cache
    gc.collect()
    pool.allocator.check_invariants()
    assert pool.allocator.blocks_in_use == 0, "a block is still held after the cache was dropped"
    if error is not None:
        raise error
    hits = pool.memory_stats().prefix_hit_tokens - hits_before
    run["hit_tokens"] += hits
    run["assisted_hits"] += hits if "prompt_lookup_num_tokens" in kw or "assistant_model" in kw else 0
    if not expanded:
        assert (hits > 0) == cached, "rows with cached leading blocks start from them; others compute every token"
    assert torch.equal(got, want)


def test_the_run_hit_cached_prefixes_and_evicted_blocks(run):
    """The configurations above exercised what they are for: prefix hits, expanded batches and assisted modes on
    cached prefixes, and evictions on both pools."""
    if len(run["ran"]) < len(CASES):
        pytest.skip("only meaningful after the whole module's cases ran")
    assert run["hit_tokens"] > 0 and run["expanded_hits"] > 0 and run["assisted_hits"] > 0
    assert all(pool.allocator.evictions > 0 for pool in run["pools"].values())
