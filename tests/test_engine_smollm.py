"""The engine on the embedded SmolLM2 (the one real-model engine test): 16 chat requests, half sharing a system
prompt, through generate_batch: greedy tokens equal each request alone through generate() with a DynamicCache (8 of
them checked, to keep the test short), the shared system prompt is served from the prefix cache, and an fp8 pool's
tokens agree with full precision on >= 90% of the positions up to each request's first difference (printed;
each fp8 token is scaled by its own amax, and the exactness of the engine's fp8 path is pinned by
test_engine_models.py::test_request_alone_and_among_fifteen_others)."""

from __future__ import annotations

import pytest
import torch

from helpers import require_smollm, smollm
from helpers.engine_oracle import TieCount, check_tokens, reference
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, RequestStatus, disable_paged_attention, embedded, generate_batch

require_smollm()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


NEW_TOKENS = 10
CHECKED = 8  # requests compared with generate() alone (every other one shares the system prompt)


def chat_ids(tokenizer, prompt: str, system: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def agreement(full: list[list[int]], other: list[list[int]]) -> tuple[int, int, int]:
    """Positions equal before each sequence's first difference; the positions compared up to and including each first
    difference (all of an identical sequence); all positions of ``full``."""
    agree = compared = 0
    for a, b in zip(full, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree += first
        compared += len(a) if a == b else min(first + 1, len(a))
    return agree, compared, sum(len(a) for a in full)


def test_smollm_chat_requests_equal_generate_alone_and_fp8_agrees():
    model, tokenizer = smollm()
    prompts = [chat_ids(tokenizer, p, embedded.SYSTEM_PARAGRAPH if i % 2 else None)
               for i, p in enumerate((embedded.CHAT_PROMPTS * 2)[:16])]
    refs = [reference(model, p, NEW_TOKENS) for p in prompts[:CHECKED]]  # before the engine patches the model
    outs, stats = {}, {}
    try:
        for kv_dtype in (None, torch.float8_e4m3fn):
            pool = BlockPool(block_size=16, num_blocks=256, prefix_caching=True, kv_dtype=kv_dtype)
            outs[kv_dtype] = list(generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, pool=pool,
                                                 max_batch_tokens=256, progress_bar=False,
                                                 eos_token_id=tokenizer.eos_token_id).values())
            stats[kv_dtype] = pool.memory_stats()
    finally:
        disable_paged_attention(model)
    ties = TieCount()
    for i, (out, ref) in enumerate(zip(outs[None], refs)):
        assert out.status == RequestStatus.FINISHED, (i, out.error)
        check_tokens(f"smollm/{i}", out.generated_tokens, ref, ties)
    print(f"\nSmolLM2: {len(ties.ties)} tie(s) accepted of {ties.requests} requests")
    assert stats[None].prefix_hit_tokens > 0  # the system prompt's blocks, computed once
    full, fp8 = [o.generated_tokens for o in outs[None]], [o.generated_tokens for o in outs[torch.float8_e4m3fn]]
    agree, compared, total = agreement(full, fp8)
    print(f"fp8 pool: {agree}/{compared} = {agree / compared:.1%} of the positions up to each request's first "
          f"difference agree with full precision ({agree}/{total} = {agree / total:.1%} of all positions)")
    # The bound is on the positions up to and including each request's first difference: each request that flips
    # costs one position wherever its flip falls, so the figure moves little between CPUs. (The share of all
    # positions does not: one flip at token 2 drops the 8 after it. On this suite's prompts it was 94.7% on an
    # Intel Xeon and 74.8% on an AMD EPYC or on the Xeon with MKL/oneDNN/ATen held to AVX2, while this measure was
    # 97.9% and 96.6%.) A wrong scale or block gives garbage at the first token of nearly every request (< 10%).
    assert agree >= 0.9 * compared
