"""Compiled decoding across batch sizes: how many graphs dynamo compiles, pinned, and the pool a compiled call takes.

Dynamo (eager backend, as most of test_compile.py) compiles the first decode step, then once more the first time a
size it saw fixed changes (the block tables' power-of-two width, the batch size), after which that size is dynamic.
"""

from __future__ import annotations

import pytest
import torch
from helpers import dynamic, generate, left_padded, tiny_model

from hf_paged import BlockPool, PagedCache, enable_paged_attention
from test_compile import compile_config, fresh_dynamo, unique_graphs

BATCHES = [4, 2, 4]


def graphs_over_batches(dynamic_shapes: bool | None) -> list[int]:
    """Unique graphs after each of three compiled generate() calls with batches of 4, 2, 4 (a new preallocated pool
    each: other addresses, same shapes), each call's tokens checked against DynamicCache."""
    fresh_dynamo()
    model = tiny_model("llama", num_hidden_layers=1)
    model.generation_config.eos_token_id = None
    calls = [left_padded([5 + 3 * r + i for r in range(batch)], seed=i) for i, batch in enumerate(BATCHES)]
    expected = [generate(model, inputs, dynamic(model), max_new_tokens=6) for inputs in calls]
    enable_paged_attention(model, backend="torch")
    config = compile_config()
    config.dynamic = dynamic_shapes
    graphs = []
    for inputs, want in zip(calls, expected):
        cache = PagedCache(model.config, pool=BlockPool(num_blocks=64, preallocate=True))
        assert torch.equal(generate(model, inputs, cache, max_new_tokens=6, compile_config=config), want)
        graphs.append(unique_graphs())
    fresh_dynamo()
    return graphs


def test_batch_4_2_4_compiles_one_more_graph_for_the_first_new_batch_size():
    """Default CompileConfig: 2 graphs in the first call (the first decode step; the tables' width going from 1 block
    to 2), one more when the batch first changes (the batch size becomes dynamic), none when it comes back."""
    assert graphs_over_batches(None) == [2, 3, 3]


def test_dynamic_compile_config_reuses_the_graphs_across_batch_sizes():
    """CompileConfig(dynamic=True): the batch size is dynamic from the start, so 4 -> 2 -> 4 adds no graph."""
    assert graphs_over_batches(True) == [2, 2, 2]


def test_compiled_generate_preallocates_a_capped_pool():
    """A capped pool grows on demand in eager use; a compiled generate() gives it its full size before the first
    step (test_compile.py checks that nothing moves afterwards)."""
    fresh_dynamo()
    model = enable_paged_attention(tiny_model("llama", num_hidden_layers=1), backend="torch")
    pool = BlockPool(block_size=4, num_blocks=64)
    generate(model, left_padded([3]), PagedCache(model.config, pool=pool), max_new_tokens=2)
    assert not pool.preallocated and pool.tensor_blocks < 65
    generate(model, left_padded([5, 9]), PagedCache(model.config, pool=pool), max_new_tokens=4,
             compile_config=compile_config())
    assert unique_graphs() >= 1
    assert pool.preallocated and all(k.shape[0] == 65 for k in pool.key_caches.values())
    fresh_dynamo()
