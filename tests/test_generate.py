"""End to end: generate() with a PagedCache gives DynamicCache's tokens, and holds only real tokens."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from helpers import EOS, PAD, dynamic, early_eos_model, generate, left_padded, live_blocks_expected, tiny_model
from hf_paged import PagedCache, compat, disable_paged_attention, enable_paged_attention, paged_backend

LENGTHS = [3, 17, 9, 1]  # very different prompt lengths in one left-padded batch


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_left_padded_matches_dynamic(kind):
    model = tiny_model(kind, sliding_window=5) if kind == "mistral" else tiny_model(kind)
    inputs = left_padded(LENGTHS)
    expected = generate(model, inputs, dynamic(model), max_new_tokens=16)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=4, release_finished=False)
    assert torch.equal(generate(model, inputs, cache, max_new_tokens=16), expected)


def test_gathered_mode_without_enable_matches_and_warns_once(llama):
    inputs = left_padded(LENGTHS)
    expected = generate(llama, inputs, dynamic(llama))
    cache = PagedCache(llama.config, block_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(llama, inputs, cache)
    ours = [w for w in caught if "enable_paged_attention" in str(w.message)]
    assert torch.equal(out, expected)
    assert len(ours) == 1


def test_layers_reading_the_pool_get_no_mask(llama):
    """Steps whose layers read K/V through the block tables never use the attention mask, so none is built for them:
    the first prefill (the model's own attention) gets the padded batch's mask, the decode steps None; the tokens
    stay DynamicCache's."""
    inputs = left_padded(LENGTHS)
    expected = generate(llama, inputs, dynamic(llama), max_new_tokens=6)
    enable_paged_attention(llama, backend="torch")
    masks = []
    hook = llama.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    try:
        out = generate(llama, inputs, PagedCache(llama.config, block_size=4), max_new_tokens=6)
    finally:
        hook.remove()
    assert torch.equal(out, expected)
    assert isinstance(masks[0], torch.Tensor) and len(masks) == 6 and all(m is None for m in masks[1:])


def test_no_kv_slots_for_padding(llama):
    enable_paged_attention(llama, backend="torch")
    inputs = left_padded(LENGTHS)
    new = 10
    cache = PagedCache(llama.config, block_size=4, release_finished=False)
    out = generate(llama, inputs, cache, max_new_tokens=new, min_new_tokens=new)
    assert out.shape[1] == inputs["input_ids"].shape[1] + new
    kept = [n + new - 1 for n in LENGTHS]  # the last token generated never enters the cache
    stats = cache.memory_stats()
    assert stats.tokens_stored == sum(kept)
    assert stats.blocks_in_use == sum(math.ceil(n / 4) for n in kept)
    assert stats.peak_blocks_in_use == stats.blocks_in_use
    assert stats.utilization == sum(kept) / (stats.blocks_in_use * 4)
    assert stats.logical_tokens == sum(kept) and stats.num_sequences == len(LENGTHS)
    assert cache.get_seq_length() == inputs["input_ids"].shape[1] + new - 1


def test_sampling_with_seed_matches_dynamic(llama):
    inputs = left_padded([5, 11])
    torch.manual_seed(123)
    expected = generate(llama, inputs, dynamic(llama), do_sample=True, top_k=20, max_new_tokens=15)
    enable_paged_attention(llama, backend="torch")
    torch.manual_seed(123)
    out = generate(llama, inputs, PagedCache(llama.config, block_size=4), do_sample=True, top_k=20, max_new_tokens=15)
    assert torch.equal(out, expected)


def test_patched_model_without_paged_cache_is_unchanged():
    reference = tiny_model("llama", seed=3)
    patched = enable_paged_attention(tiny_model("llama", seed=3))
    inputs = left_padded([4, 9])
    with torch.no_grad():
        a = reference(**inputs).logits
        b = patched(**inputs).logits
        no_mask = patched(input_ids=inputs["input_ids"]).logits
    assert torch.equal(a, b)
    # Without a mask the model must stay causal: changing a later token leaves earlier logits alone.
    ids = inputs["input_ids"].clone()
    ids[:, -1] = (ids[:, -1] + 1) % 90 + 3
    with torch.no_grad():
        changed = patched(input_ids=ids).logits
    assert torch.equal(changed[:, :-1], no_mask[:, :-1])
    # Training: same loss and gradients.
    reference.train(), patched.train()
    labels = inputs["input_ids"]
    la = reference(input_ids=labels, labels=labels).loss
    lb = patched(input_ids=labels, labels=labels).loss
    la.backward(), lb.backward()
    assert torch.equal(la, lb)
    assert torch.equal(reference.model.layers[0].self_attn.q_proj.weight.grad,
                       patched.model.layers[0].self_attn.q_proj.weight.grad)
    # DynamicCache generation is unchanged.
    reference.eval(), patched.eval()
    assert torch.equal(generate(reference, inputs, dynamic(reference)), generate(patched, inputs, dynamic(patched)))


def test_enable_twice_and_disable(llama):
    cls = type(llama)
    before = llama.config._attn_implementation
    inputs = left_padded([4, 9])
    expected = generate(llama, inputs, dynamic(llama))
    assert enable_paged_attention(llama) is llama
    assert paged_backend(llama) == "auto"
    enable_paged_attention(llama, backend="torch")
    assert paged_backend(llama) == "torch"  # the second call changes the backend, the hooks stay one pair
    assert len(llama.model._forward_pre_hooks) == 1 and len(llama.model._forward_hooks) == 1
    assert llama.config._attn_implementation == "hf_paged_" + before
    assert torch.equal(generate(llama, inputs, PagedCache(llama.config, block_size=4)), expected)
    disable_paged_attention(llama)
    assert llama.config._attn_implementation == before
    assert not llama.model._forward_pre_hooks and not llama.model._forward_hooks
    with pytest.raises(ValueError, match="enable_paged_attention"):
        paged_backend(llama)
    # generate() and the stopping criteria are transformers' own again, not wrappers around them.
    assert llama.generate.__func__ is cls.generate
    assert llama._get_stopping_criteria.__func__ is cls._get_stopping_criteria
    assert torch.equal(generate(llama, inputs, dynamic(llama)), expected)
    # Enabling again after a disable works as the first time.
    enable_paged_attention(llama, backend="torch")
    assert torch.equal(generate(llama, inputs, PagedCache(llama.config, block_size=4)), expected)
    disable_paged_attention(llama)
    assert llama.generate.__func__ is cls.generate


def test_a_model_without_attention_interface_is_refused_by_name_and_gpt2_is_taken_generically():
    """A family whose attention does not go through transformers' AttentionInterface (Bloom) is refused with a
    ValueError naming it and the fix; GPT-2, which has no ModelPatch but whose attention does, is taken generically
    and gives DynamicCache's tokens (transformers 4.x's GPT-2 passes is_causal=False: refused by name at the first
    call instead)."""
    from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

    bloom = BloomForCausalLM(BloomConfig(n_layer=1, n_head=2, hidden_size=32, vocab_size=96))
    with pytest.raises(ValueError, match="model_type='bloom' has no attention behind transformers' "
                                         "AttentionInterface.*Fix"):
        enable_paged_attention(bloom)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96)).eval()
    gpt2.generation_config.pad_token_id, gpt2.generation_config.eos_token_id = PAD, EOS
    inputs = left_padded([4, 7])
    expected = generate(gpt2, inputs, dynamic(gpt2), max_new_tokens=6)
    enable_paged_attention(gpt2, backend="torch")
    if compat.TRANSFORMERS_VERSION.major < 5:
        with pytest.raises(ValueError, match=r"layer 0 \(GPT2Attention\) asks for non-causal attention"):
            generate(gpt2, inputs, PagedCache(gpt2.config, block_size=4), max_new_tokens=6)
        return
    assert torch.equal(generate(gpt2, inputs, PagedCache(gpt2.config, block_size=4), max_new_tokens=6), expected)


def test_eager_original_implementation_kept(llama):
    model = tiny_model("llama", attn="eager")
    inputs = left_padded([4, 7])
    expected = generate(model, inputs, dynamic(model))
    enable_paged_attention(model, backend="torch")
    assert torch.equal(generate(model, inputs, dynamic(model)), expected)
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=4)), expected)


def test_finished_rows_give_blocks_back():
    model, inputs = early_eos_model()
    expected = generate(model, inputs, dynamic(model), max_new_tokens=14)
    enable_paged_attention(model, backend="torch")
    keep = PagedCache(model.config, block_size=2, release_finished=False)
    out_keep = generate(model, inputs, keep, max_new_tokens=14)
    release = PagedCache(model.config, block_size=2)
    out_release = generate(model, inputs, release, max_new_tokens=14)
    assert torch.equal(out_keep, expected) and torch.equal(out_release, expected)
    tables, lens = release.block_tables(), release.seq_lens()
    assert tables[0] is None and lens[0] is None
    assert all(t is not None for t in tables[1:])
    assert lens[1:] == keep.seq_lens()[1:]
    assert all(len(t) == math.ceil(n / 2) for t, n in zip(tables[1:], lens[1:]))
    stats = release.memory_stats()
    assert stats.blocks_in_use == live_blocks_expected(release)
    assert keep.memory_stats().blocks_in_use - stats.blocks_in_use == math.ceil(keep.seq_lens()[0] / 2)
    assert stats.num_sequences == 2
    assert release.pool.memory_stats().blocks_in_use == stats.blocks_in_use  # released blocks are free in the pool
    release.pool.allocator.check_invariants()
    # Continuing the released row is an error, not silent attention over nothing.
    more = torch.cat([out_release, torch.full((3, 1), 5)], dim=1)
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, more.shape[1] - inputs["attention_mask"].shape[1])], 1)
    with pytest.raises(RuntimeError, match="released"):
        generate(model, {"input_ids": more, "attention_mask": mask.long()}, release, max_new_tokens=2)


def _per_step(out) -> dict:
    return {"scores": out.scores, "logits": out.logits}


@pytest.mark.parametrize("release_finished", [True, False])
def test_scores_and_logits_equal_dynamic_when_a_row_ends_early(release_finished):
    """Per-step outputs of a row that finished while others go on are what DynamicCache gives (not computed
    without the row's history)."""
    model, inputs = early_eos_model()
    kw = dict(max_new_tokens=14, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = generate(model, inputs, dynamic(model), **kw)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=2, release_finished=release_finished)
    out = generate(model, inputs, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    width = inputs["input_ids"].shape[1]
    assert (ref.sequences[0, width + 3:] == model.generation_config.pad_token_id).all()  # row 0 really ended early
    assert len(out.logits) == len(ref.logits) == ref.sequences.shape[1] - width
    for name, steps in _per_step(out).items():
        for step, (got, want) in enumerate(zip(steps, _per_step(ref)[name])):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}[{step}]: {m}")
    transition = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    expected = model.compute_transition_scores(ref.sequences, ref.scores, normalize_logits=True)
    torch.testing.assert_close(transition, expected, rtol=1e-4, atol=1e-4)
    cache.pool.allocator.check_invariants()


def test_batch_of_one_keeps_cache_for_next_turn(llama):
    enable_paged_attention(llama, backend="torch")
    first = left_padded([7])
    cache, ref_cache = PagedCache(llama.config, block_size=4), dynamic(llama)
    out = generate(llama, first, cache, max_new_tokens=5)
    ref = generate(llama, first, ref_cache, max_new_tokens=5)
    assert torch.equal(out, ref)
    turn2 = {"input_ids": torch.cat([out, torch.tensor([[7, 8, 9]])], 1)}
    turn2["attention_mask"] = torch.ones_like(turn2["input_ids"])
    assert torch.equal(generate(llama, turn2, cache, max_new_tokens=5), generate(llama, turn2, ref_cache, max_new_tokens=5))


class _StopRowsAt(StoppingCriteria):
    """Stops the given rows once they hold ``length`` columns (a user's own criterion, not EOS)."""

    def __init__(self, rows: list[int], length: int):
        self.rows, self.length = rows, length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] >= self.length:
            done[self.rows] = True
        return done


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        pass


def test_streaming_and_stopping_criteria(llama):
    inputs = left_padded([6])
    stop = StoppingCriteriaList([_StopRowsAt([0], 6 + 5)])  # ends after 5 of the 8 new tokens
    expected = generate(llama, inputs, dynamic(llama), max_new_tokens=8, stopping_criteria=stop)
    assert expected.shape[1] == 6 + 5
    enable_paged_attention(llama, backend="torch")
    streamer = _Collect()
    cache = PagedCache(llama.config, block_size=4)
    out = generate(llama, inputs, cache, max_new_tokens=8, streamer=streamer, stopping_criteria=stop)
    assert torch.equal(out, expected)
    assert sum(streamer.chunks, []) == out[0].tolist()  # the prompt, then each new token as it comes
    assert cache.seq_lens() == [6 + 5 - 1]  # a batch of one keeps its cache


def test_custom_stopping_criteria_release_rows():
    """A user's stopping criterion that ends some rows early: same tokens, and those rows' blocks go back."""
    model = tiny_model("llama", seed=3)
    inputs = left_padded([5, 8, 3], seed=2)
    width = inputs["input_ids"].shape[1]
    stop = StoppingCriteriaList([_StopRowsAt([0, 2], width + 3)])
    kw = dict(max_new_tokens=10, min_new_tokens=10, stopping_criteria=stop)
    expected = generate(model, inputs, dynamic(model), **kw)
    assert (expected[[0, 2], width + 3:] == model.generation_config.pad_token_id).all()
    enable_paged_attention(model, backend="torch")
    keep = PagedCache(model.config, block_size=2, release_finished=False)
    cache = PagedCache(model.config, block_size=2)
    assert torch.equal(generate(model, inputs, keep, **kw), expected)
    assert torch.equal(generate(model, inputs, cache, **kw), expected)
    assert cache.block_tables()[0] is None and cache.block_tables()[2] is None
    assert cache.seq_lens()[1] == keep.seq_lens()[1] == 8 + 10 - 1
    stats = cache.memory_stats()
    assert stats.num_sequences == 1
    assert stats.blocks_in_use == math.ceil((8 + 10 - 1) / 2)
    assert cache.pool.memory_stats().blocks_in_use == stats.blocks_in_use
    assert keep.memory_stats().blocks_in_use == live_blocks_expected(keep) > stats.blocks_in_use
    cache.pool.allocator.check_invariants()


def test_sliding_window_blocks_return_to_pool():
    model = tiny_model("mistral", sliding_window=6)
    inputs = left_padded([5, 13])
    expected = generate(model, inputs, dynamic(model), max_new_tokens=30, min_new_tokens=30)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=2)
    out = generate(model, inputs, cache, max_new_tokens=30, min_new_tokens=30)
    assert torch.equal(out, expected)
    stats = cache.memory_stats()
    # Each row keeps only the blocks overlapping its last 6 positions (plus the partly filled one).
    assert stats.blocks_in_use <= 2 * (6 // 2 + 1)
    assert stats.logical_tokens > 2 * 30
    cache.pool.allocator.check_invariants()


def test_rows_finishing_together_keep_their_cache(llama):
    """Rows that all finish at the same step keep their cache (the call is over, nothing to give back to)."""
    enable_paged_attention(llama, backend="torch")
    cache = PagedCache(llama.config)
    generate(llama, left_padded([3, 5]), cache, max_new_tokens=4, min_new_tokens=4)
    assert cache.seq_lens() == [3 + 3, 5 + 3]
    assert cache.memory_stats().num_sequences == 2
