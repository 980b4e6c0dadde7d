"""Families taken generically (no ModelPatch): every one the suite verifies gives DynamicCache's greedy tokens in
generate() and in the engine; Llama 4's chunked layers attend within their chunk and give back finished chunks'
blocks; Gemma 4's full layers keep K/V of their own shape, and the pool's accounting equals the tensors it holds;
Gemma 4's KV-shared layers hold nothing and read their source layer's blocks, with queries cut to logits_to_keep;
what hf_paged cannot page (latent attention, state layers, attention arguments it does not implement) is refused by
name, in generate() and the engine; further transformers families give DynamicCache's tokens or a
named refusal, never another exception.

Where a float tie flips a greedy token in the engine, tests/helpers/engine_oracle.py's rule applies (top-2 logits
closer than 1e-4).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from helpers import (
    EOS, GENERIC_FAMILIES, LLAMA4_CHUNK, PAD, TINY_SHAPE, VOCAB, forward, generate, left_padded, tiny_family_config,
    tiny_family_model,
)
from helpers.attention import attention_float64, on_backend, scrambled_case
from helpers.engine_oracle import TieCount, check_tokens, drive, random_prompts, reference
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, PagedCache, RequestStatus, enable_paged_attention, init_continuous_batching, patches
from hf_paged import ops
from hf_paged.cache_state import GenerateCall
from hf_paged.groups import LayerGroups
from hf_paged.ops.reference import paged_attention_torch

BLOCK = 4
LENGTHS = [3, 27, 11]
GENERIC = [m for m in patches.GENERIC_VERIFIED if patches.generic_patch(m) is not None]
TIES = TieCount()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def test_generic_verified_list_matches_the_configs_tested_here():
    assert sorted(patches.GENERIC_VERIFIED) == sorted(GENERIC_FAMILIES)
    assert not set(patches.GENERIC_VERIFIED) & set(patches.supported_model_types())  # taken without a ModelPatch


@pytest.mark.parametrize("model_type", GENERIC)
def test_generic_family_matches_dynamic_cache(model_type):
    """Left-padded greedy batch, beams with returned sequences, and a second turn on the same cache."""
    _matches_dynamic_cache(tiny_family_model(model_type, seed=1), model_type)


def _matches_dynamic_cache(model, model_type: str):
    inputs = left_padded(LENGTHS, seed=1)
    runs = {"greedy": dict(max_new_tokens=10), "beams": dict(max_new_tokens=6, num_beams=2, num_return_sequences=2)}
    expected = {name: generate(model, inputs, DynamicCache(config=model.config), **kw) for name, kw in runs.items()}
    dyn = DynamicCache(config=model.config)
    first = generate(model, inputs, dyn, max_new_tokens=5)
    second_inputs = {"input_ids": torch.cat([first, torch.full((3, 2), 7)], 1),
                     "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(3, first.shape[1] -
                                                                                         inputs["input_ids"].shape[1] + 2,
                                                                                         dtype=torch.long)], 1)}
    expected_second = generate(model, second_inputs, dyn, max_new_tokens=5)

    enable_paged_attention(model, backend="torch")
    for name, kw in runs.items():
        got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), **kw)
        assert torch.equal(got, expected[name]), f"{model_type} {name}: tokens differ from DynamicCache"
    cache = PagedCache(model.config, block_size=BLOCK, release_finished=False)
    assert torch.equal(generate(model, inputs, cache, max_new_tokens=5), first)
    assert torch.equal(generate(model, second_inputs, cache, max_new_tokens=5), expected_second), \
        f"{model_type}: second turn differs"


@pytest.mark.parametrize("model_type", GENERIC)
def test_generic_family_engine_equals_generate_alone(model_type):
    """A budget that forces chunked prefill and a pool that forces preemption; each request's tokens equal the
    request alone through generate() with a DynamicCache."""
    model = enable_paged_attention(tiny_family_model(model_type, seed=2), backend="torch")
    prompts = random_prompts(6, VOCAB, (12, 30), seed=11)
    specs = [(f"{model_type}{i}", p, 6 + i % 5) for i, p in enumerate(prompts)]
    groups = LayerGroups.from_geometry(patches.kv_geometry(model.config))
    pool = BlockPool(block_size=BLOCK, num_blocks=10 * groups.num_groups)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=16)
    core = manager._core
    reqs = drive(core, specs, seed=5, steps_between=0)
    for rid, prompt, new in specs:
        req = reqs[rid]
        assert req.status == RequestStatus.FINISHED, (rid, req.status, req.error)
        check_tokens(f"{model_type}/{rid}", req.generated, reference(model, prompt, new), TIES)
    assert core.scheduler.counters.preemptions > 0
    assert pool.allocator.blocks_in_use == 0


def test_llama4_chunks_change_the_tokens_and_finished_chunks_go_back():
    """The chunk bound is real (without it the tokens differ), and a row's chunked layers hold only the blocks of its
    current chunk: earlier ones went back to the pool (-1 in the table) while the full layer keeps every block."""
    inputs = left_padded(LENGTHS, seed=1)
    chunked = tiny_family_model("llama4_text", seed=1)
    unchunked = tiny_family_model("llama4_text", seed=1, attention_chunk_size=None,
                                  layer_types=["full_attention"] * 4)
    assert not torch.equal(generate(chunked, inputs, DynamicCache(config=chunked.config)),
                           generate(unchunked, inputs, DynamicCache(config=unchunked.config)))
    geometry = patches.kv_geometry(chunked.config)
    assert [layer.kind for layer in geometry.layers] == ["chunked"] * 3 + ["full"]
    assert {layer.chunk for layer in geometry.layers[:3]} == {LLAMA4_CHUNK}
    enable_paged_attention(chunked, backend="torch")
    cache = PagedCache(chunked.config, block_size=BLOCK, release_finished=False)
    generate(chunked, inputs, cache, max_new_tokens=10)
    g_chunked = cache.groups.layer_group[0]
    g_full = cache.groups.layer_group[3]
    lens = cache.seq_lens()
    for row, length in enumerate(lens):
        table = cache.block_tables(g_chunked)[row]
        # the last query (position length - 1) sees from its chunk's start: blocks wholly before it went back
        keep_from = (length - 1) // LLAMA4_CHUNK * LLAMA4_CHUNK
        assert [b for b in table[: keep_from // BLOCK] if b >= 0] == [], (row, table)
        assert all(b >= 0 for b in table[keep_from // BLOCK:])
        assert all(b >= 0 for b in cache.block_tables(g_full)[row])


def test_llama4_triton_backend_matches_torch():
    """The Triton kernels (interpreted on CPU) apply the same chunk bound as the torch reference."""
    pytest.importorskip("triton")
    model = tiny_family_model("llama4_text", seed=1)
    inputs = left_padded([3, 19], seed=2)
    enable_paged_attention(model, backend="torch")
    expected = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=6)
    enable_paged_attention(model, backend="triton")
    got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=6)
    assert torch.equal(got, expected)


def test_gemma4_layer_shapes_and_accounting():
    """Gemma 4's full layers (head size 32, one KV head, K = V) get tensors of their own shape in their own slots; the
    pool's per-block figure from the geometry equals the bytes of the tensors it allocated."""
    model = tiny_family_model("gemma4_text", seed=1)
    geometry = patches.kv_geometry(model.config)
    shapes = {(layer.kind, layer.shape) for layer in geometry.layers}
    assert shapes == {("sliding", (2, 16, 16)), ("full", (1, 32, 32))}
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    generate(model, left_padded(LENGTHS, seed=1), cache, max_new_tokens=4)
    pool = cache.pool
    for i, layer in enumerate(geometry.layers):
        k, v = pool.layer_kv(i)
        assert k.shape[2:] == (layer.num_kv_heads, layer.key_dim) and v.shape[2:] == (layer.num_kv_heads,
                                                                                      layer.value_dim)
    per_block = pool.block_id_bytes([s for _, s in cache.groups.tensor_shapes], torch.float32)
    assert per_block == pool.bytes_per_block_id()
    allocated = sum(t.numel() * t.element_size() for t in (*pool.key_caches.values(), *pool.value_caches.values()))
    assert allocated == pool.bytes_reserved() == pool.tensor_blocks * per_block
    assert cache.memory_stats().bytes_reserved == allocated


def test_max_memory_sizing_uses_every_layers_shape():
    """A max_memory pool for Gemma 4 is capped from the per-layer shapes, the engine's the same as the cache's."""
    model = enable_paged_attention(tiny_family_model("gemma4_text", seed=1), backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK, max_memory="64KiB")
    generate(model, left_padded([5], seed=1), cache, max_new_tokens=2)
    per_block = cache.pool.block_id_bytes([s for _, s in cache.groups.tensor_shapes], torch.float32)
    assert cache.pool.allocator.max_blocks == 64 * 1024 // per_block - 1
    pool = BlockPool(block_size=BLOCK, max_memory="64KiB")
    init_continuous_batching(model, pool=pool)
    assert pool.allocator.max_blocks == cache.pool.allocator.max_blocks


REFUSALS = {
    # MLA families without a latent attention of their own (the others are paged: tests/test_mla.py)
    "longcat_flash": ("latent attention", dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                               qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, moe_topk=2,
                                               expert_ffn_hidden_size=32, ffn_hidden_size=64, num_layers=2)),
    # hybrid families (state layers) are paged in generate() and refused by the engine: tests/test_hybrid_states.py
}


@pytest.mark.parametrize("model_type", list(REFUSALS))
def test_named_refusals_in_generate_and_engine(model_type):
    words, overrides = REFUSALS[model_type]
    config = tiny_family_config(model_type, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="hf_paged cannot page") as err:
        enable_paged_attention(model)
    assert words in str(err.value) and "layer" in str(err.value)
    with pytest.raises(ValueError, match="hf_paged cannot page"):
        init_continuous_batching(model)


def test_unknown_attention_argument_is_refused_by_name():
    """An attention argument that changes attention and the paged path does not implement (ALiBi slopes) is
    refused, naming the layer and the argument."""
    model = enable_paged_attention(tiny_family_model("glm4", seed=0), backend="torch")
    name = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[name]

    def extra(module, query, key, value, attention_mask, **kwargs):
        return original(module, query, key, value, attention_mask, alibi_slopes=torch.ones(4), **kwargs)

    AttentionInterface.register("hf_paged_test_extra", extra)
    ALL_MASK_ATTENTION_FUNCTIONS.register("hf_paged_test_extra", ALL_MASK_ATTENTION_FUNCTIONS[name])
    model.config._attn_implementation = "hf_paged_test_extra"
    with pytest.raises(ValueError, match=r"layer 0 .*alibi_slopes"):
        generate(model, left_padded([4], seed=0), PagedCache(model.config, block_size=BLOCK), max_new_tokens=2)


# Further families transformers ships, named nowhere above: DynamicCache's tokens or a named refusal.
SWEEP = ["qwen2_moe", "olmoe", "granitemoe", "phimoe", "helium", "nemotron", "hunyuan_v1_moe", "dots1",
         "minimax", "gpt_neox", "bitnet", "falcon", "persimmon", "exaone", "deepseek_v2", "lfm2", "falcon_h1",
         "granitemoehybrid", "nemotron_h", "bamba"]


@pytest.mark.parametrize("model_type", SWEEP)
def test_further_families_match_or_are_refused_by_name(model_type):
    try:
        config = AutoConfig.for_model(model_type, **{**TINY_SHAPE, "head_dim": 16, "num_local_experts": 2,
                                                     "num_experts": 2, "n_routed_experts": 2,
                                                     "num_experts_per_tok": 1, "moe_intermediate_size": 32})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    except Exception as err:  # the family cannot be built from the tiny shape: nothing of hf_paged's to test
        pytest.skip(f"{model_type}: tiny config does not build ({type(err).__name__})")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    inputs = left_padded([3, 9], seed=1)
    try:
        expected = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=6)
    except Exception as err:  # transformers' own cache cannot run the tiny config: no reference to compare with
        pytest.skip(f"{model_type}: DynamicCache reference fails ({type(err).__name__})")
    try:
        enable_paged_attention(model, backend="torch")
        got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=6)
    except ValueError as err:
        assert "hf_paged cannot page" in str(err) or "layer" in str(err), f"{model_type}: unnamed refusal {err}"
        return
    assert torch.equal(got, expected), f"{model_type}: taken generically but tokens differ from DynamicCache"


def test_models_command_lists_verified_and_generic_families():
    out = subprocess.run([sys.executable, "-m", "hf_paged", "models"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for model_type in [*patches.GENERIC_VERIFIED, "llama", "gemma2"]:
        assert model_type in out.stdout
    assert "generically" in out.stdout and "refused" in out.stdout


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("window", [None, 6])
def test_chunk_bound_matches_float64(backend, window):
    """Chunked attention in both backends (scrambled block tables; decode rows, a fresh prompt and a chunk over a
    history crossing chunk boundaries; with and without a window as well) against the float64 oracle. Bound: float32
    kernels agree with float64 to 1e-4 (the sums here are of at most 60 terms of size ~1)."""
    if backend == "triton":
        pytest.importorskip("triton")
        run = ops._triton_kernels().paged_attention_triton
    else:
        run = paged_attention_torch
    case = scrambled_case([50, 33, 17, 60, 9], [1, 1, 17, 13, 9], num_kv_heads=2, group=2, head_dim=32,
                          block_size=8, dtype=torch.float32, seed=3, window=window)
    case["chunk"] = 12
    expected = attention_float64(**case)
    got = on_backend(run, case, max_query_len=17, max_seq_len=64).double()
    assert (got - expected).abs().max() < 1e-4
    unchunked = attention_float64(**{**case, "chunk": None})
    assert (unchunked - expected).abs().max() > 1e-2  # the chunk bound changes the result


# Gemma 4 with KV-shared layers: the last two layers read the K/V of the last earlier layer of their type (layer 3 ->
# sliding layer 1, layer 4 -> full layer 2), and the model slices their queries to logits_to_keep.
SHARED_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA4_SHARED = dict(num_hidden_layers=5, num_kv_shared_layers=2, layer_types=SHARED_TYPES)
GEMMA4_SHARED_FULL = dict(num_hidden_layers=4, num_kv_shared_layers=2, layer_types=["full_attention"] * 4)


def test_gemma4_kv_sharing_geometry():
    config = tiny_family_config("gemma4_text", **GEMMA4_SHARED)
    geometry = patches.kv_geometry(config)
    assert [(layer.kind, layer.source) for layer in geometry.layers[3:]] == [("reuse", 1), ("reuse", 2)]
    groups = LayerGroups.from_geometry(geometry)
    assert groups.layer_group[3:] == (-1, -1) and [groups.source_of(i) for i in range(5)] == [0, 1, 2, 1, 2]
    assert groups.window_of(3) == groups.window_of(1) is not None and groups.window_of(4) is None
    assert "kv_sharing" in patches.required_features(config)


def test_kv_sharing_default_configs_are_accepted():
    """The released shapes share K/V (Gemma 3n: 15 of 35 layers): taken, on the paged path and in gathered mode."""
    for config in (AutoConfig.for_model("gemma3n_text"), tiny_family_config("gemma4_text", **GEMMA4_SHARED)):
        assert "reuse" in patches.kv_geometry(config).kinds()
        for paged in (True, False):
            patches.check_supported(config, paged=paged)


def test_gemma4_kv_sharing_matches_dynamic_cache():
    """Left-padded greedy batch (the reuse layers' queries cut to the last token of the prompt), beams with returned
    sequences, a second turn on the same cache (a continuation prefill, cut too), sampling with a seed; and gathered
    mode (no enable_paged_attention: the source layer's update returns the whole history, which the reuse layers
    read as the model hands it)."""
    model = tiny_family_model("gemma4_text", seed=1, **GEMMA4_SHARED)
    inputs = left_padded(LENGTHS, seed=1)
    sample = dict(do_sample=True, top_k=20, max_new_tokens=8)
    torch.manual_seed(5)
    expected = generate(model, inputs, DynamicCache(config=model.config), **sample)
    greedy = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=6)
    with pytest.warns(UserWarning, match="without enable_paged_attention"):  # gathered mode: the model's attention
        assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=6),
                           greedy)
    _matches_dynamic_cache(model, "gemma4_text shared")
    torch.manual_seed(5)
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=BLOCK), **sample), expected)


def test_gemma4_kv_sharing_compiled_decoding_runs_eagerly():
    """compile_config on a model with reuse layers: a warning, an eager run (the cache is not compileable), and
    DynamicCache's tokens."""
    model = tiny_family_model("gemma4_text", seed=1, **GEMMA4_SHARED)
    inputs = left_padded([5, 2], seed=1)
    expected = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK, num_blocks=32)
    with pytest.warns(UserWarning, match="KV-shared layers"):
        got = generate(model, inputs, cache, max_new_tokens=4, compile_config=CompileConfig())
    assert torch.equal(got, expected)
    for config, shares in ((model.config, True), (tiny_family_config("gemma4_text"), False)):
        fixed = PagedCache(config, block_size=BLOCK, num_blocks=32)
        fixed.begin_call(GenerateCall(backend="torch", release=True, compile=True))  # a call that would compile
        assert fixed.shares_kv is shares and fixed.is_compileable is not shares
        fixed.end_call()


def test_gemma4_kv_sharing_reads_the_source_layers_blocks():
    """Without the source layer's step (reading only the fresh K/V handed to them, as update() returns them on the
    paged path), the reuse layers give other tokens: the equality above depends on it."""
    model = tiny_family_model("gemma4_text", seed=1, **GEMMA4_SHARED)
    inputs = left_padded(LENGTHS, seed=1)
    expected = generate(model, inputs, DynamicCache(config=model.config))
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    cache.groups = dataclasses.replace(cache.groups, sources=tuple(range(5)))  # each layer reads "its own"
    assert not torch.equal(generate(model, inputs, cache), expected)


def test_gemma4_kv_sharing_logits_to_keep_over_padding():
    """Queries cut to the last 3 columns (some of them padding) in a first prefill and in a continuation: the real
    ones get DynamicCache's logits. Bound: float32 logits of the tiny model agree to 1e-4 (different summation
    order)."""
    model = tiny_family_model("gemma4_text", seed=2, **GEMMA4_SHARED)
    inputs = left_padded([2, 9], seed=3)
    more = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))
    mask2 = torch.cat([inputs["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)

    def run(cache):
        first = forward(model, inputs["input_ids"], cache, attention_mask=inputs["attention_mask"], logits_to_keep=3)
        second = forward(model, more, cache, attention_mask=mask2, logits_to_keep=3)
        return first.logits, second.logits

    expected = run(DynamicCache(config=model.config))
    enable_paged_attention(model, backend="torch")
    got = run(PagedCache(model.config, block_size=BLOCK))
    real = inputs["attention_mask"][:, -3:].bool()
    assert got[0].shape == expected[0].shape == (2, 3, VOCAB) and not bool(real.all())
    assert (got[0][real] - expected[0][real]).abs().max() < 1e-4
    assert (got[1] - expected[1]).abs().max() < 1e-4


def test_gemma4_reuse_layers_hold_no_blocks_and_no_tensors():
    """The 5-layer model with 2 reuse layers holds exactly what its first 3 layers alone hold: the same tensors,
    bytes and blocks; its reuse layers are bound to no tensor."""
    inputs = left_padded(LENGTHS, seed=1)
    held = {}
    for name, overrides in (("shared", GEMMA4_SHARED), ("prefix", dict(num_hidden_layers=3,
                                                                       layer_types=SHARED_TYPES[:3]))):
        model = enable_paged_attention(tiny_family_model("gemma4_text", seed=1, **overrides), backend="torch")
        cache = PagedCache(model.config, block_size=BLOCK, release_finished=False)
        generate(model, inputs, cache, max_new_tokens=6)
        pool, stats = cache.pool, cache.memory_stats()
        allocated = sum(t.numel() * t.element_size() for t in (*pool.key_caches.values(), *pool.value_caches.values()))
        assert allocated == stats.bytes_reserved == pool.tensor_blocks * pool.block_id_bytes(
            [s for _, s in cache.groups.tensor_shapes], torch.float32)
        held[name] = (sorted(pool.layer_shapes), sorted(tuple(k.shape[1:]) for k in pool.key_caches.values()),
                      stats.bytes_reserved, stats.blocks_in_use, [cache.block_tables(g) for g in
                                                                  range(cache.groups.num_groups)])
    assert held["shared"][0] == [0, 1, 2]
    assert held["shared"] == held["prefix"]


def test_gemma4_kv_sharing_save_and_load(tmp_path):
    """A cache of the shared model saved (its paged layers' K/V only) and loaded continues as DynamicCache does."""
    model = tiny_family_model("gemma4_text", seed=1, **GEMMA4_SHARED)
    inputs = left_padded(LENGTHS, seed=1)
    dyn = DynamicCache(config=model.config)
    first = generate(model, inputs, dyn, max_new_tokens=3)
    grown = first.shape[1] - inputs["input_ids"].shape[1] + 2
    second = {"input_ids": torch.cat([first, torch.full((3, 2), 7)], 1),
              "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(3, grown, dtype=torch.long)], 1)}
    expected = generate(model, second, dyn, max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK, release_finished=False)
    cache.activate_past_recording()  # keep the sliding layers' whole history: a saved row holds it all
    assert torch.equal(generate(model, inputs, cache, max_new_tokens=3), first)
    cache.save(tmp_path / "shared.safetensors")
    loaded = PagedCache.load(tmp_path / "shared.safetensors", model.config)
    assert sorted(loaded.pool.layer_shapes) == [0, 1, 2]
    assert torch.equal(generate(model, second, loaded, max_new_tokens=4), expected)


def test_gemma4_kv_sharing_engine_equals_generate_alone():
    """Chunked prefill (a 16-token budget) and preemption (a small pool): each request's tokens equal the request
    alone through generate() with a DynamicCache."""
    model = enable_paged_attention(tiny_family_model("gemma4_text", seed=2, **GEMMA4_SHARED), backend="torch")
    prompts = random_prompts(6, VOCAB, (12, 30), seed=11)
    specs = [(f"shared{i}", p, 6 + i % 5) for i, p in enumerate(prompts)]
    groups = LayerGroups.from_geometry(patches.kv_geometry(model.config))
    pool = BlockPool(block_size=BLOCK, num_blocks=10 * groups.num_groups)
    core = init_continuous_batching(model, pool=pool, max_batch_tokens=16)._core
    reqs = drive(core, specs, seed=5, steps_between=0)
    for rid, prompt, new in specs:
        assert reqs[rid].status == RequestStatus.FINISHED, (rid, reqs[rid].status, reqs[rid].error)
        check_tokens(f"gemma4 shared/{rid}", reqs[rid].generated, reference(model, prompt, new), TIES)
    assert core.scheduler.counters.preemptions > 0
    assert pool.allocator.blocks_in_use == 0


def test_gemma4_kv_sharing_prefix_caching_hits():
    """Full-attention Gemma 4 with shared layers (one layer group: prefix caching on). In generate(), a second call
    starts from the first call's cached blocks (a first forward that reads the pool, its queries cut); in the
    engine, prompts sharing a prefix hit it under chunked prefill. Tokens equal DynamicCache's."""
    model = tiny_family_model("gemma4_text", seed=3, **GEMMA4_SHARED_FULL)
    prompt = left_padded([21], seed=6)
    expected = generate(model, prompt, DynamicCache(config=model.config), max_new_tokens=6)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=BLOCK, prefix_caching=True)
    assert torch.equal(generate(model, prompt, PagedCache(model.config, pool=pool), max_new_tokens=6), expected)
    again = PagedCache(model.config, pool=pool)
    assert torch.equal(generate(model, prompt, again, max_new_tokens=6), expected)
    assert again.prefix_hits == 20  # the prompt's whole blocks (its last token runs)

    prefix = random_prompts(1, VOCAB, (13, 13), seed=8)[0]
    prompts = random_prompts(5, VOCAB, (16, 24), seed=9, shared=[prefix])
    specs = [(f"prefix{i}", p, 5) for i, p in enumerate(prompts)]
    engine_pool = BlockPool(block_size=BLOCK, num_blocks=40, prefix_caching=True)
    core = init_continuous_batching(model, pool=engine_pool, max_batch_tokens=16)._core
    reqs = drive(core, specs, seed=3, steps_between=0)
    for rid, p, new in specs:
        assert reqs[rid].status == RequestStatus.FINISHED, (rid, reqs[rid].status, reqs[rid].error)
        check_tokens(f"gemma4 prefix/{rid}", reqs[rid].generated, reference(model, p, new), TIES)
    assert core.scheduler.counters.prefix_hit_tokens > 0


def test_gemma4_kv_sharing_triton_backend_matches_torch():
    """The Triton kernels (interpreted on CPU) read the source layers' blocks, cut queries included, as torch does."""
    pytest.importorskip("triton")
    model = tiny_family_model("gemma4_text", seed=1, **GEMMA4_SHARED)
    inputs = left_padded([3, 13], seed=2)
    enable_paged_attention(model, backend="torch")
    expected = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=4)
    enable_paged_attention(model, backend="triton")
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=4), expected)
