"""peft models on the paged path: ``enable_paged_attention(peft_model)`` hooks and wraps the model that owns the
attention layers (the one ``PeftModel.generate`` reaches), so LoRA generation pages (no gathered-mode warning, the
paged attention runs) and gives DynamicCache's tokens, across ``set_adapter`` switches and after
``merge_and_unload``."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import dynamic, generate, left_padded, tiny_model
from helpers.engine_oracle import reference
from hf_paged import PagedCache, disable_paged_attention, enable_paged_attention, generate_batch, is_paged
from hf_paged.ops import custom_ops

peft = pytest.importorskip("peft")


def lora_model():
    """A tiny Llama with two LoRA adapters ("first", "second") of random, non-zero weights (so each changes the
    tokens)."""
    model = tiny_model("llama", seed=1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False)
    torch.manual_seed(5)
    wrapped = peft.get_peft_model(model, config, adapter_name="first")
    torch.manual_seed(6)
    wrapped.add_adapter("second", config)
    return wrapped.eval()


@pytest.fixture
def paged_calls(monkeypatch):
    """Counts the paged attention's calls (the torch/Triton kernels' entry), to tell paged mode from gathered."""
    calls = []
    original = custom_ops.paged_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(custom_ops, "paged_attention", counting)
    return calls


def paged_run(model, inputs, calls):
    """generate() with a PagedCache: (tokens, whether the paged attention ran, the gathered-mode warnings)."""
    before = len(calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, inputs, PagedCache(model.config), max_new_tokens=8)
    gathered = [w for w in caught if "without enable_paged_attention" in str(w.message)]
    return out, len(calls) > before, gathered


def test_lora_pages_and_equals_dynamic_cache_across_adapters(paged_calls):
    model = lora_model()
    inputs = left_padded([9, 6], seed=4)
    expected = {}
    for name in ("first", "second"):
        model.set_adapter(name)
        expected[name] = generate(model, inputs, dynamic(model), max_new_tokens=8)
    assert not torch.equal(expected["first"], expected["second"])  # the adapters matter
    assert enable_paged_attention(model) is model and is_paged(model)
    for name in ("first", "second", "first"):
        model.set_adapter(name)
        out, paged, gathered = paged_run(model, inputs, paged_calls)
        assert paged and not gathered
        assert torch.equal(out, expected[name])
    disable_paged_attention(model)
    assert not is_paged(model)


def test_merge_and_unload_keeps_paging(paged_calls):
    model = lora_model()
    model.set_adapter("second")
    inputs = left_padded([7, 10], seed=8)
    enable_paged_attention(model)
    merged = model.merge_and_unload()  # the inner model, its LoRA weights folded in, still enabled
    expected = generate(merged, inputs, dynamic(merged), max_new_tokens=8)
    out, paged, gathered = paged_run(merged, inputs, paged_calls)
    assert is_paged(merged) and paged and not gathered
    assert torch.equal(out, expected)


def test_the_engine_serves_a_lora_model():
    """generate_batch on a PeftModel (attach_paged_attention finds the inner model): the adapter's tokens."""
    model = lora_model()
    model.set_adapter("second")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    expected = [reference(model, p, 6).tokens for p in prompts]
    outputs = generate_batch(model, prompts, max_new_tokens=6)
    assert is_paged(model)
    assert [list(o.generated_tokens) for o in outputs.values()] == expected
