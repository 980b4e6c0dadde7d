"""Mixed windows: layers with different windows keep separate block tables in one pool, hold what
DynamicCache holds, and the Triton backend (interpreter here) matches DynamicCache per attention feature."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from helpers import (
    BOS, EOS, PAD, VOCAB, dynamic, dynamic_cache_bytes, forward, generate, left_padded, tiny_family_model,
)
from hf_paged import PagedCache, enable_paged_attention, ops

WINDOW, BLOCK_SIZE = 128, 16
SLIDING, FULL = "sliding_attention", "full_attention"
LENGTHS, NEW_TOKENS = [100, 60], 450  # the longer row reaches 550 tokens: more than 4 windows


def gemma3_like(layer_types):
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, max_position_embeddings=1024, sliding_window=WINDOW,
                              layer_types=layer_types, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # run the whole length
    model.generation_config.pad_token_id = PAD
    return model


def test_hybrid_memory_is_dynamic_cache_plus_block_rounding():
    model = gemma3_like([SLIDING] * 3 + [FULL])
    inputs = left_padded(LENGTHS, seed=1)
    reference = dynamic(model)
    expected = generate(model, inputs, reference, max_new_tokens=NEW_TOKENS)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK_SIZE)
    out = generate(model, inputs, cache, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, expected)

    stats = cache.memory_stats()
    dynamic_bytes = dynamic_cache_bytes(reference)
    # The same model with every layer full holds every real token in every layer (one prefill of the result).
    all_full = gemma3_like([FULL] * 4)
    enable_paged_attention(all_full, backend="torch")
    full_cache = PagedCache(all_full.config, block_size=BLOCK_SIZE)
    mask = torch.cat([inputs["attention_mask"], torch.ones(len(LENGTHS), NEW_TOKENS, dtype=torch.long)], 1)
    forward(all_full, out[:, :-1], full_cache, attention_mask=mask[:, :-1])
    full_bytes = full_cache.memory_stats().bytes_in_use
    print(f"KV bytes in use: hybrid {stats.bytes_in_use}, DynamicCache {dynamic_bytes} "
          f"({stats.bytes_in_use / dynamic_bytes:.3f}x), all layers full {full_bytes} "
          f"({stats.bytes_in_use / full_bytes:.3f}x)")
    assert stats.bytes_in_use <= 1.15 * dynamic_bytes
    assert stats.bytes_in_use <= 0.6 * full_bytes

    assert len(stats.groups) == 4 and sorted(g.window or 0 for g in stats.groups) == [0, WINDOW, WINDOW, WINDOW]
    per_row_bound = math.ceil(WINDOW / BLOCK_SIZE) + 1
    for group in stats.groups:
        assert group.num_sequences == len(LENGTHS)
        if group.window is not None:
            assert group.blocks_in_use <= per_row_bound * len(LENGTHS), group
        else:
            assert group.tokens_stored == sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)
    assert sum(g.blocks_in_use for g in stats.groups) == stats.blocks_in_use


# One model per attention feature through the Triton kernels (CPU interpreter here), tiny and short.
FEATURES = {"softcap": "gemma2", "sinks": "gpt_oss", "mixed_windows": "gemma3_text"}


@pytest.mark.skipif(not ops.triton_available(), reason="triton is not importable here")
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_triton_backend_per_feature_matches_dynamic_cache(feature):
    model = tiny_family_model(FEATURES[feature])
    inputs = left_padded([3, 13], seed=1)  # window 8, block 4: the longer row slides
    expected = generate(model, inputs, dynamic(model), max_new_tokens=5)
    enable_paged_attention(model, backend="triton")
    out = generate(model, inputs, PagedCache(model.config, block_size=4), max_new_tokens=5)
    assert torch.equal(out, expected)
