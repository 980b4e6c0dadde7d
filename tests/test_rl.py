"""Training-time use of the engine: transformers' model methods (``model.generate_batch`` & co.) routed to hf_paged's
engine, no K/V computed with older weights ever reused (engine, persistent manager, and ``generate()`` on a shared
prefix-caching pool), sleep / wake giving the pool's memory back, and the sampled tokens' logprobs.

Token equality is against each request alone through ``generate()`` with a ``DynamicCache`` on the *current* weights
(``helpers.engine_oracle``), and against transformers' own ``generate_batch``.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

from helpers import VOCAB, decoder_token_counter, tiny_model
from helpers.engine_oracle import TieCount, check_tokens, reference
from helpers.engine_shadow import one_thread

import hf_paged
from hf_paged import BlockPool, PagedCache
from hf_paged.allocator import BlockAllocator
from hf_paged.engine.transformers_api import installed
from hf_paged.weights import WeightsWatch

NEW = 6
BLOCK = 4
CB = dict(num_blocks=64, max_batch_tokens=64, page_size=4)  # small sizes: transformers' CPU defaults build huge masks


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def prompts(n: int, seed: int, length: int = 13) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(8)]  # two full blocks every prompt starts with
    return [shared + [rng.randrange(3, VOCAB) for _ in range(length - 8)] for _ in range(n)]


def check_against_generate(model, prompt_list, outputs, new=NEW):
    ties = TieCount()
    for i, (prompt, tokens) in enumerate(zip(prompt_list, outputs)):
        check_tokens(f"prompt {i}", tokens, reference(model, prompt, new), ties)


def perturb(model, seed: int, scale: float = 0.5) -> None:
    """An in-place weight update large enough to change greedy tokens (as an optimizer step does, in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))


def tokens_of(outputs: dict) -> list[list[int]]:
    return [out.generated_tokens for out in outputs.values()]


# ------------------------------------------------------------------ model methods
def test_model_generate_batch_runs_hf_paged_engine_with_transformers_shape():
    """After enable_paged_attention, ``model.generate_batch`` with transformers' arguments runs hf_paged's engine
    (its stats count the prompts), returns ``{req_N: GenerationOutput}`` with forks before their parent as
    transformers orders them, the tokens transformers' own generate_batch gives; disable restores transformers'."""
    model = tiny_model(seed=11)
    batch = prompts(3, seed=1)
    reference_outputs = model.generate_batch(
        batch, generation_config=model.generation_config, max_new_tokens=NEW,
        continuous_batching_config=ContinuousBatchingConfig(auto_switch_to_flash=False, **CB))
    hf_paged.enable_paged_attention(model, backend="torch")
    assert installed(model) is not None
    outputs = model.generate_batch(batch, max_new_tokens=NEW, persistent_manager=True,
                                   continuous_batching_config=ContinuousBatchingConfig(**CB), progress_bar=False)
    assert list(outputs) == ["req_0", "req_1", "req_2"]
    assert tokens_of(outputs) == tokens_of(reference_outputs)
    check_against_generate(model, batch, tokens_of(outputs))
    manager = hf_paged.engine_of(model)
    assert manager is not None and model.init_continuous_batching() is manager
    stats = manager.stats()
    assert stats.prompt_tokens == sum(map(len, batch)) and stats.generated_tokens == 3 * NEW
    assert stats.prompt_tokens_computed < stats.prompt_tokens  # the shared first blocks computed once

    # num_return_sequences: forks named and ordered as transformers', ids continuing on the persistent manager
    config = model.generation_config.__class__(**model.generation_config.to_diff_dict())
    config.num_return_sequences, config.do_sample, config.top_k = 2, True, 1  # top_k=1: sampling = greedy
    forked = model.generate_batch(batch[:2], generation_config=config, max_new_tokens=NEW)
    assert list(forked) == ["req_3__child#0", "req_3", "req_4__child#0", "req_4"]
    assert tokens_of(forked) == [t for t in tokens_of(outputs)[:2] for _ in range(2)]

    with model.continuous_batching_context_manager() as cm:
        assert cm is manager and cm.is_running()
        rid = cm.add_request(batch[0], max_new_tokens=NEW)
        assert cm.get_result(rid).generated_tokens == tokens_of(outputs)[0]
    assert not manager.is_running() and hf_paged.engine_of(model) is manager  # kept for the next session

    with pytest.raises(TypeError, match="unexpected keyword arguments \\['penalty_alpha'\\]"):
        model.generate_batch(batch, penalty_alpha=0.6)
    config.do_sample = False  # refused (identical sequences): one FAILED result per prompt, named
    refused = model.generate_batch(batch[:1], generation_config=config, max_new_tokens=NEW)
    assert list(refused) == ["req_5"] and "num_return_sequences > 1 is not served" in refused["req_5"].error
    hf_paged.disable_paged_attention(model)
    assert installed(model) is None and "generate_batch" not in model.__dict__
    assert model.generate_batch.__func__ is type(model).generate_batch
    assert not manager.is_running()


def test_non_persistent_calls_build_their_own_engine_and_stop_it():
    """Without a persistent manager each call builds an engine and stops it; transformers' manager calls
    (``init_continuous_batching`` then ``stop(keep_for_next_session=True)``) make it the persistent one."""
    model = hf_paged.attach_paged_attention(tiny_model(seed=12), backend="torch")
    batch = prompts(2, seed=2)
    first = model.generate_batch(batch, max_new_tokens=NEW, pool=BlockPool(BLOCK, num_blocks=32))
    assert hf_paged.engine_of(model) is None and list(first) == ["req_0", "req_1"]
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(**CB))
    manager.start()
    rid = manager.add_request(batch[1], max_new_tokens=NEW)
    assert manager.get_result(rid).generated_tokens == first["req_1"].generated_tokens
    manager.stop(keep_for_next_session=True)
    assert hf_paged.engine_of(model) is manager
    again = model.generate_batch(batch, max_new_tokens=NEW)
    assert tokens_of(again) == tokens_of(first) and manager.stats().prefix_hit_tokens > 0
    model.destroy_cached_continuous_batching_manager()
    assert hf_paged.engine_of(model) is None
    hf_paged.disable_paged_attention(model)


# ------------------------------------------------------------------ stale K/V
def test_allocator_reset_forgets_cached_and_live_keys():
    """reset_prefix_cache: cached blocks are freed, blocks held live are unkeyed (freed, not cached, when let go)
    and live sequences stop keying what they fill next."""
    a = BlockAllocator(4, num_blocks=16, prefix_caching=True)
    tokens = list(range(12))
    done, live = a.new_sequence(), a.new_sequence()
    a.append([(done, 12), (live, 8)], [tokens, tokens[:8]])
    a.free(done)
    assert a.num_cached == 3 and len(a.match_prefix(tokens)) == 3
    a.reset_prefix_cache()
    a.check_invariants()
    assert a.num_cached == 0 and a.match_prefix(tokens) == [] and a.prefix_epoch == 1
    a.append([(live, 4)], [tokens[8:]])  # a full block written after the reset: never keyed
    a.free(live)
    a.check_invariants()
    assert a.num_cached == 0 and a.match_prefix(tokens) == [] and a.num_free == 16


@pytest.mark.parametrize("update", ["in_place", "load_state_dict"])
def test_engine_on_shared_pool_never_reuses_kv_of_older_weights(update):
    """Two generate_batch calls on one prefix-caching pool with a weight change between: the second equals a
    fresh engine (and generate() alone) on the new weights; without a change the second call hits the cache."""
    model = hf_paged.attach_paged_attention(tiny_model(seed=13), backend="torch")
    batch = prompts(3, seed=3)
    pool = BlockPool(BLOCK, num_blocks=64, prefix_caching=True)
    first = hf_paged.generate_batch(model, batch, pool=pool, max_new_tokens=NEW, progress_bar=False)
    hits = pool.allocator.prefix_hits
    same = hf_paged.generate_batch(model, batch, pool=pool, max_new_tokens=NEW, progress_bar=False)
    assert tokens_of(same) == tokens_of(first) and pool.allocator.prefix_hits > hits  # unchanged: cache used
    if update == "in_place":
        perturb(model, seed=1)
    else:
        model.load_state_dict(tiny_model(seed=14).state_dict())
    hits = pool.allocator.prefix_hits
    second = hf_paged.generate_batch(model, batch, pool=pool, max_new_tokens=NEW, progress_bar=False)
    fresh = hf_paged.generate_batch(model, batch, pool=BlockPool(BLOCK, num_blocks=64, prefix_caching=True),
                                    max_new_tokens=NEW, progress_bar=False)
    assert tokens_of(second) == tokens_of(fresh) != tokens_of(first)
    check_against_generate(model, batch, tokens_of(second))
    # the first prompt's lookup finds nothing; the later ones share the blocks it computed on the new weights
    assert pool.allocator.prefix_hits - hits < (len(batch) - 1) * 8 + 1
    assert pool.prefix_epoch >= 1


def test_persistent_manager_across_a_training_step():
    """A persistent manager, a real training step (loss, backward, optimizer.step) between two model.generate_batch
    calls on the same prompts: the second call equals a fresh engine on the trained weights."""
    model = hf_paged.enable_paged_attention(tiny_model(seed=15), backend="torch")
    manager = hf_paged.keep_engine(model, pool=BlockPool(BLOCK, num_blocks=64, prefix_caching=True))
    batch = prompts(3, seed=4)
    before = model.generate_batch(batch, max_new_tokens=NEW)
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    model.train()
    ids = torch.tensor(batch)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    model.eval()
    after = model.generate_batch(batch, max_new_tokens=NEW)
    fresh = hf_paged.generate_batch(model, batch, pool=BlockPool(BLOCK, num_blocks=64, prefix_caching=True),
                                    max_new_tokens=NEW, progress_bar=False)
    assert tokens_of(after) == tokens_of(fresh) != tokens_of(before)
    check_against_generate(model, batch, tokens_of(after))
    assert list(after) == ["req_3", "req_4", "req_5"]  # ids continue on the persistent manager
    # the explicit reset: the next call computes every prompt again
    computed = manager.stats().prompt_tokens_computed
    manager.weights_updated()
    model.generate_batch(batch[:1], max_new_tokens=NEW)
    assert manager.stats().prompt_tokens_computed - computed == len(batch[0])
    hf_paged.disable_paged_attention(model)


def test_generate_on_shared_pool_never_reuses_kv_of_older_weights():
    """generate() with PagedCaches on one prefix-caching pool: after an in-place weight change the next call
    recomputes its prompt (decoder sees every column) and equals DynamicCache on the new weights."""
    model = hf_paged.enable_paged_attention(tiny_model(seed=16), backend="torch")
    prompt = prompts(1, seed=5)[0]
    pool = BlockPool(BLOCK, num_blocks=64, prefix_caching=True)

    def run():
        cache = PagedCache(model.config, pool=pool)
        with decoder_token_counter(model) as seen:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, past_key_values=cache)
        return out[0, len(prompt):].tolist(), seen[0]

    run()
    _, first_columns = run()
    assert first_columns < len(prompt)  # unchanged weights: the cached prefix is reused
    perturb(model, seed=2)
    tokens, columns = run()
    assert columns == len(prompt)
    assert tokens == reference(model, prompt, NEW).tokens
    hf_paged.disable_paged_attention(model)


def test_weights_check_sees_in_place_updates_and_replaced_tensors():
    """The weights version changes with an optimizer step, load_state_dict and a replaced parameter, not
    otherwise."""
    model = tiny_model(seed=17)
    watch = WeightsWatch()
    assert not watch.changed(model) and not watch.changed(model)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))
    assert not watch.changed(model)  # a forward changes nothing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    opt.zero_grad(set_to_none=False)
    assert not watch.changed(model)  # gradients are not weights
    model(torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    opt.step()
    assert watch.changed(model) and not watch.changed(model)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # writes without bumping the counters
    fused.step()
    assert watch.changed(model) and not watch.changed(model)
    model.load_state_dict(model.state_dict())
    assert watch.changed(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert not watch.changed(model, rewalk=False)  # the tensors of the last walk: the new one not among them
    assert watch.changed(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert watch.changed(model, rewalk=False)  # in place: seen without a walk
    assert watch.changed(tiny_model(seed=17))  # another model


# ------------------------------------------------------------------ memory, logprobs
def test_sleep_frees_the_pool_and_wake_takes_it_back():
    """sleep() frees the pool's K/V tensors (the bytes it reports) and the prefix cache; generation after wake()
    (or the next call, waking by itself) gives the same tokens."""
    model = hf_paged.enable_paged_attention(tiny_model(seed=18), backend="torch")
    manager = hf_paged.keep_engine(model, pool=BlockPool(BLOCK, num_blocks=64, prefix_caching=True))
    batch = prompts(3, seed=6)
    before = model.generate_batch(batch, max_new_tokens=NEW)
    held = manager.pool.bytes_reserved()
    assert held > 0
    assert manager.sleep() == held and manager.pool.bytes_reserved() == 0 and manager.asleep
    assert manager.pool.allocator.num_cached == 0
    assert manager.wake() == held and not manager.asleep
    assert tokens_of(model.generate_batch(batch, max_new_tokens=NEW)) == tokens_of(before)
    manager.sleep()
    assert tokens_of(model.generate_batch(batch, max_new_tokens=NEW)) == tokens_of(before)  # woke by itself
    manager.start()
    with pytest.raises(RuntimeError, match="stop it first"):
        manager.sleep()
    manager.stop(keep_for_next_session=True)
    hf_paged.disable_paged_attention(model)


def test_sampled_token_logprobs_through_model_generate_batch():
    """ContinuousBatchingConfig(return_logprobs=True): each output carries its sampled tokens' log-probabilities,
    equal to the log-softmax of a plain forward over prompt + generated tokens (greedy here)."""
    model = hf_paged.enable_paged_attention(tiny_model(seed=19), backend="torch")
    batch = prompts(2, seed=7)
    outputs = model.generate_batch(batch, max_new_tokens=NEW, continuous_batching_config=ContinuousBatchingConfig(
        return_logprobs=True, **CB))
    for prompt, out in zip(batch, outputs.values()):
        assert len(out.logprobs) == len(out.generated_tokens) == NEW
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.generated_tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)  # [len, vocab]
        for i, (token, lp) in enumerate(zip(out.generated_tokens, out.logprobs)):
            assert abs(lp - logp[len(prompt) - 1 + i, token].item()) < 1e-4
    hf_paged.disable_paged_attention(model)


def test_generate_batch_after_transformers_own_in_every_call_shape():
    """transformers' own ``generate_batch`` ran on the model first (it writes eos_token_id=-1, "disabled", into a
    generation config without EOS); then, paged, every call shape transformers' accepts (a GenerationConfig with
    max_new_tokens, keywords, both) gives the same tokens as transformers' own and generate() per prompt, never an
    empty completion."""
    model = tiny_model(seed=5)
    batch = prompts(4, seed=3, length=17)

    def config(**extra):
        return GenerationConfig(**{"max_new_tokens": 8, "do_sample": False, "eos_token_id": None, "pad_token_id": 0,
                                   **extra})

    gc = config()
    theirs = tokens_of(model.generate_batch(
        batch, generation_config=gc, continuous_batching_config=ContinuousBatchingConfig(auto_switch_to_flash=False,
                                                                                         **CB)))
    assert gc.eos_token_id == -1  # what transformers' manager leaves on the config it was given
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), generation_config=config(), past_key_values=DynamicCache())[
            0, len(p):].tolist() for p in batch]
    assert theirs == alone and all(len(t) == 8 for t in alone)
    hf_paged.enable_paged_attention(model, backend="torch")
    shapes = {
        "config": dict(generation_config=gc),
        "fresh config": dict(generation_config=config()),
        "config and keywords": dict(generation_config=config(max_new_tokens=3), max_new_tokens=8),
        "keywords": dict(max_new_tokens=8, do_sample=False, eos_token_id=-1),
    }
    for name, kwargs in shapes.items():
        outs = model.generate_batch(batch, **kwargs)
        assert [o.error for o in outs.values()] == [None] * 4, name
        assert tokens_of(outs) == alone, name
    hf_paged.disable_paged_attention(model)
