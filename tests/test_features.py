"""The feature rules table (hf_paged/engine/features.py): its API, that the engine follows it, and that no module of
the engine refuses a combination on its own."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest
from transformers import GenerationConfig

from hf_paged.engine import features
from hf_paged.engine.sampling import SamplingParams
from hf_paged.engine.speculative import Speculation

ENGINE = pathlib.Path(features.__file__).parent
SERVE = ENGINE.parent / "serve"
# raise sites whose message says a thing is not supported / served / is refused
REFUSAL = re.compile(r"not supported|not served|is refused|are refused|cannot be combined|drop one of them")
# what an adapter *file* may hold is validated when it is loaded (lora.py; not a request feature): the only other place
ALLOWED = {"lora.py"}
# the server's refusals of a single field's *value* (not a combination of features): the protocol's own validation
SERVE_VALUE_CHECKS = ("'best_of' ({fields.best_of}) other than", ".content[{i}]: {named} not supported", "'{where}.{key}' is not supported")


def test_api_names_every_feature_and_rule():
    assert features.REQUEST_FEATURES < features.FEATURES
    for rule in features.RULES:
        assert rule.features <= features.FEATURES and rule.unless <= features.FEATURES, rule
        assert rule.outcome in (features.SERVED, features.PLAIN, features.REFUSED) and rule.reason
    assert set(features.SETTINGS) == set(features.FEATURES)
    with pytest.raises(ValueError, match="unknown feature"):
        features.decide({"beam"})
    assert features.decide(set()).outcome == "served"
    assert features.decide({"beams", "images"}).outcome == "served"
    assert features.decide({"beams", "adapter", "processors"}).outcome == "served"
    d = features.decide({"speculative", "sampled", "seeded"})
    assert d.outcome == "plain" and d.dropped == {"speculative"}
    assert features.decide({"speculative", "sampled"}).outcome == "served"  # distributional, rejection sampling
    with pytest.raises(features.FeatureRefused, match="stop_strings with num_beams > 1 is not served"):
        features.check({"beams", "stop_strings", "sampled"})
    assert features.decide({"n"}).outcome == "refused" and features.served({"n", "beams"})
    assert len(features.table()) == len(features.RULES)


def test_the_table_decides_every_pair_consistently():
    """A refusal of a pair refuses every superset; "plain" only drops speculation."""
    names = sorted(features.FEATURES)
    for a, b in itertools.combinations(names, 2):
        d = features.decide({a, b})
        assert d.dropped <= features.SPECULATION
        if d.outcome == "refused":
            assert features.decide({a, b, "sampled", "adapter"}).outcome == "refused" or "n" in (a, b)


def test_sampling_params_follow_the_table():
    for kwargs, feature in ((dict(logprobs=0), "logprobs"), (dict(prompt_lookup_num_tokens=3), "ngram")):
        with pytest.raises(features.FeatureRefused, match=f"{features.SETTINGS[feature]} with num_beams > 1"):
            SamplingParams(num_beams=2, **kwargs)
    with pytest.raises(ValueError, match="num_return_sequences > 1 is not served"):
        SamplingParams(num_return_sequences=2)
    SamplingParams(num_beams=2, num_return_sequences=2)  # served
    assert features.request_features(SamplingParams(do_sample=True, seed=3, logprobs=0)) == {
        "sampled", "seeded", "logprobs"}
    with pytest.raises(ValueError, match="penalty_alpha=0.6 is not supported by the engine: contrastive"):
        SamplingParams.from_generation_config(GenerationConfig(penalty_alpha=0.6, top_k=4))


class _Req:
    def __init__(self, params):
        self.params, self.beam = params, None


@pytest.mark.parametrize("default", [None, "ngram"])
def test_speculation_asks_the_table(default):
    spec = Speculation(default)
    cases = [
        (SamplingParams(), default is not None),
        (SamplingParams(prompt_lookup_num_tokens=0), False),
        (SamplingParams(prompt_lookup_num_tokens=2), True),
        (SamplingParams(do_sample=True), default is not None),
        (SamplingParams(do_sample=True, seed=5), False),  # keeps generate()'s tokens after manual_seed
        (SamplingParams(do_sample=True, seed=5, prompt_lookup_num_tokens=2), False),
        (SamplingParams(logprobs=0, prompt_lookup_num_tokens=2), False),
    ]
    for params, speculates in cases:
        assert (spec._mode(_Req(params))[0] is not None) == speculates, params


def refusals_outside_the_table(paths, allowed_messages=()) -> list[str]:
    offenders = []
    for path in paths:
        text = path.read_text()
        for match in re.finditer(r"raise\s+\w+\((?:[^()]|\([^()]*\))*\)", text):
            if REFUSAL.search(match.group(0)) and not any(a in match.group(0) for a in allowed_messages):
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{path.parent.name}/{path.name}:{line}: {match.group(0)[:100]}")
    return offenders


def test_no_refusal_of_a_combination_outside_the_table():
    """Every raise in the engine whose message refuses something comes from features.py (its table, its unserved
    settings), except the adapter file checks of lora.py."""
    paths = [p for p in sorted(ENGINE.glob("*.py")) if p.name != "features.py" and p.name not in ALLOWED]
    offenders = refusals_outside_the_table(paths)
    assert not offenders, "refusals outside engine/features.py (add a rule there and call features.check):\n" + \
        "\n".join(offenders)


def test_the_server_refuses_no_combination_on_its_own():
    """The server's raises that refuse something are either the table's (features.check) or checks of one field's
    value (SERVE_VALUE_CHECKS): a combination the server refuses by itself fails here."""
    offenders = refusals_outside_the_table(sorted(SERVE.glob("*.py")), SERVE_VALUE_CHECKS)
    assert not offenders, "refusals outside engine/features.py (add a rule there and call features.check):\n" + \
        "\n".join(offenders)
