"""The continuous-batching engine on MLA models: every request's greedy tokens equal the same request alone through
``model.generate()`` with a ``DynamicCache``, under a token budget that forces chunked prefill (each chunk attends
to the paged latent of the earlier ones), a pool that forces preemption, and prefix-cache hits on latent blocks.

Tie rule (helpers/engine_oracle.py): a differing token is accepted only where the lone run's top-2 logits are closer
than 1e-4; after it the continuations are not compared. The test prints how many were accepted.
"""

from __future__ import annotations


import pytest

from helpers import VOCAB
from helpers.engine_oracle import TieCount, check_tokens, drive, random_prompts, reference
from helpers.engine_shadow import one_thread
from helpers.mla import MLA_TYPES, tiny_mla_model
from hf_paged import BlockPool, RequestStatus, enable_paged_attention, init_continuous_batching

BLOCK = 4
TIES = TieCount()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_engine_equals_generate_alone(model_type):
    """Chunked prefill, preemption and prefix hits together on one MLA model."""
    model = enable_paged_attention(tiny_mla_model(model_type, seed=5), backend="torch")
    shared = [random_prompts(1, VOCAB, (10, 10), 60)[0]]
    prompts = random_prompts(10, VOCAB, (4, 24), seed=9, shared=shared)
    specs = [(f"{model_type}{i}", p, 4 + i % 7) for i, p in enumerate(prompts)]
    pool = BlockPool(block_size=BLOCK, num_blocks=24, prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=12)
    core = manager._core
    chunks = []
    reqs = drive(core, specs, seed=3, chunks=chunks)
    for rid, prompt, new in specs:
        req = reqs[rid]
        assert req.status == RequestStatus.FINISHED, (rid, req.status, req.error)
        check_tokens(rid, req.generated, reference(model, prompt, new), TIES)
    counters = core.scheduler.counters
    assert counters.preemptions > 0
    assert counters.prefix_hit_tokens > 0
    assert any(start > 0 and start + n <= prompt_len for _, start, n, prompt_len in chunks)  # a later chunk of a prompt
    assert pool.allocator.blocks_in_use == 0
    pool.allocator.check_invariants()
    assert pool.key_caches[0].shape[2:] == (1, model.config.kv_lora_rank)
    print(f"\n{model_type}: ties accepted {len(TIES.ties)} of {TIES.requests} requests")


def test_engine_on_the_triton_backend_equals_torch():
    """The engine's packed steps (chunks and decodes together) through the Triton MLA kernel (the interpreter on
    CPU) give the torch backend's tokens."""
    prompts = random_prompts(3, VOCAB, (5, 14), seed=21)
    specs = [(f"t{i}", p, 5) for i, p in enumerate(prompts)]
    tokens = {}
    for backend in ("torch", "triton"):
        model = enable_paged_attention(tiny_mla_model("deepseek_v3", seed=7), backend=backend)
        manager = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=32),
                                           max_batch_tokens=8)
        reqs = drive(manager._core, specs, seed=1)
        tokens[backend] = {rid: reqs[rid].generated for rid, _, _ in specs}
    assert tokens["triton"] == tokens["torch"]
