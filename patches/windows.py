"""Which sliding window each decoder layer's attention uses, exactly as the model's attention decides it.

The value is the one the attention passes as ``sliding_window=W``: a query attends to the last ``W`` positions,
itself included (transformers' mask keeps ``kv_idx > q_idx - W``; ``hf_paged.ops`` reads ``W`` the same way).
transformers' ``DynamicSlidingWindowLayer(sliding_window=W)`` holds the same ``W`` but keeps only ``W - 1`` tokens
between steps: the new token completes the window.
"""

from __future__ import annotations

from typing import Callable

WindowRule = Callable[[object, int], "int | None"]

def text_config(config):
    """The decoder's config (a multimodal config's text part; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def layer_config(config, layer_idx: int):
    """The config a layer is built from: its own under transformers' heterogeneous configs, the shared one otherwise."""
    if getattr(config, "is_heterogeneous", False):
        return config.per_layer_config[layer_idx]
    return config


def layer_types(config) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    return list(types) if types is not None else None


def no_window(config, layer_idx: int) -> None:
    """Llama-shaped attention: never passes a window."""
    return None


def config_window(config, layer_idx: int) -> int | None:
    """Mistral-shaped attention: ``config.sliding_window`` on every layer (``layer_types`` is not read)."""
    return getattr(layer_config(config, layer_idx), "sliding_window", None)


def layer_types_window(config, layer_idx: int) -> int | None:
    """Gemma2/3-, Qwen2-, gpt-oss-shaped attention: the window on ``"sliding_attention"`` layers only."""
    types = layer_types(config)
    if types is None:
        return config_window(config, layer_idx)
    if types[layer_idx] != "sliding_attention":
        return None
    return getattr(layer_config(config, layer_idx), "sliding_window", None)


def num_layers(config) -> int:
    types = layer_types(config)
    return int(getattr(config, "num_hidden_layers", None) or (len(types) if types else 0))
