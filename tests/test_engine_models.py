"""The engine on real (tiny, random-weight) models: every request's greedy tokens equal the same request alone through
``model.generate()`` with a ``DynamicCache`` -- across random arrival orders, token budgets that force chunked
prefill, pools that force preemption, prefix-cache hits, model families and an fp8 pool -- and the engine keeps
serving under pool pressure from many threads, past failing forwards, and over thousands of requests.

Where a float tie flips a greedy token, a difference is accepted only if the reference's top-2 logits at that position
differ by less than 1e-4 (see tests/helpers/engine_oracle.py); the tests print how often that happened.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import weakref

import pytest
import torch

from helpers import DEVICE, EOS, FAMILIES, VOCAB, tiny_family_model, tiny_model
from helpers.engine_oracle import TieCount, check_tokens, drive, random_prompts, reference
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, RequestStatus, enable_paged_attention, generate_batch, init_continuous_batching, patches
from hf_paged.engine.sampling import SamplingParams
from hf_paged.patches import layer_windows


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


BLOCK = 4
# families the installed transformers has
AVAILABLE = sorted(m for m in FAMILIES if patches._registry()[m].in_transformers())
TIES = TieCount()


def engine(model, pool, **options):
    """A manager whose core the test steps itself (no thread): arrival order under the test's control."""
    manager = init_continuous_batching(model, pool=pool, **options)
    return manager, manager._core


def assert_like_generate(model, reqs, specs, label):
    for rid, prompt, new in specs:
        req = reqs[rid]
        assert req.status == RequestStatus.FINISHED, (label, rid, req.status, req.error)
        check_tokens(f"{label}/{rid}", req.generated, reference(model, prompt, new), TIES)


SCENARIOS = {
    # name: (num_blocks, max_batch_tokens, prefix_caching, shared prefixes)
    "roomy": (256, 256, False, False),
    "chunked_prefill": (256, 7, False, False),
    "preemption": (22, 64, False, False),
    "prefix_hits": (256, 32, True, True),
    "prefix_hits_preemption_chunks": (26, 11, True, True),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tokens_equal_generate_alone(scenario):
    num_blocks, budget, prefix, shared = SCENARIOS[scenario]
    model = enable_paged_attention(tiny_model("llama", seed=3), backend="torch")
    prefixes = [random_prompts(1, VOCAB, (9, 9), 50)[0], random_prompts(1, VOCAB, (14, 14), 51)[0]] if shared else []
    prompts = random_prompts(14, VOCAB, (1, 30), seed=7, shared=prefixes)
    specs = [(f"r{i}", p, 1 + (i * 5) % 13) for i, p in enumerate(prompts)]
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix)
    manager, core = engine(model, pool, max_batch_tokens=budget)
    chunks = []
    reqs = drive(core, specs, seed=len(scenario), chunks=chunks)
    assert_like_generate(model, reqs, specs, scenario)
    c = core.scheduler.counters
    if "preemption" in scenario:
        assert c.preemptions > 0
    if prefix:
        assert c.prefix_hit_tokens > 0
    if budget < 30:  # some prompt was prefilled over several steps
        assert any(start + n < prompt_len for _, start, n, prompt_len in chunks)
    assert pool.allocator.blocks_in_use == 0
    pool.allocator.check_invariants()
    print(f"\n{scenario}: ties accepted so far {len(TIES.ties)} of {TIES.requests} requests")


@pytest.mark.parametrize("model_type", AVAILABLE)
def test_families_equal_generate_alone(model_type):
    """Every family ``python -m hf_paged models`` lists (windows, one or mixed, soft-capping, sinks, MoE), through a
    pool that forces preemption and a budget that forces chunked prefill. Mixed-window models run through their layer
    groups without prefix caching."""
    model = enable_paged_attention(tiny_family_model(model_type, seed=2), backend="torch")
    prompts = random_prompts(8, VOCAB, (12, 30), seed=11)
    specs = [(f"{model_type}{i}", p, 6 + i % 6) for i, p in enumerate(prompts)]
    sliding_only = None not in layer_windows(model.config)  # its blocks leave the window: a smaller pool for pressure
    pool = BlockPool(block_size=BLOCK, num_blocks=10 if sliding_only else 20, prefix_caching=True)
    manager, core = engine(model, pool, max_batch_tokens=16)
    chunks = []
    reqs = drive(core, specs, seed=5, chunks=chunks, steps_between=0)
    assert_like_generate(model, reqs, specs, model_type)
    assert core.scheduler.counters.preemptions > 0
    assert any(start + n < prompt_len for _, start, n, prompt_len in chunks)  # a prompt prefilled in chunks
    assert pool.allocator.blocks_in_use == 0


def check_same(name, got: list[int], alone) -> None:
    """``got`` equals the tokens of the same request run alone (``alone``: a finished Request asked for top-2
    logprobs), or first differs where the alone run's top-2 tied within 1e-4 (counted)."""
    TIES.requests += 1
    for i, (g, r) in enumerate(zip(got, alone.generated)):
        if g != r:
            (_, first), (_, second) = alone.top_logprobs[i][:2]
            assert first - second < 1e-4, f"{name}: token {i} is {g}, alone {r} (top-2 gap {first - second:.2e})"
            TIES.ties.append((name, i, first - second))
            return
    assert len(got) == len(alone.generated), name


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_request_alone_and_among_fifteen_others(kv_dtype):
    """Sixteen requests, half greedy and half sampled with a seed: each gives the same tokens run alone through the
    engine and run among the 15 others (random arrivals, a budget forcing chunked prefill, a pool forcing
    preemption), on a full-precision and an fp8 pool (each fp8 token's scales are its own, whatever shares the pool)."""
    model = enable_paged_attention(tiny_model("llama", seed=4), backend="torch")
    prompts = random_prompts(16, VOCAB, (3, 30), seed=13)
    specs = []
    for i, p in enumerate(prompts):
        sampled = dict(do_sample=True, temperature=0.8, top_k=20, seed=1000 + i) if i % 2 else {}
        specs.append((f"r{i}", p, SamplingParams(max_new_tokens=8, eos_token_ids=(EOS,), logprobs=2, **sampled)))
    pool = BlockPool(block_size=BLOCK, num_blocks=30, kv_dtype=kv_dtype)
    _, core = engine(model, pool, max_batch_tokens=16)
    alone = {}
    for spec in specs:
        alone.update(drive(core, [spec], seed=0))
    together = drive(core, specs, seed=1)
    assert core.scheduler.counters.preemptions > 0
    for rid, _, _ in specs:
        assert together[rid].status == RequestStatus.FINISHED
        check_same(f"{kv_dtype}/{rid}", together[rid].generated, alone[rid])
    assert pool.allocator.blocks_in_use == 0


def test_pool_pressure_from_threads_with_cancellations():
    """64 requests from 8 threads on a pool holding ~30% of the KV they need at once, some cancelled mid-way: every
    other request finishes with the tokens generate() gives alone, preemptions happen, no thread sees an exception,
    and no block is in use at the end (cached prefix blocks aside)."""
    model = enable_paged_attention(tiny_model("llama", seed=5), backend="torch")
    rng = random.Random(3)
    specs = [(rng.randint(2, 24), rng.randint(4, 16)) for _ in range(64)]
    need = sum(-(-(p + n) // BLOCK) for p, n in specs)
    # ~20% of what the requests need at once, so the pool runs short even when the threads' requests arrive spread
    # over several steps (a loaded machine schedules the client threads late)
    pool = BlockPool(block_size=BLOCK, num_blocks=int(0.2 * need), prefix_caching=True)
    prompts = random_prompts(64, VOCAB, (2, 24), seed=17)
    prompts = [p[: specs[i][0]] or p for i, p in enumerate(prompts)]
    errors, results = [], {}
    start = threading.Barrier(8)
    with init_continuous_batching(model, pool=pool, max_batch_tokens=64) as manager:
        def client(t):
            try:
                start.wait(timeout=60)  # the eight threads add their requests together
                mine = []
                for i in range(t, 64, 8):
                    rid = manager.add_request(prompts[i], max_new_tokens=specs[i][1])
                    mine.append((rid, i))
                for rid, i in mine:
                    if i % 7 == 3:
                        manager.cancel_request(rid)
                for rid, i in mine:
                    results[i] = manager.get_result(rid, timeout=300)
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        stats = manager.stats()
    assert not errors, errors
    assert stats.preemptions > 0
    finished = 0
    for i, out in results.items():
        if out.status == RequestStatus.CANCELLED:
            assert i % 7 == 3
            continue
        assert out.status == RequestStatus.FINISHED, (i, out.status, out.error)
        check_tokens(f"pressure/{i}", out.generated_tokens, reference(model, prompts[i], specs[i][1]), TIES)
        finished += 1
    assert finished >= 64 - 10 and len(results) == 64
    assert pool.allocator.blocks_in_use == 0
    pool.allocator.check_invariants()


def test_request_larger_than_the_pool_gets_its_error_and_the_rest_finish():
    """generate_batch with one prompt that cannot fit the whole pool: that one comes back FAILED with the sizes, the
    others finish with generate()'s tokens."""
    model = enable_paged_attention(tiny_model("llama", seed=6), backend="torch")
    prompts = random_prompts(4, VOCAB, (3, 10), seed=19)
    prompts.insert(2, random_prompts(1, VOCAB, (60, 60), seed=20)[0])
    pool = BlockPool(block_size=BLOCK, num_blocks=16)
    outs = generate_batch(model, prompts, pool=pool, max_new_tokens=6, progress_bar=False)
    assert list(outs) == [f"req_{i}" for i in range(5)]
    big = outs["req_2"]
    assert big.status == RequestStatus.FAILED and "needs 17 KV blocks of 4 tokens" in big.error
    for i in (0, 1, 3, 4):
        check_tokens(f"big/{i}", outs[f"req_{i}"].generated_tokens, reference(model, prompts[i], 6), TIES)


def test_failing_forward_fails_only_its_step():
    """A layer that raises on one prompt's token: the requests of the steps it ran in fail with the error; the
    requests never batched with it finish with generate()'s tokens; the engine keeps serving."""
    model = enable_paged_attention(tiny_model("llama", seed=7), backend="torch")
    poison = [VOCAB - 1] * 3  # three in a row: a prompt's, never a generation's (one token per step)
    embed = model.model.embed_tokens

    def hook(module, args):
        ids = args[0][0].tolist()
        if any(ids[i: i + 3] == poison for i in range(len(ids) - 2)):
            raise RuntimeError("poisoned token")

    handle = embed.register_forward_pre_hook(hook)
    try:
        pool = BlockPool(block_size=BLOCK, num_blocks=64)
        with init_continuous_batching(model, pool=pool, max_batch_tokens=64) as manager:
            bad = manager.add_request([5, 6, *poison, 7], max_new_tokens=4)
            out = manager.get_result(bad, timeout=60)
            assert out.status == RequestStatus.FAILED and "RuntimeError: poisoned token" in out.error
            good = [[3, 4, 5], [9, 8, 7, 6, 5]]
            outs = [manager.get_result(manager.add_request(p, max_new_tokens=5), timeout=60) for p in good]
            assert manager.stats().failed == 1
    finally:
        handle.remove()
    for p, o in zip(good, outs):
        check_tokens("poison", o.generated_tokens, reference(model, p, 5), TIES)
    assert pool.allocator.blocks_in_use == 0


def test_logits_only_where_a_token_is_sampled():
    """A step with a 20-token prefill chunk that does not reach its prompt's end and a decode token computes one row
    of logits (the lm_head sees only the decode token)."""
    model = enable_paged_attention(tiny_model("llama", seed=8), backend="torch")
    rows = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    try:
        pool = BlockPool(block_size=BLOCK, num_blocks=64)
        _, core = engine(model, pool, max_batch_tokens=21)
        drive(core, [("a", [5, 6, 7], 3)], seed=0, steps_between=0)
        rows.clear()
        drive(core, [("b", list(range(3, 43)), 2), ("c", [4, 5], 2)], seed=0, steps_between=0)
    finally:
        handle.remove()
    assert rows and max(rows) <= 2  # steps of up to 21 tokens, at most 2 of them sampled


def test_longrope_requests_past_the_switch_are_refused():
    """Phi3 with LongRoPE: the long factors apply past original_max_position_embeddings for the whole packed batch,
    so requests that would cross it are refused with the sizes; shorter ones equal generate()."""
    if "phi3" not in AVAILABLE:
        pytest.skip("no phi3 in this transformers")
    head = 8
    rope = {"rope_type": "longrope", "short_factor": [1.0] * (head // 2), "long_factor": [4.0] * (head // 2),
            "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    model = enable_paged_attention(tiny_family_model("phi3", seed=3, head_dim=head, num_attention_heads=8,
                                                     num_key_value_heads=4, max_position_embeddings=128,
                                                     original_max_position_embeddings=32, rope_parameters=rope),
                                   backend="torch")
    pool = BlockPool(block_size=BLOCK, num_blocks=64)
    with init_continuous_batching(model, pool=pool) as manager:
        with pytest.raises(ValueError, match=r"prompt has 40 tokens but the model's context is 32 \(original_max"):
            manager.add_request(list(range(3, 43)), max_new_tokens=4)
        assert manager.max_context == 32
        prompt = list(range(3, 20))
        out = manager.get_result(manager.add_request(prompt, max_new_tokens=6), timeout=60)
    check_tokens("phi3-longrope", out.generated_tokens, reference(model, prompt, 6), TIES)


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_stability_over_two_thousand_requests():
    """2,000 short requests through one engine: the pool goes back to idle, RSS grows by at most 50 MB between request
    500 and request 2,000, stop() joins the engine thread, and a dropped engine frees its pool."""
    model = enable_paged_attention(tiny_model("llama", seed=9), backend="torch")
    pool = BlockPool(block_size=BLOCK, num_blocks=512, prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=256)
    manager.start()
    rng = random.Random(0)
    rss = {}
    for wave in range(20):
        ids = manager.add_requests([[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 8))] for _ in range(100)],
                                   max_new_tokens=3)
        for rid in ids:
            assert manager.get_result(rid, timeout=120).status == RequestStatus.FINISHED
        if wave + 1 in (5, 20):
            gc.collect()
            rss[(wave + 1) * 100] = _rss_mb()
    assert pool.allocator.blocks_in_use == 0
    manager.stop()
    assert manager.join(timeout=0)
    print(f"\nRSS after 500 requests {rss[500]:.1f} MB, after 2000 {rss[2000]:.1f} MB")
    assert rss[2000] - rss[500] <= 50
    ref = weakref.ref(pool)
    del manager, pool
    gc.collect()
    assert ref() is None


def test_forks_share_the_prompt_and_match_requests_seeded_alone():
    """num_return_sequences=3 with a seed: three results (transformers' child ids), computed from one prefill whose
    blocks they share; each fork's tokens equal a request run alone with that fork's seed (the sampler derives fork
    k's seed from the request's)."""
    from hf_paged.engine.sampling import _fork_seed

    model = enable_paged_attention(tiny_model("llama", seed=10), backend="torch")
    prompt = random_prompts(1, VOCAB, (21, 21), seed=23)[0]
    sampling = dict(do_sample=True, temperature=0.9, max_new_tokens=6)
    pool = BlockPool(block_size=BLOCK, num_blocks=64)
    with init_continuous_batching(model, pool=pool) as manager:
        rid = manager.add_request(prompt, seed=77, num_return_sequences=3, **sampling)
        forks = [manager.get_result(i, timeout=60) for i in (rid, f"{rid}__child#0", f"{rid}__child#1")]
        computed = manager.stats().prompt_tokens_computed
        alone = [manager.get_result(manager.add_request(prompt, seed=_fork_seed(77, k), **sampling), timeout=60)
                 for k in range(3)]
    assert computed == len(prompt)  # one prefill for the three
    assert [f.request_id for f in forks] == [rid, f"{rid}__child#0", f"{rid}__child#1"]
    assert all(f.status == RequestStatus.FINISHED for f in forks)
    assert [f.generated_tokens for f in forks] == [a.generated_tokens for a in alone]
    assert len({tuple(f.generated_tokens) for f in forks}) > 1
    assert pool.allocator.blocks_in_use == 0


def test_logprobs_of_greedy_tokens():
    """logprobs=2: per generated token its log-probability and the two most likely alternatives; for greedy decoding
    the token is the first alternative, with the same value."""
    model = enable_paged_attention(tiny_model("llama", seed=11), backend="torch")
    with init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=32)) as manager:
        out = manager.get_result(manager.add_request([5, 9, 12, 7], max_new_tokens=5, logprobs=2), timeout=60)
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.generated_tokens) == 5
    for token, lp, top in zip(out.generated_tokens, out.logprobs, out.top_logprobs):
        assert len(top) == 2 and top[0][0] == token and top[0][1] == pytest.approx(lp) and lp <= 0


def test_init_options_and_continuous_batching_config():
    """transformers' ContinuousBatchingConfig sizes the default pool and the budget; explicit arguments win; sizing
    it while passing pool= is refused; the default pool is fixed, with prefix caching; the context is the model's."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model("llama", seed=12)
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=32, max_queue_size=3)
    manager = init_continuous_batching(model, continuous_batching_config=cb, max_batch_tokens=24)
    assert (manager.pool.block_size, manager.pool.allocator.max_blocks) == (8, 64)
    assert manager._core.scheduler.max_batch_tokens == 24 and manager.max_queue_size == 3
    assert manager.max_context == model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"sets \['block_size', 'num_blocks'\] but pool= was given"):
        init_continuous_batching(model, continuous_batching_config=cb, pool=BlockPool())
    default = init_continuous_batching(model).pool
    assert default.fixed and default.prefix_caching and default.allocator.max_blocks > 0


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphs"])
def test_triton_backend(graphed, monkeypatch):
    """The packed varlen forward through the Triton kernels (real ones on CUDA, the interpreter on CPU): requests
    chunked and preempted equal generate() alone; with decode steps through CUDA graphs (emulated on CPU: no host
    read inside the captured forward, the launcher included)."""
    from hf_paged.engine import graphs

    if graphed and DEVICE.type == "cpu":
        monkeypatch.setattr(graphs, "graph_type", lambda device: graphs.EmulatedGraph)
    model = enable_paged_attention(tiny_model("llama", seed=3, device=DEVICE), backend="triton")
    prompts = random_prompts(3, VOCAB, (14, 24), seed=7)
    specs = [(f"t{i}", p, 6) for i, p in enumerate(prompts)]
    pool = BlockPool(block_size=BLOCK, num_blocks=10)
    manager, core = engine(model, pool, max_batch_tokens=16, cuda_graphs=graphed)
    chunks = []
    reqs = drive(core, specs, seed=1, chunks=chunks, steps_between=0)
    assert core.scheduler.counters.preemptions > 0
    assert any(start + n < prompt_len for _, start, n, prompt_len in chunks)
    assert_like_generate(model, reqs, specs, "triton")
    if graphed:
        stats = manager.stats()
        assert stats.graphs_off is None and stats.graph_replays > 0, stats


def test_pool_shared_with_a_paged_cache():
    """The engine and a generate() PagedCache on one pool: while the cache holds most blocks the engine's request
    waits (it fits the empty pool, so it is accepted); once the cache lets go it runs and gives generate()'s tokens."""
    from hf_paged import PagedCache

    model = enable_paged_attention(tiny_model("llama", seed=13), backend="torch")
    pool = BlockPool(block_size=BLOCK, num_blocks=20)
    cache = PagedCache(model.config, pool=pool)
    model.generate(torch.tensor([list(range(3, 63))]), cache=cache, max_new_tokens=2, do_sample=False)  # 16 blocks
    prompt = list(range(10, 30))
    with init_continuous_batching(model, pool=pool) as manager:
        rid = manager.add_request(prompt, max_new_tokens=6)
        assert manager.get_result(rid, timeout=0.3) is None  # waiting for blocks
        cache.reset()
        out = manager.get_result(rid, timeout=60)
    check_tokens("shared-pool", out.generated_tokens, reference(model, prompt, 6), TIES)
    assert pool.allocator.blocks_in_use == 0


GRAPHED = {  # name: (model type, kv_dtype, pool blocks: preemption on this workload)
    "llama": ("llama", None, 22),
    "llama_fp8": ("llama", torch.float8_e4m3fn, 22),
    "gemma2_mixed_windows": ("gemma2", None, 32),  # two layer groups: two tables per request
}


@pytest.mark.parametrize("name", [n for n, (t, *_) in GRAPHED.items() if t in AVAILABLE])
def test_decode_graphs_replay_their_buffers_only(name, monkeypatch):
    """Decode-only steps through the graph path (emulated on CPU: a replay re-runs the captured forward with the
    captured step, so it sees each new step only through the staged buffers): tokens equal the eager engine's and
    generate() alone, over buckets of rows that shrink and grow, block tables that widen, preemption, chunked prefill
    and prefix hits; mixed-window models with one width per layer group. The default floor of table widths makes
    these short requests' tables one width (a test below)."""
    from hf_paged.engine import graphs

    monkeypatch.setattr(graphs, "graph_type", lambda device: graphs.EmulatedGraph)
    monkeypatch.setattr(graphs, "TABLE_WIDTH_FLOOR", 1)  # tables that widen step by step: several graphs per bucket
    model_type, kv_dtype, num_blocks = GRAPHED[name]
    model = (tiny_model("llama", seed=3) if model_type == "llama" else tiny_family_model(model_type, seed=2))
    enable_paged_attention(model, backend="torch")
    prefix = random_prompts(1, VOCAB, (9, 9), 50)[0]
    prompts = random_prompts(10, VOCAB, (1, 20), seed=8, shared=[prefix])
    specs = [(f"g{i}", p, 2 + (i * 7) % 23) for i, p in enumerate(prompts)]
    outs = {}
    for graphed in (True, False):
        pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=True, kv_dtype=kv_dtype)
        manager, core = engine(model, pool, max_batch_tokens=12, cuda_graphs=graphed)
        reqs = drive(core, specs, seed=4, steps_between=3)
        outs[graphed] = {rid: r.generated for rid, r in reqs.items()}
        assert all(r.status == RequestStatus.FINISHED for r in reqs.values())
        assert pool.allocator.blocks_in_use == 0
        stats = manager.stats()
        if graphed:
            widths = {key[1] for key in core.runner.graphs.keys}
            buckets = {key[0] for key in core.runner.graphs.keys}
            assert stats.graphs_off is None and stats.graph_replays > stats.graphs_captured >= 3, stats
            assert len(buckets) >= 3 and len(widths) >= 2, (buckets, widths)
            assert core.scheduler.counters.preemptions > 0
            assert core.scheduler.counters.prefix_hit_tokens > 0 or not core.kv.prefix_caching  # mixed windows: none
        else:
            assert core.runner.graphs is None and stats.graph_replays == 0
    assert outs[True] == outs[False]
    if kv_dtype is None:
        assert_like_generate(model, reqs, specs, f"graphs/{name}")


def test_decode_graphs_off_where_they_cannot_run(monkeypatch):
    """cuda_graphs=True is refused on a CPU model and on a pool without a cap; a capture that fails turns the graphs
    off with a warning and the step's eager result stands (the tokens stay right)."""
    from hf_paged.engine import graphs

    model = enable_paged_attention(tiny_model("llama", seed=3), backend="torch")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=20), cuda_graphs=True)
    assert init_continuous_batching(model, pool=BlockPool(block_size=BLOCK, num_blocks=20))._core.runner.graphs is None

    class FailingGraph(graphs.EmulatedGraph):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "graph_type", lambda device: FailingGraph)
    with pytest.raises(ValueError, match="needs a pool with a cap"):
        init_continuous_batching(model, pool=BlockPool(block_size=BLOCK), cuda_graphs=True)
    pool = BlockPool(block_size=BLOCK, num_blocks=40)
    manager, core = engine(model, pool, max_batch_tokens=16, cuda_graphs=True)
    assert pool.preallocated
    specs = [(f"f{i}", p, 5) for i, p in enumerate(random_prompts(3, VOCAB, (4, 12), seed=9))]
    with pytest.warns(RuntimeWarning, match="CUDA graphs turned off.*operation not permitted"):
        reqs = drive(core, specs, seed=2, steps_between=0)
    stats = manager.stats()
    assert stats.graphs_captured == 0 and "capturing the" in stats.graphs_off
    assert_like_generate(model, reqs, specs, "graphs-off")


@pytest.mark.parametrize("model_type", AVAILABLE)
def test_decode_graphs_every_family(model_type, monkeypatch):
    """Every listed family's decode steps through the (emulated) graph path: no host read of a tensor inside the
    captured forward (a CUDA capture would fail there) and the same tokens as the eager engine."""
    from hf_paged.engine import graphs

    monkeypatch.setattr(graphs, "graph_type", lambda device: graphs.EmulatedGraph)
    model = enable_paged_attention(tiny_family_model(model_type, seed=2), backend="torch")
    specs = [(f"{model_type}{i}", p, 4 + i) for i, p in enumerate(random_prompts(5, VOCAB, (3, 14), seed=12))]
    outs = {}
    for graphed in (True, False):
        manager, core = engine(model, BlockPool(block_size=BLOCK, num_blocks=48), max_batch_tokens=16,
                               cuda_graphs=graphed)
        reqs = drive(core, specs, seed=3, steps_between=1)
        outs[graphed] = {rid: (r.status, r.generated) for rid, r in reqs.items()}
        if graphed:
            stats = manager.stats()
            assert stats.graphs_off is None and stats.graph_replays > 0, stats
    assert outs[True] == outs[False]


def test_decode_graphs_table_width_floor(monkeypatch):
    """Graphed steps' block tables are at least ``TABLE_WIDTH_FLOOR`` columns wide (one graph per bucket for every
    context up to it), and the tokens stay the eager engine's."""
    from hf_paged.engine import graphs

    monkeypatch.setattr(graphs, "graph_type", lambda device: graphs.EmulatedGraph)
    monkeypatch.setattr(graphs, "TABLE_WIDTH_FLOOR", 8)
    model = enable_paged_attention(tiny_model("llama", seed=3), backend="torch")
    specs = [(f"w{i}", p, 3 + 2 * i) for i, p in enumerate(random_prompts(4, VOCAB, (2, 20), seed=21))]
    outs = {}
    for graphed in (True, False):
        manager, core = engine(model, BlockPool(block_size=BLOCK, num_blocks=40), max_batch_tokens=32,
                               cuda_graphs=graphed)
        reqs = drive(core, specs, seed=6, steps_between=0)
        outs[graphed] = {rid: r.generated for rid, r in reqs.items()}
        if graphed:
            assert {key[1] for key in core.runner.graphs.keys} == {(8,)}  # every context <= 32 tokens: one width
            assert manager.stats().graph_replays > 0
    assert outs[True] == outs[False]
