"""Per-architecture knowledge: which models the paged attention path takes, and what each layer keeps.

Shipped inside the wheel as ``hf_paged.patches`` (a checkout sees it through the ``hf_paged/patches`` link).
Model-specific knowledge lives here and nowhere else:

- :func:`kv_geometry`: per decoder layer, its kind (full, sliding, chunked, reuse, state, none) and K/V shape,
  from the config (``kinds.py``); every part of hf_paged reads that one description;
- :func:`find_patch` / :func:`find_patch_for_config`: a family's :class:`ModelPatch`, or the generic one for any
  model whose attention goes through transformers' ``AttentionInterface`` (``registry.py``);
- :func:`layer_windows`: per decoder layer, the sliding window its attention uses (``None`` = no window);
- :func:`check_supported` / :func:`check_model`: refuse, before any forward and by layer, what the paged path
  cannot do (``support.py``);
- :data:`IMAGE_VERIFIED` / :func:`bidirectional_image_families`: vision-language families with images in the
  engine, and those refused there (``vision.py``);
- :func:`supported_models` / :func:`format_models_table`: the table ``python -m hf_paged models`` prints
  (``table.py``).

The families that differ from the generic path are described in a few files that group the ones that differ the
same way: ``llama.py`` (never a window, whatever ``layer_types`` says), ``mistral.py`` (one window from the config on
every layer), ``hybrid.py`` (windows per layer from ``config.layer_types``), and one file each for Gemma2
(soft-capping), Gemma3 and gpt-oss (sinks).
"""

from __future__ import annotations

from .kinds import head_sizes, kv_geometry
from .model_patch import ModelPatch, base_decoder
from .registry import (
    GENERIC_VERIFIED, REFUSED, STATE_VERIFIED, _registry, find_patch, find_patch_for_config, generic_patch,
    layer_windows, supported_model_types, verified_model_types,
)
from .support import (
    attention_modules, available_features, check_engine_supported, check_model, check_supported, kv_shape,
    required_features, state_mixers,
)
from .table import format_models_table, supported_models
from .vision import IMAGE_VERIFIED, bidirectional_image_families, refused_image_families
from .windows import WindowRule, layer_types_window, text_config

__all__ = [
    "GENERIC_VERIFIED",
    "IMAGE_VERIFIED",
    "bidirectional_image_families",
    "refused_image_families",
    "STATE_VERIFIED",
    "check_engine_supported",
    "state_mixers",
    "REFUSED",
    "ModelPatch",
    "WindowRule",
    "attention_modules",
    "available_features",
    "base_decoder",
    "check_model",
    "check_supported",
    "find_patch",
    "find_patch_for_config",
    "format_models_table",
    "generic_patch",
    "head_sizes",
    "kv_geometry",
    "kv_shape",
    "layer_types_window",
    "layer_windows",
    "required_features",
    "supported_model_types",
    "supported_models",
    "text_config",
    "verified_model_types",
]
