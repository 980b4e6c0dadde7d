"""fp8 KV blocks: ``kv_dtype=torch.float8_e4m3fn`` — accuracy on the embedded SmolLM2, bytes, bad input, and
the two backends agreeing on fp8 blocks."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (
    chat_inputs, dynamic, forward, generate, left_padded, ones_mask, require_smollm, smollm, tiny_config, tiny_model,
)
from hf_paged import BlockPool, PagedCache, embedded, enable_paged_attention, disable_paged_attention, ops

FP8 = torch.float8_e4m3fn
PASSAGE = embedded.STORY
CHUNKS = 4


def test_unsupported_kv_dtype_lists_the_supported_ones():
    for kv_dtype in (torch.int8, torch.float16, torch.float8_e5m2):
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            PagedCache(tiny_config(), kv_dtype=kv_dtype)
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            BlockPool(kv_dtype=kv_dtype)


def pool_bytes_per_token(cache) -> float:
    """Bytes one token takes in the pool, over every layer: K/V blocks, and on fp8 pools the token's scales (the
    pool counts them in its bytes per block)."""
    stats = cache.memory_stats()
    return stats.bytes_per_block / stats.block_size


def test_fp8_pool_bytes_per_token_vs_bf16():
    model = tiny_model("llama").to(torch.bfloat16)
    enable_paged_attention(model, backend="torch")
    per_token = {}
    for kv_dtype in (None, FP8):
        cache = PagedCache(model.config, kv_dtype=kv_dtype)
        generate(model, left_padded([20, 33]), cache, max_new_tokens=4)
        per_token[kv_dtype] = pool_bytes_per_token(cache)
    print(f"bytes/token: bf16 {per_token[None]:.1f}, fp8 {per_token[FP8]:.1f}")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    # half the bytes of bf16, plus one bf16 scale per token, KV head, K and V: 2 bytes beside head_dim fp8 bytes
    assert per_token[FP8] == per_token[None] / 2 * (1 + 2 / head_dim)
    reserved = cache.pool.bytes_reserved()
    assert reserved == cache.memory_stats().bytes_reserved == (cache.pool.tensor_blocks * per_token[FP8] * 16)


@pytest.mark.skipif(not ops.triton_available(), reason="triton is not importable here")
def test_fp8_torch_and_triton_backends_agree():
    model = tiny_model("llama", seed=3)
    inputs = left_padded([5, 12], seed=1)
    outs = []
    for backend in ("torch", "triton"):
        enable_paged_attention(model, backend=backend)
        outs.append(generate(model, inputs, PagedCache(model.config, block_size=4, kv_dtype=FP8), max_new_tokens=6))
    assert torch.equal(*outs)
    print("fp8 tokens equal to DynamicCache:", torch.equal(outs[0], generate(model, inputs, dynamic(model),
                                                                              max_new_tokens=6)))


# ---------------------------------------------------------------------------------------------------------------------
# Scales per token and KV head: nothing depends on who wrote first
# ---------------------------------------------------------------------------------------------------------------------


def _slots_kv(cache, layer: int, count: int, row: int = 0) -> list[torch.Tensor]:
    """Row ``row``'s first ``count`` positions of layer ``layer``, read through its block table: K and V bits and
    their scales (``[count, Hkv, D]``, ``[count, Hkv]``)."""
    pool, bs = cache.pool, cache.pool.block_size
    table = cache.block_tables()[row]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(count)])  # [count]
    return [t.view(-1, *t.shape[2:])[slots].clone() for t in (*pool.layer_kv(layer), *pool.layer_scales(layer))]


def _second_request_logits(model, pool, loud_first: bool) -> torch.Tensor:
    """Logits of request B (a prompt, then a second chunk attending through the pool) on ``pool``, after a request A
    whose keys and values are 1000x larger (its layers' K/V projections scaled while it runs) when ``loud_first``."""
    if loud_first:
        layers = model.model.layers
        saved = [(layer.self_attn.k_proj.weight.clone(), layer.self_attn.v_proj.weight.clone()) for layer in layers]
        with torch.no_grad():
            for layer in layers:
                layer.self_attn.k_proj.weight.mul_(1000)
                layer.self_attn.v_proj.weight.mul_(1000)
        try:
            forward(model, left_padded([9], seed=21)["input_ids"], PagedCache(model.config, pool=pool))
        finally:
            with torch.no_grad():
                for layer, (k, v) in zip(layers, saved):
                    layer.self_attn.k_proj.weight.copy_(k)
                    layer.self_attn.v_proj.weight.copy_(v)
    ids = left_padded([14], seed=22)["input_ids"]
    cache = PagedCache(model.config, pool=pool)
    forward(model, ids[:, :8], cache)
    return forward(model, ids[:, 8:], cache).logits  # [1, 6, vocab]: the second chunk reads the first through fp8


def test_a_loud_request_does_not_change_another_requests_precision():
    """On a shared fp8 pool, a first request with 1000x larger keys and values leaves a later request's output exactly
    as it is without it (each token's scales are its own; a first write fixing the pool's scales failed this), and
    that output stays close to full precision."""
    model = tiny_model("llama", seed=6)
    enable_paged_attention(model, backend="torch")
    alone = _second_request_logits(model, BlockPool(block_size=4, kv_dtype=FP8), loud_first=False)
    after_loud = _second_request_logits(model, BlockPool(block_size=4, kv_dtype=FP8), loud_first=True)
    full = _second_request_logits(model, BlockPool(block_size=4), loud_first=False)
    assert torch.equal(after_loud, alone)
    # e4m3 keeps 3 mantissa bits: each stored K/V value is off by at most 2**-4 of its magnitude (round to nearest,
    # per-token scale, no saturation), and the logits are sums of such products weighed by a softmax, so their error
    # stays a few percent of the largest logit whatever the CPU's summation order; a wrong scale is off by 100%+.
    assert (alone - full).abs().max() < 0.05 * full.abs().max()


def test_shared_and_copied_blocks_keep_their_scales():
    """A prefix-cache hit reads the first request's blocks with their scales, and its own writes change none of them;
    forks writing into a shared, partly filled block copy it with its scales (copy-on-write), so every cache reads
    its prefix back bit for bit, scales included."""
    model = tiny_model("llama", seed=7)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=4, kv_dtype=FP8, prefix_caching=True)
    prompt = left_padded([21], seed=23)
    first = PagedCache(model.config, pool=pool)
    generate(model, prompt, first, max_new_tokens=3)
    recorded = [_slots_kv(first, layer, 21) for layer in range(model.config.num_hidden_layers)]
    assert all((r[2] > 0).all() and (r[3] > 0).all() for r in recorded)  # every written token has its scales
    second = PagedCache(model.config, pool=pool)
    generate(model, ones_mask(torch.cat([prompt["input_ids"], torch.tensor([[5, 6, 7]])], 1)), second,
             max_new_tokens=3)
    assert pool.memory_stats().prefix_hit_tokens == 20  # five full blocks; position 20 is computed again
    for cache, count in ((first, 21), (second, 20)):
        for layer, want in enumerate(recorded):
            assert all(torch.equal(a, b[:count]) for a, b in zip(_slots_kv(cache, layer, count), want))

    base = PagedCache(model.config, block_size=4, kv_dtype=FP8)
    forward(model, prompt["input_ids"], base)  # 21 tokens: the last block is partly filled
    recorded = [_slots_kv(base, layer, 21) for layer in range(model.config.num_hidden_layers)]
    forks = [base.fork() for _ in range(2)]
    for fork, extra in zip(forks, ([11, 12, 13], [40, 41])):
        forward(model, torch.tensor([extra]), fork)  # writes into the shared last block: copied first
    forward(model, torch.tensor([[60, 61]]), base)
    assert len({c.block_tables()[0][5] for c in (base, *forks)}) == 3  # the partly filled block was copied
    for cache in (base, *forks):
        for layer, want in enumerate(recorded):
            assert all(torch.equal(a, b) for a, b in zip(_slots_kv(cache, layer, 21), want))


def test_pool_growth_keeps_scales():
    """A growing fp8 pool copies the scale caches with the K/V: tokens written before a growth read back the same."""
    model = tiny_model("llama", seed=8)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=4, kv_dtype=FP8)
    cache = PagedCache(model.config, pool=pool)
    forward(model, left_padded([6], seed=24)["input_ids"], cache)
    recorded = _slots_kv(cache, 0, 6)
    rows = pool.tensor_blocks
    other = PagedCache(model.config, pool=pool)
    forward(model, left_padded([40], seed=25)["input_ids"], other)  # needs more blocks: the tensors grow
    assert pool.tensor_blocks > rows and pool.layer_scales(0)[0].shape[0] == pool.tensor_blocks == pool.key_caches[0].shape[0]
    assert all(torch.equal(a, b) for a, b in zip(_slots_kv(cache, 0, 6), recorded))


# ---------------------------------------------------------------------------------------------------------------------
# The embedded SmolLM2
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paged_smollm():
    require_smollm()
    model, tokenizer = smollm()
    enable_paged_attention(model, backend="torch")
    yield model, tokenizer
    disable_paged_attention(model)


def chunked_perplexity(model, ids: torch.Tensor, kv_dtype):
    """Perplexity of ``ids`` ``[1, L]`` fed in CHUNKS forwards: every chunk after the first attends through the pool."""
    cache = PagedCache(model.config, kv_dtype=kv_dtype)
    nll, count, last = 0.0, 0, None
    for chunk in ids.tensor_split(CHUNKS, dim=1):
        logits = forward(model, chunk, cache).logits.float()  # [1, n, vocab]
        if last is not None:  # the previous chunk's last position predicts this chunk's first token
            logits = torch.cat([last, logits], 1)
            targets = chunk
        else:
            logits, targets = logits[:, :-1], chunk[:, 1:]
        nll -= torch.log_softmax(logits[:, : targets.shape[1]], -1).gather(-1, targets[..., None]).sum().item()
        count += targets.shape[1]
        last = logits[:, -1:]
    return math.exp(nll / count), cache


def test_fp8_perplexity_within_two_percent(paged_smollm):
    model, tokenizer = paged_smollm
    ids = tokenizer(PASSAGE, return_tensors="pt").input_ids
    assert ids.shape[1] >= 250
    full, full_cache = chunked_perplexity(model, ids, None)
    fp8, fp8_cache = chunked_perplexity(model, ids, FP8)
    print(f"perplexity over {ids.shape[1]} tokens in {CHUNKS} chunks: full precision {full:.4f}, fp8 {fp8:.4f}, "
          f"ratio {fp8 / full:.4f}")
    assert fp8 / full <= 1.02
    full_bytes, fp8_bytes = pool_bytes_per_token(full_cache), pool_bytes_per_token(fp8_cache)
    print(f"bytes/token: fp32 {full_bytes:.1f}, fp8 {fp8_bytes:.1f} ({fp8_bytes / full_bytes:.3f}x)")
    assert fp8_bytes <= 0.26 * full_bytes
    # a quarter of fp32, plus 2 bytes of scale per token, KV head and K/V beside 64 fp8 bytes (head_dim 64)
    assert fp8_cache.memory_stats().bytes_in_use * 4 * 32 == full_cache.memory_stats().bytes_in_use * 33


def test_fp8_greedy_chat_batch_share_identical(paged_smollm):
    model, tokenizer = paged_smollm
    inputs = chat_inputs(tokenizer, embedded.CHAT_PROMPTS[:4])
    outs = [model.generate(**inputs, cache=PagedCache(model.config, kv_dtype=kv), max_new_tokens=12, do_sample=False)
            for kv in (None, FP8)]
    same = [torch.equal(a, b) for a, b in zip(*outs)]
    print(f"fp8 greedy rows identical to full precision: {sum(same)}/{len(same)}")
    assert outs[1].shape[0] == 4 and outs[1].shape[1] > inputs["input_ids"].shape[1]
