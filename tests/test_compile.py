"""Compiled decoding: ``generate(compile_config=...)`` with a fixed-size PagedCache.

Compilation is slow on the 2-core machine, so most cases use dynamo with the ``"eager"`` backend (it traces the
whole forward, which is what graph breaks, guards and recompiles are about) and one small case runs inductor.
Every case starts from ``torch._dynamo.reset()``.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation import CompileConfig

from helpers import PAD, dynamic, early_eos_model, forward, generate, left_padded, tiny_model
from hf_paged import BlockPool, PagedCache, enable_paged_attention

# Measured: the first call compiles 2 graphs (the first decode step; again at the first shape change, after which
# dynamo compiles the changing dimensions as dynamic) and the later calls, with other prompt lengths and
# max_new_tokens, reuse them. One spare graph is allowed.
MAX_UNIQUE_GRAPHS = 3
NUM_BLOCKS = 64


def compile_config(backend: str = "eager") -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)  # fullgraph: a graph break is an error
    config._compile_all_devices = True  # compile on CPU too
    return config


def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def pool_tensors(cache) -> list[torch.Tensor]:
    pool = cache.pool
    return [*pool.key_caches.values(), *pool.value_caches.values()]


class StepProbe(StoppingCriteria):
    """Runs after every step, outside the compiled region: records the pool's addresses and whether the decode
    step's metadata tensors are the cache's stable step buffers."""

    def __init__(self, cache):
        self.cache = cache
        self.pool_ptrs: list[tuple[int, ...]] = []
        self.decode_reads_buffers: list[bool] = []
        self.widths: list[tuple[int, int, int]] = []  # per decode layer: table width, mask width, plan blocks

    def __call__(self, input_ids, scores, **kwargs):
        self.pool_ptrs.append(tuple(t.data_ptr() for t in pool_tensors(self.cache)))
        step = self.cache.last_step
        if step is not None and step.query_len == 1:
            buffers = list(self.cache.step_buffers.staged().values())
            for layer in step.layers:
                g, meta = layer.group, layer.group.attention
                # the torch backend's plan too, mask included: its presence and shapes depend on the bucket alone
                (part,) = meta.plan.parts
                read = (g.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, part.tables, part.mask)
                self.decode_reads_buffers.append(all(any(t is b for b in buffers) for t in read))
                self.widths.append((meta.block_tables.shape[1], part.mask.shape[-1], part.tables.shape[0]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.fixture(scope="module")
def greedy_calls():
    """Three compiled greedy generate() calls on one model (batch of 3, other prompt lengths and max_new_tokens each;
    in the first, row 0 ends at its third token and its blocks are released mid-generation), then an eager manual
    decoding loop continuing the last cache, then the last cache dropped. Records what the tests check."""
    fresh_dynamo()
    model, first_inputs = early_eos_model()
    # (the last call's rows run 33 tokens without ending, for the manual loop)
    calls = [(first_inputs, 14), (left_padded([3, 17, 8], seed=3), 20), (left_padded([12, 2, 5], seed=11), 30)]
    expected = [generate(model, inputs, dynamic(model), max_new_tokens=n) for inputs, n in calls]
    extra = 3  # manual decoding steps after the last call
    last_inputs, last_n = calls[-1]
    expected_longer = generate(model, last_inputs, dynamic(model), max_new_tokens=last_n + extra)
    enable_paged_attention(model, backend="torch")
    record = {"tokens": [], "expected": expected, "graphs": [], "probes": [], "released": [], "static": [],
              "widths": []}
    for inputs, n in calls:
        cache = PagedCache(model.config, num_blocks=NUM_BLOCKS)
        probe = StepProbe(cache)
        out = generate(model, inputs, cache, max_new_tokens=n, compile_config=compile_config(),
                       stopping_criteria=StoppingCriteriaList([probe]))
        record["tokens"].append(out)
        record["graphs"].append(unique_graphs())
        record["probes"].append((probe.pool_ptrs, probe.decode_reads_buffers))
        record["widths"].append(probe.widths)
        record["released"].append(cache.seq_lens())
        record["static"].append({
            "pool": [getattr(t, "_dynamo_static_input_type", None) for t in pool_tensors(cache)],
            "buffers": [getattr(t, "_dynamo_static_input_type", None) for t in cache.step_buffers.staged().values()],
        })
        del probe
    record["graph_breaks"] = dict(counters["graph_break"])
    record["model"] = model

    # The last cache, continued by hand: one token a step, eagerly, left-padded rows at their own positions.
    mask = torch.cat([last_inputs["attention_mask"], torch.ones(3, last_n, dtype=torch.long)], 1)
    ids = out
    for _ in range(extra):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        logits = forward(model, ids[:, -1:], cache, attention_mask=mask,
                         position_ids=mask.sum(-1, keepdim=True) - 1).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    record["manual"], record["manual_expected"] = ids, expected_longer
    record["graphs_after_manual"] = unique_graphs()

    cache_ref, pool_ref = weakref.ref(cache), weakref.ref(pool_tensors(cache)[0])
    del cache
    gc.collect()
    record["collected"] = (cache_ref() is None, pool_ref() is None)
    yield record
    fresh_dynamo()


@pytest.mark.parametrize("call", [0, 1, 2])
def test_compiled_greedy_equals_dynamic_cache(greedy_calls, call):
    assert torch.equal(greedy_calls["tokens"][call], greedy_calls["expected"][call])


def test_compiled_greedy_has_no_graph_breaks_and_bounded_graphs(greedy_calls):
    assert greedy_calls["graph_breaks"] == {}
    graphs = greedy_calls["graphs"]
    print("unique graphs after each call:", graphs)
    assert graphs[0] >= 1, "generate() did not compile the decoding forward"
    assert graphs[-1] <= MAX_UNIQUE_GRAPHS
    assert graphs[2] - graphs[1] <= 1, "the third call, with other lengths, should reuse the graphs"


def test_compiled_run_released_a_finished_row(greedy_calls):
    """Row 0 of the first call ended early: its blocks went back while the compiled steps went on."""
    released = greedy_calls["released"][0]
    assert released[0] is None and None not in released[1:]
    assert greedy_calls["tokens"][0][0, -1].item() == PAD


def test_pool_and_step_buffers_are_static_and_stay_put(greedy_calls):
    for static in greedy_calls["static"]:
        assert static["pool"] and all(s is not None for s in static["pool"])
        assert static["buffers"] and all(s is not None for s in static["buffers"])
    for pool_ptrs, decode_reads_buffers in greedy_calls["probes"]:
        assert len(pool_ptrs) > 5 and len(set(pool_ptrs)) == 1, "the KV pool was reallocated between steps"
        assert decode_reads_buffers and all(decode_reads_buffers), "a decode step read metadata outside the buffers"


def test_compiled_decode_steps_keep_their_inputs_and_bucket_the_tables(greedy_calls):
    """A compiled decode step's inputs are the same every step (the torch plan always carries its mask: a plan
    without one would be another graph) and the block tables' width is a power of two, so shapes change only with
    the bucket, or block by block for the plan (a dimension dynamo then compiles as dynamic)."""
    block_size = PagedCache(greedy_calls["model"].config).pool.block_size
    for widths in greedy_calls["widths"]:
        assert widths
        for width, mask_width, plan_blocks in widths:
            assert width & (width - 1) == 0
            assert mask_width % block_size == 0 and plan_blocks == 3 * (mask_width // block_size) <= 3 * width


def test_manual_eager_loop_after_compiled_generate(greedy_calls):
    assert torch.equal(greedy_calls["manual"], greedy_calls["manual_expected"])
    assert greedy_calls["graphs_after_manual"] == greedy_calls["graphs"][-1], "the manual forwards were compiled"


def test_compiled_cache_is_collected_after_del(greedy_calls):
    assert greedy_calls["collected"] == (True, True)


def test_compiled_sampling_with_returned_sequences_mistral():
    """Seeded sampling, two returned sequences per prompt (shared prompt blocks, copy-on-write) and a sliding window."""
    fresh_dynamo()
    model = tiny_model("mistral", sliding_window=6, num_hidden_layers=1)
    model.generation_config.eos_token_id = None
    inputs = left_padded([4, 9], seed=2)
    kw = dict(do_sample=True, top_k=0, num_return_sequences=2, max_new_tokens=14)
    torch.manual_seed(7)
    expected = generate(model, inputs, dynamic(model), **kw)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=4, num_blocks=NUM_BLOCKS)
    torch.manual_seed(7)
    out = generate(model, inputs, cache, compile_config=compile_config(), **kw)
    assert unique_graphs() >= 1 and counters["graph_break"] == {}
    assert torch.equal(out, expected)
    assert max(len([b for b in t if b >= 0]) for t in cache.block_tables()) <= 3  # window 6, block 4
    fresh_dynamo()


def test_beam_search_with_compile_config():
    """transformers 5.24 runs beam search's forward uncompiled even with a compile config; tokens must hold."""
    fresh_dynamo()
    model = tiny_model("llama", seed=2, num_hidden_layers=1)
    inputs = left_padded([7, 4], seed=5)
    kw = dict(num_beams=2, max_new_tokens=8)
    expected = generate(model, inputs, dynamic(model), **kw)
    enable_paged_attention(model, backend="torch")
    out = generate(model, inputs, PagedCache(model.config, num_blocks=NUM_BLOCKS), compile_config=compile_config(),
                   **kw)
    assert torch.equal(out, expected)
    assert counters["graph_break"] == {}
    fresh_dynamo()


def test_unbounded_pool_with_compile_config_warns_and_runs_eagerly():
    fresh_dynamo()
    model = tiny_model("llama", num_hidden_layers=1)
    inputs = left_padded([5, 8])
    expected = generate(model, inputs, dynamic(model), max_new_tokens=6)
    enable_paged_attention(model, backend="torch")
    with pytest.warns(UserWarning, match="fixed size"):
        out = generate(model, inputs, PagedCache(model.config), max_new_tokens=6, compile_config=compile_config())
    assert torch.equal(out, expected)
    assert unique_graphs() == 0
    fresh_dynamo()


def test_eager_cache_is_collected_after_del():
    model = tiny_model("llama", num_hidden_layers=1)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config)
    generate(model, left_padded([5, 8]), cache, max_new_tokens=4)
    cache_ref, pool_ref = weakref.ref(cache), weakref.ref(pool_tensors(cache)[0])
    del cache
    gc.collect()
    assert cache_ref() is None and pool_ref() is None


def test_step_buffers_go_back_to_the_pool_for_the_next_cache():
    """What lets recorded CUDA graphs replay for the next call on a shared pool: a collected cache's step buffers go
    to the next cache on the same pool; caches alive at once never share them."""
    fresh_dynamo()
    model = tiny_model("llama", num_hidden_layers=1)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(num_blocks=NUM_BLOCKS)
    first = PagedCache(model.config, pool=pool)
    generate(model, left_padded([5, 8]), first, max_new_tokens=4, compile_config=compile_config())
    buffers = first.step_buffers
    assert buffers.staged(), "the compiled decode steps staged nothing"
    addresses = {k: t.data_ptr() for k, t in buffers.staged().items()}
    other = PagedCache(model.config, pool=pool)
    assert other.step_buffers is not buffers  # both alive: their own buffers
    del first
    gc.collect()
    second = PagedCache(model.config, pool=pool)
    assert second.step_buffers is buffers
    generate(model, left_padded([5, 8]), second, max_new_tokens=4, compile_config=compile_config())
    assert {k: t.data_ptr() for k, t in second.step_buffers.staged().items()} == addresses
    del other, second
    fresh_dynamo()


def test_reenabling_keeps_the_attention_function_and_mask_sizes_follow_the_bucket():
    """Re-enabling paged attention registers the very same attention function (so compiled graphs, which guard on
    it, stay valid), and a compiled decode step's mask width is the block tables' bucket, not the exact length."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_paged import disable_paged_attention
    from hf_paged.attention import GenerateCall

    model = tiny_model("llama", num_hidden_layers=1)
    enable_paged_attention(model, backend="torch")
    name = model.config._attn_implementation
    function = ALL_ATTENTION_FUNCTIONS[name]
    disable_paged_attention(model)
    enable_paged_attention(model, backend="torch")
    assert ALL_ATTENTION_FUNCTIONS[name] is function

    cache = PagedCache(model.config, num_blocks=NUM_BLOCKS)  # block size 16
    model(torch.randint(3, 90, (1, 40)), cache=cache)
    assert cache.get_mask_sizes(1) == (41, 0)  # eager: the exact length
    cache.begin_call(GenerateCall(backend="torch", release=True, compile=True))
    assert cache.get_mask_sizes(1) == (64, 0)  # 3 blocks -> a bucket of 4
    assert cache.get_mask_sizes(5) == (45, 0)  # not a decode step
    model(torch.randint(3, 90, (1, 24)), cache=cache)
    assert cache.get_seq_length() == 64
    assert cache.get_mask_sizes(1) == (128, 0)
    cache.end_call()


def test_inductor_compiled_decode_step():
    """The one real compile (inductor, CPU): tokens equal, no graph break, and the cache is collected afterwards."""
    fresh_dynamo()
    model = tiny_model("llama", num_hidden_layers=1)
    inputs = left_padded([7, 4], seed=5)
    expected = generate(model, inputs, dynamic(model), max_new_tokens=2)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, num_blocks=8)
    out = generate(model, inputs, cache, max_new_tokens=2, compile_config=compile_config("inductor"))
    assert unique_graphs() == 1 and counters["graph_break"] == {}
    assert torch.equal(out, expected)
    cache_ref, pool_ref = weakref.ref(cache), weakref.ref(pool_tensors(cache)[0])
    del cache
    gc.collect()
    assert cache_ref() is None and pool_ref() is None
    fresh_dynamo()
