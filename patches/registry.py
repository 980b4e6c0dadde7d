"""Which families take the paged path, and how: the :class:`ModelPatch` registry, generic acceptance, the window
rule per layer, and the family table ``python -m hf_paged models`` prints.

A model type with no :class:`ModelPatch` is taken *generically* when its modeling file routes attention through
transformers' ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS``): its windows come from ``config.layer_types`` (else
``config.sliding_window``), its kinds and shapes from :func:`~hf_paged.patches.kv_geometry`, and the paged attention
function refuses, by name, any attention argument it does not implement (``hf_paged.attention``). A ``ModelPatch``
is needed only where a family differs (a window rule that ignores ``layer_types``, features to list).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import transformers

from hf_paged import compat

from . import deepseek, gemma2, gemma3, gpt_oss, hybrid, llama, mistral
from .model_patch import ModelPatch
from .windows import layer_types_window, num_layers, text_config

PATCHES = [*llama.PATCHES, *mistral.PATCHES, *hybrid.PATCHES, gemma2.PATCH, gemma3.PATCH, gpt_oss.PATCH,
           *deepseek.PATCHES]

# Families the test suite runs token for token against DynamicCache (generate() and the engine) that need no
# ModelPatch: they are taken generically (tests/test_families.py; tests/helpers/models.py has their tiny configs).
GENERIC_VERIFIED = ("olmo3", "glm4", "glm4_moe", "seed_oss", "apertus", "ernie4_5", "arcee", "hunyuan_v1_dense",
                    "llama4_text", "gemma4_text", "gemma3n_text")

# Hybrid families (state layers beside attention) taken generically, their states in the pool's state store: the
# suite runs generate() and the engine token for token against DynamicCache (tests/test_hybrid_states.py).
STATE_VERIFIED = {
    "qwen3_next": "linear attention", "qwen3_5_text": "linear attention", "olmo_hybrid": "linear attention",
    "nemotron_h": "Mamba2", "granitemoehybrid": "Mamba2", "falcon_h1": "Mamba2 beside attention",
    "jamba": "Mamba", "lfm2": "short convolutions",
}

# Families refused by name until their kind of layer is paged (the suite checks each refusal).
REFUSED = {
    "longcat_flash": "multi-head latent attention", "mistral4": "multi-head latent attention",
}

_REGISTRY = {t: p for p in PATCHES for t in p.model_types}


def _registry() -> dict[str, ModelPatch]:
    return _REGISTRY


def supported_model_types() -> list[str]:
    """Model types with a :class:`ModelPatch` (others are taken generically, see the module docstring)."""
    return sorted(_REGISTRY)


def verified_model_types() -> list[str]:
    """Model types the suite runs token for token against DynamicCache: the patched ones, :data:`GENERIC_VERIFIED` and
    the hybrid :data:`STATE_VERIFIED`."""
    return sorted({*_REGISTRY, *GENERIC_VERIFIED, *STATE_VERIFIED})


def _modeling_file(module: str) -> Path | None:
    spec = importlib.util.find_spec(f"transformers.models.{module}")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / f"modeling_{module}.py"
    return path if path.is_file() else None


def generic_patch(model_type: str) -> ModelPatch | None:
    """The generic :class:`ModelPatch` of a model type without one of its own: its attention goes through
    ``AttentionInterface``; ``None`` when this transformers has no such modeling file."""
    try:
        module = compat.modeling_module_name(model_type)
    except Exception:
        return None
    path = _modeling_file(module)
    if path is None or "ALL_ATTENTION_FUNCTIONS" not in path.read_text():
        return None
    return ModelPatch((model_type,), module, features=(), window=layer_types_window)


def find_patch_for_config(config) -> ModelPatch:
    """The :class:`ModelPatch` for ``config`` (its text/decoder config's ``model_type``): the family's own, else the
    generic one; ``ValueError`` when the model's attention does not go through ``AttentionInterface``."""
    model_type = getattr(text_config(config), "model_type", None)
    patch = _REGISTRY.get(model_type)
    if patch is not None and patch.in_transformers():
        return patch
    if patch is None:
        patch = generic_patch(model_type)
        if patch is not None:
            return patch
    raise ValueError(
        f"hf_paged cannot page this model: model_type={model_type!r} has no attention behind transformers' "
        f"AttentionInterface in transformers {transformers.__version__}, which the paged path hooks. Fix: upgrade "
        "transformers, or use PagedCache without enable_paged_attention (gathered mode)."
    )


def find_patch(model) -> ModelPatch:
    """The :class:`ModelPatch` for ``model`` (by its config); ``ValueError`` naming the problem if none."""
    try:
        return find_patch_for_config(getattr(model, "config", None))
    except ValueError as err:
        raise ValueError(f"{type(model).__name__}: {err}") from None


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, the ``sliding_window`` its attention passes (``None`` = no window).

    Uses the family's rule (:class:`~hf_paged.patches.ModelPatch` ``window``); for a model type taken generically,
    ``config.layer_types`` when present, else ``config.sliding_window`` on every layer.

    Example: ``layer_windows(Gemma3TextConfig(num_hidden_layers=6, sliding_window=512))``
    -> ``[512, 512, 512, 512, 512, None]``.
    """
    config = text_config(config)
    patch = _REGISTRY.get(getattr(config, "model_type", None))
    rule = patch.window if patch is not None else layer_types_window
    windows = [rule(config, i) for i in range(num_layers(config))]
    return [int(w) if w is not None else None for w in windows]
