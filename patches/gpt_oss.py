"""gpt-oss: alternating sliding/full layers (``layer_types``) and attention sinks, passed as ``s_aux=module.sinks``
(one learned logit per query head joins the softmax denominator and takes no value)."""

from .model_patch import ModelPatch

PATCH = ModelPatch(("gpt_oss",), "gpt_oss", features=("sliding_window", "layer_windows", "sinks"))
