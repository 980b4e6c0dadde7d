"""PagedCache's state across generate() calls, direct forwards and failures: each forward counted once, nothing of
a call left on the cache after it ends (also when it fails), a new fill without the paged path warned about."""

import warnings

import pytest
import torch

from hf_paged import BlockPool, PagedCache, enable_paged_attention
from helpers import dynamic, forward, generate, left_padded, tiny_model


def _continued(inputs, out) -> dict:
    """``out`` (generate()'s sequences for ``inputs``) as the next call's inputs, its mask extended."""
    mask = torch.cat([inputs["attention_mask"], torch.ones(out.shape[0], out.shape[1] - inputs["input_ids"].shape[1],
                                                           dtype=torch.long)], 1)
    return {"input_ids": out, "attention_mask": mask}


def test_each_forward_is_counted_once_and_no_call_outlives_generate():
    """After generate() the cache holds no call and no planned forward, and reports the columns its forwards
    consumed (the last new token is never fed back); a direct forward adds its columns once, however often the
    cache is told the forward ran."""
    model = enable_paged_attention(tiny_model("llama"), backend="torch")
    inputs = left_padded([5, 9])
    cache = PagedCache(model.config)
    out = generate(model, inputs, cache, max_new_tokens=4)
    assert cache.call is None and not cache.planned
    assert cache.get_seq_length() == out.shape[1] - 1
    forward(model, out[:, -1:], cache)
    cache.forward_ran()
    cache.forward_ran()
    assert cache.get_seq_length() == out.shape[1]
    assert cache.last_step is not None and cache.last_step.query_len == 1


def test_a_failed_call_leaves_no_call_and_the_cache_continues_like_dynamic_cache():
    """A generate() refused at its start (input_ids no longer than what the cache holds) leaves no call on the
    cache; the next call continues the rows and gives DynamicCache's tokens."""
    model = enable_paged_attention(tiny_model("llama", seed=2), backend="torch")
    inputs = left_padded([4, 7], seed=1)
    cache, reference = PagedCache(model.config), dynamic(model)
    out = generate(model, inputs, cache, max_new_tokens=3)
    expected_out = generate(model, inputs, reference, max_new_tokens=3)
    assert torch.equal(out, expected_out)
    with pytest.raises(ValueError, match="reset"):
        generate(model, inputs, cache, max_new_tokens=3)  # no new column
    assert cache.call is None
    more = _continued(inputs, out)
    assert torch.equal(generate(model, more, cache, max_new_tokens=5),
                       generate(model, more, reference, max_new_tokens=5))


def test_start_from_prefix_outside_a_generate_call_is_refused():
    """Starting rows from cached prefix blocks belongs to a generate() call (its first forward shares them)."""
    model = tiny_model("llama")
    cache = PagedCache(model.config, pool=BlockPool(block_size=4, prefix_caching=True))
    with pytest.raises(RuntimeError, match="begin_call"):
        cache.start_from_prefix(left_padded([9])["input_ids"], None)


def test_every_fill_without_the_paged_path_warns():
    """Without enable_paged_attention the first forward of each fill (a new cache, or after reset()) warns that
    the history is gathered; later forwards of the same fill do not."""
    model = tiny_model("llama")
    cache = PagedCache(model.config)
    ids = left_padded([6])["input_ids"]
    with pytest.warns(UserWarning, match="without enable_paged_attention"):
        forward(model, ids, cache)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        forward(model, ids[:, :1], cache)
    assert not seen and cache.get_seq_length() == 7
    cache.reset()
    with pytest.warns(UserWarning, match="without enable_paged_attention"):
        forward(model, ids, cache)
    assert cache.get_seq_length() == 6
