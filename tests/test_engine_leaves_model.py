"""What hf_paged's engine leaves on the user's model: it copies and pickles (the prepacked CPU weights are remade,
not copied), its transformers methods run (never transformers' own refusing the paged attention), and
``disable_paged_attention`` gives back plain linears and transformers' own methods."""

from __future__ import annotations

import copy
import io

import torch
from helpers import tiny_model
from torch import nn

import hf_paged
from hf_paged.engine.cpu_linears import PackedLinear

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def engine_tokens(model) -> list[list[int]]:
    outs = hf_paged.generate_batch(model, PROMPTS, max_new_tokens=4, do_sample=False, progress_bar=False)
    return [list(o.generated_tokens) for o in outs.values()]


def bf16_model():
    model = tiny_model("llama", seed=4).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model


def test_a_model_the_engine_ran_deep_copies_and_saves():
    model = bf16_model()
    first = engine_tokens(model)
    layer = model.model.layers[0].mlp.down_proj  # (up_proj ran fused with gate_proj, in the engine's lean forward)
    assert type(layer) is PackedLinear and layer._packed is not None  # the engine packed it, and it ran packed
    twin = copy.deepcopy(model)  # TRL's reference model; transformers' generate_batch on a copy
    assert twin.model.layers[0].mlp.down_proj._packed is None  # remade from the weight at its first call
    assert engine_tokens(twin) == first
    torch.save(model.state_dict(), io.BytesIO())
    torch.save(model, io.BytesIO())


def test_model_generate_batch_after_the_engine_runs_on_the_engine():
    model = bf16_model()
    first = engine_tokens(model)
    from transformers import GenerationConfig

    outs = model.generate_batch(PROMPTS, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False),
                                progress_bar=False)
    assert [list(o.generated_tokens) for o in outs.values()] == first
    assert hf_paged.engine_of(model) is None  # no persistent manager was asked for


def test_disable_gives_back_plain_linears_and_transformers_methods():
    model = bf16_model()
    first = engine_tokens(model)
    hf_paged.disable_paged_attention(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert {type(m) for m in linears} == {nn.Linear}
    assert not any("_packed" in vars(m) for m in linears)  # the packed copies are freed, not kept under nn.Linear
    assert "generate_batch" not in model.__dict__ and not hf_paged.is_paged(model)
    twin = copy.deepcopy(model)  # the demo's transformers generate_batch row copies the model here
    assert engine_tokens(twin) == first
