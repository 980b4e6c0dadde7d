"""Gemma2: alternating sliding/full layers (``layer_types``), ``softcap=config.attn_logit_softcapping``
(scores -> ``softcap * tanh(scores / softcap)`` before the mask), ``scaling=config.query_pre_attn_scalar ** -0.5``."""

from .model_patch import ModelPatch

PATCH = ModelPatch(("gemma2",), "gemma2", features=("sliding_window", "layer_windows", "softcap", "scaling"))
