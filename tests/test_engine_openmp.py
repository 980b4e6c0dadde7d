"""The engine lets the starting thread's idle OpenMP workers go (``hf_paged/engine/openmp.py``): with them alive
beside the engine thread's, libgomp throttles its spinning and every parallel op of a step pays a wake-up."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import tiny_model

import hf_paged
from hf_paged.engine import openmp


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(openmp._runtime() is None or not os.path.isdir("/proc/self/task"),
                    reason="needs torch on libgomp and /proc")
def test_release_lets_the_callers_workers_go_and_torch_goes_on():
    """Run a parallel op on a fresh thread (its own pool: one more worker), release there: the worker leaves, and
    parallel ops on that thread still compute (the pool comes back)."""
    a, b = torch.randn(1 << 20), torch.randn(1 << 20)
    seen = {}

    def body():
        torch.set_num_threads(2)
        torch.add(a, b)  # above the grain size: a parallel region, so this thread gets a pool of workers
        seen["with_pool"] = threads()
        seen["released"] = openmp.release_caller_threads()
        deadline = time.monotonic() + 5
        while threads() >= seen["with_pool"] and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["after"] = threads()
        seen["sum"] = torch.add(a, b)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["released"]
    assert seen["after"] < seen["with_pool"]
    assert torch.equal(seen["sum"], a + b)


def test_starting_a_cpu_engine_releases_the_starting_threads_pool(monkeypatch):
    calls = []
    monkeypatch.setattr(openmp, "release_caller_threads", lambda: calls.append(threading.current_thread()))
    model = tiny_model("llama", seed=2)
    hf_paged.generate_batch(model, [[5, 6, 7]], max_new_tokens=2, progress_bar=False)
    assert calls == [threading.current_thread()]
