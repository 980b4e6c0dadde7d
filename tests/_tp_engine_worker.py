"""One rank of the tensor-parallel engine check in ``test_tp_engine.py``, which launches it under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/_tp_engine_worker.py WORK_DIR

``WORK_DIR/job.json`` holds the model path, the requests (prompt, settings, when and from which thread rank 0 adds
them), the request to cancel and the engine's settings. Rank 0 adds the requests from several threads at their
moments and cancels one; every rank runs the engine and writes what it saw to ``WORK_DIR/rank{rank}.json``. Then a
second manager runs a step whose forward raises on rank 1 only, and one request after it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_paged import BlockPool, generate_batch, init_continuous_batching
from hf_paged.distributed import sum_over_ranks

warnings.filterwarnings("ignore")


def outputs(manager, ids: list[str] | None) -> dict:
    """Results by id: rank 0 waits for each of ``ids``; a follower reads what its engine finished."""
    got = {}
    if ids is not None:
        for rid in ids:
            out = manager.get_result(rid, timeout=120)
            got[rid] = out
    else:
        while (out := manager.get_result(timeout=0)) is not None:
            got[out.request_id] = out
    return {rid: {"tokens": list(o.generated_tokens), "status": o.status.name, "error": o.error} if o is not None
            else {"tokens": [], "status": "NO RESULT", "error": None} for rid, o in got.items()}


def main_run(model, job: dict, rank: int) -> dict:
    pool = BlockPool(num_blocks=job["num_blocks"], block_size=job["block_size"], prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=job["max_batch_tokens"],
                                       tp_timeout_s=job["timeout_s"])
    assert manager._sync is not None, "the manager did not run tensor-parallel"
    manager.start()
    refused = False
    if rank == 0:
        start = time.monotonic()
        cancelled = threading.Event()

        def cancel_once_running(delta) -> None:  # cancelled while it runs (it asks for 40 tokens), on any machine
            if delta.generated_tokens and not cancelled.is_set():
                cancelled.set()
                manager.cancel_request(job["cancel"])

        def feed(thread: int) -> None:
            for spec in job["requests"]:
                if spec["thread"] != thread:
                    continue
                time.sleep(max(0.0, start + spec["at"] - time.monotonic()))
                callback = cancel_once_running if spec["id"] == job["cancel"] else None
                manager.add_request(spec["prompt"], request_id=spec["id"], max_new_tokens=spec["max_new_tokens"],
                                    callback=callback, **spec["settings"])

        threads = [threading.Thread(target=feed, args=(t,)) for t in range(job["threads"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen = outputs(manager, [spec["id"] for spec in job["requests"]])
        manager.stop()
    else:
        try:
            manager.add_request([1, 2, 3], max_new_tokens=2)
        except ValueError:
            refused = True
        manager.stop()  # returns when rank 0 stops
        seen = outputs(manager, None)
    stats = manager.stats()
    mine = pool.memory_stats()
    return {"outputs": seen, "follower_refused": refused, "error": manager.error,
            "preemptions": stats.preemptions, "prefix_hit_tokens": stats.prefix_hit_tokens, "steps": stats.steps,
            "bytes_per_block": mine.bytes_per_block,
            "all_ranks_bytes_per_block": manager.memory_stats(all_ranks=True).bytes_per_block,
            "all_ranks_bytes_reserved": manager.memory_stats(all_ranks=True).bytes_reserved,
            "bytes_reserved": mine.bytes_reserved, "all_ranks_default_group": sum_over_ranks(mine).bytes_reserved,
            "pool_heads": [int(t.shape[2]) for t in pool.key_caches.values()]}


def failing_run(model, job: dict, rank: int) -> dict:
    """A step whose forward raises on rank 1 only (after its collectives): its requests fail on both ranks."""
    manager = init_continuous_batching(model, pool=BlockPool(num_blocks=64, block_size=job["block_size"]),
                                       max_batch_tokens=job["max_batch_tokens"], tp_timeout_s=job["timeout_s"])
    inner = manager._core.runner.inner
    run, plan = inner.run, inner._plan
    planning_fails = [False]

    def run_or_raise(batch):
        ids = {c.request.request_id for c in batch.chunks}
        planning_fails[0] = rank == 1 and "boom-plan" in ids
        logits = run(batch)
        if rank == 1 and "boom" in ids:  # after the forward's collectives
            raise RuntimeError("injected failure on rank 1")
        return logits

    def plan_or_raise(*args, **kwargs):  # before the forward: rank 0 must not start its collectives
        if planning_fails[0]:
            raise RuntimeError("injected planning failure on rank 1")
        return plan(*args, **kwargs)

    inner.run, inner._plan = run_or_raise, plan_or_raise
    start = time.monotonic()
    with manager:
        if rank == 0:
            seen = {}
            for rid in ("boom", "boom-plan", "after"):
                manager.add_request(job["requests"][0]["prompt"], request_id=rid, max_new_tokens=4)
                seen.update(outputs(manager, [rid]))
    if rank != 0:
        seen = outputs(manager, None)
    return {"outputs": seen, "error": manager.error, "seconds": time.monotonic() - start}


def fp8_run(model, job: dict, rank: int) -> dict:
    """Greedy requests on an fp8 pool (the same requests every rank; rank 0 adds them)."""
    pool = BlockPool(num_blocks=64, block_size=job["block_size"], prefix_caching=True, kv_dtype=torch.float8_e4m3fn)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=job["max_batch_tokens"],
                                       tp_timeout_s=job["timeout_s"])
    specs = [s for s in job["requests"] if not s["settings"].get("do_sample")][:job["fp8_requests"]]
    with manager:
        if rank == 0:
            for spec in specs:
                manager.add_request(spec["prompt"], request_id=spec["id"], max_new_tokens=spec["max_new_tokens"],
                                    do_sample=False)
            seen = outputs(manager, [s["id"] for s in specs])
    if rank != 0:
        seen = outputs(manager, None)
    return {"outputs": seen, "error": manager.error}


def diverged_run(model, job: dict, rank: int) -> dict:
    """Ranks whose engines are set up differently (step budgets 16 and 8) schedule different steps: the batch digest
    check stops both engines with an error before any forward, instead of hanging in the model's collectives."""
    manager = init_continuous_batching(model, pool=BlockPool(num_blocks=64, block_size=job["block_size"]),
                                       max_batch_tokens=16 if rank == 0 else 8, tp_timeout_s=job["timeout_s"])
    manager.start()
    start = time.monotonic()
    if rank == 0:
        manager.add_request(list(range(3, 23)), request_id="long", max_new_tokens=4)  # 20 tokens: chunked apart
        seen = outputs(manager, ["long"])
    stopped = manager.join(timeout=job["timeout_s"])
    if rank != 0:
        seen = outputs(manager, None)
    return {"outputs": seen, "error": manager.error, "seconds": time.monotonic() - start,
            "stopped": stopped}


def generate_batch_run(model, job: dict) -> dict:
    """generate_batch as before: every rank is handed the same prompts and runs its own engine."""
    specs = [s for s in job["requests"] if not s["settings"].get("do_sample")][:job["fp8_requests"]]
    out = generate_batch(model, [s["prompt"] for s in specs], max_new_tokens=6, do_sample=False, progress_bar=False,
                         pool=BlockPool(num_blocks=64, block_size=job["block_size"], prefix_caching=True),
                         max_batch_tokens=job["max_batch_tokens"])
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def main(work_dir: str) -> None:
    job = json.load(open(os.path.join(work_dir, "job.json")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=job["timeout_s"]))
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(job["model"], tp_plan="auto", dtype=torch.float32).eval()
    result = {"main": main_run(model, job, rank), "failing": failing_run(model, job, rank),
              "fp8": fp8_run(model, job, rank),
              "generate_batch": generate_batch_run(model, job),
              "diverged": diverged_run(model, job, rank),
              "tp_size": model.tp_size}
    tmp = os.path.join(work_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, tmp[: -len(".tmp")])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
