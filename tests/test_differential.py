"""The differential tester (tests/differential, issue 51) in the suite: a bounded campaign in ``make test`` (every
request of a few random cases equals generate() alone), a longer one in ``make test-slow``, and the tester's own
parts: deterministic draws, a planted difference shrunk to its smallest case with a reproducer that runs."""

from __future__ import annotations

import pytest
import torch
from differential import run as fuzz_run
from differential.draw import draw_case, refusal, request_features
from differential.fuzz import campaign, reproducer
from differential.models import FAMILIES
from differential.run import Finding, Runner, shrink
from helpers.engine_shadow import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def runner():
    return Runner()


def fixed_hot(family, model_seed):
    return [5, 9, 17]


def test_draws_are_deterministic_and_only_served_combinations():
    """The same seed draws the same case; every drawn request is one the feature table serves, or is marked to be
    refused (and the table refuses it)."""
    for seed in range(30):
        case = draw_case(seed, fixed_hot)
        assert case == draw_case(seed, fixed_hot)
        kind = FAMILIES[case["family"]]
        for phase in case["phases"]:
            for request in phase["requests"]:
                assert (refusal(kind, case["engine"], request) is None) == (request.get("expect") != "refused")
    kinds = {FAMILIES[draw_case(s, fixed_hot)["family"]] for s in range(60)}
    assert kinds == set(FAMILIES.values())


def test_planted_difference_is_shrunk_to_one_plain_request(runner, monkeypatch):
    """A difference planted in the comparison (every request with no_repeat_ngram_size "differs") is found and
    shrunk: one request, no other settings, the plain engine, a one-token prompt; its reproducer names it."""
    compare = fuzz_run.compare

    def planted(request, got, ref, logits):
        return "planted" if "no_repeat_ngram_size" in request["kwargs"] else compare(request, got, ref, logits)

    monkeypatch.setattr(fuzz_run, "compare", planted)
    other = {"text": [[5, 6, 7]], "images": [], "type_ids": True, "seed": None, "adapter": None,
             "kwargs": {"max_new_tokens": 2, "do_sample": False}}
    target = {"text": [[8, 9, 10, 11, 12, 13]], "images": [], "type_ids": True, "seed": None, "adapter": None,
              "kwargs": {"max_new_tokens": 4, "do_sample": False, "no_repeat_ngram_size": 2,
                         "repetition_penalty": 1.3, "eos_token_id": [1, 5]}}
    case = {"family": "llama", "model_seed": 0,
            "engine": {"block_size": 4, "prefix_caching": True, "max_batch_tokens": 8, "speculative": None,
                       "adapters": None, "num_blocks": 64},
            "phases": [{"bump": None, "requests": [other, target, other]}]}
    found = runner.run(case)
    assert [(f.phase, f.index, f.detail) for f in found] == [(0, 1, "planted")]
    small, finding = shrink(runner, case, found[0])
    request = small["phases"][0]["requests"]
    assert len(request) == 1 and request[0]["kwargs"] == {"max_new_tokens": 1, "do_sample": False,
                                                          "no_repeat_ngram_size": 2}
    assert sum(map(len, request[0]["text"])) == 1
    assert small["engine"]["prefix_caching"] is False and small["engine"]["max_batch_tokens"] == 512
    text = reproducer(small, finding)
    assert "Runner().run(CASE)" in text and "planted" in text
    compile(text, "reproducer", "exec")


# (seed, trials): a few mixed cases over every family kind, under a minute on a 2-core machine
BOUNDED = [(11, 3), (12, 3)]


@pytest.mark.parametrize("seed,trials", BOUNDED)
def test_bounded_campaign_every_request_equals_generate_alone(runner, seed, trials):
    """A few random cases (random family, engine conditions, request mix): every request equals generate() alone
    (greedy: token for token up to a near-tie; seeded sampling: the same seed's tokens; beams: the sequences)."""
    report = campaign(seed, trials, max_requests=4, runner=runner)
    assert report.requests > 0
    assert not report.failures, "\n\n".join(text for _, _, text in report.failures)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [101, 102, 103])
def test_long_campaign(runner, seed):
    """Longer campaigns (``make test-slow``): 25 cases per seed, up to 8 requests a phase."""
    report = campaign(seed, 25, max_requests=8, runner=runner)
    assert not report.failures, "\n\n".join(text for _, _, text in report.failures)


def test_refused_combination_is_refused_by_the_feature_table(runner):
    """A request the feature table refuses (beams with prompt lookup), drawn with ``"expect": "refused"``: the
    runner reports nothing when add_request refuses it by name, and a finding if the refusal is missing."""
    refused = {"text": [[5, 6, 7, 8]], "images": [], "type_ids": True, "seed": None, "adapter": None,
               "expect": "refused", "kwargs": {"max_new_tokens": 2, "num_beams": 2, "prompt_lookup_num_tokens": 3}}
    served = {**refused, "kwargs": {"max_new_tokens": 2, "do_sample": False}}
    case = {"family": "llama", "model_seed": 0,
            "engine": {"block_size": 4, "prefix_caching": False, "max_batch_tokens": 64, "speculative": None,
                       "adapters": None, "num_blocks": 64},
            "phases": [{"bump": None, "requests": [refused, served]}]}
    assert refusal("plain", case["engine"], refused) is not None
    found = runner.run(case)
    assert [(f.index, f.kind) for f in found] == [(1, "not refused")]
