"""No stale or foreign K/V on a shared prefix-caching pool: block keys name the weights' values, the adapter's content
and PEFT's switches (``hf_paged.weights``, ``engine/kv.py``), however the weights were written.

Each case: a ``generate_batch`` call on a shared pool, a change, the same call again on the shared pool, and the same
call on a fresh pool. The second call must equal the fresh one and differ from the first (so the check is not
vacuous). Before keys named content, the writes that move no version counter (``p.data``, PEFT's merge, switched or
rewritten adapters) served the first call's K/V.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

pytest.importorskip("peft")

from helpers import VOCAB, tiny_model  # noqa: E402
from helpers.engine_shadow import one_thread  # noqa: E402
from helpers.lora import peft_model, save_adapters  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import BlockPool, PagedCache  # noqa: E402
from hf_paged.errors import CacheFileError  # noqa: E402
from hf_paged.weights import SAMPLE_PER_TENSOR, WeightsFingerprint, sample_stride  # noqa: E402

NEW = 6
BLOCK = 4
# adapters that move greedy tokens, each its own (save_adapters draws them from the same seed: the targets differ)
STRONG = {"a": dict(r=4, lora_alpha=96, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
          "b": dict(r=4, lora_alpha=96, target_modules=["gate_proj", "up_proj", "down_proj"]),
          "c": dict(r=4, lora_alpha=64, target_modules=["v_proj", "up_proj"])}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def make():
    return tiny_model("llama", seed=3)


def prompts(n: int = 3, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(8)]  # two full blocks every prompt starts with
    return [shared + [rng.randrange(3, VOCAB) for _ in range(5)] for _ in range(n)]


def pool() -> BlockPool:
    return BlockPool(BLOCK, num_blocks=96, prefix_caching=True)


def tokens(model, shared_pool, **kw) -> list[list[int]]:
    outs = hf_paged.generate_batch(model, prompts(), pool=shared_pool, max_new_tokens=NEW, progress_bar=False, **kw)
    return [o.generated_tokens for o in outs.values()]


def noise(p: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(p.shape, generator=g) * 0.5 * p.detach().float().std().clamp_min(1e-3)


def train_step(model, optimizer) -> None:
    ids = torch.tensor(prompts())
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def add_under_no_grad(model):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(noise(p, i))


def data_copy(model):
    for i, p in enumerate(model.parameters()):
        p.data.copy_(p.detach() + noise(p, i))


def data_add(model):
    for i, p in enumerate(model.parameters()):
        p.data += noise(p, i)


def load_state_dict_copy(model):
    model.load_state_dict(tiny_model("llama", seed=4).state_dict())


def load_state_dict_assign(model):
    model.load_state_dict(tiny_model("llama", seed=4).state_dict(), assign=True)


def vector_to_params(model):
    params = list(model.parameters())
    vec = parameters_to_vector(params).detach()
    vector_to_parameters(vec + noise(vec, 1), params)


def adamw_step(model):
    train_step(model, torch.optim.AdamW(model.parameters(), lr=0.05))


def fused_adamw_step(model):
    train_step(model, torch.optim.AdamW(model.parameters(), lr=0.05, fused=True))


WRITES = [add_under_no_grad, data_copy, data_add, load_state_dict_copy, load_state_dict_assign, vector_to_params,
          adamw_step, fused_adamw_step]


@pytest.mark.parametrize("write", WRITES, ids=[w.__name__ for w in WRITES])
def test_weights_written_any_way_are_never_served_stale_kv(write):
    """Weights changed between two calls on one shared pool, written each way PyTorch allows: the next call equals a
    fresh engine's tokens and differs from the first call's."""
    model = hf_paged.attach_paged_attention(make(), backend="torch")
    shared = pool()
    first = tokens(model, shared)
    assert tokens(model, shared) == first  # unchanged weights: the cache is used and changes nothing
    write(model)
    second = tokens(model, shared)
    assert second == tokens(model, pool()) != first


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return save_adapters(make, tmp_path_factory.mktemp("stale_adapters"), STRONG)


def peft_base_tokens(model, shared_pool, adapter_dirs):
    """Base-model requests on a PeftModel in an engine that loaded an adapter for its first prompt (PEFT's own layers
    bypassed: the base layers run, merged weights included): the other prompts' tokens."""
    return tokens(model, shared_pool, lora_modules={"c": adapter_dirs["c"]}, adapters=["c", None, None])[1:]


def test_peft_merge_and_unmerge_are_never_served_stale_kv(adapter_dirs):
    """merge_adapter() writes the adapter into the base layers through ``.data`` (no version counter moves):
    base-model requests after it equal a fresh engine's; unmerge_adapter() the same, back."""
    model = peft_model(make, {"a": adapter_dirs["a"]})
    shared = pool()
    first = peft_base_tokens(model, shared, adapter_dirs)
    model.merge_adapter()
    merged = peft_base_tokens(model, shared, adapter_dirs)
    assert merged == peft_base_tokens(model, pool(), adapter_dirs) != first
    model.unmerge_adapter()
    unmerged = peft_base_tokens(model, shared, adapter_dirs)
    assert unmerged == peft_base_tokens(model, pool(), adapter_dirs) != merged


def test_peft_set_adapter_is_never_served_stale_kv(adapter_dirs):
    """set_adapter() switches which PEFT adapter runs without changing a tensor: the next call equals a fresh
    engine's."""
    model = peft_model(make, {"a": adapter_dirs["a"], "b": adapter_dirs["b"]}, "a")
    shared = pool()
    first = tokens(model, shared)
    model.set_adapter("b")
    second = tokens(model, shared)
    assert second == tokens(model, pool()) != first


def test_adapter_directory_rewritten_between_two_engines_on_one_pool(adapter_dirs, tmp_path):
    """generate_batch(..., pool=shared, lora_modules={"sql": dir}) twice with ``dir`` rewritten in between (each call
    its own engine, both adapters at generation 1): the second equals a fresh pool's, not the first's."""
    model = hf_paged.attach_paged_attention(make(), backend="torch")
    shared = pool()
    path = save_adapters(make, tmp_path, {"sql": STRONG["a"]}, seed=100)["sql"]
    run = dict(lora_modules={"sql": path}, adapters=["sql"] * 3)
    first = tokens(model, shared, **run)
    assert tokens(model, shared, **run) == first
    save_adapters(make, tmp_path, {"sql": STRONG["b"]})  # the same directory, another adapter
    second = tokens(model, shared, **run)
    assert second == tokens(model, pool(), **run) != first


def test_engine_adapter_loaded_into_a_peft_model_keeps_base_requests_apart(adapter_dirs):
    """On a PeftModel, requests without an adapter run PEFT's active adapter until an engine adapter loads, and the
    base model after: the two never share K/V on one pool."""
    model = peft_model(make, {"a": adapter_dirs["a"]})
    shared = pool()
    with_peft = tokens(model, shared)  # no engine adapter: PEFT's adapter "a" runs
    base = peft_base_tokens(model, shared, adapter_dirs)  # an engine adapter loaded: PEFT's layers bypassed
    assert base == peft_base_tokens(model, pool(), adapter_dirs) != with_peft[1:]
    assert tokens(model, shared) == with_peft  # and back


def test_generate_on_a_shared_pool_after_a_data_write():
    """generate() with PagedCaches on one prefix-caching pool: after ``p.data.copy_`` the next call equals a fresh
    pool's tokens (before: the prefix cached with the old weights was reused)."""
    model = hf_paged.enable_paged_attention(make(), backend="torch")
    prompt = torch.tensor([prompts(1)[0]])
    shared = pool()

    def run(p):
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, past_key_values=PagedCache(model.config,
                                                                                                      pool=p))
        return out[0, prompt.shape[1]:].tolist()

    first = run(shared)
    assert run(shared) == first and shared.allocator.prefix_hits > 0
    data_copy(model)
    second = run(shared)
    assert second == run(pool()) != first
    hf_paged.disable_paged_attention(model)


def test_saved_cache_is_refused_under_other_weights(tmp_path):
    """A prompt cache saved under one set of weights and loaded under another is refused naming the cause: at load
    with ``model=``, else at the first generate() on it; under the same weights it loads and continues."""
    model = hf_paged.enable_paged_attention(make(), backend="torch")
    prompt = torch.tensor([prompts(1)[0]])
    cache = PagedCache(model.config, pool=pool())
    model.generate(prompt, max_new_tokens=2, do_sample=False, past_key_values=cache)
    path = tmp_path / "prompt.safetensors"
    cache.save(path)
    PagedCache.load(path, model.config, model=model)  # the same weights: fine
    data_add(model)
    with pytest.raises(CacheFileError, match="weights: K/V computed with other weights"):
        PagedCache.load(path, model.config, model=model)
    loaded = PagedCache.load(path, model.config)
    with pytest.raises(ValueError, match="computed with other weights"):
        model.generate(torch.cat([prompt, torch.tensor([[5, 6, 7]])], 1), max_new_tokens=2, past_key_values=loaded)
    hf_paged.disable_paged_attention(model)


@pytest.mark.parametrize("rows,columns", [(1, 1), (1, 3000), (7, 3), (3, 7), (64, 100), (100, 64), (512, 2048),
                                          (2048, 8192), (8192, 2048), (96, 96), (49152, 576), (128256, 2048)])
def test_sample_is_a_fixed_count_spread_over_rows_and_columns(rows, columns):
    """The per-check sample reads about ``SAMPLE_PER_TENSOR`` elements of a ``[rows, columns]`` tensor however large
    it is, each in its own row where the tensor has that many rows (else every row), in distinct columns."""
    numel = rows * columns
    d = sample_stride(numel, columns)
    picked = list(range(0, numel, d))
    assert len(picked) <= min(numel, 2 * SAMPLE_PER_TENSOR + 1)
    assert len(picked) >= min(numel, SAMPLE_PER_TENSOR * 9 // 10)
    picked_rows = [i // columns for i in picked]
    if rows >= SAMPLE_PER_TENSOR:
        assert len(set(picked_rows)) == len(picked)
    else:
        assert set(picked_rows) == set(range(rows))
    assert len({i % columns for i in picked}) == min(len(picked), columns)
    assert picked[-1] >= numel - d  # spread to the end, not bunched at the start


def test_fingerprint_sees_dense_data_writes_between_walks_and_any_write_at_the_next():
    """A ``.data`` write over a whole tensor (new weights, a scaled tensor, a rank-1 update that changes a tenth of
    its bf16 values) changes the fingerprint between walks (the sample); a single row or element written through
    ``.data`` is seen at the next walk (the full checksum)."""
    model = make().to(torch.bfloat16)
    fp = WeightsFingerprint()
    root = fp.root(model)
    q = model.model.layers[0].self_attn.q_proj.weight
    q.data.copy_(torch.randn_like(q))
    assert fp.root(model, rewalk=False) != root
    root = fp.root(model, rewalk=False)
    gate = model.model.layers[1].mlp.gate_proj.weight
    before = gate.detach().clone()
    g = torch.Generator().manual_seed(0)
    gate.data += 2e-5 * torch.randn(gate.shape[0], 1, generator=g) @ torch.randn(1, gate.shape[1], generator=g)
    assert 0.02 < (gate != before).float().mean() < 0.5  # a small update: most bf16 values round back unchanged
    assert fp.root(model, rewalk=False) != root
    root = fp.root(model)
    embed = model.model.embed_tokens.weight
    embed.data[17] += 1  # one row, no counter of the embedding moves
    assert fp.root(model) != root  # a walk reads every value
    root = fp.root(model)
    q.data[3, 9] += 1  # one element
    assert fp.root(model) != root
