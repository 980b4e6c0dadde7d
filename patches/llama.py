"""Llama (and Llama-architecture models such as SmolLM2)."""

from transformers.models.llama import modeling_llama

from . import ModelPatch, base_decoder

PATCH = ModelPatch(
    model_types=("llama",),
    eager_attention=modeling_llama.eager_attention_forward,
    decoder=base_decoder,
)
