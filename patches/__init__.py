"""Per-architecture knowledge: which models the paged attention path supports and where their parts are.

Shipped inside the wheel as ``hf_paged.patches``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class ModelPatch:
    """How to put one architecture on the paged path.

    Attributes:
        model_types: ``config.model_type`` values this patch covers.
        eager_attention: the architecture's own eager attention function (used when the model ran "eager").
        decoder: returns the decoder module whose forward receives ``attention_mask`` and the cache.
    """

    model_types: tuple[str, ...]
    eager_attention: Callable
    decoder: Callable[[nn.Module], nn.Module]


def _registry() -> dict[str, ModelPatch]:
    from . import llama, mistral

    return {t: p for p in (llama.PATCH, mistral.PATCH) for t in p.model_types}


def supported_model_types() -> list[str]:
    return sorted(_registry())


def find_patch(model: nn.Module) -> ModelPatch:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    patch = _registry().get(model_type)
    if patch is None:
        raise ValueError(
            f"enable_paged_attention supports {', '.join(supported_model_types())} models; got "
            f"{type(model).__name__} (model_type={model_type!r}). Without it a PagedCache still works (gathered K/V), "
            "or add a file to hf_paged/patches/ for this architecture."
        )
    return patch


def base_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a ``*ForCausalLM`` (or the model itself when it is the stack)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model
