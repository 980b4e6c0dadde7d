"""Mistral: Llama's layout plus a sliding window, which its attention passes as ``sliding_window=``."""

from transformers.models.mistral import modeling_mistral

from . import ModelPatch, base_decoder

PATCH = ModelPatch(
    model_types=("mistral",),
    eager_attention=modeling_mistral.eager_attention_forward,
    decoder=base_decoder,
)
