"""The engine's per-request options that evaluation harnesses and benchmark tools rely on, on a tiny real model:
prompt logprobs (equal to the model's own log-softmax over a plain forward, through chunked prefill, prefix-cache
hits, preemption and batching with others), ``ignore_eos``, ``min_tokens`` and ``stop_token_ids``."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.engine_shadow import one_thread
from helpers.models import VOCAB, tiny_model

import hf_paged
from hf_paged import BlockPool
from hf_paged.engine.sampling import SamplingParams

TOL = 1e-4  # fp32: the packed paged forward against a plain forward of the same model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def direct_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), vocab]`` log-softmax of a plain forward (no cache), in float32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(out, model, prompt: list[int], k: int) -> None:
    ref = direct_logprobs(model, prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None and out.prompt_ranks[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_ranks) == len(out.prompt_top_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        row = ref[p - 1]
        assert abs(out.prompt_logprobs[p] - row[prompt[p]].item()) < TOL, p
        # rank: 1 + tokens strictly more likely (ties rank the token first); compared away from ties
        assert out.prompt_ranks[p] == 1 + int((row > row[prompt[p]] + TOL).sum()) or \
            (row - row[prompt[p]]).abs().min() < TOL
        top = out.prompt_top_logprobs[p]
        assert len(top) == k
        values, _ = row.topk(k)
        assert [round(v, 3) for _, v in top] == [round(v, 3) for v in values.tolist()]
        for token, value in top:
            assert abs(row[token].item() - value) < TOL


def test_prompt_logprobs_equal_a_plain_forward_through_chunks_and_batching(model):
    """Prompts longer than a step's token budget (so split over several chunks), batched with requests that ask
    nothing: each asking request gets one entry per prompt token (the first None) equal to the model's log-softmax
    at the previous position within 1e-4, with its own top-k; the others get none and the same tokens as alone."""
    prompts = [prompt_of(n, seed) for n, seed in ((45, 1), (23, 2), (60, 3), (9, 4))]
    pool = BlockPool(block_size=8, num_blocks=64, prefix_caching=True)
    with hf_paged.init_continuous_batching(model, pool=pool, max_batch_tokens=16) as manager:
        ids = [manager.add_request(p, max_new_tokens=3, prompt_logprobs=k)
               for p, k in zip(prompts, (2, None, 5, 0))]
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
    for out, prompt, k in zip(outs, prompts, (2, None, 5, 0)):
        assert len(out.generated_tokens) == 3
        if k is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(out, model, prompt, k)


def test_prompt_logprobs_survive_a_prefix_cache_hit_and_generate_batch(model):
    """A prompt whose blocks are cached by an earlier request still gets every prompt logprob (it takes no cached
    positions whose logits it lacks); one asking nothing takes the hit. generate_batch passes the option too."""
    shared = prompt_of(40, 7)
    pool = BlockPool(block_size=8, num_blocks=64, prefix_caching=True)
    with hf_paged.init_continuous_batching(model, pool=pool, max_batch_tokens=64) as manager:
        manager.get_result(manager.add_request(shared, max_new_tokens=2), timeout=120)
        hits = manager.stats().prefix_hit_tokens
        out = manager.get_result(manager.add_request(shared + [5, 6], max_new_tokens=2, prompt_logprobs=1),
                                 timeout=120)
        assert manager.stats().prefix_hit_tokens == hits  # no cached position used
        manager.get_result(manager.add_request(shared + [7], max_new_tokens=2), timeout=120)
        assert manager.stats().prefix_hit_tokens >= hits + 40  # the plain one hits
    check_prompt_logprobs(out, model, shared + [5, 6], 1)
    outs = hf_paged.generate_batch(model, [shared, prompt_of(12, 8)], max_new_tokens=2, prompt_logprobs=3,
                                   progress_bar=False, pool=BlockPool(block_size=8, num_blocks=64))
    check_prompt_logprobs(outs["req_0"], model, shared, 3)
    check_prompt_logprobs(outs["req_1"], model, prompt_of(12, 8), 3)


def test_prompt_logprobs_survive_preemption(model):
    """On a pool too small for all requests at once (preemptions happen), every request's prompt logprobs are
    still whole and right: positions computed before a preemption are kept, the rest computed on readmission."""
    prompts = [prompt_of(30 + 3 * i, 20 + i) for i in range(6)]
    pool = BlockPool(block_size=4, num_blocks=34, prefix_caching=True)
    with hf_paged.init_continuous_batching(model, pool=pool, max_batch_tokens=24) as manager:
        ids = [manager.add_request(p, max_new_tokens=12, prompt_logprobs=1) for p in prompts]
        outs = [manager.get_result(rid, timeout=300) for rid in ids]
        assert manager.stats().preemptions > 0
    for out, prompt in zip(outs, prompts):
        check_prompt_logprobs(out, model, prompt, 1)


def test_ignore_eos_min_tokens_and_stop_token_ids(model):
    """With EOS set to the greedy first token, a request stops after one token; ``ignore_eos`` gives exactly
    max_new_tokens; ``min_tokens`` masks EOS until that many tokens (the first token changes, none of the first
    min_tokens is EOS); a stop token id ends the request even with ``ignore_eos``."""
    prompt = prompt_of(12, 11)
    pool = BlockPool(block_size=8, num_blocks=32)
    with hf_paged.init_continuous_batching(model, pool=pool) as manager:
        free = manager.get_result(manager.add_request(prompt, max_new_tokens=8, eos_token_id=[]), timeout=60)
        first = free.generated_tokens[0]
        stopped = manager.get_result(manager.add_request(prompt, max_new_tokens=8, eos_token_id=first), timeout=60)
        assert stopped.generated_tokens == [first] and stopped.finish_reason == "stop"
        ignored = manager.get_result(manager.add_request(prompt, max_new_tokens=8, eos_token_id=first,
                                                         ignore_eos=True), timeout=60)
        assert ignored.generated_tokens == free.generated_tokens and ignored.finish_reason == "length"
        held = manager.get_result(manager.add_request(prompt, max_new_tokens=8, eos_token_id=first,
                                                      min_tokens=4), timeout=60)
        assert len(held.generated_tokens) >= 4 and first not in held.generated_tokens[:4]
        third = free.generated_tokens[2]
        cut = manager.get_result(manager.add_request(prompt, max_new_tokens=8, ignore_eos=True,
                                                     stop_token_ids=[third], eos_token_id=[]), timeout=60)
        assert cut.generated_tokens == free.generated_tokens[:free.generated_tokens.index(third) + 1]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=2, min_tokens=3)
