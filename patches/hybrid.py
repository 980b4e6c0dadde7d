"""Families whose window is per layer, from ``config.layer_types`` (``"sliding_attention"`` layers only).

- Qwen2, Qwen3: ``sliding_window`` is ``None`` unless ``use_sliding_window``; the config's ``layer_types`` then marks
  layers ``>= max_window_layers`` as sliding.
- Cohere2, EXAONE 4: a repeating pattern (three sliding, one full by default).
- SmolLM3: the config marks layers sliding only when ``use_sliding_window``. Its attention passes
  ``sliding_window=None`` when ``use_sliding_window`` is false even on a layer an explicit ``layer_types`` calls
  sliding, but the model still builds that layer a sliding mask (and ``DynamicCache`` a sliding layer): the window
  reported is that effective one, so the paged path should take each layer's window from :func:`layer_windows`.
"""

from .model_patch import ModelPatch

WINDOWED = ("sliding_window", "layer_windows")

PATCHES = [
    ModelPatch((model_type,), model_type, features=WINDOWED)
    for model_type in ("qwen2", "qwen3", "cohere2", "exaone4", "smollm3")
]
