"""Gemma3 (text): windows from ``layer_types`` (five sliding per full by default), ``scaling=query_pre_attn_scalar ** -0.5``.

Its attention does not pass ``softcap`` (``attn_logit_softcapping`` is stored but unused). Multimodal Gemma3 checkpoints
(``model_type="gemma3"``) are found through their text config. ``use_bidirectional_attention`` (embedding models)
is refused by :func:`~hf_paged.patches.check_supported`.
"""

from .model_patch import ModelPatch

PATCH = ModelPatch(("gemma3_text",), "gemma3", features=("sliding_window", "layer_windows", "scaling"))
