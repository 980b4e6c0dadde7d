"""The continuous-batching engine under tensor parallelism: two gloo ranks on CPU, rank 0 drives.

``tests/_tp_engine_worker.py`` runs under torchrun with a tiny Llama whose two KV heads split over the two ranks.
Rank 0 adds 18 requests from three threads at staggered moments (greedy and seeded sampling, shared prefixes, a pool
small enough to preempt, chunked prefill) and cancels one; both ranks must produce the single-process engine's
tokens, hold half its KV bytes per block, and fail together a step whose forward raised on rank 1 only.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import tiny_model
from helpers.engine_oracle import TIE, TieCount, check_tokens, reference
from helpers.models import VOCAB
from hf_paged import BlockPool, generate_batch, init_continuous_batching
from test_distributed import _tp_unavailable

WORKER = Path(__file__).with_name("_tp_engine_worker.py")
WORLD_SIZE = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 20  # small: running requests preempt each other
MAX_BATCH_TOKENS = 16  # prompts up to 21 tokens are prefilled in chunks
TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 240
CANCEL = "r5"
UNSEEDED = "r17"
FP8_REQUESTS = 4


def _requests() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(8)]  # two full blocks: later requests hit them in the cache
    specs = []
    for i in range(18):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 14))]
        prompt = shared + own if i % 3 else own
        if i % 2:
            settings = dict(do_sample=True, temperature=0.9, top_k=20, seed=100 + i)
        else:
            settings = dict(do_sample=False)
        rid = f"r{i}"
        if rid == CANCEL:
            settings = dict(do_sample=False, eos_token_id=VOCAB - 1)  # runs its 40 tokens unless cancelled
        if rid == UNSEEDED:
            settings = dict(do_sample=True, temperature=1.0)  # rank 0 seeds it: the ranks must still agree
        # the first nine arrive at once (their blocks cannot all fit: preemption on any machine, however fast),
        # the rest staggered (events arriving while the engine runs)
        specs.append(dict(id=rid, prompt=prompt, settings=settings, thread=i % 3, at=0.0 if i < 9 else 0.03 * i,
                          max_new_tokens=40 if rid == CANCEL else 6 + i % 5))
    return specs


def _single_process(path: Path, specs: list[dict]) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pool = BlockPool(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, prefix_caching=True)
    with init_continuous_batching(model, pool=pool, max_batch_tokens=MAX_BATCH_TOKENS) as manager:
        for spec in specs:
            manager.add_request(spec["prompt"], request_id=spec["id"], max_new_tokens=spec["max_new_tokens"],
                                **spec["settings"])
        tokens = {spec["id"]: list(manager.get_result(spec["id"], timeout=120).generated_tokens) for spec in specs}
    stats = pool.memory_stats()
    fp8_pool = BlockPool(num_blocks=64, block_size=BLOCK_SIZE, prefix_caching=True, kv_dtype=torch.float8_e4m3fn)
    with init_continuous_batching(model, pool=fp8_pool, max_batch_tokens=MAX_BATCH_TOKENS) as manager:
        greedy = [s for s in specs if not s["settings"].get("do_sample")][:FP8_REQUESTS]
        for spec in greedy:
            manager.add_request(spec["prompt"], request_id=spec["id"], max_new_tokens=spec["max_new_tokens"],
                                do_sample=False)
        fp8 = {s["id"]: list(manager.get_result(s["id"], timeout=120).generated_tokens) for s in greedy}
    batch_pool = BlockPool(num_blocks=64, block_size=BLOCK_SIZE, prefix_caching=True)
    batch = generate_batch(model, [s["prompt"] for s in greedy], max_new_tokens=6, do_sample=False,
                           progress_bar=False, pool=batch_pool, max_batch_tokens=MAX_BATCH_TOKENS)
    # greedy: generate() alone with a DynamicCache, its logits kept for the tie rule
    greedy_refs = {s["id"]: reference(model, s["prompt"], s["max_new_tokens"]) for s in specs
                   if not s["settings"].get("do_sample")}
    return {"tokens": tokens, "bytes_per_block": stats.bytes_per_block, "bytes_reserved": stats.bytes_reserved,
            "fp8_tokens": fp8, "greedy_refs": greedy_refs,
            "generate_batch": {rid: list(o.generated_tokens) for rid, o in batch.items()},
            "generate_batch_specs": [s["id"] for s in greedy]}


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory):
    reason = _tp_unavailable()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("tp_engine")
    tiny_model("llama", seed=3).save_pretrained(work / "llama")
    specs = _requests()
    single = _single_process(work / "llama", specs)
    job = dict(model=str(work / "llama"), requests=specs, cancel=CANCEL, threads=3, block_size=BLOCK_SIZE,
               num_blocks=NUM_BLOCKS, max_batch_tokens=MAX_BATCH_TOKENS, timeout_s=TIMEOUT_S,
               fp8_requests=FP8_REQUESTS)
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
           str(WORKER), str(work)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s\n{stderr[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited with {proc.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}")
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return specs, single, ranks


def _check_prefix(name: str, got: list[int], ref) -> None:
    """The tie rule of :func:`check_tokens` over the positions both have (a cancelled request's tokens, a reference
    that stopped at EOS where the request ignores it)."""
    for i, (g, r) in enumerate(zip(got, ref.tokens)):
        if g != r:
            top2 = ref.logits[i].topk(2).values
            assert float(top2[0] - top2[1]) < TIE, f"{name}: token {i} is {g}, generate() alone gives {r}"
            return


def test_tp_engine_tokens_equal_single_process(tp_engine):
    """Greedy requests: generate() alone's tokens, or a first difference where its top-2 logits tie within TIE (the
    ranks' all-reduce sums in another order than one process). Seeded sampled requests: the single-process engine's
    tokens exactly (a flip needs a uniform draw within float rounding of a boundary of the cumulative
    probabilities: about 1e-6 per token)."""
    specs, single, ranks = tp_engine
    ties = TieCount()
    for rank, result in enumerate(ranks):
        main = result["main"]
        assert main["error"] is None, main["error"]
        for spec in specs:
            rid = spec["id"]
            out = main["outputs"][rid]
            if rid == UNSEEDED:
                continue
            if rid == CANCEL:
                assert out["status"] == "CANCELLED", (rank, out)
                assert 0 < len(out["tokens"]) < spec["max_new_tokens"], (rank, out)
                _check_prefix(f"rank {rank} {rid}", out["tokens"], single["greedy_refs"][rid])
                continue
            assert out["status"] == "FINISHED", (rank, rid, out)
            if spec["settings"].get("do_sample"):
                assert out["tokens"] == single["tokens"][rid], (rank, rid, spec["settings"])
            else:
                check_tokens(f"rank {rank} {rid}", out["tokens"], single["greedy_refs"][rid], ties)
    assert ties.requests > 0


def test_tp_engine_ranks_agree_on_everything(tp_engine):
    """Every rank ends every request the same way with the same tokens, the unseeded sampled one included."""
    specs, _, ranks = tp_engine
    first, second = (r["main"] for r in ranks)
    assert set(first["outputs"]) == set(second["outputs"]) == {s["id"] for s in specs}
    assert first["outputs"] == second["outputs"]
    assert len(first["outputs"][UNSEEDED]["tokens"]) > 0
    # the run exercised what it claims: preemption, prefix hits, several steps; the same counts on both ranks
    assert first["preemptions"] > 0 and first["prefix_hit_tokens"] > 0
    assert (first["preemptions"], first["prefix_hit_tokens"], first["steps"]) == \
        (second["preemptions"], second["prefix_hit_tokens"], second["steps"])
    assert second["follower_refused"], "add_request on rank 1 must raise"


def test_tp_engine_rank_holds_half_the_kv(tp_engine):
    _, single, ranks = tp_engine
    for result in ranks:
        main = result["main"]
        assert result["tp_size"] == WORLD_SIZE
        assert main["pool_heads"] and set(main["pool_heads"]) == {1}  # 2 KV heads, one per rank
        assert main["bytes_per_block"] * WORLD_SIZE == single["bytes_per_block"]
        assert main["all_ranks_bytes_per_block"] == single["bytes_per_block"]
        # manager.memory_stats(all_ranks=True) (its own group) and sum_over_ranks (the default group) agree
        summed = main["all_ranks_bytes_reserved"]
        assert summed == main["all_ranks_default_group"] == WORLD_SIZE * main["bytes_reserved"]
        assert main["bytes_reserved"] > 0


def test_tp_engine_step_failing_on_one_rank_fails_its_step_everywhere(tp_engine):
    """A forward raising on rank 1 after its collectives, then planning raising on rank 1 before the forward: both
    fail their request on both ranks, promptly, and the next request runs."""
    _, _, ranks = tp_engine
    for rank, result in enumerate(ranks):
        failing = result["failing"]
        assert failing["error"] is None, failing["error"]  # the engine went on
        boom, after = failing["outputs"]["boom"], failing["outputs"]["after"]
        assert boom["status"] == "FAILED", (rank, boom)
        assert ("injected failure on rank 1" if rank == 1 else "failed on rank(s) [1]") in boom["error"]
        planning = failing["outputs"]["boom-plan"]
        assert planning["status"] == "FAILED", (rank, planning)
        assert ("injected planning failure on rank 1" if rank == 1 else "failed on rank(s) [1]") in planning["error"]
        assert failing["seconds"] < TIMEOUT_S  # nobody waited for a collective's timeout
        assert after["status"] == "FINISHED" and after["tokens"], (rank, after)
    assert ranks[0]["failing"]["outputs"]["after"]["tokens"] == ranks[1]["failing"]["outputs"]["after"]["tokens"]


def test_tp_engine_fp8_pool_tokens_equal_single_process(tp_engine):
    """Both ranks give the same tokens, equal to the single-process fp8 engine's: a difference would need a K/V
    value within float rounding of an fp8 rounding boundary (one in ~1e6) *and* its ~6% change to flip a greedy
    near-tie."""
    _, single, ranks = tp_engine
    assert len(single["fp8_tokens"]) == FP8_REQUESTS
    for rank, result in enumerate(ranks):
        fp8 = result["fp8"]
        assert fp8["error"] is None, fp8["error"]
        assert {rid: out["tokens"] for rid, out in fp8["outputs"].items()} == single["fp8_tokens"], rank
    assert ranks[0]["fp8"]["outputs"] == ranks[1]["fp8"]["outputs"]


def test_tensor_parallel_without_a_process_group_is_refused(llama):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this pytest process")
    with pytest.raises(ValueError, match="torchrun"):
        init_continuous_batching(llama, pool=BlockPool(num_blocks=8, block_size=BLOCK_SIZE), tensor_parallel=True)
    manager = init_continuous_batching(llama, pool=BlockPool(num_blocks=8, block_size=BLOCK_SIZE))
    assert manager._sync is None  # a model without tp_plan runs the single-process engine


def test_tp_engine_diverged_ranks_stop_with_an_error_instead_of_hanging(tp_engine):
    _, _, ranks = tp_engine
    for rank, result in enumerate(ranks):
        diverged = result["diverged"]
        assert diverged["stopped"] and diverged["seconds"] < TIMEOUT_S, (rank, diverged)
        assert "scheduled different steps" in (diverged["error"] or ""), (rank, diverged)
        assert diverged["outputs"]["long"]["status"] == "FAILED", (rank, diverged)


def test_settings_the_other_ranks_cannot_receive_are_refused_at_add():
    from types import SimpleNamespace

    from hf_paged.engine.distributed import check_broadcastable
    from hf_paged.engine.sampling import SamplingParams

    class Grammar:
        def matcher(self):
            return None

    check_broadcastable(SamplingParams(do_sample=True, seed=3))  # plain settings pass
    with pytest.raises(ValueError, match="structured output"):
        check_broadcastable(SamplingParams(grammar=Grammar()))
    with pytest.raises(ValueError, match="cannot be sent"):
        check_broadcastable(SimpleNamespace(grammar=None, stop=lambda text: False))  # a local function: no pickle


def test_tp_generate_batch_on_every_rank_still_works(tp_engine):
    """generate_batch called on every rank with the same prompts (no driver): 6 tokens each (no EOS in the way), equal
    to generate() alone's under the tie rule, the same on both ranks."""
    _, single, ranks = tp_engine
    assert len(single["generate_batch"]) == FP8_REQUESTS
    assert ranks[0]["generate_batch"] == ranks[1]["generate_batch"]
    for i, spec_id in enumerate(single["generate_batch_specs"]):
        ref = single["greedy_refs"][spec_id]
        for rank, result in enumerate(ranks):
            got = result["generate_batch"][f"req_{i}"]
            assert len(got) == min(6, len(ref.tokens)), (rank, spec_id, got)
            _check_prefix(f"rank {rank} generate_batch {spec_id}", got, ref)
