"""MLA models (DeepSeek-V3, DeepSeek-V2, GLM-4.7-Flash's glm4_moe_lite) through ``generate()`` on the paged latent:
tokens equal ``DynamicCache``'s for greedy, sampling, beams, ``num_return_sequences`` and a second turn; the pool holds
``kv_lora_rank + qk_rope_head_dim`` values per token and layer; caps, save/load, fp8 blocks and prefix caching work
on the latent.

Tie rule: the absorbed attention rounds differently from transformers' expanded one (within the float32 bound of
tests/test_mla_ops.py), so a greedy step whose top-2 logits tie that closely could flip. Greedy rows are compared with
DynamicCache's up to their first difference, which is accepted only where DynamicCache's own top-2 logits differ by
less than 1e-4 (helpers.engine_oracle.TIE); the tests print how many were accepted. Beams and sampled rows must be
equal outright (no difference has been accepted for them).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DeepseekV3Config, DynamicCache

from helpers import generate, left_padded
from helpers.engine_oracle import TIE
from helpers.mla import MLA_TYPES, tiny_mla_config, tiny_mla_model
from hf_paged import BlockPool, PagedCache, enable_paged_attention
from hf_paged.ops import mla
from hf_paged.report import kv_bytes_per_token
from hf_paged.patches import check_supported, kv_shape
from hf_paged.patches.support import kv_widths

BLOCK = 4
LENGTHS = [3, 19, 11]
TIES = []


def assert_greedy_equal(model, inputs, got, **kw):
    """``got`` equals DynamicCache's greedy tokens, or first differs where its top-2 logits tie within ``TIE``."""
    ref = generate(model, inputs, DynamicCache(config=model.config), output_scores=True, return_dict_in_generate=True,
                   **kw)
    width = inputs["input_ids"].shape[1]
    assert got.shape[1] > width
    for row in range(got.shape[0]):
        diff = (got[row, width:] != ref.sequences[row, width:]).nonzero()
        if len(diff):
            step = int(diff[0])
            top2 = ref.scores[step][row].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE, f"row {row} differs at new token {step} (top-2 gap {gap:.2e})"
            TIES.append(gap)
    assert got.shape == ref.sequences.shape


@pytest.fixture(params=MLA_TYPES)
def model(request):
    return tiny_mla_model(request.param, seed=1)


def test_greedy_beams_sampling_equal_dynamic_cache(model):
    """Left-padded greedy, beam search, and sampling with ``num_return_sequences``: DynamicCache's tokens."""
    inputs = left_padded(LENGTHS, seed=2)
    beams = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=8, num_beams=3)
    torch.manual_seed(7)
    sampled = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=8, do_sample=True,
                       num_return_sequences=2, temperature=1.3)
    enable_paged_attention(model, backend="torch")
    got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=12)
    assert_greedy_equal(model, inputs, got, max_new_tokens=12)
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=8,
                                num_beams=3), beams)
    torch.manual_seed(7)
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=8,
                                do_sample=True, num_return_sequences=2, temperature=1.3), sampled)
    print(f"\nties accepted so far: {len(TIES)}")


def test_second_turn_continues_the_cache(model):
    """A second generate() on the same cache, with new user tokens appended, equals DynamicCache's second turn."""
    inputs = left_padded([5, 9], seed=3)
    turn2 = torch.randint(3, 90, (2, 4), generator=torch.Generator().manual_seed(4))

    def two_turns(cache):
        first = generate(model, inputs, cache, max_new_tokens=5)
        ids = torch.cat([first, turn2], 1)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, ids.shape[1] - inputs["input_ids"].shape[1],
                                                                 dtype=torch.long)], 1)
        return generate(model, {"input_ids": ids, "attention_mask": mask}, cache, max_new_tokens=6)

    want = two_turns(DynamicCache(config=model.config))
    enable_paged_attention(model, backend="torch")
    assert torch.equal(two_turns(PagedCache(model.config, block_size=BLOCK, release_finished=False)), want)


def test_pool_holds_the_latent_per_token_and_layer(monkeypatch):
    """Each layer's pool tensors hold one head of ``kv_lora_rank`` (key: the latent) and ``qk_rope_head_dim``
    (value: the rotated key) values per token, so memory_stats' bytes per block are ``block_size * layers * (R + P)
    * 4`` in float32, not per-head K/V (``2 * heads * qk_head_dim``)."""
    model = enable_paged_attention(tiny_mla_model("deepseek_v3"), backend="torch")
    config = model.config
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    cache = PagedCache(config, block_size=BLOCK)
    calls = []
    attend = mla.mla_attention_torch
    monkeypatch.setattr(mla, "mla_attention_torch", lambda *a, **k: calls.append(a[0].shape) or attend(*a, **k))
    generate(model, left_padded(LENGTHS, seed=2), cache, max_new_tokens=4)
    # the prompt ran the model's own attention on its fresh latent; each of the 3 decode steps read the pool
    assert calls == [(len(LENGTHS), config.num_attention_heads, rank)] * (3 * config.num_hidden_layers)
    pool = cache.pool
    assert len(pool.key_caches) == config.num_hidden_layers
    for slot in pool.key_caches:
        assert pool.key_caches[slot].shape[1:] == (BLOCK, 1, rank)
        assert pool.value_caches[slot].shape[1:] == (BLOCK, 1, rope)
    stats = cache.memory_stats()
    assert stats.bytes_per_block == BLOCK * config.num_hidden_layers * (rank + rope) * 4
    assert kv_shape(config) == (1, rank)
    full = DeepseekV3Config()  # the real shape: 576 values per token and layer against 128 heads x (192 + 128)
    heads, key, value = kv_widths(full)
    assert (heads, key, value) == (1, 512, 64)
    assert full.num_attention_heads * (full.qk_nope_head_dim + full.qk_rope_head_dim + full.v_head_dim) // (
        key + value) == 71


def test_memory_cap_counts_the_latent():
    """``max_memory`` turns into blocks of the latent's size: room for exactly the blocks it pays for."""
    model = enable_paged_attention(tiny_mla_model("deepseek_v2"), backend="torch")
    config = model.config
    per_block = BLOCK * config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    cache = PagedCache(config, block_size=BLOCK, max_memory=per_block * 41)
    out = generate(model, left_padded(LENGTHS, seed=2), cache, max_new_tokens=4)
    assert cache.pool.allocator.max_blocks == 40  # one block of the 41 is the scratch block
    assert out.shape[1] == max(LENGTHS) + 4


def test_save_load_continues_like_the_original(tmp_path):
    """A cache saved after a first turn and loaded into a new pool continues with the same tokens as the original."""
    model = enable_paged_attention(tiny_mla_model("glm4_moe_lite", seed=2), backend="torch")
    inputs = left_padded([6, 10], seed=5)
    cache = PagedCache(model.config, block_size=BLOCK, release_finished=False)
    first = generate(model, inputs, cache, max_new_tokens=4)
    cache.save(tmp_path / "mla.safetensors")
    loaded = PagedCache.load(tmp_path / "mla.safetensors", model.config)
    assert loaded.pool.layer_shapes[0].value_dim == model.config.qk_rope_head_dim
    follow = {"input_ids": first, "attention_mask": torch.cat([inputs["attention_mask"],
                                                               torch.ones(2, 4, dtype=torch.long)], 1)}
    assert torch.equal(generate(model, follow, loaded, max_new_tokens=5), generate(model, follow, cache,
                                                                                   max_new_tokens=5))


def test_prefix_caching_hits_the_latent_blocks():
    """A second call with the same prompt on a prefix-caching pool starts from the first call's latent blocks and
    gives DynamicCache's tokens."""
    model = tiny_mla_model("deepseek_v3", seed=3)
    prompt = left_padded([18], seed=6)
    want = generate(model, prompt, DynamicCache(config=model.config), max_new_tokens=6)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=BLOCK, prefix_caching=True)
    generate(model, prompt, PagedCache(model.config, pool=pool), max_new_tokens=6)
    second = PagedCache(model.config, pool=pool)
    assert torch.equal(generate(model, prompt, second, max_new_tokens=6), want)
    assert second.prefix_hits == 16


def test_fp8_latent_blocks():
    """fp8 blocks on the latent: the pool stores one byte per value plus a bf16 scale per token for the latent and for
    the rotated key; the first step's logits (read back from fp8 blocks after a fresh prompt chunk) stay within 5% of
    full precision's spread, and greedy generation runs."""
    model = enable_paged_attention(tiny_mla_model("deepseek_v3", seed=4), backend="torch")
    config = model.config
    ids = left_padded([12], seed=7)["input_ids"]
    logits = {}
    for kv_dtype in (None, torch.float8_e4m3fn):
        cache = PagedCache(config, block_size=BLOCK, kv_dtype=kv_dtype)
        with torch.no_grad():
            model(input_ids=ids[:, :8], cache=cache)
            logits[kv_dtype] = model(input_ids=ids[:, 8:], cache=cache).logits  # attends through the pool
        if kv_dtype is not None:
            assert cache.pool.key_caches[0].dtype == torch.uint8
            assert cache.memory_stats().bytes_per_block == BLOCK * config.num_hidden_layers * (
                config.kv_lora_rank + config.qk_rope_head_dim + 2 * 2)
    full, fp8 = logits[None], logits[torch.float8_e4m3fn]
    assert (fp8 - full).abs().max() < 0.05 * (full.max() - full.min())
    out = generate(model, left_padded(LENGTHS, seed=2), PagedCache(config, block_size=BLOCK,
                                                                   kv_dtype=torch.float8_e4m3fn), max_new_tokens=4)
    assert out.shape[1] == max(LENGTHS) + 4


def test_mla_configs_accepted_and_mistaken_head_sizes_not_compared():
    """MLA configs pass the support check (their per-head key and value sizes differ, but the cache holds the
    latent)."""
    for model_type in MLA_TYPES:
        check_supported(tiny_mla_config(model_type))


@pytest.mark.parametrize("model_type", ["minicpm3", "youtu"])
def test_other_registered_families_greedy(model_type):
    """The other MLA families patches/deepseek.py registers: left-padded greedy equals DynamicCache's."""
    model = tiny_mla_model(model_type, seed=1)
    inputs = left_padded(LENGTHS, seed=2)
    enable_paged_attention(model, backend="torch")
    got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK), max_new_tokens=10)
    assert_greedy_equal(model, inputs, got, max_new_tokens=10)


def test_gathered_mode_holds_the_latent_too():
    """Without enable_paged_attention a PagedCache gathers the latent history back for the model's own attention:
    DynamicCache's tokens, from a pool of the same latent shape."""
    model = tiny_mla_model("deepseek_v2", seed=6)
    inputs = left_padded(LENGTHS, seed=3)
    want = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=6)
    cache = PagedCache(model.config, block_size=BLOCK)
    with pytest.warns(UserWarning, match="without enable_paged_attention"):
        got = generate(model, inputs, cache, max_new_tokens=6)
    assert torch.equal(got, want)
    assert cache.pool.value_caches[0].shape[-1] == model.config.qk_rope_head_dim


def test_compiled_decoding_traces_without_graph_breaks():
    """Compiled decoding (``fullgraph=True``, dynamo's eager backend) of an MLA model on a fixed pool traces the
    absorbed attention without a graph break and gives DynamicCache's tokens."""
    model = tiny_mla_model("deepseek_v3", seed=1)
    inputs = left_padded([3, 9], seed=2)
    want = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=6)
    enable_paged_attention(model, backend="torch")
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK, num_blocks=32), max_new_tokens=6,
                   compile_config=config)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert torch.equal(got, want)


def test_kv_bytes_per_token_report_counts_the_latent():
    """hf_paged.report's figures (demo, benchmarks) count ``R + P`` values per token and layer for MLA."""
    config = tiny_mla_config("deepseek_v3")
    assert kv_bytes_per_token(config, torch.bfloat16) == config.num_hidden_layers * (
        config.kv_lora_rank + config.qk_rope_head_dim) * 2
    assert kv_bytes_per_token(DeepseekV3Config(), torch.bfloat16) == 61 * 1152
