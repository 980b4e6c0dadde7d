"""Putting a model on the paged path: ``attach_paged_attention`` (the attention and the decoder hooks, what the engine
needs) under ``enable_paged_attention`` (attach plus the ``generate()`` wrappers a ``PagedCache`` needs), both undone by
``disable_paged_attention``; and ``compat`` as the bottom layer the attention registers through in one step."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from helpers import VOCAB, dynamic, forward, generate, left_padded, tiny_model
from helpers.engine_oracle import TieCount, check_tokens, random_prompts, reference
from helpers.engine_shadow import one_thread
from hf_paged import (BlockPool, PagedCache, RequestStatus, attach_paged_attention, compat, disable_paged_attention,
                      enable_paged_attention, generate_batch, is_paged, paged_backend)

WRAPPED = ("generate", "prepare_inputs_for_generation", "_get_stopping_criteria")


def _wrapped(model) -> list[str]:
    """The generate() methods of ``model`` that are hf_paged's wrappers rather than its class's own."""
    return [name for name in WRAPPED
            if getattr(getattr(model, name), "__func__", None) is not getattr(type(model), name)]


def _hooks(model) -> tuple[int, int]:
    return len(model.model._forward_pre_hooks), len(model.model._forward_hooks)


def test_attach_sets_the_attention_and_hooks_but_leaves_generate_alone(llama):
    """attach: the paged attention implementation and one pair of decoder hooks, no generate() wrapper; a second call
    changes only the backend; without a PagedCache the model computes what it did (DynamicCache generate())."""
    before = llama.config._attn_implementation
    inputs = left_padded([4, 9])
    expected = generate(llama, inputs, dynamic(llama))
    assert attach_paged_attention(llama, backend="torch") is llama
    assert is_paged(llama) and paged_backend(llama) == "torch"
    assert llama.config._attn_implementation == "hf_paged_" + before
    assert _hooks(llama) == (1, 1)
    assert _wrapped(llama) == []
    attach_paged_attention(llama)
    assert paged_backend(llama) == "auto" and _hooks(llama) == (1, 1) and _wrapped(llama) == []
    assert torch.equal(generate(llama, inputs, dynamic(llama)), expected)


def test_a_paged_cache_on_an_attached_model_is_refused_until_enable(llama):
    """generate() or a forward with a PagedCache on a model only attached raises a ValueError naming
    enable_paged_attention before any layer runs (the cache stays empty and usable); enable then adds only the
    wrappers and the same cache gives DynamicCache's tokens."""
    inputs = left_padded([4, 9, 1])
    expected = generate(llama, inputs, dynamic(llama))
    attach_paged_attention(llama, backend="torch")
    cache = PagedCache(llama.config, block_size=4)
    with pytest.raises(ValueError, match=r"attach_paged_attention\(\).*enable_paged_attention\(model\)"):
        generate(llama, inputs, cache)
    with pytest.raises(ValueError, match="enable_paged_attention"):
        forward(llama, inputs["input_ids"], cache, attention_mask=inputs["attention_mask"])
    assert cache.get_seq_length() == 0 and cache.memory_stats().blocks_in_use == 0
    enable_paged_attention(llama)
    assert paged_backend(llama) == "auto" and _hooks(llama) == (1, 1)
    assert _wrapped(llama) == list(WRAPPED)
    assert torch.equal(generate(llama, inputs, cache), expected)
    # attach on an enabled model keeps the wrappers (the engine may attach a model the user enabled).
    attach_paged_attention(llama, backend="torch")
    assert _wrapped(llama) == list(WRAPPED) and paged_backend(llama) == "torch"
    assert torch.equal(generate(llama, inputs, PagedCache(llama.config, block_size=4)), expected)


@pytest.mark.parametrize("first", ["attach", "enable"])
def test_disable_removes_whatever_was_installed(first):
    """disable after attach or enable: the original implementation, no hooks, no wrappers, not paged; the model is
    transformers' own again and can be put back on the paged path."""
    model = tiny_model("llama", seed=2)
    before = model.config._attn_implementation
    inputs = left_padded([5, 2])
    expected = generate(model, inputs, dynamic(model))
    (attach_paged_attention if first == "attach" else enable_paged_attention)(model, backend="torch")
    assert disable_paged_attention(model) is model
    assert not is_paged(model) and model.config._attn_implementation == before
    assert _hooks(model) == (0, 0) and _wrapped(model) == []
    assert all("_hf_paged_eager" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="attach_paged_attention"):
        paged_backend(model)
    assert torch.equal(generate(model, inputs, dynamic(model)), expected)
    assert disable_paged_attention(model) is model  # twice: nothing left to undo
    enable_paged_attention(model, backend="torch")
    assert torch.equal(generate(model, inputs, PagedCache(model.config, block_size=4)), expected)


@pytest.mark.skipif(not compat.STEP_IN_ATTENTION_KWARGS, reason="the engine needs transformers >= 5.24")
def test_the_engine_runs_on_an_attached_model(llama):
    """The continuous-batching engine on a model only attached (keeping its backend: the factory does not re-page a
    paged model): every request finishes with generate()'s tokens, and generate() was never wrapped."""
    with contextlib.contextmanager(one_thread)():
        attach_paged_attention(llama, backend="torch")
        prompts = random_prompts(3, VOCAB, (3, 9), seed=4)
        outs = generate_batch(llama, prompts, pool=BlockPool(block_size=4, num_blocks=32), max_new_tokens=5,
                              progress_bar=False)
        assert _wrapped(llama) == [] and paged_backend(llama) == "torch"
        ties = TieCount()
        for i, prompt in enumerate(prompts):
            out = outs[f"req_{i}"]
            assert out.status == RequestStatus.FINISHED, out.error
            check_tokens(f"attached/{i}", out.generated_tokens, reference(llama, prompt, 5), ties)


def test_compat_is_the_bottom_layer_with_its_imports_at_the_top():
    """compat imports no other hf_paged module (nothing calls back into the attention) and every import sits at
    module level (inside a top-level try/if at most), never in a function."""
    tree = ast.parse((Path(compat.__file__)).read_text())
    local = [node.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert local == [], f"function-local imports in compat.py at lines {local}"
    ours = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.level > 0 or (node.module or "").startswith("hf_paged"))]
    assert ours == [], f"compat.py imports hf_paged modules at lines {ours}"
