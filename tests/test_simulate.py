"""The memory simulation: it serves requests with the engine's own scheduler (the same schedule as the engine on a
model), exact waste on known lengths, budgets respected, pool left clean."""

import numpy as np
import pytest
import torch

from helpers.engine_shadow import one_thread
from helpers.models import tiny_model
from hf_paged import BlockPool, enable_paged_attention, init_continuous_batching
from hf_paged.engine.outputs import RequestStatus
from hf_paged.engine.sampling import SamplingParams
from hf_paged.engine.scheduler import Scheduler
from hf_paged.tools.simulate import (
    ALPACA, SHAREGPT, EngineSimulation, batch_memory_trace, block_map_snapshot, fake_prompt, sample_workload,
    simulate_padded, simulate_paged, simulate_reservation, simulate_workload,
)

KNOWN = [(5, 3), (17, 1), (1, 9), (30, 4), (16, 16)]  # (prompt_len, output_len)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def expected_paged(requests, block_size):
    """held, real, live per step when everything is admitted at step 1 and nothing is preempted: the prompt runs in
    step 1 and gives the first token, step t runs token t - 1 (the last token's K/V is never computed)."""
    held, real, live = [], [], []
    for t in range(1, max(o for _, o in requests) + 1):
        lens = [p + t - 1 for p, o in requests if o >= t]
        held.append(sum(-(-n // block_size) * block_size for n in lens))
        real.append(sum(lens))
        live.append(len(lens))
    return np.array(held), np.array(real), np.array(live)


def test_workload_is_seeded_clipped_and_calibrated():
    for model in (SHAREGPT, ALPACA):
        a = sample_workload(model, 500, seed=3)
        assert a == sample_workload(model, 500, seed=3)
        assert a != sample_workload(model, 500, seed=4)
        lens = np.array(a)
        assert lens.min() >= 1 and (lens.sum(1) <= model.max_len).all()
        assert abs(lens[:, 0].mean() - model.prompt_mean) < 0.5
        assert abs(lens[:, 1].mean() - model.output_mean) < 0.5


@pytest.mark.parametrize("block_size", [1, 2, 8, 16])
def test_paged_matches_exact_formula(block_size):
    run = simulate_paged(KNOWN, block_size, budget_tokens=10_000)
    held, real, live = expected_paged(KNOWN, block_size)
    np.testing.assert_array_equal(run.held, held)
    np.testing.assert_array_equal(run.real, real)
    np.testing.assert_array_equal(run.live, live)
    assert run.waste == pytest.approx(1 - real.sum() / held.sum())
    assert run.preemptions == 0 and not run.waiting.any() and run.capacity is None


def test_block_size_one_wastes_nothing():
    requests = sample_workload(SHAREGPT, 80, seed=1)
    run = simulate_paged(requests, 1, budget_tokens=6_000)
    assert run.preemptions > 0  # the budget binds: preemption and re-admission are exercised too
    np.testing.assert_array_equal(run.held, run.real)
    assert run.waste == 0.0


@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_paged_waste_is_only_the_last_block(block_size):
    requests = sample_workload(SHAREGPT, 80, seed=2)
    run = simulate_paged(requests, block_size, budget_tokens=6_000)
    assert ((run.held - run.real) >= 0).all()
    assert ((run.held - run.real) <= run.live * (block_size - 1)).all()


def test_reservation_waste_is_one_minus_mean_len_over_max_len():
    prompts = [3, 100, 700, 2000]
    run = simulate_reservation([(p, 1) for p in prompts], max_len=2048, budget_tokens=4 * 2048,
                               max_batch_tokens=4 * 2048)
    assert run.steps == 1
    assert run.waste == pytest.approx(1 - np.mean(prompts) / 2048)

    run = simulate_reservation(KNOWN, max_len=64, budget_tokens=64 * len(KNOWN))
    _, real, live = expected_paged(KNOWN, 64)
    np.testing.assert_array_equal(run.held, live * 64)
    assert run.waste == pytest.approx(1 - real.sum() / (live.sum() * 64))


def test_padded_batch_holds_longest_row_until_the_batch_ends():
    run = simulate_padded(KNOWN, batch_size=len(KNOWN), budget_tokens=10_000)
    t = np.arange(1, 17)
    np.testing.assert_array_equal(run.held, len(KNOWN) * (30 + t - 1))  # longest prompt 30, longest output 16
    _, real, live = expected_paged(KNOWN, 1)
    np.testing.assert_array_equal(run.real, real)
    np.testing.assert_array_equal(run.live, live)
    assert simulate_padded(KNOWN, len(KNOWN), budget_tokens=200).error  # 5 x 46 slots do not fit in 200


def test_budget_respected_and_every_token_served():
    requests = sample_workload(SHAREGPT, 100, seed=5)
    budget = 12_000
    res = simulate_workload(requests, budget, block_sizes=(8, 16, 32), batch_sizes=(2, 4))
    outputs = sum(o for _, o in requests)
    for run in res.runs():
        assert run.error is None
        assert run.peak_held <= budget, run.label
        # padded: each request is live for exactly its output's steps; the engine also runs prefill chunks that give
        # no token and recomputes preempted requests
        assert run.live.sum() == outputs if run in res.padded.values() else run.live.sum() >= outputs, run.label
        assert run.capacity is not None and run.capacity <= res.ideal.capacity * 1.05, run.label
    assert res.reservation.live.max() == budget // 2048
    assert res.paged[8].waste < res.paged[16].waste < res.paged[32].waste < res.reservation.waste


def test_pool_and_scheduler_consistent_through_preemption_and_every_request_served():
    """Under a binding pool the simulation preempts; the scheduler's and the allocator's invariants hold at every step,
    every request ends with exactly its output length, and the pool ends with no block in use."""
    requests = sample_workload(SHAREGPT, 120, seed=6)
    sim = EngineSimulation(requests, block_size=16, num_blocks=700)
    while not sim.done:
        figures = sim.step()
        sim.scheduler.check_invariants()
        sim.allocator.check_invariants()
        assert figures.real <= figures.held <= 700 * 16
    assert sim.preemptions > 0
    assert sim.allocator.blocks_in_use == 0 and sim.allocator.num_free == 700
    assert sim.pool.bytes_reserved() == 0  # no K/V tensor was ever made
    for i, (req, (p, o)) in enumerate(zip(sim.requests, requests)):
        assert req.status == RequestStatus.FINISHED and req.finish_reason == "length"
        assert req.tokens == fake_prompt(i, p) + [i] * o


def test_simulation_runs_the_engine_scheduler(monkeypatch):
    """A change to the engine's Scheduler shows in the simulation's figures: capping it to two running requests
    caps the simulation's batch to two (it runs no scheduling policy of its own)."""
    requests = sample_workload(ALPACA, 40, seed=1)
    assert simulate_paged(requests, 16, budget_tokens=4096).live.max() > 2
    schedule = Scheduler.schedule

    def capped(self):
        self.max_num_seqs = 2
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", capped)
    run = simulate_paged(requests, 16, budget_tokens=4096)
    assert run.live.max() == 2 and run.steps > 40


def test_simulation_schedules_what_the_engine_schedules():
    """The same requests on the engine with a tiny model and on the simulation, with the same pool and budget (chunked
    prefill, preemption, prefix hits on readmission): every step runs the same chunks in the same order."""
    specs = [(13, 9), (3, 14), (22, 4), (7, 11), (30, 2), (5, 12), (11, 6), (2, 10)]  # (prompt_len, output_len)
    num_blocks, block_size, budget = 20, 4, 16
    sim = EngineSimulation(specs, block_size, num_blocks, max_batch_tokens=budget, keep_schedules=True)
    sim.run()
    assert sim.preemptions > 0 and sim.scheduler.counters.prefix_hit_tokens > 0

    model = enable_paged_attention(tiny_model("llama", seed=3), backend="torch")
    pool = BlockPool(block_size=block_size, num_blocks=num_blocks, prefix_caching=True)
    core = init_continuous_batching(model, pool=pool, max_batch_tokens=budget)._core
    schedules, run = [], core.runner.run

    def recording(batch):
        schedules.append([(int(c.request.request_id), c.start, c.num_tokens) for c in batch.chunks])
        return run(batch)

    core.runner.run = recording
    reqs = []
    for i, (p, o) in enumerate(specs):
        reqs.append(core.new_request(str(i), fake_prompt(i, p), SamplingParams(max_new_tokens=o)))
        core.add(reqs[-1])
    with torch.no_grad():
        while core.has_work:
            core.step()
    assert all(req.num_generated == o for req, (_, o) in zip(reqs, specs))
    assert core.scheduler.counters.preemptions == sim.preemptions
    assert schedules == sim.schedules


def test_block_map_reads_back_through_scattered_tables():
    bm = block_map_snapshot(sample_workload(ALPACA, 60, seed=0), block_size=16, num_blocks=128, step=70)
    assert bm.finished > 0 and 0 < (bm.owners() >= 0).sum() < 128
    assert any(np.any(np.diff(t) != 1) for t in bm.tables.values())  # not laid out contiguously
    for r in bm.tables:
        owner, pos = bm.gather(r)
        np.testing.assert_array_equal(owner, r + 1)
        np.testing.assert_array_equal(pos, np.arange(bm.lens[r]))


def test_batch_trace_orders_the_caches():
    trace = batch_memory_trace(sample_workload(SHAREGPT, 8, seed=0), block_size=16)
    assert (trace.real <= trace.paged).all() and (trace.paged <= trace.dynamic).all()
    assert (trace.paged - trace.real < 8 * 16).all()
    assert (trace.static == 8 * 2048).all()


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from hf_paged.tools.plots import plot_block_map, plot_memory_over_steps, plot_waste_vs_block_size
    from hf_paged.tools.simulate import SMOLLM2_135M

    requests = sample_workload(ALPACA, 80, seed=0)
    res = simulate_workload(requests, 4096, block_sizes=(8, 16), batch_sizes=(8,), name="alpaca")
    paths = [tmp_path / n for n in ("waste.png", "memory.png", "map.png")]
    plot_waste_vs_block_size([res], paths[0])
    plot_memory_over_steps(batch_memory_trace(requests[:4]), SMOLLM2_135M, paths[1])
    plot_block_map(block_map_snapshot(requests[:40], num_blocks=64, step=30), paths[2])
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
