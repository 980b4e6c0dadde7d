"""The memory simulation: exact waste on known lengths, budgets respected, allocator left clean."""

import numpy as np
import pytest

from hf_paged.tools.simulate import (
    ALPACA, SHAREGPT, PagedScheduler, batch_memory_trace, block_map_snapshot, sample_workload, simulate_padded,
    simulate_paged, simulate_reservation, simulate_workload,
)

KNOWN = [(5, 3), (17, 1), (1, 9), (30, 4), (16, 16)]  # (prompt_len, output_len)


def expected_paged(requests, block_size):
    """held, real, live per step when everything is admitted at step 1 and nothing is preempted."""
    held, real, live = [], [], []
    for t in range(1, max(o for _, o in requests) + 1):
        lens = [p + t for p, o in requests if o >= t]
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
    requests = sample_workload(SHAREGPT, 150, seed=1)
    run = simulate_paged(requests, 1, budget_tokens=12_000)
    assert run.preemptions > 0  # the budget binds: preemption and re-admission are exercised too
    np.testing.assert_array_equal(run.held, run.real)
    assert run.waste == 0.0


@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_paged_waste_is_only_the_last_block(block_size):
    requests = sample_workload(SHAREGPT, 150, seed=2)
    run = simulate_paged(requests, block_size, budget_tokens=12_000)
    assert ((run.held - run.real) >= 0).all()
    assert ((run.held - run.real) <= run.live * (block_size - 1)).all()


def test_reservation_waste_is_one_minus_mean_len_over_max_len():
    prompts = [3, 100, 700, 2000]
    run = simulate_reservation([(p, 1) for p in prompts], max_len=2048, budget_tokens=4 * 2048)
    assert run.steps == 1
    assert run.waste == pytest.approx(1 - np.mean([p + 1 for p in prompts]) / 2048)

    run = simulate_reservation(KNOWN, max_len=64, budget_tokens=64 * len(KNOWN))
    _, real, live = expected_paged(KNOWN, 64)
    np.testing.assert_array_equal(run.held, live * 64)
    assert run.waste == pytest.approx(1 - real.sum() / (live.sum() * 64))


def test_padded_batch_holds_longest_row_until_the_batch_ends():
    run = simulate_padded(KNOWN, batch_size=len(KNOWN), budget_tokens=10_000)
    t = np.arange(1, 17)
    np.testing.assert_array_equal(run.held, len(KNOWN) * (30 + t))  # longest prompt 30, longest output 16
    _, real, live = expected_paged(KNOWN, 1)
    np.testing.assert_array_equal(run.real, real)
    np.testing.assert_array_equal(run.live, live)
    assert simulate_padded(KNOWN, len(KNOWN), budget_tokens=200).error  # 5 x 46 slots do not fit in 200


def test_budget_respected_and_every_token_served():
    requests = sample_workload(SHAREGPT, 200, seed=5)
    budget = 20_000
    res = simulate_workload(requests, budget, block_sizes=(8, 16, 32), batch_sizes=(2, 4))
    outputs = sum(o for _, o in requests)
    for run in res.runs():
        assert run.error is None
        assert run.peak_held <= budget, run.label
        assert run.live.sum() == outputs, run.label  # each request generates exactly its output, once
        assert run.capacity is not None and run.capacity <= res.ideal.capacity * 1.05, run.label
    assert res.reservation.live.max() == budget // 2048
    assert res.paged[8].waste < res.paged[16].waste < res.paged[32].waste < res.reservation.waste


def test_allocator_consistent_through_preemption_and_empty_at_the_end():
    requests = sample_workload(SHAREGPT, 120, seed=6)
    sched = PagedScheduler(requests, block_size=16, num_blocks=700)
    a = sched.allocator
    while not sched.done:
        sched.step()
        if sched.steps % 25 == 0:
            a.check_invariants()
            assert sched.real_tokens == sum(a.seq_len(sched.seq_of[r]) for r in sched.running)
            assert sorted(sched.seq_of) == sorted(sched.running)
    assert sched.preemptions > 0
    a.check_invariants()
    assert a.sequences == [] and a.blocks_in_use == 0 and a.num_free == 700
    assert sched.generated == [o for _, o in requests]


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

    requests = sample_workload(ALPACA, 150, seed=0)
    res = simulate_workload(requests, 4096, block_sizes=(8, 16), batch_sizes=(8,), name="alpaca")
    paths = [tmp_path / n for n in ("waste.png", "memory.png", "map.png")]
    plot_waste_vs_block_size([res], paths[0])
    plot_memory_over_steps(batch_memory_trace(requests[:4]), SMOLLM2_135M, paths[1])
    plot_block_map(block_map_snapshot(requests[:40], num_blocks=64, step=30), paths[2])
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
