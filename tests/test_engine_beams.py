"""Beam search in the engine: a request with ``num_beams = k`` runs as k rows of the packed batch, beside plain
requests, and returns the sequences (and scores) ``model.generate(num_beams=k)`` returns for it alone with a
``DynamicCache`` -- with ``num_return_sequences``, ``length_penalty``, ``early_stopping``, beam sampling, prefix
caching, chunked prefill and preemption (a preempted beam request is recomputed whole); its rows' blocks all go back.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from helpers import EOS, PAD, VOCAB, tiny_model
from helpers.engine_oracle import drive, random_prompts
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, RequestStatus, compat, enable_paged_attention, generate_batch, init_continuous_batching
from hf_paged.engine.outputs import RequestTooLargeError
from hf_paged.engine.sampling import SamplingParams

BLOCK = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def model():
    return enable_paged_attention(tiny_model("llama", seed=3), backend="torch")


def beam_reference(model, prompt: list[int], p: SamplingParams, seed: int | None = None):
    """``generate(num_beams=k)`` alone: ``[(generated ids, score)]`` of its ``num_return_sequences`` sequences."""
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = dict(do_sample=p.do_sample, temperature=p.temperature, top_k=p.top_k) if p.do_sample else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=p.max_new_tokens,
                             num_beams=p.num_beams, num_return_sequences=p.num_return_sequences,
                             length_penalty=p.length_penalty, early_stopping=p.early_stopping, eos_token_id=EOS,
                             pad_token_id=PAD, return_dict_in_generate=True, output_scores=True, output_logits=True,
                             **kwargs, **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    result = []
    for j in range(p.num_return_sequences):
        length = int((out.beam_indices[j] != -1).sum())  # this sequence's own generated length
        result.append((out.sequences[j, len(prompt): len(prompt) + length].tolist(), float(out.sequences_scores[j])))
    return result


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    return out[0, len(prompt):].tolist()


def mixed_specs(n: int, seed: int, shared=()):
    """Plain greedy requests and beam requests (2-4 beams, varied settings), in one list."""
    prompts = random_prompts(n, VOCAB, (2, 22), seed=seed, shared=shared)
    settings = [(1.0, False), (0.5, True), (-1.0, "never"), (2.0, False)]
    specs = []
    for i, prompt in enumerate(prompts):
        k = [1, 2, 3, 4][i % 4]
        kwargs = dict(max_new_tokens=4 + (i * 3) % 9, eos_token_ids=(EOS,))
        if k > 1:
            penalty, early = settings[i % len(settings)]
            kwargs.update(num_beams=k, num_return_sequences=1 + i % k, length_penalty=penalty, early_stopping=early)
        specs.append((f"r{i}", prompt, SamplingParams(**kwargs)))
    return specs


def check(model, reqs, specs) -> None:
    for rid, prompt, p in specs:
        req = reqs[rid]
        assert req.status == RequestStatus.FINISHED, (rid, req.status, req.error)
        if p.num_beams == 1:
            assert req.generated == greedy_reference(model, prompt, p.max_new_tokens), rid
            continue
        ref = beam_reference(model, prompt, p)
        got = [r.generated for r in (req, *req.children)]
        assert got == [tokens for tokens, _ in ref], (rid, got, ref)
        assert all(c.status == RequestStatus.FINISHED for c in req.children)
        scores = [score for _, score in req.beam.best()]
        assert scores == pytest.approx([score for _, score in ref], rel=1e-4, abs=1e-4), rid


SCENARIOS = {
    # name: (num_blocks, max_batch_tokens, prefix caching)
    "roomy": (256, 64, False),
    "prefix_hits_chunked": (256, 9, True),
    "pool_pressure": (24, 32, True),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_beams_among_plain_requests_equal_generate_alone(model, scenario):
    """Beam requests of 2-4 beams and plain requests in one engine: each beam request's sequences and scores equal
    generate(num_beams=k) alone, each plain request's tokens greedy generate(); prefix hits, chunked prefill and
    preemption (of beam groups, recomputed whole) leave that unchanged and every block comes back."""
    num_blocks, budget, prefix = SCENARIOS[scenario]
    shared = [random_prompts(1, VOCAB, (9, 9), 40)[0]] if prefix else []
    specs = mixed_specs(10, seed=len(scenario), shared=shared)
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix)
    core = init_continuous_batching(model, pool=pool, max_batch_tokens=budget)._core
    reqs = drive(core, specs, seed=3)
    check(model, reqs, specs)
    if prefix:
        assert core.scheduler.counters.prefix_hit_tokens > 0
    if scenario == "pool_pressure":
        assert core.scheduler.counters.preemptions > 0
    assert pool.allocator.blocks_in_use == 0
    pool.allocator.check_invariants()


def test_preempted_beam_request_is_recomputed_whole(model):
    """Plain requests admitted first grow into the room a beam request was admitted with: the beam group (the most
    recently admitted) gives back all its rows mid-search and starts again from its prompt, with the same result."""
    prompts = random_prompts(4, VOCAB, (6, 10), seed=2)
    pool = BlockPool(block_size=BLOCK, num_blocks=18, prefix_caching=True)
    core = init_continuous_batching(model, pool=pool, max_batch_tokens=32)._core
    preempted_searches = []
    preempt = core.scheduler.preempt

    def recording(req):
        if req.beam is not None:
            preempted_searches.append((req.beam.started, len(req.beam.requests)))
        preempt(req)

    core.scheduler.preempt = recording
    plain = [core.new_request(f"p{i}", prompts[i], SamplingParams(max_new_tokens=24, eos_token_ids=()))
             for i in range(3)]
    p = SamplingParams(max_new_tokens=8, num_beams=3, num_return_sequences=2, eos_token_ids=(EOS,))
    beam = core.new_request("b", prompts[3], p)
    with torch.no_grad():
        for req in plain:
            core.add(req)
        core.step()
        core.step()
        core.add(beam)
        while core.has_work:
            core.step()
            core.scheduler.check_invariants()
    assert (True, 3) in preempted_searches, preempted_searches  # preempted with its three rows, mid-search
    assert [beam.generated, beam.children[0].generated] == [t for t, _ in beam_reference(model, prompts[3], p)]
    for i, req in enumerate(plain):
        assert req.generated == greedy_reference(model, prompts[i], 24)
    assert pool.allocator.blocks_in_use == 0


def test_beam_sampling_with_a_seed_equals_generate_after_manual_seed(model):
    """Beam sampling (do_sample with num_beams) draws from the request's own generator: alone, its sequence is the
    one generate() gives after torch.manual_seed(seed)."""
    prompt = random_prompts(1, VOCAB, (9, 9), seed=5)[0]
    p = SamplingParams(do_sample=True, temperature=0.7, top_k=50, num_beams=3, seed=11, max_new_tokens=10,
                       eos_token_ids=(EOS,))
    core = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=128))._core
    reqs = drive(core, [("a", prompt, p), ("b", prompt[:5], 6)], seed=0)
    assert reqs["a"].generated == beam_reference(model, prompt, p, seed=11)[0][0]


def test_generate_batch_with_beams_returns_the_best_sequences(model):
    """generate_batch(num_beams=k, num_return_sequences=n): each prompt's n best sequences, the 2nd and later under
    transformers' fork names."""
    prompts = random_prompts(3, VOCAB, (4, 12), seed=9)
    out = generate_batch(model, prompts, max_new_tokens=6, num_beams=3, num_return_sequences=2, progress_bar=False,
                         pool=BlockPool(block_size=BLOCK, num_blocks=128))
    assert list(out) == ["req_0", "req_0__child#0", "req_1", "req_1__child#0", "req_2", "req_2__child#0"]
    p = SamplingParams(max_new_tokens=6, num_beams=3, num_return_sequences=2, eos_token_ids=(EOS,))
    for i, prompt in enumerate(prompts):
        ref = beam_reference(model, prompt, p)
        assert [out[f"req_{i}"].generated_tokens, out[f"req_{i}__child#0"].generated_tokens] == [t for t, _ in ref]
        assert out[f"req_{i}"].finish_reason in ("stop", "length")


def test_beam_request_cancelled_midway_gives_every_row_back(model):
    """Cancelling a beam request ends it and its children, and frees all its rows' blocks."""
    pool = BlockPool(block_size=BLOCK, num_blocks=128)
    core = init_continuous_batching(model, pool=pool)._core
    p = SamplingParams(max_new_tokens=30, num_beams=4, num_return_sequences=2, eos_token_ids=())
    req = core.new_request("a", random_prompts(1, VOCAB, (10, 10), seed=1)[0], p)
    core.add(req)
    with torch.no_grad():
        for _ in range(4):
            core.step()
    assert len(core.scheduler.running) == 4  # its four rows
    ended = core.cancel(req)
    assert {r.request_id for r in ended} == {"a", "a__child#0"}
    assert all(r.status == RequestStatus.CANCELLED for r in ended)
    assert not core.scheduler.running and pool.allocator.blocks_in_use == 0


def test_beam_request_larger_than_the_pool_is_refused_with_its_size(model):
    """A beam request is checked against the pool at its worst case: k rows at full length."""
    core = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=12))._core
    core.check_fits(8, 20)  # fits as one row
    with pytest.raises(RequestTooLargeError, match="with 4 beams"):
        core.check_fits(8, 20, num_beams=4)


def test_beam_settings_are_validated():
    with pytest.raises(ValueError, match="num_return_sequences=3 is more than num_beams=2"):
        SamplingParams(num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="logprobs with num_beams"):
        SamplingParams(num_beams=2, logprobs=0)
    assert SamplingParams.from_generation_config(None, num_beams=3, length_penalty=0.5,
                                                 early_stopping="never").num_beams == 3


def test_beams_apply_processors_as_generate_does(model):
    """Beam requests score their candidates after the request's processors (here n-gram blocking and bad words), as
    generate(num_beams=k) does; stopping rules other than EOS and length are refused with beams by name."""
    prompts = random_prompts(2, VOCAB, (5, 10), seed=31)
    settings = dict(num_beams=3, no_repeat_ngram_size=2, bad_words_ids=[[prompts[0][0]], [prompts[1][1]]])
    out = generate_batch(model, prompts, max_new_tokens=8, eos_token_id=EOS, progress_bar=False,
                         pool=BlockPool(block_size=BLOCK, num_blocks=128), **settings)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=8, eos_token_id=EOS,
                                 pad_token_id=PAD, **settings,
                                 **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
        assert out[f"req_{i}"].generated_tokens == ref[0, len(prompt):].tolist()
    with pytest.raises(ValueError, match="num_beams"):
        SamplingParams.from_generation_config(None, num_beams=2, max_time=5.0)
