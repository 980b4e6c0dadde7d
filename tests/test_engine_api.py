"""The manager's API over a shadow engine (no model, see tests/helpers/engine_shadow.py): many threads adding, reading and
cancelling; results going to whoever asks for their id; streams of new tokens only; the queue limit; refusals with
sizes; stop() draining or cancelling; unread results kept up to a limit; transformers' ContinuousBatchingConfig mapped
or refused by name; a dropped manager ends its thread and frees its pool."""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import pytest
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from helpers.engine_shadow import VOCAB, expected_tokens, one_thread, shadow_engine
from hf_paged.engine.manager import ContinuousBatchingManager
from hf_paged.engine.options import from_continuous_batching_config
from hf_paged.engine.outputs import GenerationOutput, QueueFullError, RequestStatus, RequestTooLargeError


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def shadow_manager(num_blocks=48, block_size=4, max_batch_tokens=16, step_delay=0.0, **options):
    core = shadow_engine(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=max_batch_tokens)
    if step_delay:
        run = core.runner.run

        def slow(batch):
            time.sleep(step_delay)
            return run(batch)

        core.runner.run = slow
    return ContinuousBatchingManager(core, GenerationConfig(max_new_tokens=8), vocab_size=VOCAB, **options)


def test_threads_add_read_and_cancel_under_pool_pressure():
    """64 requests from 8 threads on a pool holding ~30% of what they need at once, a quarter cancelled mid-way:
    every other request finishes with its expected tokens, the cancelled ones say so, preemptions happen, no thread
    sees an exception, and no block is in use at the end."""
    manager = shadow_manager(num_blocks=40, block_size=4, max_batch_tokens=32, step_delay=0.0005)
    errors, outcomes = [], {}

    def client(t):
        try:
            rng = random.Random(t)
            mine = []
            for i in range(8):
                prompt = prompt_of(rng.randint(4, 20), 100 * t + i)
                new = rng.randint(8, 24)
                rid = manager.add_request(prompt, max_new_tokens=new)
                mine.append((rid, prompt, new, i % 4 == 3))
            for rid, prompt, new, cancel in mine:
                if cancel:
                    time.sleep(0.002)
                    manager.cancel_request(rid)
            for rid, prompt, new, cancel in mine:
                out = manager.get_result(rid, timeout=60)
                outcomes[rid] = (out, prompt, new, cancel)
        except BaseException as err:  # noqa: BLE001 - the test reports it
            errors.append(err)

    with manager:
        threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        stats = manager.stats()
    assert not errors, errors
    assert len(outcomes) == 64
    for rid, (out, prompt, new, cancel) in outcomes.items():
        assert out.request_id == rid and out.prompt_ids == prompt
        want = expected_tokens(prompt, new)
        if out.status == RequestStatus.CANCELLED:
            assert cancel and out.generated_tokens == want[: len(out.generated_tokens)]
        else:
            assert out.status == RequestStatus.FINISHED and out.finish_reason == "length"
            assert out.generated_tokens == want
            assert len(out.timestamps) == new and out.first_token_time is not None
    assert stats.preemptions > 0
    assert stats.finished + stats.cancelled == 64 and stats.blocks_in_use == 0 and stats.running == 0


def test_get_result_by_id_never_returns_another_request():
    """get_result(id) waits for that request only; get_result() takes the oldest unread; a result is read once."""
    manager = shadow_manager()
    a = manager.add_request(prompt_of(5, 1), max_new_tokens=20)
    b = manager.add_request(prompt_of(5, 2), max_new_tokens=2, request_id="mine")
    assert b == "mine"
    with pytest.raises(ValueError, match="request id 'mine' is in use"):
        manager.add_request(prompt_of(3, 3), request_id="mine")
    with manager:
        out_a = manager.get_result(a)
        assert out_a.request_id == a and len(out_a.generated_tokens) == 20
        out_any = manager.get_result(timeout=5)
        assert out_any.request_id == "mine"
        assert manager.get_result(timeout=0.01) is None
    with pytest.raises(KeyError, match="already read"):
        manager.get_result(a)
    with pytest.raises(KeyError, match="no request with id 'nope'"):
        manager.get_result("nope")


def test_stream_yields_only_new_tokens_each_step():
    """A streaming request's outputs carry each step's new tokens; joined they are the whole generation, and the
    last has the final status. A callback sees the same deltas."""
    seen = []
    manager = shadow_manager()
    prompt = prompt_of(9, 5)
    with manager:
        rid = manager.add_request(prompt, max_new_tokens=7, streaming=True, callback=seen.append)
        deltas = list(manager.request_id_iter(rid))
    assert all(isinstance(d, GenerationOutput) for d in deltas)
    assert [len(d.generated_tokens) for d in deltas] == [1] * 7
    assert [t for d in deltas for t in d.generated_tokens] == expected_tokens(prompt, 7)
    assert deltas[-1].status == RequestStatus.FINISHED and not any(d.is_finished() for d in deltas[:-1])
    assert [d.generated_tokens for d in seen] == [d.generated_tokens for d in deltas]
    with pytest.raises(KeyError):  # the stream carried the end: nothing left to read
        manager.get_result(rid)


def test_queue_limit_and_refusals():
    """Past max_queue_size waiting requests add_request raises QueueFullError; a request that can never fit the pool
    is refused with its sizes; bad prompts are refused by name; nothing is queued by a refused call."""
    manager = shadow_manager(num_blocks=8, block_size=4, max_queue_size=2)
    manager.add_request(prompt_of(4, 1))
    manager.add_requests([prompt_of(4, 2)])
    with pytest.raises(QueueFullError, match="2 requests are waiting and max_queue_size is 2"):
        manager.add_request(prompt_of(4, 3))
    with pytest.raises(RequestTooLargeError, match=r"30 prompt \+ 8 new tokens needs 10 KV blocks .* holds 8"):
        manager.add_request(prompt_of(30, 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        manager.add_request([5, VOCAB + 3])
    with pytest.raises(ValueError, match="empty"):
        manager.add_request([])
    with pytest.raises(ValueError, match="num_beam_groups"):
        manager.add_request(prompt_of(4, 5), generation_config=GenerationConfig(num_beams=2, num_beam_groups=2))
    with manager:
        outs = [manager.get_result(timeout=10) for _ in range(2)]
    assert all(o.status == RequestStatus.FINISHED for o in outs)


def test_too_large_request_fails_alone_in_add_requests_of_generate_batch_style():
    """add_requests is all or nothing: one request too large for the pool refuses the call, naming its size."""
    manager = shadow_manager(num_blocks=8, block_size=4)
    with pytest.raises(RequestTooLargeError):
        manager.add_requests([prompt_of(4, 1), prompt_of(40, 2)])
    assert manager.stats().waiting == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread re-raises the bug
def test_an_engine_bug_fails_every_request_and_stops_the_manager():
    """An exception escaping the engine's step (a bug, not one request's error) fails every request the engine held
    and every one still queued, each naming the error; the manager then refuses new requests, naming it too."""
    manager = shadow_manager()
    ids = manager.add_requests([prompt_of(5, i) for i in range(4)], max_new_tokens=6)
    engine = manager._core

    def broken():
        raise RuntimeError("a bug in the step")

    engine.step = broken
    manager.start()
    outs = [manager.get_result(i, timeout=30) for i in ids]
    assert all(o.status == RequestStatus.FAILED and "the engine stopped: RuntimeError: a bug in the step" in o.error
               for o in outs), outs
    with pytest.raises(RuntimeError, match="a bug in the step"):
        manager.add_request(prompt_of(3, 1))
    manager.stop(block=True, timeout=10)


def test_stop_drains_or_cancels_and_every_request_ends():
    """stop(drain=True) finishes what is queued; stop(drain=False) cancels it; after a drain timeout what is left is
    cancelled; every request ends with a final status, the thread is joined, and add_request then raises."""
    manager = shadow_manager()
    ids = manager.add_requests([prompt_of(5, i) for i in range(6)], max_new_tokens=6)
    manager.start()
    manager.stop(drain=True)
    assert not manager.is_running() and manager.join(timeout=0)
    outs = [manager.get_result(i) for i in ids]
    assert all(o.status == RequestStatus.FINISHED for o in outs)
    with pytest.raises(RuntimeError, match="stopped"):
        manager.add_request(prompt_of(3, 1))

    manager = shadow_manager(step_delay=0.005)
    ids = manager.add_requests([prompt_of(5, i) for i in range(6)], max_new_tokens=200 // 8)
    manager.start()
    manager.stop(drain=False)
    outs = [manager.get_result(i) for i in ids]
    assert {o.status for o in outs} == {RequestStatus.CANCELLED}
    assert manager.stats().blocks_in_use == 0

    manager = shadow_manager(step_delay=0.01)
    ids = manager.add_requests([prompt_of(5, i) for i in range(4)], max_new_tokens=30)
    manager.start()
    manager.stop(drain=True, timeout=0.05)
    outs = [manager.get_result(i) for i in ids]
    assert all(o.is_finished() for o in outs) and RequestStatus.CANCELLED in {o.status for o in outs}

    manager = shadow_manager()  # never started: queued requests are cancelled
    rid = manager.add_request(prompt_of(4, 1))
    manager.stop()
    assert manager.get_result(rid).status == RequestStatus.CANCELLED


def test_unread_results_are_kept_up_to_the_limit():
    """Past max_unread_results the oldest unread results are dropped (with a warning); asking for one says so."""
    manager = shadow_manager(max_unread_results=3)
    ids = manager.add_requests([prompt_of(4, i) for i in range(5)], max_new_tokens=2)
    with pytest.warns(UserWarning, match="max_unread_results=3"):
        with manager:
            while manager.stats().finished < 5:
                time.sleep(0.005)
    with pytest.raises(KeyError, match="dropped unread"):
        manager.get_result(ids[0])
    assert manager.get_result(ids[4]).status == RequestStatus.FINISHED


def test_failing_forward_fails_only_its_step_and_the_engine_goes_on():
    """A forward that raises ends that step's requests as FAILED with the error; the engine thread keeps serving."""
    manager = shadow_manager(max_batch_tokens=8)
    core = manager._core
    bad = prompt_of(6, 77)
    core.runner.fail = lambda batch: any(c.request.tokens[: len(bad)] == bad for c in batch.chunks)
    with manager:
        rid_bad = manager.add_request(bad, max_new_tokens=4)
        out = manager.get_result(rid_bad, timeout=10)
        assert out.status == RequestStatus.FAILED and "shadow forward failed" in out.error
        good = [manager.add_request(prompt_of(5, i), max_new_tokens=4) for i in range(3)]
        outs = [manager.get_result(g, timeout=10) for g in good]
    assert all(o.status == RequestStatus.FINISHED for o in outs)
    assert manager.stats().failed >= 1


def test_dropped_manager_ends_its_thread_and_frees_its_pool():
    """A manager dropped without stop(): its engine thread ends and its pool is freed (weak reference)."""
    manager = shadow_manager()
    before = set(threading.enumerate())
    manager.start()
    manager.add_request(prompt_of(5, 1), max_new_tokens=3)
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "hf_paged-engine"]
    pool = weakref.ref(manager.pool)
    del manager
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    gc.collect()
    assert pool() is None


def test_continuous_batching_config_is_mapped_or_refused_by_name():
    """transformers' ContinuousBatchingConfig: the fields with a meaning here are mapped; the others, when set, are
    refused by name; its defaults are accepted."""
    assert from_continuous_batching_config(ContinuousBatchingConfig()) == {}
    got = from_continuous_batching_config(ContinuousBatchingConfig(
        page_size=32, num_blocks=100, max_batch_tokens=256, max_queue_size=5, max_requests_per_batch=7,
        allow_block_sharing=False, return_logprobs=True, auto_switch_to_flash=False))
    assert got == {"block_size": 32, "num_blocks": 100, "max_batch_tokens": 256, "max_queue_size": 5,
                   "max_num_seqs": 7, "prefix_caching": False, "logprobs": 0}
    assert from_continuous_batching_config(ContinuousBatchingConfig(use_cuda_graph=False)) == {"cuda_graphs": False}
    assert from_continuous_batching_config(ContinuousBatchingConfig(use_cuda_graph=(False, True))) == {
        "cuda_graphs": True}  # (varlen, decode): decode-only steps are graphed here
    with pytest.raises(ValueError, match=r"use_cuda_graph=\(True, True\) \(this engine graphs decode-only steps"):
        from_continuous_batching_config(ContinuousBatchingConfig(use_cuda_graph=(True, True)))
    with pytest.raises(ValueError, match=r"scheduler_type='prefill_first'.*cpu_offload_space=1\.0"):
        from_continuous_batching_config(ContinuousBatchingConfig(scheduler_type="prefill_first",
                                                                 cpu_offload_space=1.0))
