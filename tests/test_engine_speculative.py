"""Speculative decoding in the engine: n-gram prompt lookup and a draft model, verified in the packed step beside plain
and beam requests. Greedy requests get exactly the tokens of greedy ``generate()`` alone (drafts accepted or not, rows
cut back after rejections, under pool pressure); sampled requests get the target distribution (rejection sampling,
checked with chi-square tests at a fixed seed); the per-step policy turns drafts off where a step's cost grows with its
tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from helpers import EOS, PAD, VOCAB, tiny_model
from helpers.engine_oracle import drive, random_prompts
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, RequestStatus, compat, enable_paged_attention, generate_batch, init_continuous_batching
from hf_paged.engine.sampling import SamplingParams
from hf_paged.engine.request import Request
from hf_paged.engine.speculative import (PRIOR_ACCEPTANCE, DraftModelProposer, NgramProposer, SpeculationPolicy,
                                         accept_sampled)

BLOCK = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def model():
    return enable_paged_attention(tiny_model("llama", seed=3), backend="torch")


def greedy(model, prompt: list[int], max_new_tokens: int, repetition_penalty=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS, pad_token_id=PAD, repetition_penalty=repetition_penalty,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    return out[0, len(prompt):].tolist()


def grounded_prompts(model, n: int, seed: int) -> list[list[int]]:
    """Prompts that end where their own text repeats: a random start, the model's greedy continuation, and the start
    again (so prompt lookup finds what comes next)."""
    prompts = []
    for i, start in enumerate(random_prompts(n, VOCAB, (3, 8), seed=seed)):
        prompts.append(start + greedy(model, start, 10 + i % 5) + start)
    return prompts


def always(engine_core) -> None:
    """Make the policy speculate at every step (the tests check tokens, not speed)."""
    engine_core.speculation.policy.choose = lambda options: len(options) - 1


def specs_with_drafts(model, seed: int):
    prompts = grounded_prompts(model, 6, seed) + random_prompts(3, VOCAB, (2, 15), seed=seed + 1)
    specs = []
    for i, prompt in enumerate(prompts):
        kwargs = dict(max_new_tokens=6 + (i * 5) % 14, eos_token_ids=(EOS,))
        if i == 2:
            kwargs["repetition_penalty"] = 1.3
        if i == 4:
            kwargs["prompt_lookup_num_tokens"] = 0  # this one never speculates
        if i == 7:
            kwargs.update(num_beams=2)
        specs.append((f"r{i}", prompt, SamplingParams(**kwargs)))
    return specs


def check_greedy(model, reqs, specs) -> None:
    for rid, prompt, p in specs:
        req = reqs[rid]
        assert req.status == RequestStatus.FINISHED, (rid, req.error)
        if p.num_beams == 1:
            assert req.generated == greedy(model, prompt, p.max_new_tokens, p.repetition_penalty), rid


SCENARIOS = {
    # name: (num_blocks, max_batch_tokens, prefix caching)
    "roomy": (256, 64, False),
    "pool_pressure_prefix_hits": (30, 24, True),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ngram_speculation_gives_greedy_tokens(model, scenario):
    """Prompt lookup on input-grounded prompts, beside a request that opts out, one with a repetition penalty and a
    beam request: drafts are accepted (> 0), every greedy request's tokens equal generate() alone, rejected tokens'
    K/V is cut off (each row holds exactly its computed tokens) and every block comes back."""
    num_blocks, budget, prefix = SCENARIOS[scenario]
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix)
    core = init_continuous_batching(model, pool=pool, max_batch_tokens=budget, speculative="ngram",
                                    num_speculative_tokens=5)._core
    always(core)
    specs = specs_with_drafts(model, seed=len(scenario))
    reqs = drive(core, specs, seed=2)
    check_greedy(model, reqs, specs)
    stats = core.speculation.stats
    assert stats.accepted > 0 and stats.proposed > stats.accepted  # some drafts were cut back too
    if "pressure" in scenario:
        assert core.scheduler.counters.preemptions > 0
    assert pool.allocator.blocks_in_use == 0
    pool.allocator.check_invariants()


def test_prompt_lookup_per_request_without_an_engine_default(model):
    """prompt_lookup_num_tokens on one request speculates for it alone (generate()'s setting, through
    generate_batch); its tokens stay greedy generate()'s."""
    prompts = grounded_prompts(model, 2, seed=11)
    out = generate_batch(model, prompts, max_new_tokens=12, prompt_lookup_num_tokens=4, progress_bar=False,
                         pool=BlockPool(block_size=BLOCK, num_blocks=128))
    for i, prompt in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == greedy(model, prompt, 12)


@pytest.mark.parametrize("draft_seed, draft_layers", [(3, 2), (4, 1)])
def test_draft_model_gives_greedy_tokens(model, draft_seed, draft_layers):
    """A draft model (the same weights: drafts accepted; another 1-layer model: mostly rejected) proposes in its own
    pool; tokens equal greedy generate() alone either way, and both pools end empty."""
    draft = enable_paged_attention(tiny_model("llama", seed=draft_seed, num_hidden_layers=draft_layers),
                                   backend="torch")
    pool = BlockPool(block_size=BLOCK, num_blocks=256, prefix_caching=True)
    core = init_continuous_batching(model, pool=pool, max_batch_tokens=64, speculative=draft,
                                    num_speculative_tokens=4)._core
    always(core)
    specs = specs_with_drafts(model, seed=5)
    reqs = drive(core, specs, seed=4)
    check_greedy(model, reqs, specs)
    stats = core.speculation.stats
    assert stats.proposed > 0
    if draft_seed == 3:
        assert stats.accepted > stats.proposed // 2
    assert pool.allocator.blocks_in_use == 0
    assert core.speculation.draft.kv.pool.allocator.blocks_in_use == 0


def p_value(observed: list[float], expected: list[float], min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit (cells expecting fewer than ``min_expected`` merged into one)."""
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected):
        if e < min_expected:
            rest_o, rest_e = rest_o + o, rest_e + e
        else:
            obs.append(o)
            exp.append(e)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def test_rejection_sampling_keeps_the_target_distribution():
    """accept_sampled on fixed distributions: the first token's distribution is p0 and, after an accepted draft, the
    second's is p1 (chi-square); a scheme that keeps every draft fails the same test."""
    p0 = torch.tensor([0.1, 0.5, 0.25, 0.15])
    p1 = torch.tensor([0.3, 0.05, 0.45, 0.2])
    probs = torch.stack([p0, p1])
    generator = torch.Generator().manual_seed(0)
    n = 20000
    first, second = torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        out = accept_sampled(probs, [2], generator)
        first[out[0]] += 1
        if out[0] == 2:
            second[out[1]] += 1
    assert p_value(first.tolist(), (p0 * n).tolist()) > 1e-4
    assert p_value(second.tolist(), (p1 * second.sum()).tolist()) > 1e-4
    always_kept = torch.zeros(4)
    always_kept[2] = n
    assert p_value(always_kept.tolist(), (p0 * n).tolist()) < 1e-6


def test_sampling_with_speculation_matches_the_target_distribution(model):
    """A sampled request (top_k=4) with drafts of one token on an input-grounded prompt, forked 1500 times
    (num_return_sequences; unseeded, the global generator seeded here: a seeded request decodes plainly): drafts
    are accepted and rejected, and the second and third tokens follow the model's own distribution given the first
    (chi-square over (first, second, third) cells)."""
    prompt = grounded_prompts(model, 1, seed=21)[0]
    n = 1500
    torch.manual_seed(1234)
    params = SamplingParams(do_sample=True, top_k=4, max_new_tokens=3, num_return_sequences=n,
                            prompt_lookup_num_tokens=1, eos_token_ids=())
    core = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=4096),
                                    max_batch_tokens=4096)._core
    always(core)
    reqs = drive(core, [("a", prompt, params)], seed=0)
    req = reqs["a"]
    outputs = [r.generated for r in (req, *req.children)]
    stats = core.speculation.stats
    assert 0 < stats.accepted < stats.proposed  # both branches of the acceptance ran

    def probs(tokens):  # the target's sampling distribution after ``tokens``
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        top = logits.topk(4)
        p = torch.zeros_like(logits)
        p[top.indices] = top.values.softmax(-1)
        return p

    observed: dict[tuple[int, int, int], int] = {}
    for out in outputs:
        observed[tuple(out)] = observed.get(tuple(out), 0) + 1
    firsts: dict[int, int] = {}
    for out in outputs:
        firsts[out[0]] = firsts.get(out[0], 0) + 1
    cells_obs, cells_exp = [], []
    for t1, count in firsts.items():
        p2 = probs([t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = probs([t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                cells_obs.append(observed.get((t1, t2, t3), 0))
                cells_exp.append(count * float(p2[t2]) * float(p3[t3]))
    assert sum(cells_obs) == n
    assert p_value(cells_obs, cells_exp) > 1e-4


def test_policy_turns_drafts_off_where_a_step_costs_its_tokens():
    """The policy runs the draft length with the most expected tokens per second: with step costs flat in their
    tokens, the longest drafts; where cost grows with tokens (compute-bound), a plain step; unmeasured step sizes
    are measured first; a token cap keeps larger steps plain."""
    policy = SpeculationPolicy()
    one = [(1, 1.0, 0, 0), (2, 1.6, 0, 0), (5, 2.8, 0, 0)]  # (tokens, expected tokens, drafting, draft forwards)
    assert policy.choose(one) == 0  # nothing measured: measure (the plain step first)
    for tokens, seconds in ((1, 0.010), (2, 0.011), (5, 0.012)):
        policy.observe(tokens, seconds)
    assert policy.choose(one) == 2  # 2.8 tokens / 12 ms
    many = [(16, 16.0, 0, 0), (32, 25.0, 0, 0), (80, 40.0, 0, 0)]
    for tokens, seconds in ((16, 0.1), (32, 0.2), (80, 0.5)):
        policy.observe(tokens, seconds)
    assert policy.choose(many) == 0  # 16 / 100 ms beats 25 / 200 ms and 40 / 500 ms
    drafted = [(1, 1.0, 0, 0), (5, 4.0, 1, 4)]  # a draft model: 4 draft forwards of 5 ms each
    policy.observe(1, 0.005, policy.draft_costs)
    assert policy.choose(drafted) == 1  # 4 / 32 ms beats 1 / 10 ms
    policy.observe(1, 0.050, policy.draft_costs)
    policy.observe(1, 0.050, policy.draft_costs)
    assert policy.choose(drafted) == 0  # drafting became expensive
    capped = SpeculationPolicy(max_tokens=4)
    for tokens in (1, 2, 5):
        capped.observe(tokens, 0.01)
    assert capped.choose(one) == 1


def test_draft_row_ahead_of_its_request_reruns_the_last_token(model):
    """Fuzz finding F5: a draft row can hold K/V for all of its request's tokens -- the request did not run the step
    it drafted for (preempted, or left out of a full pool), or it verified a shorter draft than the draft model ran
    and the target's own token was the next draft token. The next proposal must rerun the last token (its logits give
    the first draft token), not call the draft model on 0 tokens; the drafts stay the draft model's greedy ones."""
    draft = DraftModelProposer(model, block_size=BLOCK)
    prompt = random_prompts(1, VOCAB, (9, 10), seed=7)[0]
    req = Request(request_id="r", tokens=list(prompt), num_prompt=len(prompt), max_new_tokens=16, max_length=64)
    [first] = draft.propose_all([req], 5)
    assert first == greedy(model, prompt, 5)
    assert draft.propose_all([req], 3) == [first[:3]]  # the step did not run: the request has the same tokens
    req.tokens += first[:2]  # two tokens taken from a draft of which the model computed four
    assert draft.propose_all([req], 3) == [first[2:5]]
    draft.forget(req)
    assert draft.kv.pool.allocator.blocks_in_use == 0


def test_ngram_proposer_takes_what_followed_the_latest_match():
    proposer = NgramProposer(max_ngram=3)

    class Req:
        tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]

    assert proposer.propose(Req, 3) == [1, 2, 5]  # "5 6 7" last seen before the end at position 7
    Req.tokens = Req.tokens + [4]
    assert proposer.propose(Req, 2) == []  # "4" never seen before


def test_speculation_settings_are_validated(model):
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens with num_beams"):
        SamplingParams(num_beams=2, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="speculative must be None, 'ngram' or a draft model"):
        init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=16), speculative="eagle")


def test_sliding_window_model_drafts_within_its_window():
    """On a sliding-window model (window 4) drafts are capped at 3 tokens, so a row can always be cut back; greedy
    tokens stay generate()'s."""
    model = enable_paged_attention(tiny_model("mistral", seed=3, sliding_window=4), backend="torch")
    core = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=128), speculative="ngram")._core
    assert core.speculation.max_draft == 3
    always(core)
    specs = [(f"r{i}", p * 3, SamplingParams(max_new_tokens=16, eos_token_ids=(EOS,)))
             for i, p in enumerate(random_prompts(3, VOCAB, (4, 8), seed=1))]
    reqs = drive(core, specs, seed=0)
    check_greedy(model, reqs, specs)
    assert core.speculation.stats.proposed > 0


def test_requests_with_processors_verify_drafts_through_them(model):
    """A drafting request with processors that read only its ids (sequence bias, bad words, a repetition penalty)
    verifies its drafts through the sampler's whole processing stage, so its tokens are generate()'s with the same
    settings; a request with its own logits processor (called once per step by contract) decodes plainly beside it,
    equal too."""
    prompts = grounded_prompts(model, 3, seed=21)
    bias = {(prompts[0][-1],): -2.0}
    bad = [[prompts[1][3]]]

    def shift(ids, scores):  # deterministic, reads only this request's ids
        scores = scores.clone()
        scores[0, int(ids[0, -1]) % VOCAB] -= 1.0
        return scores

    settings = [dict(sequence_bias=bias, repetition_penalty=1.2), dict(bad_words_ids=bad), dict(logits_processor=[shift])]
    manager = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=256), max_batch_tokens=64,
                                       speculative="ngram", num_speculative_tokens=4)
    always(manager._core)
    with manager:
        rids = [manager.add_request(p, max_new_tokens=12, eos_token_id=EOS, **kw) for p, kw in zip(prompts, settings)]
        results = [manager.get_result(rid, timeout=120) for rid in rids]
    assert manager._core.speculation.stats.accepted > 0
    for prompt, kw, out in zip(prompts, settings, results):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=12, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=PAD, **kw,
                                 **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
        assert out.generated_tokens == ref[0, len(prompt):].tolist(), kw


def test_plain_steps_learn_the_held_back_drafts_acceptance(model):
    """A policy that keeps every step plain still learns how often the n-gram drafts it held back would have been
    accepted (their first token against the token the request then got), so a high acceptance rate is not hidden
    behind the prior: on input-grounded prompts the proposer's learned rate rises above it."""
    manager = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=256), max_batch_tokens=64,
                                       speculative="ngram", num_speculative_tokens=4)
    speculation = manager._core.speculation
    speculation.policy.choose = lambda options: 0  # never speculate
    prompts = grounded_prompts(model, 3, seed=41)
    with manager:
        outs = [manager.get_result(rid, timeout=120)
                for rid in [manager.add_request(p, max_new_tokens=12, eos_token_id=EOS) for p in prompts]]
    assert speculation.stats.speculative_steps == 0 and speculation.stats.accepted == 0
    assert speculation._mode_acceptance["ngram"] > PRIOR_ACCEPTANCE
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == greedy(model, prompt, 12)


def sampled_reference(model, prompt: list[int], seed: int, max_new_tokens: int) -> list[int]:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=max_new_tokens,
                             do_sample=True, temperature=0.9, top_p=0.95, eos_token_id=EOS, pad_token_id=PAD,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    return out[0, len(prompt):].tolist()


def test_seeded_requests_keep_generate_tokens_under_speculation(model):
    """The guarantee of the continuous-batching guide: a seeded sampled request gets, alone, the tokens generate()
    gives after torch.manual_seed(seed) — also in an engine with speculative="ngram" whose policy drafts at every
    step, on prompts whose drafts would be accepted (features.py: a seeded request decodes plainly). Unseeded sampled
    requests beside them still speculate."""
    prompts = grounded_prompts(model, 3, seed=31)
    core = init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=256), speculative="ngram")._core
    always(core)
    def params(seed):  # generate()'s defaults for what is not set (top_k=50)
        return SamplingParams.from_generation_config(None, do_sample=True, temperature=0.9, top_p=0.95, seed=seed,
                                                     max_new_tokens=24, eos_token_id=EOS)

    specs = [(f"s{i}", p, params(100 + i)) for i, p in enumerate(prompts)]
    specs += [(f"u{i}", p, params(None)) for i, p in enumerate(prompts)]
    reqs = drive(core, specs, seed=0)
    for i, prompt in enumerate(prompts):
        assert reqs[f"s{i}"].generated == sampled_reference(model, prompt, 100 + i, 24), i
    assert core.speculation.stats.proposed > 0  # the unseeded ones drafted
