"""The engine's scheduler on a bare allocator (no model): admission, chunked prefill, preemption by recompute, prefix
hits and hold-back, cancellation and failing steps, with the pool's and the scheduler's invariants after every step.

The shadow runner (tests/_engine_shadow.py) checks each chunk's history slot by slot, and its tokens are a known
function of the request's tokens, so every finished request is compared with its expected tokens.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from _engine_shadow import VOCAB, expected_tokens, one_thread, run_to_end, shadow_engine
from hf_paged.engine.outputs import RequestStatus, RequestTooLargeError

from hf_paged.engine.sampling import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def prompt_of(n: int, seed: int, prefix: list[int] = ()) -> list[int]:
    rng = random.Random(seed)
    return list(prefix) + [rng.randrange(2, VOCAB) for _ in range(n - len(prefix))]


def add(core, rid, prompt, max_new=8, eos=None):
    params = SamplingParams(max_new_tokens=max_new, eos_token_ids=(eos,) if eos is not None else ())
    core.check_fits(len(prompt), max_new)
    req = core.new_request(rid, prompt, params)
    core.add(req)
    return req


def assert_correct(req, eos=None):
    assert req.status == RequestStatus.FINISHED, (req.request_id, req.status, req.error)
    assert req.generated == expected_tokens(req.tokens[: req.num_prompt], req.max_new_tokens, eos), req.request_id


def test_requests_finish_with_their_tokens_and_blocks_come_back():
    """Requests of mixed sizes, all arriving at once, end with their expected tokens; afterwards no block is in use
    and only keyed (cached) blocks remain outside the free list."""
    core = shadow_engine(num_blocks=64, block_size=4, max_batch_tokens=16)
    reqs = [add(core, f"r{i}", prompt_of(3 + 5 * i, i), max_new=4 + i) for i in range(8)]
    run_to_end(core)
    for req in reqs:
        assert_correct(req)
    assert core.kv.allocator.blocks_in_use == 0


def test_long_prompt_is_prefilled_in_chunks_of_the_budget_and_decodes_go_first():
    """A 40-token prompt with a 16-token budget runs as chunks of 16, 16, 8 (minus what decoding requests take first:
    a decoding request's token is always in the step)."""
    core = shadow_engine(num_blocks=64, block_size=4, max_batch_tokens=16, prefix_caching=False)
    short = add(core, "short", prompt_of(3, 1), max_new=10)
    core.step()  # short's prefill
    long = add(core, "long", prompt_of(40, 2), max_new=2)
    run_to_end(core)
    steps = core.runner.steps
    for step in steps[1:]:
        ids = [rid for rid, _, _ in step]
        if "short" in ids:
            assert ids[0] == "short" and step[0][2] == 1  # its decode token first
        assert sum(n for _, _, n in step) <= 16
    long_chunks = [n for step in steps for rid, start, n in step if rid == "long" and start < 40]
    assert long_chunks[:2] == [15, 15] and sum(long_chunks) == 40
    assert_correct(short)
    assert_correct(long)


def test_pool_pressure_preempts_the_most_recent_request_and_results_stay_right():
    """A pool far smaller than the workload: running requests are preempted (most recently admitted first), requeued
    at the head, recomputed, and still end with their expected tokens."""
    core = shadow_engine(num_blocks=12, block_size=4, max_batch_tokens=32, prefix_caching=False)
    reqs = [add(core, f"r{i}", prompt_of(6, i), max_new=14) for i in range(6)]
    preempted_order = []
    while core.has_work:
        batch_before = list(core.scheduler.running)
        core.step()
        core.scheduler.check_invariants()
        core.kv.allocator.check_invariants()
        gone = [r for r in batch_before if r.status == RequestStatus.PENDING]
        if gone:  # victims are the latest admitted of those running
            latest = sorted(batch_before, key=lambda r: r.admitted_at)[-len(gone):]
            assert set(map(id, gone)) == set(map(id, latest))
            assert list(core.scheduler.waiting)[: len(gone)] == sorted(gone, key=lambda r: r.admitted_at)
            preempted_order += gone
    assert core.scheduler.counters.preemptions > 0
    assert core.scheduler.counters.recomputed_tokens > 0
    for req in reqs:
        assert_correct(req)
    assert core.kv.allocator.blocks_in_use == 0


def test_preempted_request_recomputes_from_its_cached_prefix():
    """With prefix caching, a preempted request's full blocks stay cached: when it is readmitted it starts from them
    and recomputes nothing it had computed. (9 blocks of 4: a's 16-token prompt and 4 decode tokens; b's 18-token
    prompt is cut to 16 by the pool, then b preempts itself when a's decode takes the last block.)"""
    core = shadow_engine(num_blocks=9, block_size=4, max_batch_tokens=64)
    a = add(core, "a", prompt_of(16, 1), max_new=5)
    b = add(core, "b", prompt_of(18, 2), max_new=6)
    run_to_end(core)
    c = core.scheduler.counters
    assert b.preemptions == 1 and a.preemptions == 0
    assert c.prefix_hit_tokens == 16 and c.recomputed_tokens == 0
    assert_correct(a)
    assert_correct(b)


def test_same_prefix_waits_for_the_request_computing_it():
    """Sixteen requests sharing a 40-token system prompt, all arriving at once: the first computes the shared blocks,
    the others wait for them instead of computing them again, so prompt tokens computed stay far below the total."""
    system = prompt_of(40, 99)
    core = shadow_engine(num_blocks=200, block_size=4, max_batch_tokens=32)
    reqs = [add(core, f"q{i}", prompt_of(40 + 5 + i % 4, 200 + i, prefix=system), max_new=3) for i in range(16)]
    run_to_end(core)
    c = core.scheduler.counters
    assert c.held_back > 0
    assert c.prefix_hit_tokens == 15 * 40
    assert c.prompt_tokens_computed <= 0.3 * c.prompt_tokens, (c.prompt_tokens_computed, c.prompt_tokens)
    for req in reqs:
        assert_correct(req)

    off = shadow_engine(num_blocks=200, block_size=4, max_batch_tokens=32, hold_back=False)
    for i in range(16):
        add(off, f"q{i}", prompt_of(40 + 5 + i % 4, 200 + i, prefix=system), max_new=3)
    run_to_end(off)
    assert off.scheduler.counters.prompt_tokens_computed > c.prompt_tokens_computed


def test_too_large_requests_are_refused_with_sizes():
    """A request that could never fit the empty pool, or the context, is refused before it is queued."""
    core = shadow_engine(num_blocks=8, block_size=4)
    with pytest.raises(RequestTooLargeError, match=r"needs 9 KV blocks of 4 tokens .* the whole pool holds 8"):
        core.check_fits(30, 6)
    core.check_fits(26, 6)  # 32 tokens: exactly 8 blocks
    core.max_context = 20
    with pytest.raises(RequestTooLargeError, match="the prompt has 20 tokens but the model's context is 20"):
        core.check_fits(20, 1)


def test_request_filling_the_whole_pool_runs_alone():
    """A request needing every block of the pool is admitted once the others are done (the watermark does not apply
    when nothing runs), and everything finishes."""
    core = shadow_engine(num_blocks=8, block_size=4, max_batch_tokens=16, prefix_caching=False)
    big = add(core, "big", prompt_of(20, 5), max_new=12)
    small = [add(core, f"s{i}", prompt_of(5, i), max_new=6) for i in range(3)]
    run_to_end(core)
    assert_correct(big)
    for req in small:
        assert_correct(req)


def test_eos_ends_a_request():
    """A request stops at its EOS token with finish reason "stop"; the others run to max_new_tokens ("length")."""
    core = shadow_engine()
    prompt = prompt_of(5, 3)
    stop_at = expected_tokens(prompt, 6)[2]
    req = add(core, "eos", prompt, max_new=6, eos=stop_at)
    other = add(core, "len", prompt_of(5, 4), max_new=6)
    run_to_end(core)
    assert req.finish_reason == "stop" and req.generated[-1] == stop_at and len(req.generated) <= 3
    assert other.finish_reason == "length" and len(other.generated) == 6


def test_failing_step_fails_only_its_requests_and_publishes_nothing_half_written():
    """A forward that raises ends that step's requests as failed, with the error, and gives their blocks back; none
    of the blocks that step took is offered as a prefix later (the shadow forward fails before writing them, so a
    later prompt starting from them would read garbage). Requests outside the step, and later steps, go on."""
    core = shadow_engine(num_blocks=64, block_size=4, max_batch_tokens=8)
    a = add(core, "a", prompt_of(8, 1), max_new=4)
    core.step()  # a's prefill
    b = add(core, "b", prompt_of(12, 2), max_new=4)
    c = add(core, "c", prompt_of(6, 3), max_new=4)
    core.runner.fail = lambda batch: any(ch.request.request_id == "b" for ch in batch.chunks)
    touched = core.step()  # a's decode token and b's first chunk (7 tokens); c does not fit the budget
    assert {r.request_id for r in touched} == {"a", "b"}
    assert a.status == b.status == RequestStatus.FAILED
    assert "RuntimeError: shadow forward failed" in b.error and a.error == b.error
    assert c.status == RequestStatus.PENDING
    core.runner.fail = None
    run_to_end(core)
    assert_correct(c)
    hits = core.scheduler.counters.prefix_hit_tokens
    again = add(core, "b2", list(b.tokens[: b.num_prompt]), max_new=4)
    run_to_end(core)
    assert_correct(again)
    assert core.scheduler.counters.prefix_hit_tokens == hits
    assert core.kv.allocator.blocks_in_use == 0


def test_cancel_gives_blocks_back_at_once():
    """A cancelled running request's blocks return before the next step; a cancelled waiting one never runs."""
    core = shadow_engine(num_blocks=64, block_size=4, max_batch_tokens=8)
    a = add(core, "a", prompt_of(10, 1), max_new=20)
    b = add(core, "b", prompt_of(10, 2), max_new=20)
    core.step()
    assert a.status == RequestStatus.RUNNING
    in_use = core.kv.allocator.blocks_in_use
    core.cancel(a)
    core.cancel(b)
    assert a.status == b.status == RequestStatus.CANCELLED
    assert core.kv.allocator.blocks_in_use < in_use and not core.has_work
    assert core.kv.allocator.blocks_in_use == 0


def test_sliding_window_groups_release_blocks_and_stay_correct():
    """A mixed-window model (a full group and a sliding group): each request keeps a row per group, the sliding
    group's old blocks go back, prefix caching is off, and tokens are right under preemption."""
    core = shadow_engine(num_blocks=30, block_size=4, max_batch_tokens=16, windows=(None, 6))
    assert not core.kv.prefix_caching
    reqs = [add(core, f"r{i}", prompt_of(9 + i, i), max_new=15) for i in range(6)]
    run_to_end(core)
    for req in reqs:
        assert_correct(req)
    assert core.kv.allocator.blocks_in_use == 0


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, cancellations and steps on a small pool, with shared prefixes: invariants after every step,
    expected tokens for every request that finished, no block in use at the end."""

    def __init__(self):
        super().__init__()
        self.core = shadow_engine(num_blocks=24, block_size=4, max_batch_tokens=12)
        self.reqs = []
        self.prefixes = [prompt_of(8, 1000), prompt_of(13, 1001)]

    @rule(length=st.integers(1, 30), new=st.integers(1, 12), shared=st.integers(0, 2), seed=st.integers(0, 10**6))
    def add_request(self, length, new, shared, seed):
        prefix = self.prefixes[shared - 1][:length] if shared else []
        prompt = prompt_of(max(length, len(prefix)), seed, prefix)
        try:
            self.core.check_fits(len(prompt), new)
        except ValueError:
            return
        self.reqs.append(add(self.core, f"r{len(self.reqs)}", prompt, max_new=new))

    @precondition(lambda self: any(not r.is_finished for r in self.reqs))
    @rule(pick=st.integers(0, 10**6))
    def cancel(self, pick):
        live = [r for r in self.reqs if not r.is_finished]
        self.core.cancel(live[pick % len(live)])

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self.core.step()

    @invariant()
    def consistent(self):
        self.core.scheduler.check_invariants()
        a = self.core.kv.allocator
        a.check_invariants()
        rows = {s for r in self.core.scheduler.running for s in r.row.seqs}
        assert set(a.sequences) == rows

    def teardown(self):
        run_to_end(self.core)
        for req in self.reqs:
            if req.status == RequestStatus.FINISHED:
                assert_correct(req)
            else:
                assert req.status == RequestStatus.CANCELLED
        assert self.core.kv.allocator.blocks_in_use == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                         suppress_health_check=list(HealthCheck))
