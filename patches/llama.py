"""Llama-shaped families: full attention on every layer, nothing passed beyond ``scaling``.

Granite's ``scaling`` is ``config.attention_multiplier`` rather than ``head_dim ** -0.5``.
"""

from .model_patch import ModelPatch
from .windows import no_window

PATCHES = [
    ModelPatch(("llama",), "llama", window=no_window),
    ModelPatch(("gemma",), "gemma", window=no_window),
    ModelPatch(("granite",), "granite", features=("scaling",), window=no_window),
    ModelPatch(("olmo",), "olmo", window=no_window),
    ModelPatch(("olmo2",), "olmo2", window=no_window),
    ModelPatch(("stablelm",), "stablelm", window=no_window),
    ModelPatch(("cohere",), "cohere", window=no_window),
    ModelPatch(("glm",), "glm", window=no_window),
    ModelPatch(("phi",), "phi", window=no_window),
]
