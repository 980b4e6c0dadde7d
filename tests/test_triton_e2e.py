"""End to end with the Triton kernels (on a GPU when there is one, else the CPU interpreter): DynamicCache's tokens."""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, dynamic, generate, left_padded, ones_mask, tiny_model
from hf_paged import PagedCache, enable_paged_attention, ops
from hf_paged.ops import triton_kernels

pytestmark = pytest.mark.skipif(not ops.triton_available(),
                                reason="triton cannot run here (not importable, or no CUDA and no interpreter)")


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts the paged-attention calls that went to the Triton kernels."""
    calls, real = [], triton_kernels.paged_attention_triton

    def counted(*args, **kwargs):
        calls.append(args[0].device)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_attention_triton", counted)
    return calls


def _model(kind, **kw):
    return tiny_model(kind, device=DEVICE, **kw)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_triton_backend_generates_dynamic_cache_tokens(kind, triton_calls):
    model = _model(kind, sliding_window=5) if kind == "mistral" else _model(kind)
    inputs = left_padded([3, 9])
    expected = generate(model, inputs, dynamic(model), max_new_tokens=6)
    enable_paged_attention(model, backend="triton")
    cache = PagedCache(model.config, block_size=4)
    assert torch.equal(generate(model, inputs, cache, max_new_tokens=6), expected)
    assert triton_calls and all(d.type == DEVICE.type for d in triton_calls)  # the kernels ran, on the model's device


def test_triton_backend_beam_search_with_copy_on_write(triton_calls):
    model = _model("llama", seed=2)
    inputs = left_padded([6])
    kw = dict(num_beams=2, num_return_sequences=2, max_new_tokens=4)
    expected = generate(model, inputs, dynamic(model), **kw)
    enable_paged_attention(model, backend="triton")
    cache = PagedCache(model.config, block_size=4)
    assert torch.equal(generate(model, inputs, cache, **kw), expected)
    assert triton_calls
    cache.pool.allocator.check_invariants()


def test_triton_backend_extend_with_history(triton_calls):
    """A second turn and prompt-lookup verification run the prefill/extend kernel over cached history."""
    model = _model("mistral", seed=3, sliding_window=7)
    first = left_padded([5])
    ref_cache = dynamic(model)
    ref = generate(model, first, ref_cache, max_new_tokens=3)
    turn2 = ones_mask(torch.cat([ref.cpu(), torch.tensor([[7, 8, 9, 10, 11]])], 1))
    expected = generate(model, turn2, ref_cache, max_new_tokens=3)
    # Prompt lookup on a model without a window: transformers 4.56.0's windowed DynamicCache cannot crop.
    lookup_model = _model("llama", seed=3)
    lookup = ones_mask(torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]]))
    kw = dict(prompt_lookup_num_tokens=2, max_new_tokens=5)
    expected_lookup = generate(lookup_model, lookup, dynamic(lookup_model), **kw)

    enable_paged_attention(model, backend="triton")
    cache = PagedCache(model.config, block_size=4)
    assert torch.equal(generate(model, first, cache, max_new_tokens=3), ref)
    assert torch.equal(generate(model, turn2, cache, max_new_tokens=3), expected)
    enable_paged_attention(lookup_model, backend="triton")
    out = generate(lookup_model, lookup, PagedCache(lookup_model.config, block_size=4), **kw)
    assert torch.equal(out, expected_lookup)
    assert triton_calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the pool is created on the GPU")
def test_pool_lives_on_the_model_device():
    model = enable_paged_attention(_model("llama"), backend="auto")
    cache = PagedCache(model.config, block_size=4)
    out = generate(model, left_padded([4, 7]), cache, max_new_tokens=4)
    assert out.device.type == "cuda"
    key_cache, _ = cache.pool.layer_kv(0)
    assert key_cache.device.type == "cuda"
    assert cache.memory_stats().bytes_reserved > 0
