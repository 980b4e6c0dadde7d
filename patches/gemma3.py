"""Gemma3 (text): windows from ``layer_types`` (five sliding per full by default), ``scaling=query_pre_attn_scalar ** -0.5``.

Its attention does not pass ``softcap`` (``attn_logit_softcapping`` is stored but unused). Multimodal Gemma3 checkpoints
(``model_type="gemma3"``) are found through their text config. ``use_bidirectional_attention`` (embedding models)
is refused by :func:`~hf_paged.patches.check_supported`. An image's tokens (``token_type_ids == 1``, each run of them
one image) attend to each other both ways (:func:`image_tokens`: the paged path's bidirectional spans).
"""

from __future__ import annotations

import torch

from .model_patch import ModelPatch


def image_tokens(inputs: dict) -> torch.Tensor | None:
    """``[B, S]`` bool over the columns of ``token_type_ids`` (a forward's model inputs): Gemma 3's image tokens,
    each run of which attends to itself bidirectionally (transformers' ``get_block_sequence_ids_for_mask``); None
    when the forward has no ``token_type_ids`` (text, or a decode step)."""
    types = inputs.get("token_type_ids")
    return None if types is None else types == 1


PATCH = ModelPatch(("gemma3_text",), "gemma3", features=("sliding_window", "layer_windows", "scaling"),
                   bidirectional=image_tokens)
