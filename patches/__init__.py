"""Per-architecture knowledge: which models the paged attention path supports and where their parts are.

Shipped inside the wheel as ``hf_paged.patches``. Model-specific knowledge lives here and nowhere else:

- :func:`find_patch` / :func:`find_patch_for_config`: the :class:`ModelPatch` of a model's family;
- :func:`layer_windows`: per decoder layer, the sliding window its attention uses (``None`` = full attention);
- :func:`check_supported`: refuses, before any forward, what the paged path cannot do;
- :func:`supported_models`: the table ``python -m hf_paged models`` prints.

The families are described in a few files that group the ones that differ the same way from Llama:
``llama.py`` (no window), ``mistral.py`` (one window from the config on every layer), ``hybrid.py`` (windows
per layer from ``config.layer_types``), and one file each for Gemma2 (soft-capping), Gemma3 and gpt-oss (sinks).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from .support import attention_modules, available_features, check_model, check_supported, kv_shape, required_features
from .windows import WindowRule, layer_types_window, layer_windows, text_config

__all__ = [
    "ModelPatch",
    "attention_modules",
    "available_features",
    "base_decoder",
    "check_model",
    "check_supported",
    "find_patch",
    "find_patch_for_config",
    "format_models_table",
    "kv_shape",
    "layer_windows",
    "required_features",
    "supported_model_types",
    "supported_models",
]


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
    """

    model_types: tuple[str, ...]
    module: str
    features: tuple[str, ...] = ()
    window: WindowRule = layer_types_window
    decoder: Callable[[nn.Module], nn.Module] = base_decoder
    attention: Callable | None = None

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


def _patches() -> list[ModelPatch]:
    from . import deepseek, gemma2, gemma3, gpt_oss, hybrid, llama, mistral

    return [*llama.PATCHES, *mistral.PATCHES, *hybrid.PATCHES, gemma2.PATCH, gemma3.PATCH, gpt_oss.PATCH,
            *deepseek.PATCHES]


def _registry() -> dict[str, ModelPatch]:
    return {t: p for p in _patches() for t in p.model_types}


def supported_model_types() -> list[str]:
    return sorted(_registry())


def find_patch_for_config(config) -> ModelPatch:
    """The :class:`ModelPatch` for ``config`` (its text/decoder config's ``model_type``); ``ValueError`` if none."""
    model_type = getattr(text_config(config), "model_type", None)
    patch = _registry().get(model_type)
    if patch is None:
        raise ValueError(
            f"enable_paged_attention supports {', '.join(supported_model_types())} models; got "
            f"model_type={model_type!r}. Without it a PagedCache still works (gathered K/V), "
            "or add a ModelPatch for this architecture in hf_paged/patches/."
        )
    if not patch.in_transformers():
        import transformers

        raise ValueError(
            f"model_type={model_type!r}: transformers {transformers.__version__} has no attention function for it "
            "behind AttentionInterface, which the paged path hooks; upgrade transformers, or use PagedCache without "
            "enable_paged_attention (gathered mode)."
        )
    return patch


def find_patch(model: nn.Module) -> ModelPatch:
    """The :class:`ModelPatch` for ``model`` (by its config); ``ValueError`` naming the supported types if none."""
    config = getattr(model, "config", None)
    try:
        return find_patch_for_config(config)
    except ValueError as err:
        raise ValueError(f"{type(model).__name__}: {err}") from None


def supported_models() -> list[dict]:
    """One row per model type: ``model_type``, ``features`` (the family's), ``status`` ("supported" or what is missing)."""
    have = available_features()
    rows = []
    for model_type, patch in sorted(_registry().items()):
        missing = [f for f in patch.features if f not in have]
        status = "supported" if not missing else "needs " + ", ".join(missing)
        if not patch.in_transformers():
            status = "not in this transformers"
        rows.append({"model_type": model_type, "features": patch.features, "status": status})
    return rows


def format_models_table() -> str:
    """The table ``python -m hf_paged models`` prints: model type, the family's attention features, status."""
    rows = supported_models()
    header = ("model type", "features", "status")
    lines = [(r["model_type"], ", ".join(r["features"]) or "-", r["status"]) for r in rows]
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(3)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*row).rstrip() for row in [header, *lines])
