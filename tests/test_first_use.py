"""What a new user meets first: refusals and warnings that name the fix, and warnings that point at their code."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import Gemma3TextConfig

from helpers import dynamic, generate, left_padded, ones_mask, tiny_model
from hf_paged import BlockPool, PagedCache, enable_paged_attention


def test_a_cache_given_other_leading_tokens_continues_like_dynamic_cache_and_warns_once():
    """Reusing a cache for input_ids that do not start with its rows' tokens continues from the cached K/V, as
    DynamicCache does (same tokens), with one warning per cache naming the first differing column and the fix;
    input_ids no longer than what the cache holds are refused with a pointer to reset()."""
    model = tiny_model("llama")
    enable_paged_attention(model, backend="torch")
    cache, reference = PagedCache(model.config), dynamic(model)
    first = left_padded([5, 7], seed=1)
    assert torch.equal(generate(model, first, cache, max_new_tokens=3),
                       generate(model, first, reference, max_new_tokens=3))
    with pytest.raises(ValueError, match=r"reset\(\)"):
        generate(model, left_padded([9, 9], seed=2), cache, max_new_tokens=3)  # no longer than what the cache holds
    other = left_padded([12, 12], seed=3)
    with pytest.warns(UserWarning, match=r"row \d of this PagedCache holds other tokens than input_ids from column "
                                         r"\d+ on.*reset\(\)"):
        got = generate(model, other, cache, max_new_tokens=3)
    assert torch.equal(got, generate(model, other, reference, max_new_tokens=3))
    more = left_padded([16, 16], seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per cache
        assert torch.equal(generate(model, more, cache, max_new_tokens=2),
                           generate(model, more, reference, max_new_tokens=2))


def test_prefix_caching_on_a_mixed_window_model_warns_once():
    """Prefix caching asked for where it cannot work (layers with different windows) warns once, naming why."""
    config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    pool = BlockPool(prefix_caching=True)
    with pytest.warns(UserWarning, match="different attention windows"):
        PagedCache(config, pool=pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PagedCache(config, pool=pool)  # said once


def test_past_key_values_warning_points_at_the_callers_line():
    """generate(past_key_values=PagedCache) warns (transformers renamed it) at the user's line, not inside
    hf_paged, and still uses the cache."""
    model = tiny_model("llama")
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config)
    ids = ones_mask(torch.randint(3, 90, (1, 5)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(**ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    renamed = [w for w in caught if "past_key_values" in str(w.message)]
    assert renamed and all(w.filename == __file__ for w in renamed), [(w.filename, w.lineno) for w in renamed]
    assert cache.get_seq_length() == 6
