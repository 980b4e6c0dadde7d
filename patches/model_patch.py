""":class:`ModelPatch`: what one family does differently from the generic path, and :func:`base_decoder`."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from .windows import WindowRule, layer_types_window


def base_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (the module holding ``layers``) of a ``*ForCausalLM``, a multimodal wrapper, or the stack itself."""
    candidates = [model, getattr(model, "model", None), getattr(model, "language_model", None)]
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        candidates.append(getattr(inner, "language_model", None))
    for module in candidates:
        if isinstance(module, nn.Module) and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    return model


@dataclass(frozen=True)
class ModelPatch:
    """How to put one architecture family on the paged path.

    Attributes:
        model_types: ``config.model_type`` values this patch covers (of the text/decoder config).
        module: the ``transformers.models.<module>`` package holding the family's modeling file.
        features: attention features the family's attention may pass beyond Llama's (``"sliding_window"``,
            ``"layer_windows"`` = different windows per layer, ``"softcap"``, ``"sinks"``, ``"scaling"`` = a
            softmax scale other than ``head_dim ** -0.5``). A given config may need fewer (:func:`required_features`).
        window: ``(config, layer_idx) -> int | None``, the ``sliding_window=`` the layer's attention passes.
        decoder: returns the decoder module whose forward receives ``attention_mask`` and the cache.
        attention: the family's own paged attention, ``(module, query [N, H, Dq], layer_step, scale) -> [N, H, Dv]``,
            where its pool holds something other than per-head K/V (MLA's latent, :mod:`latent`); None: the shared
            one (``hf_paged.ops.paged_attention``).
        bidirectional: ``(model inputs) -> [B, S] bool | None``, the tokens of a forward's columns that attend
            bidirectionally within each run of them (Gemma 3's image tokens); the paged path turns the runs into
            bidirectional spans (:func:`hf_paged.step.bidirectional_spans`). None: a causal-only family.
    """

    model_types: tuple[str, ...]
    module: str
    features: tuple[str, ...] = ()
    window: WindowRule = layer_types_window
    decoder: Callable[[nn.Module], nn.Module] = base_decoder
    attention: Callable | None = None
    bidirectional: Callable | None = None

    @property
    def eager_attention(self) -> Callable:
        """The family's own ``eager_attention_forward`` (imported on first use: modeling files are slow to import)."""
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}").eager_attention_forward

    def in_transformers(self) -> bool:
        """Whether the installed transformers has this family with its attention behind ``AttentionInterface``
        (older releases lack some families, or route their attention through per-implementation classes).
        Reads the modeling file's text rather than importing it: importing all the families is slow."""
        spec = importlib.util.find_spec(f"transformers.models.{self.module}")
        if spec is None or not spec.submodule_search_locations:
            return False
        modeling = Path(list(spec.submodule_search_locations)[0]) / f"modeling_{self.module}.py"
        return modeling.is_file() and "def eager_attention_forward" in modeling.read_text()
