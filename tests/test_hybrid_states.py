"""Hybrid models (linear-attention, Mamba / Mamba2 and short-convolution layers beside attention): their per-row
states live in cells of the pool's state store (hf_paged/states.py) while their attention layers stay paged.

Every test compares generate() with a PagedCache against transformers' DynamicCache on the same model and inputs
(the same mixer code runs in both; only where the states and K/V are kept differs, so tokens are equal, ties
included), and checks that no state cell is left held once the cache is reset. Beams, sampling with
num_return_sequences and a second turn run on every family: DynamicCache supports them on all eight in this
transformers (its linear layers lack batch_repeat_interleave / batch_select_indices, which these calls do not use).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_paged import BlockPool, PagedCache, compat, enable_paged_attention, init_continuous_batching, patches
from hf_paged.states import OutOfStateMemoryError, StateStore
from helpers import EOS, PAD, TINY_SHAPE, VOCAB, forward, generate, left_padded, tiny_model
from helpers.engine_oracle import TieCount, check_tokens, random_prompts, reference
from hf_paged.engine.sampling import SamplingParams
from hf_paged.engine.request import RequestStatus

BLOCK = 4  # prompts and generations cross block boundaries

_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
# model_type -> overrides on the tiny shape: 2 to 4 layers, state layers and attention layers both present
HYBRIDS = {
    "qwen3_next": dict(num_hidden_layers=4, layer_types=None, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, **_LINEAR),
    "qwen3_5_text": dict(num_hidden_layers=4, **_LINEAR),
    "olmo_hybrid": dict(num_hidden_layers=4),
    "lfm2": dict(num_hidden_layers=4, full_attn_idxs=[1, 3]),
    "nemotron_h": dict(num_hidden_layers=4, hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=16, n_groups=2),
    # every layer is "hybrid": attention and a Mamba2 mixer side by side (paged K/V and a state)
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_n_groups=2),
    "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["mamba", "attention"] * 2, mamba_n_heads=4,
                             mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, num_local_experts=4,
                             num_experts_per_tok=2),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_expand=2),
}
FAMILIES = list(HYBRIDS)


def hybrid_model(model_type: str, seed: int = 0):
    config = AutoConfig.for_model(model_type, **{**TINY_SHAPE, "head_dim": 16, **HYBRIDS[model_type]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # fixed lengths: every row generates max_new_tokens
    return model


def run(model, inputs, cache, seed: int = 7, **kwargs):
    torch.manual_seed(seed)  # sampling draws the same numbers for both caches
    return generate(model, inputs, cache, **kwargs)


def state_bytes_per_row(cache: DynamicCache, rows: int) -> int:
    """What transformers' own linear layers hold per row: their conv and recurrent state tensors."""
    total = 0
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            total += sum(t.numel() * t.element_size() for t in states.values() if t is not None)
    assert total % rows == 0
    return total // rows


def assert_states_match(cache: PagedCache, reference: DynamicCache) -> None:
    """Each live row's conv and recurrent states in the store equal DynamicCache's for that row (to float rounding:
    the attention layers feeding the mixers are computed by other kernels), state for state."""
    rows = [(r, row.state) for r, row in enumerate(cache.rows) if row.state is not None]
    compared = 0
    for layer_idx, layer in enumerate(reference.layers):
        for kind, states in (("conv", getattr(layer, "conv_states", {})),
                             ("recurrent", getattr(layer, "recurrent_states", {}))):
            for state_idx, expected in states.items():
                if expected is None:
                    continue
                got = cache.pool.states.get(kind, layer_idx, state_idx)
                for r, cell in rows:
                    torch.testing.assert_close(got[cell], expected[r], rtol=1e-4, atol=1e-5)
                    compared += 1
    assert compared > 0


def assert_released(cache: PagedCache) -> None:
    cache.reset()
    assert cache.pool.states.in_use == 0
    assert cache.pool.memory_stats().state_slots_in_use == 0


def test_geometry_marks_state_layers_and_hybrid_layers():
    """State layers are kind "state"; Falcon-H1's hybrid layers are paged attention layers with a state beside."""
    qwen = patches.kv_geometry(hybrid_model("qwen3_5_text").config)
    assert [layer.kind for layer in qwen.layers] == ["state", "state", "state", "full"]
    assert qwen.state_layers == [0, 1, 2] and qwen.paged_layers == [3]
    falcon = patches.kv_geometry(hybrid_model("falcon_h1").config)
    assert [(layer.kind, layer.state) for layer in falcon.layers] == [("full", True), ("full", True)]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_left_padded_batch_equals_dynamic_cache(model_type):
    """Left-padded rows of different lengths (both caches run the same padded forward through the mixers), the
    state bytes counted equal to what DynamicCache's linear layers allocate, cells given back on reset."""
    model = hybrid_model(model_type)
    inputs = left_padded([3, 9, 6], seed=1)
    reference = DynamicCache(config=model.config)
    expected = run(model, inputs, reference, max_new_tokens=8)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    got = run(model, inputs, cache, max_new_tokens=8)
    assert torch.equal(got, expected)
    assert_states_match(cache, reference)
    stats = cache.memory_stats()
    assert stats.state_slots_in_use == 3
    assert stats.state_bytes_per_slot == state_bytes_per_row(reference, 3)
    assert stats.state_bytes_in_use == 3 * stats.state_bytes_per_slot
    store = cache.pool.states
    assert stats.state_bytes_reserved == sum(t.numel() * t.element_size() for t in store.tensors.values())
    assert stats.state_bytes_reserved == store.capacity * stats.state_bytes_per_slot
    assert cache.is_croppable is compat.STATE_ROLLBACK
    assert cache.is_linear == reference.is_linear
    assert_released(cache)


def test_recurrent_states_keep_their_fp32_dtype():
    """A bf16 Qwen3.5 writes its conv state in bf16 and its recurrent state in fp32: the store keeps both dtypes."""
    model = hybrid_model("qwen3_5_text").to(torch.bfloat16)
    inputs = left_padded([5, 7], seed=2)
    expected = run(model, inputs, DynamicCache(config=model.config), max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    assert torch.equal(run(model, inputs, cache, max_new_tokens=4), expected)
    dtypes = {kind: {t.dtype for (k, _, _), t in cache.pool.states.tensors.items() if k == kind}
              for kind in ("conv", "recurrent")}
    assert dtypes == {"conv": {torch.bfloat16}, "recurrent": {torch.float32}}
    assert_released(cache)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sampling_beams_and_a_second_turn_equal_dynamic_cache(model_type):
    """num_return_sequences (rows sampled from one prompt, each with its own states), beam search (reorder_cache
    copies the states of the chosen beams into each row's own slot), and a second generate() on the same cache
    continuing the states with new tokens."""
    model = hybrid_model(model_type)
    inputs = left_padded([4, 7], seed=3)
    sample = dict(do_sample=True, num_return_sequences=3, max_new_tokens=6)
    beams = dict(num_beams=3, max_new_tokens=6)
    expected_sample = run(model, inputs, DynamicCache(config=model.config), **sample)
    expected_beams = run(model, inputs, DynamicCache(config=model.config), **beams)
    reference = DynamicCache(config=model.config)
    first = run(model, inputs, reference, max_new_tokens=3)
    follow = torch.cat([first, torch.randint(3, 90, (2, 2), generator=torch.Generator().manual_seed(4))], 1)
    follow_inputs = {"input_ids": follow,
                     "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 5, dtype=torch.long)], 1)}
    expected_second = run(model, follow_inputs, reference, max_new_tokens=4)

    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=BLOCK)
    for kwargs, expected in ((sample, expected_sample), (beams, expected_beams)):
        cache = PagedCache(model.config, pool=pool)
        assert torch.equal(run(model, inputs, cache, **kwargs), expected), kwargs
        assert cache.memory_stats().state_slots_in_use == 6
        assert_released(cache)
    cache = PagedCache(model.config, pool=pool)
    assert torch.equal(run(model, inputs, cache, max_new_tokens=3), first)
    assert torch.equal(run(model, follow_inputs, cache, max_new_tokens=4), expected_second)
    assert_released(cache)


def test_deepcopy_continues_independently_with_its_own_slots():
    """A deep copy after the prompt holds copies of the states (its own slots): continuing the copy and then the
    original gives the same tokens as DynamicCache continuing twice from copies of its own."""
    model = hybrid_model("nemotron_h")
    inputs = left_padded([5, 8], seed=5)
    reference = DynamicCache(config=model.config)
    first = run(model, inputs, reference, max_new_tokens=3)
    follow = {"input_ids": torch.cat([first, torch.full((2, 1), 17)], 1),
              "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)}
    expected = run(model, follow, copy.deepcopy(reference), max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    run(model, inputs, cache, max_new_tokens=3)
    twin = copy.deepcopy(cache)
    slots = {row.state for row in cache.rows} | {row.state for row in twin.rows}
    assert len(slots) == 4 and cache.pool.states.in_use == 4
    assert torch.equal(run(model, follow, twin, max_new_tokens=4), expected)
    assert torch.equal(run(model, follow, cache, max_new_tokens=4), expected)  # the twin did not touch its states
    twin.reset()
    assert_released(cache)


def test_finished_rows_give_back_their_slots_and_the_rest_continue():
    """Row 0 stops at an EOS while row 1 runs on: row 0's slot goes back at once (the batch's slots are then no
    longer consecutive: the running rows' states are gathered and written back), tokens equal DynamicCache's."""
    model = hybrid_model("qwen3_5_text")
    inputs = left_padded([6, 4], seed=6)
    free = run(model, inputs, DynamicCache(config=model.config), max_new_tokens=8)
    width = inputs["input_ids"].shape[1]
    eos = int(free[0, width + 2])  # row 0's third new token becomes EOS
    assert eos not in free[1, width:].tolist(), "pick another seed: row 1 would stop too"
    reference = DynamicCache(config=model.config)
    expected = run(model, inputs, reference, max_new_tokens=8, eos_token_id=eos)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    got = run(model, inputs, cache, max_new_tokens=8, eos_token_id=eos)
    assert torch.equal(got, expected)
    assert_states_match(cache, reference)  # row 1's states, written back from the gathered copies
    assert [row.state is None for row in cache.rows] == [True, False]
    assert cache.memory_stats().state_slots_in_use == 1 and cache.pool.states.in_use == 1
    assert_released(cache)


def test_states_and_blocks_share_a_max_memory_cap():
    """Under max_memory the state tensors' bytes come off the block cap; a cap that cannot hold the states is
    refused by name."""
    model = hybrid_model("qwen3_5_text")
    inputs = left_padded([5, 7], seed=7)
    expected = run(model, inputs, DynamicCache(config=model.config), max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    cap = 256 * 1024
    cache = PagedCache(model.config, block_size=BLOCK, max_memory=cap)
    assert torch.equal(run(model, inputs, cache, max_new_tokens=4), expected)
    pool = cache.pool
    per_block = pool.bytes_per_block_id()
    states = pool.states.bytes_reserved()
    assert states > 0
    assert pool.allocator.max_blocks == (cap - states) // per_block - 1
    assert (pool.allocator.max_blocks + 1) * per_block + states <= cap
    assert_released(cache)
    small = PagedCache(model.config, block_size=BLOCK, max_memory=24 * 1024)
    with pytest.raises(OutOfStateMemoryError, match="max_memory"):
        run(model, inputs, small, max_new_tokens=4)
    assert_released(small)


def repetitive_prompt(seed: int) -> dict:
    """One 12-token prompt whose second half repeats its first: prompt lookup finds drafts in it."""
    inputs = left_padded([12], seed=seed)
    inputs["input_ids"][0, 6:] = inputs["input_ids"][0, :6]
    return inputs


@pytest.mark.skipif(not compat.STATE_ROLLBACK, reason="state rollback needs transformers >= 5.25")
@pytest.mark.parametrize("model_type", FAMILIES)
def test_assisted_decoding_rolls_the_states_back_like_dynamic_cache(model_type, monkeypatch):
    """Prompt lookup and a draft model (a tiny Llama: its drafts are often wrong): the verifying forward's rejected drafts are
    cropped, and the states (conv columns and recurrent states) are rolled back to the last accepted token, so the
    tokens equal DynamicCache's. Rejections happen (crops of n > 0 are counted), so a rollback that did nothing
    would drift."""
    model = hybrid_model(model_type)
    inputs = repetitive_prompt(seed=8)
    assistant = tiny_model("llama", seed=5, num_hidden_layers=1)
    cases = (dict(prompt_lookup_num_tokens=3), dict(assistant_model=assistant, num_assistant_tokens=3))
    expected = [run(model, inputs, DynamicCache(config=model.config), max_new_tokens=10, **kw) for kw in cases]
    enable_paged_attention(model, backend="torch")
    drops = []
    crop = PagedCache.crop

    def counting_crop(self, max_length):
        drops.append(-max_length)
        return crop(self, max_length)

    monkeypatch.setattr(PagedCache, "crop", counting_crop)
    for kw, want in zip(cases, expected):
        drops.clear()
        cache = PagedCache(model.config, block_size=BLOCK)
        assert torch.equal(run(model, inputs, cache, max_new_tokens=10, **kw), want), list(kw)
        assert cache.is_croppable and cache.get_recurrent_states_to_keep() >= 3
        assert any(drop > 0 for drop in drops), f"no draft was rejected with {list(kw)}: the rollback went untested"
        assert_released(cache)


@pytest.mark.skipif(not compat.STATE_ROLLBACK, reason="state rollback needs transformers >= 5.25")
def test_crop_restores_the_states_of_a_shorter_run():
    """Recording, then one forward of 4 tokens and crop(-3): the states in the cells equal those of the run that
    stopped 3 tokens earlier (DynamicCache), conv columns and recurrent states; a crop further back than the mixers
    kept is refused naming recurrent_states_to_keep; crop() without recording is refused naming the fix."""
    model = hybrid_model("nemotron_h")
    enable_paged_attention(model, backend="torch")
    prompt = left_padded([6], seed=2)["input_ids"]
    extra = torch.randint(3, 90, (1, 4), generator=torch.Generator().manual_seed(3))
    reference = DynamicCache(config=model.config)
    forward(model, torch.cat([prompt, extra[:, :1]], 1), reference)
    cache = PagedCache(model.config, block_size=BLOCK)
    forward(model, prompt, cache)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-1)
    cache.activate_past_recording(recurrent_states_to_keep=4)
    forward(model, extra, cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    assert_states_match(cache, reference)
    cache.activate_past_recording(recurrent_states_to_keep=1)
    forward(model, extra, cache)
    with pytest.raises(ValueError, match="recurrent_states_to_keep"):
        cache.crop(-3)
    assert_released(cache)


@pytest.mark.skipif(compat.STATE_ROLLBACK, reason="this transformers' mixers hand back the states a rollback needs")
def test_rollbacks_are_refused_by_name_before_transformers_5_25():
    """Before 5.25 a state mixer hands back no intermediate recurrent state, so nothing can roll one back:
    assisted decoding and the cache's past recording are refused by name, and so is crop()."""
    model = hybrid_model("qwen3_next")
    enable_paged_attention(model, backend="torch")
    inputs = left_padded([6], seed=8)
    cache = PagedCache(model.config, block_size=BLOCK)
    assert cache.is_croppable is False
    with pytest.raises(ValueError, match="assisted"):
        run(model, inputs, cache, max_new_tokens=4, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="assisted decoding"):
        cache.activate_past_recording()
    assert cache.is_recording_past(0) is False
    run(model, inputs, cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-1)
    assert_released(cache)


def test_store_slots_are_consecutive_where_free_and_never_given_twice():
    store = StateStore()
    first = store.take(3)
    assert first == [0, 1, 2] and store.capacity == 4
    store.give_back([1])
    assert store.take(2) == [3, 4]  # no free run of 2 among 1 and 3: the store grows
    assert store.take(1) == [1]
    with pytest.raises(RuntimeError, match="twice"):
        store.give_back([0, 0])
    store.give_back([0, 1, 2, 3, 4])
    assert store.in_use == 0


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "falcon_h1", "lfm2"])
def test_save_and_load_continue_the_states(model_type, tmp_path):
    """A saved cache of a hybrid model holds its rows' states (format 4): loaded into another pool, a second turn
    gives DynamicCache's tokens; the loaded slots are counted and given back."""
    model = hybrid_model(model_type)
    inputs = left_padded([4, 7], seed=9)
    reference = DynamicCache(config=model.config)
    first = run(model, inputs, reference, max_new_tokens=3)
    follow = {"input_ids": torch.cat([first, torch.full((2, 2), 21)], 1),
              "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 5, dtype=torch.long)], 1)}
    expected = run(model, follow, reference, max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    run(model, inputs, cache, max_new_tokens=3)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    saved = {key: t[[row.state for row in cache.rows]].clone() for key, t in cache.pool.states.tensors.items()}
    written = cache.states_written
    assert written == {(layer, 0) for layer in cache.state_layers}
    assert_released(cache)
    loaded = PagedCache.load(path, model.config, block_size=BLOCK)
    assert loaded.pool.states.in_use == 2 and loaded.memory_stats().state_slots_in_use == 2
    assert loaded.states_written == written
    for key, t in loaded.pool.states.tensors.items():
        assert torch.equal(t[[row.state for row in loaded.rows]], saved[key]), key
    assert torch.equal(run(model, follow, loaded, max_new_tokens=4), expected)
    assert_released(loaded)


def test_state_files_are_checked_before_the_pool_is_touched(tmp_path):
    """A state tensor of the wrong shape, or a NaN in a state, is refused naming the field; a file without states
    does not load into a model with state layers."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    from hf_paged import CacheFileError

    model = hybrid_model("qwen3_5_text")
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK)
    run(model, left_padded([5], seed=10), cache, max_new_tokens=2)
    path = tmp_path / "good.safetensors"
    cache.save(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    name = "state.recurrent.0.0"
    bad = dict(tensors, **{name: tensors[name][..., :-1].contiguous()})
    save_file(bad, tmp_path / "shape.safetensors", metadata=metadata)
    with pytest.raises(CacheFileError, match=name.replace(".", r"\.")):
        PagedCache.load(tmp_path / "shape.safetensors", model.config)
    nan = dict(tensors, **{name: torch.full_like(tensors[name], float("nan"))})
    save_file(nan, tmp_path / "nan.safetensors", metadata=metadata)
    with pytest.raises(CacheFileError, match="NaN"):
        PagedCache.load(tmp_path / "nan.safetensors", model.config)
    no_states = {k: v for k, v in tensors.items() if not k.startswith("state.")}
    plain = {k: v for k, v in metadata.items() if k not in ("states", "states_written", "digest")}
    plain["format"] = "hf_paged.cache/1"  # no digest to recompute
    save_file(no_states, tmp_path / "plain.safetensors", metadata=plain)
    with pytest.raises(CacheFileError, match="holds no states"):
        PagedCache.load(tmp_path / "plain.safetensors", model.config)
    assert_released(cache)


# ---------------------------------------------------------------------------------------------------- the engine
TIES = TieCount()


def drive(core, specs, chunks: list) -> dict:
    """Add every request (``(rid, prompt, max_new)``) two steps apart, run to the end; ``chunks`` collects
    ``(rid, start, num_tokens, prompt_len)`` of every chunk run. Checks after every step that each running request
    holds one state cell and nobody else does but the prefix-caching checkpoints."""
    run = core.runner.run

    def recording(batch):
        chunks.extend((c.request.request_id, c.start, c.num_tokens, c.request.num_prompt) for c in batch.chunks)
        return run(batch)

    core.runner.run = recording
    kv = core.runner.kv
    reqs = {}

    def step():
        core.step()
        running = core.scheduler.running
        assert len(running) == len({r.row.state for r in running})
        assert kv.pool.states.in_use == len(running) + len(kv.checkpoints or ())

    with torch.no_grad():
        for rid, prompt, new in specs:
            reqs[rid] = req = core.new_request(rid, prompt, SamplingParams(max_new_tokens=new, eos_token_ids=(EOS,)))
            core.add(req)
            for _ in range(2):
                step()
        while core.has_work:
            step()
    return reqs


@pytest.mark.parametrize("model_type", FAMILIES)
def test_engine_requests_equal_generate_alone(model_type):
    """Ten requests through the engine with a budget that prefills prompts in chunks (the states carried from chunk
    to chunk) and a pool small enough to preempt (a preempted request gives its slot back and recomputes from a
    fresh one); each request's greedy tokens equal it alone through generate() with a DynamicCache (a difference
    only where that run's top-2 logits tie within 1e-4); no block or slot is left held."""
    model = hybrid_model(model_type, seed=2)
    model.generation_config.eos_token_id = EOS
    prompts = random_prompts(10, VOCAB, (8, 26), seed=11)
    specs = [(f"{model_type}{i}", p, 4 + i % 5) for i, p in enumerate(prompts)]
    expected = {rid: reference(model, prompt, new) for rid, prompt, new in specs}
    pool = BlockPool(block_size=BLOCK, num_blocks=14, prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=8)
    core = manager._core
    chunks = []
    reqs = drive(core, specs, chunks)
    for rid, _, _ in specs:
        assert reqs[rid].status == RequestStatus.FINISHED, (rid, reqs[rid].error)
        check_tokens(rid, reqs[rid].generated, expected[rid], TIES)
    assert core.scheduler.counters.preemptions > 0
    assert any(0 < start < prompt_len for _, start, n, prompt_len in chunks)  # a prefill chunk after the first
    assert any(0 < start and start + n < prompt_len for _, start, n, prompt_len in chunks)  # ... and a middle one
    assert pool.allocator.blocks_in_use == 0 and pool.states.in_use == len(core.runner.kv.checkpoints)
    print(f"\n{model_type}: ties accepted so far {len(TIES.ties)} of {TIES.requests} requests")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_engine_forks_copy_the_states_of_one_prefill(model_type):
    """num_return_sequences=3 with a seed: one prefill, whose states each fork copies into its own slot; each fork's
    tokens equal a request run alone with that fork's seed (the sampler derives fork k's seed from the request's)."""
    from hf_paged.engine.sampling import _fork_seed

    model = hybrid_model(model_type, seed=4)
    prompt = random_prompts(1, VOCAB, (13, 13), seed=23)[0]
    sampling = dict(do_sample=True, temperature=0.9, max_new_tokens=6)
    pool = BlockPool(block_size=BLOCK, num_blocks=64)
    with init_continuous_batching(model, pool=pool) as manager:
        rid = manager.add_request(prompt, seed=77, num_return_sequences=3, **sampling)
        forks = [manager.get_result(i, timeout=60) for i in (rid, f"{rid}__child#0", f"{rid}__child#1")]
        computed = manager.stats().prompt_tokens_computed
        alone = [manager.get_result(manager.add_request(prompt, seed=_fork_seed(77, k), **sampling), timeout=60)
                 for k in range(3)]
    assert computed == len(prompt)  # one prefill for the three
    assert all(f.status == RequestStatus.FINISHED for f in forks)
    assert [f.generated_tokens for f in forks] == [a.generated_tokens for a in alone]
    assert len({tuple(f.generated_tokens) for f in forks}) > 1
    assert pool.allocator.blocks_in_use == 0 and pool.states.in_use == 0


def test_engine_under_a_byte_cap_counts_the_states():
    """A pool capped by bytes: the engine's state cells take their bytes off the block cap (admission then sees fewer
    blocks), every request finishes with generate()'s tokens, states plus blocks stay within the cap, and a request
    whose slot would not fit is not opened (it waits)."""
    model = hybrid_model("qwen3_5_text", seed=3)
    model.generation_config.eos_token_id = EOS
    prompts = random_prompts(8, VOCAB, (6, 20), seed=12)
    specs = [(f"c{i}", p, 3 + i % 4) for i, p in enumerate(prompts)]
    expected = {rid: reference(model, prompt, new) for rid, prompt, new in specs}
    cap = 100 * 1024
    pool = BlockPool(block_size=BLOCK, max_memory=cap)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=32)
    reqs = drive(manager._core, specs, [])
    for rid, _, _ in specs:
        assert reqs[rid].status == RequestStatus.FINISHED, (rid, reqs[rid].error)
        check_tokens(rid, reqs[rid].generated, expected[rid], TIES)
    states = pool.states.bytes_reserved()
    assert states == pool.states.capacity * pool.states.bytes_per_cell() > 0
    assert pool.allocator.max_blocks == (cap - states) // pool.bytes_per_block_id() - 1
    assert pool.allocator.blocks_in_use == 0 and pool.states.in_use == 0
    kv = manager._core.runner.kv
    opened = []
    while (row := kv.open()) is not None:  # slots until the next would pass the cap
        opened.append(row)
        assert len(opened) < 64
    per_block, states = pool.bytes_per_block_id(), pool.states.bytes_reserved()
    assert len(opened) == pool.states.capacity
    assert (pool.allocator.capacity + 1) * per_block + states <= cap
    assert (pool.allocator.capacity + 1) * per_block + states + pool.states.bytes_per_cell() > cap
    for row in opened:
        kv.free(row)
    assert pool.states.in_use == 0


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "falcon_h1"])
def test_engine_prefix_hits_restore_state_checkpoints(model_type):
    """Sixteen requests submitted at once whose prompts start with one 42-token system prompt: the first computes it
    whole; the next, finding its K/V blocks but no states, stops its prefill at the last block boundary of the cached
    blocks (token 40) once, where its states are checkpointed; the others restore that checkpoint with the blocks and
    compute only the rest. Each request's tokens equal it alone through generate(); at most a quarter of the
    sixteen copies of the system prompt is computed."""
    model = hybrid_model(model_type, seed=5)
    model.generation_config.eos_token_id = EOS
    system = random_prompts(1, VOCAB, (42, 42), seed=30)[0]
    questions = random_prompts(16, VOCAB, (3, 8), seed=31)
    specs = [(f"p{i}", system + q, 3 + i % 3) for i, q in enumerate(questions)]
    expected = {rid: reference(model, prompt, new) for rid, prompt, new in specs}
    pool = BlockPool(block_size=BLOCK, num_blocks=256, prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=64)
    core = manager._core
    reqs = {}
    with torch.no_grad():
        for rid, prompt, new in specs:
            reqs[rid] = req = core.new_request(rid, prompt, SamplingParams(max_new_tokens=new, eos_token_ids=(EOS,)))
            core.add(req)
        while core.has_work:
            core.step()
    for rid, _, _ in specs:
        assert reqs[rid].status == RequestStatus.FINISHED, (rid, reqs[rid].error)
        check_tokens(rid, reqs[rid].generated, expected[rid], TIES)
    c = core.scheduler.counters
    shared_computed = c.prompt_tokens_computed - sum(len(q) for q in questions)
    assert c.prefix_hit_tokens >= 14 * 40
    assert shared_computed <= 0.25 * 16 * len(system), shared_computed
    kv = core.runner.kv
    assert pool.allocator.blocks_in_use == 0 and pool.states.in_use == len(kv.checkpoints) > 0
    kv.checkpoints.clear()
    assert pool.states.in_use == 0


def test_checkpoints_give_way_to_requests_under_a_byte_cap():
    """Requests that find no room for their slots take the checkpoints' (least recently used first), never the other
    way round."""
    model = hybrid_model("qwen3_5_text", seed=5)
    pool = BlockPool(block_size=BLOCK, max_memory=100 * 1024, prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=16)
    core, kv = manager._core, manager._core.runner.kv
    with torch.no_grad():  # one request: the states' size is known, a checkpoint kept
        core.add(core.new_request("a", list(range(3, 20)), SamplingParams(max_new_tokens=2)))
        while core.has_work:
            core.step()
    assert pool.states.in_use == len(kv.checkpoints) > 0
    rows = []
    while (row := kv.open()) is not None:
        rows.append(row)
        assert len(rows) < 64
    assert len(kv.checkpoints) == 0 and len(rows) == pool.states.capacity  # the checkpoints' slots went to rows
    for row in rows:
        kv.free(row)
    assert pool.states.in_use == 0
