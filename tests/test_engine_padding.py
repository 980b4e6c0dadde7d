"""CPU step padding decided by measurement (hf_paged/engine/padding.py): the decision over measured costs (a slow
path's range padded, a machine without one never, timing noise never), the measured rule cached per model shape,
and the engine's tokens unchanged whichever rule it runs with (padding rows are a released row's, their logits
dropped)."""

from __future__ import annotations

import pytest
import torch

from helpers import VOCAB, tiny_model
from helpers.engine_oracle import TieCount, check_tokens, drive, random_prompts, reference
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, RequestStatus, init_continuous_batching
from hf_paged.engine.padding import TARGET, PaddingRule, measure_padding, padding_sizes
from hf_paged.engine.runner import pack
from hf_paged.engine.scheduler import Batch, Chunk


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def costs(fn) -> dict[int, float]:
    return {n: fn(n) for n in range(1, TARGET + 1)}


def test_padding_pays_only_across_a_slow_path():
    """A Xeon-like slow path (7-15 rows cost more than 16) is padded; a cost growing with the rows (AMD EPYC, or
    MKL's AVX2 path) never is; a single slow measurement is noise; so is a saving under 25%."""
    xeon = costs(lambda n: 1.0 + 0.01 * n if n < 7 else 2.4 if n < TARGET else 1.0)
    assert padding_sizes(xeon) == frozenset(range(7, TARGET))
    epyc = costs(lambda n: 0.9 + 0.02 * n)
    assert padding_sizes(epyc) == frozenset()
    noisy = {**epyc, 3: 9.0}
    assert padding_sizes(noisy) == frozenset()
    assert padding_sizes({**epyc, 15: 9.0}) == frozenset()  # one slow size at 15: a noisy timing, not a range
    small_gain = costs(lambda n: 1.2 if n < TARGET else 1.0)  # 16 is 17% faster: not worth it
    assert padding_sizes(small_gain) == frozenset()


def test_rule_sizes_and_the_former_fixed_rule():
    rule = PaddingRule.fixed()
    assert [rule.step_tokens(n) for n in (3, 6, 7, 15, 16, 40)] == [3, 6, 16, 16, 16, 40]
    assert [rule.logit_rows(n) for n in (3, 4, 15, 17)] == [3, 16, 16, 17]
    assert PaddingRule().step_tokens(9) == 9 and "none" in PaddingRule().describe()


def test_measured_rule_is_cached_per_model_shape():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    rule = measure_padding(a)
    assert isinstance(rule, PaddingRule) and rule.source == "measured"
    assert measure_padding(b) is rule  # same shapes, dtype, threads: measured once
    assert all(n < TARGET for n in rule.tokens | rule.rows)


def test_pack_pads_as_its_rule_says():
    class Req:
        def __init__(self, tokens):
            self.tokens, self.prompt_logprobs = tokens, None

    batch = Batch([Chunk(Req(list(range(3, 12))), 0, 9), Chunk(Req([5, 6]), 1, 1)])
    cpu = torch.device("cpu")
    padded = pack(batch, cpu, rule=PaddingRule(frozenset({10}), frozenset({2})))
    assert padded.padding == TARGET - 10 and padded.input_ids.shape[0] == TARGET
    assert padded.logits_index.tolist() == [8, 9] + [9] * (TARGET - 2) and padded.num_sampled == 2
    plain = pack(batch, cpu, rule=PaddingRule())
    assert plain.padding == 0 and plain.logits_index.tolist() == [8, 9]


@pytest.mark.parametrize("rule", [PaddingRule.fixed(), PaddingRule(frozenset(range(1, TARGET)),
                                                                    frozenset(range(1, TARGET)))],
                         ids=["fixed", "pad-everything"])
def test_engine_tokens_do_not_depend_on_the_padding(rule):
    """The engine's greedy tokens equal generate() alone with padded steps (chunked prefill and decode steps of
    every size below 16)."""
    model = tiny_model("llama", seed=3)
    pool = BlockPool(block_size=4, num_blocks=256)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=11)
    core = manager._core
    core.runner.padding = rule
    prompts = random_prompts(9, VOCAB, (3, 14), seed=2)
    specs = [(f"r{i}", p, 7) for i, p in enumerate(prompts)]
    reqs = drive(core, specs, seed=4)
    ties = TieCount()
    for rid, prompt, new in specs:
        assert reqs[rid].status == RequestStatus.FINISHED
        check_tokens(rid, reqs[rid].generated, reference(model, prompt, new), ties)
    manager.stop()
