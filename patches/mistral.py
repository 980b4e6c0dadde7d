"""Mistral-shaped families: Llama's layout plus ``sliding_window=config.sliding_window`` on every layer.

Their attention reads the window from the config directly (``layer_types`` is ignored); ``None`` = full attention.
Qwen3-MoE's config sets ``sliding_window`` to ``None`` unless ``use_sliding_window``.
"""

from .model_patch import ModelPatch
from .windows import config_window

PATCHES = [
    ModelPatch((model_type,), model_type, features=("sliding_window",), window=config_window)
    for model_type in ("mistral", "mixtral", "phi3", "starcoder2", "qwen3_moe")
]
