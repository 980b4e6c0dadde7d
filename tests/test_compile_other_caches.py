"""Enabling the paged path never changes what another cache does, compiled included: transformers' compiled
``StaticCache`` decoding (``fullgraph=True``: a graph break is an error) gives the unpatched model's tokens."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers.generation import CompileConfig

from helpers import left_padded, tiny_model
from hf_paged import disable_paged_attention, enable_paged_attention


def static_compiled(model, inputs) -> torch.Tensor:
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)  # dynamo's trace, no inductor: fast
    config._compile_all_devices = True  # compile on CPU too
    torch._dynamo.reset()
    return model.generate(**inputs, cache_implementation="static", compile_config=config, max_new_tokens=8,
                          do_sample=False)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_compiled_static_cache_after_enabling_equals_the_unpatched_model(kind):
    """The paged attention function finds no step of its own in what it is handed (module, kwargs) and hands the
    StaticCache's forward to the model's attention without reading anything dynamo cannot trace."""
    model = tiny_model(kind, sliding_window=8) if kind == "mistral" else tiny_model(kind)
    inputs = left_padded([9, 5])
    expected = static_compiled(model, inputs)
    enable_paged_attention(model)
    try:
        got = static_compiled(model, inputs)
    finally:
        disable_paged_attention(model)
    assert torch.equal(got, expected)
