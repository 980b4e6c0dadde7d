"""An idle engine's first step waits for requests that come together (``arrival_window_s``): they are prefilled in
one step, and a request arriving while others run is never held."""

import time

import pytest
import torch

from hf_paged.engine.factory import init_continuous_batching
from hf_paged.pool import BlockPool

from helpers.models import tiny_model


def _manager(window: float):
    model = tiny_model(seed=21)
    return init_continuous_batching(model, pool=BlockPool(block_size=4, num_blocks=512), arrival_window_s=window)


def _prompt(seed: int) -> list[int]:
    return torch.randint(3, 90, (12,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_requests_sent_together_start_in_one_step():
    """B comes 50 ms after A on an idle engine; within a 1 s window A's first token waits for B's arrival and both
    start in the same step."""
    with _manager(1.0) as manager:
        a = manager.add_request(_prompt(1), max_new_tokens=3, do_sample=False)
        time.sleep(0.05)
        b = manager.add_request(_prompt(2), max_new_tokens=3, do_sample=False)
        ra, rb = manager.get_result(a, timeout=60), manager.get_result(b, timeout=60)
    assert ra.first_token_time >= rb.created_time
    assert ra.first_token_time == pytest.approx(rb.first_token_time, abs=1e-6)  # the same step sampled both


def test_a_lone_request_waits_one_quiet_window_and_a_running_engine_none():
    with _manager(0.3) as manager:
        a = manager.add_request(_prompt(3), max_new_tokens=2, do_sample=False)
        ra = manager.get_result(a, timeout=60)
        assert ra.first_token_time - ra.created_time >= 0.3  # nobody else came: one window of quiet, then the step
    with _manager(5.0) as manager:  # a window longer than the test: only an idle engine would wait it out
        long = manager.add_request(_prompt(4), max_new_tokens=100_000, do_sample=False, ignore_eos=True)
        deadline = time.monotonic() + 60
        while manager._core.scheduler.running == []:  # the long request is running (after its own wait)
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.01)
        b = manager.add_request(_prompt(5), max_new_tokens=2, do_sample=False)
        rb = manager.get_result(b, timeout=60)
        manager.cancel_request(long)
    assert rb.first_token_time - rb.created_time < 2.5


def test_arrival_window_off_and_refused_values():
    with _manager(0.0) as manager:
        assert manager._core.arrival_window_s == 0.0
    with pytest.raises(ValueError, match="arrival_window_s"):
        _manager(-1.0)
    model = tiny_model(seed=21)
    assert init_continuous_batching(model)._core.arrival_window_s == 0.01  # CPU's default


@pytest.mark.parametrize("flag,expected", [([], None), (["--arrival-window-ms", "0"], 0.0),
                                           (["--arrival-window-ms", "25"], 0.025)])
def test_serve_passes_the_arrival_window(monkeypatch, flag, expected):
    pytest.importorskip("fastapi")
    from hf_paged.serve import cli

    seen = {}

    class Built(Exception):
        pass

    def capture(model, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(cli, "init_continuous_batching", capture)
    args = cli.parser().parse_args(["--model", "unused", *flag])
    with pytest.raises(Built):
        cli.build(args, load=lambda path, dtype: (tiny_model(seed=1), None))
    assert seen["arrival_window_s"] == expected
