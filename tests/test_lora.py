"""LoRA adapters per request: requests of three adapters (different ranks, targets, scalings) and of the base model
share the engine's steps, and each request's tokens equal the ``PeftModel`` with its adapter active generating alone
(greedy, DynamicCache; seeded sampling: the same request alone in an engine over that PeftModel) -- with chunked
prefill, preemption and prefix caching, where KV made under one adapter is never reused by another, by a reload of
it, or by the base model. Plus the manager's adapter API: unknown names, the LRU cap, unloading, bytes."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("peft")

from helpers import EOS, VOCAB, tiny_family_model, tiny_model  # noqa: E402
from helpers.engine_oracle import TieCount, check_tokens, random_prompts, reference  # noqa: E402
from helpers.engine_shadow import one_thread  # noqa: E402
from helpers.lora import ADAPTERS, peft_model, save_adapters  # noqa: E402
from hf_paged import BlockPool, RequestStatus, generate_batch, init_continuous_batching  # noqa: E402
from hf_paged.engine.lora import AdapterNotLoadedError  # noqa: E402
from hf_paged.engine.sampling import SamplingParams  # noqa: E402

BLOCK = 4
TIES = TieCount()
FAMILIES = {
    "llama": lambda: tiny_model("llama", seed=3),
    "qwen2": lambda: tiny_family_model("qwen2", seed=2, use_sliding_window=False),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """``{family: {name: saved directory}}``."""
    root = tmp_path_factory.mktemp("adapters")
    return {family: save_adapters(make, root / family) for family, make in FAMILIES.items()}


def engine(make, paths, pool, **options):
    manager = init_continuous_batching(make(), pool=pool, **options)
    for name, path in paths.items():
        manager.load_adapter(name, path)
    return manager


def run(manager, specs, seed: int, steps_between: int = 2) -> dict:
    """Queue ``specs`` (``(rid, prompt, params, adapter)``) through the manager in an order shuffled by ``seed``, 0
    to ``steps_between`` engine steps apart, stepping the engine core on this thread to the end."""
    core, handoff = manager._core, manager._handoff
    rng = random.Random(seed)
    order = list(specs)
    rng.shuffle(order)
    with torch.no_grad():
        for rid, prompt, params, adapter in order:
            manager.add_request(prompt, request_id=rid, max_new_tokens=params.max_new_tokens, adapter=adapter,
                                **_options(params))
            handoff.take_requests()
            for _ in range(rng.randint(0, steps_between)):
                handoff.deliver(core.step())
        while core.has_work:
            handoff.deliver(core.step())
            core.scheduler.check_invariants()
    return {rid: manager.get_result(rid, timeout=0) for rid, *_ in specs}


def _options(params: SamplingParams) -> dict:
    out = dict(eos_token_id=EOS)
    if params.do_sample:
        out.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, seed=params.seed)
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, eos_token_ids=(EOS,))


class Oracle:
    """The reference tokens of a (prompt, adapter) alone: ``model.generate()`` with a DynamicCache on the PeftModel
    with that adapter active (the base model for None)."""

    def __init__(self, make, paths):
        self.make, self.paths, self.models = make, paths, {}

    def model(self, adapter):
        if adapter not in self.models:
            self.models[adapter] = self.make().eval() if adapter is None else peft_model(self.make, self.paths, adapter)
        return self.models[adapter]

    def check(self, label, out, prompt, n, adapter):
        assert out.status == RequestStatus.FINISHED, (label, out.status, out.error)
        check_tokens(label, out.generated_tokens, reference(self.model(adapter), prompt, n), TIES)


SCENARIOS = {
    # name: (num_blocks, max_batch_tokens, prefix_caching)
    "roomy": (256, 256, False),
    "chunks_preemption_prefix": (16, 11, True),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mixed_adapters_equal_peft_alone(family, scenario, adapters):
    """Three adapters and the base model mixed in the same steps: each request's greedy tokens equal the PeftModel
    with its adapter active generating alone; the same prompts run under every adapter (never sharing KV)."""
    num_blocks, budget, prefix = SCENARIOS[scenario]
    make, paths = FAMILIES[family], adapters[family]
    shared = [random_prompts(1, VOCAB, (9, 9), 50)[0]]
    prompts = random_prompts(6, VOCAB, (2, 26), seed=7, shared=shared)
    names = [None, *ADAPTERS]
    specs = [(f"r{i}-{names[j]}", p, greedy(3 + (i * 5 + j) % 8), names[j])
             for i, p in enumerate(prompts) for j in range(len(names)) if (i + j) % 2 == 0 or i < 2]
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix),
                     max_batch_tokens=budget)
    chunks = []
    step = manager._core.runner.run

    def recording(batch):
        chunks.append({c.request.adapter.name if c.request.adapter else None for c in batch.chunks})
        return step(batch)

    manager._core.runner.run = recording
    outs = run(manager, specs, seed=len(scenario))
    oracle = Oracle(make, paths)
    for rid, prompt, params, adapter in specs:
        oracle.check(f"{family}/{scenario}/{rid}", outs[rid], prompt, params.max_new_tokens, adapter)
    assert max(len(names_in_step) for names_in_step in chunks) == 4  # some step ran all three adapters and the base
    counters = manager._core.scheduler.counters
    if budget < 30:
        assert counters.preemptions > 0
    assert manager.pool.allocator.blocks_in_use == 0
    manager.pool.allocator.check_invariants()


def test_same_prompt_never_shares_kv_across_adapters(adapters):
    """One prompt under the base model and each adapter, one after another: no prefix-cache hit across adapters
    (each output equals its own reference); the same adapter again hits; a reloaded adapter starts afresh."""
    make, paths = FAMILIES["llama"], adapters["llama"]
    prompt = random_prompts(1, VOCAB, (21, 21), seed=3)[0]
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=64, prefix_caching=True))
    counters = manager._core.scheduler.counters
    oracle = Oracle(make, paths)
    for i, adapter in enumerate([None, *ADAPTERS]):
        out = run(manager, [(f"first-{adapter}", prompt, greedy(6), adapter)], seed=0)[f"first-{adapter}"]
        oracle.check(f"first-{adapter}", out, prompt, 6, adapter)
        assert counters.prefix_hit_tokens == 0, adapter
    out = run(manager, [("again-b", prompt, greedy(6), "b")], seed=0)["again-b"]
    oracle.check("again-b", out, prompt, 6, "b")
    assert counters.prefix_hit_tokens == 20  # the full blocks of the prompt, made under "b"
    manager.load_adapter("b", paths["b"])  # a reload: a new generation, a new key-chain root
    out = run(manager, [("reloaded-b", prompt, greedy(6), "b")], seed=0)["reloaded-b"]
    oracle.check("reloaded-b", out, prompt, 6, "b")
    assert counters.prefix_hit_tokens == 20


def test_seeded_sampling_equals_peft_engine_alone(adapters):
    """Seeded sampled requests of each adapter, mixed with the base model's, draw the tokens the same request draws
    alone in an engine over the PeftModel with that adapter active (PEFT's own layers)."""
    make, paths = FAMILIES["llama"], adapters["llama"]
    prompts = random_prompts(8, VOCAB, (3, 20), seed=21)
    names = [None, *ADAPTERS]
    specs = [(f"s{i}", p, SamplingParams(max_new_tokens=8, eos_token_ids=(EOS,), do_sample=True, temperature=0.9,
                                         top_k=30, seed=500 + i), names[i % 4]) for i, p in enumerate(prompts)]
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=40), max_batch_tokens=16)
    mixed = run(manager, specs, seed=2)
    for rid, prompt, params, adapter in specs:
        alone_model = make() if adapter is None else peft_model(make, paths, adapter)
        alone = init_continuous_batching(alone_model, pool=BlockPool(block_size=BLOCK, num_blocks=40))
        out = run(alone, [(rid, prompt, params, None)], seed=0)[rid]
        assert mixed[rid].status == RequestStatus.FINISHED
        assert mixed[rid].generated_tokens == out.generated_tokens, (rid, adapter)


def test_generate_batch_from_a_peft_model(adapters):
    """``generate_batch`` on a PeftModel holding the three adapters: each prompt names one (or None: the base
    weights, PEFT's layers bypassed), all in one engine, each equal to its reference."""
    make, paths = FAMILIES["qwen2"], adapters["qwen2"]
    model = peft_model(make, paths, "a")
    prompts = random_prompts(8, VOCAB, (4, 18), seed=9)
    names = [None, *ADAPTERS] * 2
    outs = generate_batch(model, prompts, max_new_tokens=6, adapters=names, progress_bar=False,
                          pool=BlockPool(block_size=BLOCK, num_blocks=64))
    oracle = Oracle(make, paths)
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        oracle.check(f"peft/{i}", outs[f"req_{i}"], prompt, 6, adapter)


def test_adapter_api_errors_cap_and_bytes(adapters):
    """Unknown adapters are refused naming the loaded ones; past max_loras the least recently used idle adapter is
    unloaded, never one a live request uses; memory_stats counts the adapters' bytes."""
    make, paths = FAMILIES["llama"], adapters["llama"]
    manager = init_continuous_batching(make(), pool=BlockPool(block_size=BLOCK, num_blocks=32), max_loras=2)
    assert manager.memory_stats().adapter_bytes == 0
    manager.load_adapter("a", paths["a"])
    manager.load_adapter("b", paths["b"])
    with pytest.raises(AdapterNotLoadedError, match=r"'zzz'.*\['a', 'b'\]"):
        manager.add_request([5, 6, 7], max_new_tokens=2, adapter="zzz")
    outs = generate_batch(make(), [[5, 6, 7]], max_new_tokens=2, adapters=["zzz"], lora_modules={"zzz": paths["a"]},
                          progress_bar=False)
    assert outs["req_0"].status == RequestStatus.FINISHED
    rid = manager.add_request([5, 6, 7], max_new_tokens=2, adapter="a")  # "a" in use (queued, engine not started)
    manager.load_adapter("c", paths["c"])  # evicts "b": "a" is older but busy
    assert sorted(manager.adapters) == ["a", "c"]
    with pytest.raises(RuntimeError, match="live request"):
        manager.unload_adapter("a")
    manager.add_request([8, 9], max_new_tokens=2, adapter="c")
    with pytest.raises(RuntimeError, match="max_loras"):
        manager.load_adapter("b", paths["b"])
    expected = 0
    for name in ("a", "c"):
        state = __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            str(paths[name] / "adapter_model.safetensors"))
        expected += sum(t.numel() for t in state.values()) * 4
    stats = manager.memory_stats()
    assert stats.adapter_bytes == expected
    assert stats.adapter_bytes_reserved >= expected
    with manager:
        assert manager.get_result(rid, timeout=60).status == RequestStatus.FINISHED
    manager.unload_adapter("a")
    assert manager.adapters == ["c"]
    with pytest.raises(AdapterNotLoadedError):
        manager.unload_adapter("a")


def test_prompt_logprobs_per_adapter_equal_a_direct_forward(adapters):
    """Prompt logprobs of requests of every adapter and the base model, chunked and mixed in the same steps (which
    the runner lays out adapter by adapter and puts back in batch order), equal a direct forward of the PeftModel
    with that adapter active, within 1e-4; their greedy tokens equal the PeftModel alone."""
    make, paths = FAMILIES["llama"], adapters["llama"]
    prompts = random_prompts(8, VOCAB, (6, 20), seed=31)
    names = [None, *ADAPTERS] * 2
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=64), max_batch_tokens=13)
    specs = [(f"p{i}", p, greedy(4), names[i]) for i, p in enumerate(prompts)]
    core = manager._core
    with torch.no_grad():
        ids = [manager.add_request(p, request_id=rid, max_new_tokens=4, adapter=a, prompt_logprobs=1,
                                   eos_token_id=EOS) for rid, p, _, a in specs]
        manager._handoff.take_requests()
        while core.has_work:
            manager._handoff.deliver(core.step())
    oracle = Oracle(make, paths)
    for rid, (_, prompt, _, adapter) in zip(ids, specs):
        out = manager.get_result(rid, timeout=0)
        oracle.check(rid, out, prompt, 4, adapter)
        with torch.no_grad():
            direct = torch.log_softmax(oracle.model(adapter)(torch.tensor([prompt])).logits[0].float(), -1)
        want = [float(direct[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
        assert out.prompt_logprobs[0] is None
        assert max(abs(g - w) for g, w in zip(out.prompt_logprobs[1:], want)) < 1e-4, (rid, adapter)


@pytest.mark.slow
def test_triton_backend_tokens_equal_peft_alone(adapters):
    """The engine on its Triton backend (attention and the LoRA shrink / expand kernels; the interpreter on CPU):
    requests of three adapters and the base model in the same steps equal the PeftModel alone."""
    pytest.importorskip("triton")
    from hf_paged.ops import triton_available

    if not triton_available():
        pytest.skip("Triton cannot run here (no CUDA and no TRITON_INTERPRET)")
    make, paths = FAMILIES["llama"], adapters["llama"]
    prompts = random_prompts(4, VOCAB, (3, 9), seed=41)
    names = [None, *ADAPTERS]
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=32), backend="triton")
    assert manager._adapters.backend == "triton"
    specs = [(f"t{i}", p, greedy(3), names[i]) for i, p in enumerate(prompts)]
    outs = run(manager, specs, seed=0, steps_between=0)
    oracle = Oracle(make, paths)
    for rid, prompt, params, adapter in specs:
        oracle.check(f"triton/{rid}", outs[rid], prompt, 3, adapter)


def test_load_and_unload_while_serving(adapters):
    """Adapters loaded and unloaded from another thread while the engine thread serves requests of others: every
    request still equals its PeftModel alone (loads wait for the running step; the running adapters never move)."""
    make, paths = FAMILIES["llama"], adapters["llama"]
    manager = engine(make, {"a": paths["a"], "b": paths["b"]}, BlockPool(block_size=BLOCK, num_blocks=64),
                     max_batch_tokens=8, max_loras=3)
    prompts = random_prompts(9, VOCAB, (4, 16), seed=51)
    names = ["a", "b", None] * 3
    with manager:
        ids = [manager.add_request(p, max_new_tokens=6, adapter=n, eos_token_id=EOS) for p, n in zip(prompts, names)]
        for _ in range(4):
            manager.load_adapter("c", paths["c"])
            manager.unload_adapter("c")
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
    oracle = Oracle(make, paths)
    for rid, out, prompt, name in zip(ids, outs, prompts, names):
        oracle.check(f"threads/{rid}", out, prompt, 6, name)
    assert manager.adapters == ["a", "b"]


def test_two_engines_on_one_model(adapters):
    """``generate_batch`` twice on the same model object (a new engine each time, the layers wrapped once): the
    second engine's adapters apply as the first's did."""
    make, paths = FAMILIES["llama"], adapters["llama"]
    model = make()
    prompts = random_prompts(4, VOCAB, (4, 12), seed=61)
    names = [None, "a", "b", "c"]
    oracle = Oracle(make, paths)
    for run_ in range(2):
        outs = generate_batch(model, prompts, max_new_tokens=5, adapters=names, lora_modules=paths,
                              progress_bar=False, pool=BlockPool(block_size=BLOCK, num_blocks=64))
        for i, (prompt, adapter) in enumerate(zip(prompts, names)):
            oracle.check(f"engine{run_}/{i}", outs[f"req_{i}"], prompt, 5, adapter)


def test_hybrid_model_adapters_equal_peft_alone(tmp_path):
    """A hybrid model (LFM2: short-convolution state layers and attention layers), whose state mixers run per
    request segment of the packed step: with the step laid out adapter by adapter, each request of an adapter on its
    attention projections (and the base model) still equals the PeftModel alone; an adapter on a layer inside a state
    mixer is refused at load."""

    def make():
        return tiny_family_model("lfm2", seed=4, num_hidden_layers=4, full_attn_idxs=[1, 3])

    specs = {"x": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
             "y": dict(r=2, lora_alpha=4, target_modules=["k_proj", "self_attn.out_proj"]),
             "conv": dict(r=2, target_modules=["conv.out_proj"])}
    paths = save_adapters(make, tmp_path, specs)
    refused = init_continuous_batching(make(), pool=BlockPool(block_size=BLOCK, num_blocks=8))
    with pytest.raises(ValueError, match="inside a state layer's mixer"):
        refused.load_adapter("conv", paths.pop("conv"))
    prompts = random_prompts(6, VOCAB, (4, 14), seed=71)
    names = ["x", None, "y"] * 2
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=64), max_batch_tokens=10)
    outs = run(manager, [(f"h{i}", p, greedy(5), n) for i, (p, n) in enumerate(zip(prompts, names))], seed=3)
    oracle = Oracle(make, paths)
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        oracle.check(f"lfm2/{i}", outs[f"h{i}"], prompt, 5, adapter)


def test_beams_per_adapter_equal_peft_beam_search_alone(adapters):
    """features.py serves beams with an adapter: num_beams=3 requests of two adapters and of the base model in one
    engine (the beam rows, made by Request.fork, run with the request's adapter), each the best sequence
    generate(num_beams=3) gives on the PeftModel with that adapter active."""
    from transformers import DynamicCache

    make, paths = FAMILIES["llama"], adapters["llama"]
    prompts = random_prompts(3, VOCAB, (5, 14), seed=41)
    names = [None, "a", "b"]
    manager = engine(make, paths, BlockPool(block_size=BLOCK, num_blocks=128))
    rids = [manager.add_request(p, request_id=f"b{i}", max_new_tokens=6, num_beams=3, eos_token_id=EOS, adapter=a)
            for i, (p, a) in enumerate(zip(prompts, names))]
    with manager:
        outs = [manager.get_result(rid, timeout=300) for rid in rids]
    oracle = Oracle(make, paths)
    for out, prompt, adapter in zip(outs, prompts, names):
        assert out.status == RequestStatus.FINISHED, out.error
        with torch.no_grad():
            ref = oracle.model(adapter).generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=6,
                                                 num_beams=3, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                                                 past_key_values=DynamicCache())
        assert out.generated_tokens == ref[0, len(prompt):].tolist(), adapter
