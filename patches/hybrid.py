"""Families whose window is per layer, from ``config.layer_types`` (``"sliding_attention"`` layers only).

- Qwen2, Qwen3: ``sliding_window`` is ``None`` unless ``use_sliding_window``; the config's ``layer_types`` then marks
  layers ``>= max_window_layers`` as sliding.
- Cohere2, EXAONE 4: a repeating pattern (three sliding, one full by default).
- SmolLM3: a window only when ``use_sliding_window`` and the layer type is sliding.
"""

from . import ModelPatch
from .windows import layer_types_window

WINDOWED = ("sliding_window", "layer_windows")


def smollm3_window(config, layer_idx: int) -> int | None:
    if not getattr(config, "use_sliding_window", False):
        return None
    return layer_types_window(config, layer_idx)


PATCHES = [
    ModelPatch(("qwen2",), "qwen2", features=WINDOWED),
    ModelPatch(("qwen3",), "qwen3", features=WINDOWED),
    ModelPatch(("cohere2",), "cohere2", features=WINDOWED),
    ModelPatch(("exaone4",), "exaone4", features=WINDOWED),
    ModelPatch(("smollm3",), "smollm3", features=WINDOWED, window=smollm3_window),
]
