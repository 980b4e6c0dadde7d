"""What the paged path can run: features each config needs, what this build implements, refusals before any forward."""

from __future__ import annotations

from torch import nn

from .latent import latent_widths
from .windows import ATTENTION_LAYER_TYPES, layer_types, layer_windows, text_config

# What this build's attention implements: the softmax scale the model passes, a window per layer group and one block
# table per group of layers sharing a window, logit soft-capping and attention sinks (ops.paged_attention's options).
FEATURES = frozenset({"scaling", "sliding_window", "layer_windows", "softcap", "sinks"})
GATHERED = "use PagedCache without enable_paged_attention (gathered mode: the model's own attention runs)"
DYNAMIC = "use transformers' DynamicCache for this model"


def available_features() -> frozenset[str]:
    """Attention features this build implements: what :func:`required_features` of a config may ask for."""
    return FEATURES


def required_features(config) -> tuple[str, ...]:
    """The attention features this config's model passes, e.g. ``("sliding_window", "layer_windows", "softcap")``."""
    from . import _registry

    config = text_config(config)
    patch = _registry().get(getattr(config, "model_type", None))
    family = patch.features if patch is not None else ("softcap",)
    windows = layer_windows(config)
    need = []
    if any(w is not None for w in windows):
        need.append("sliding_window")
    if len(set(windows)) > 1:
        need.append("layer_windows")
    if "softcap" in family and getattr(config, "attn_logit_softcapping", None) is not None:
        need.append("softcap")
    if "sinks" in family:
        need.append("sinks")
    return tuple(need)


def _refuse(what: str, fix: str) -> None:
    raise ValueError(f"hf_paged cannot page this model: {what}. Fix: {fix}.")


def _check_attention_only(config) -> None:
    types = layer_types(config) or []
    for idx, kind in enumerate(types):
        if kind == "chunked_attention":
            _refuse(f"layer {idx} uses chunked attention (layer type 'chunked_attention')", DYNAMIC)
        if kind not in ATTENTION_LAYER_TYPES:
            _refuse(f"layer {idx} is a {kind!r} layer, not softmax attention over a KV cache (linear-attention, "
                    "state-space, recurrent and attention-free layers keep no pageable K/V)", DYNAMIC)
    if not types and getattr(config, "attention_chunk_size", None) is not None:
        _refuse(f"chunked attention (attention_chunk_size={config.attention_chunk_size})", DYNAMIC)


def _check_kv_sharing(config) -> None:
    modes = getattr(config, "kv_sharing_modes", None) or []
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if "reuse" in modes or shared > 0:
        count = sum(m == "reuse" for m in modes) or shared
        _refuse(f"KV sharing: {count} layers reuse another layer's K/V (kv_sharing_modes / num_kv_shared_layers)", DYNAMIC)


def head_sizes(config) -> tuple[int | None, int | None]:
    """``(key head size, value head size)`` of a decoder config's attention."""
    heads = getattr(config, "num_attention_heads", None)
    default = config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    key = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None) or default
    value = getattr(config, "v_head_dim", None) or getattr(config, "value_head_dim", None) or key
    return key, value


def kv_shape(config) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of one layer's K/V in a decoder config (the block pool's per-token shape); an MLA
    config's is one head of the latent's width (its value tensor, the rotated key, is narrower: :func:`kv_widths`)."""
    config = text_config(config)
    latent = latent_widths(config)
    if latent is not None:
        return 1, latent[0]
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, head_sizes(config)[0]


def kv_widths(config) -> tuple[int, int, int]:
    """``(num_kv_heads, key width, value width)`` the pool stores per token and layer: an MLA config's one head of
    ``(kv_lora_rank, qk_rope_head_dim)``, others' ``(num_kv_heads, head_dim, head_dim)``."""
    heads, key = kv_shape(config)
    latent = latent_widths(text_config(config))
    return heads, key, latent[1] if latent is not None else key


def _check_head_sizes(config) -> None:
    if latent_widths(config) is not None:  # MLA: the cache holds the latent, not per-head K/V of these sizes
        return
    key, value = head_sizes(config)
    if key != value:
        _refuse(f"different key and value head sizes ({key} vs {value}); the block pool stores K and V with one "
                "head_dim", DYNAMIC)


def _check_causal(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        _refuse("bidirectional attention (use_bidirectional_attention=True); paged attention is causal", DYNAMIC)


def check_supported(config, paged: bool = True) -> None:
    """Raise ``ValueError`` naming what this config needs that hf_paged cannot do, and the fix.

    ``paged=True`` checks the paged path (``enable_paged_attention``): also a known family and the attention
    features this build implements. ``paged=False`` checks only what a ``PagedCache`` in gathered mode cannot hold
    either: linear-attention / state-space / chunked layers, KV sharing, different key and value head sizes.
    Runs on the config alone, so it can be called before any forward.
    """
    config = text_config(config)
    _check_causal(config)
    _check_attention_only(config)
    _check_kv_sharing(config)
    _check_head_sizes(config)
    if not paged:
        return
    from . import find_patch_for_config

    find_patch_for_config(config)
    missing = [f for f in required_features(config) if f not in available_features()]
    if missing:
        fix = DYNAMIC if "layer_windows" in missing else GATHERED
        _refuse(f"the model's attention needs {', '.join(missing)}, which this hf_paged build does not implement", fix)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The per-layer attention modules of ``model`` (modules carrying a ``layer_idx``, whose class is an attention)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]


def check_model(model: nn.Module) -> None:
    """:func:`check_supported` on ``model.config`` plus what the modules must offer: an attention module per layer
    with ``layer_idx`` and ``head_dim`` (GPT-NeoX's has ``head_size``)."""
    config = getattr(model, "config", None)
    latent = latent_widths(text_config(config)) is not None
    for module in attention_modules(model):
        if latent:  # MLA modules have no head_dim: their parts are checked by name
            if not all(hasattr(module, name) for name in ("kv_b_proj", "qk_nope_head_dim")):
                _refuse(f"{type(module).__name__} (layer {module.layer_idx}) has no kv_b_proj / qk_nope_head_dim, "
                        "which MLA's absorbed attention reads", GATHERED)
            continue
        if not isinstance(getattr(module, "head_dim", None), int):
            _refuse(f"{type(module).__name__} (layer {module.layer_idx}) has no head_dim attribute", GATHERED)
    check_supported(config)
