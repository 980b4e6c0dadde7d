"""What the paged path can run: features each config needs, what this build implements, refusals before any forward."""

from __future__ import annotations

import inspect

from torch import nn

from . import kinds
from .kinds import kv_geometry
from .latent import latent_widths
from .model_patch import base_decoder
from .registry import _registry, find_patch_for_config, layer_windows
from .windows import text_config

# What this build's attention implements: the softmax scale the model passes, a window per layer group and one block
# table per group of layers sharing a window, logit soft-capping and attention sinks (ops.paged_attention's options),
# chunked attention, layers of their own K/V shape, KV-shared layers reading their source layer's blocks.
FEATURES = frozenset({"scaling", "sliding_window", "layer_windows", "softcap", "sinks", "chunked_attention",
                      "layer_shapes", "kv_sharing"})
GATHERED = "use PagedCache without enable_paged_attention (gathered mode: the model's own attention runs)"
DYNAMIC = "use transformers' DynamicCache for this model"


def available_features() -> frozenset[str]:
    """Attention features this build implements: what :func:`required_features` of a config may ask for."""
    return FEATURES


def required_features(config) -> tuple[str, ...]:
    """The attention features this config's model passes, e.g. ``("sliding_window", "layer_windows", "softcap")``."""
    config = text_config(config)
    patch = _registry().get(getattr(config, "model_type", None))
    family = patch.features if patch is not None else ("softcap",)
    windows = layer_windows(config)
    geometry = kv_geometry(config)
    need = []
    if any(w is not None for w in windows):
        need.append("sliding_window")
    if len(set(windows)) > 1:
        need.append("layer_windows")
    if any(layer.kind == "chunked" for layer in geometry.layers):
        need.append("chunked_attention")
    if len({layer.shape for layer in geometry.layers if layer.paged}) > 1:
        need.append("layer_shapes")
    if any(layer.kind == "reuse" for layer in geometry.layers):
        need.append("kv_sharing")
    if "softcap" in family and getattr(config, "attn_logit_softcapping", None) is not None:
        need.append("softcap")
    if "sinks" in family:
        need.append("sinks")
    return tuple(need)


def _refuse(what: str, fix: str) -> None:
    raise ValueError(f"hf_paged cannot page this model: {what}. Fix: {fix}.")


STATE_MIXERS = ("Mamba", "DeltaNet", "LinearAttention", "ShortConv", "Recurrent", "SSM", "Lightning", "RWKV", "LSTM")


def _check_kinds(config) -> None:
    """Refuse, by layer, the kinds this build does not page: reuse layers whose source keeps no K/V in the pool,
    models without any attention layer. (State layers keep their states in the pool's state store.)"""
    try:
        geometry = kv_geometry(config)
    except ValueError as err:
        _refuse(str(err).removesuffix(" Fix: use transformers' DynamicCache for this model."), DYNAMIC)
    for idx, layer in enumerate(geometry.layers):
        if layer.kind == "reuse" and (layer.source is None or not geometry[layer.source].paged):
            _refuse(f"layer {idx} reuses the K/V of {'no layer' if layer.source is None else f'layer {layer.source}'}"
                    " (KV sharing, kv_sharing_modes 'reuse'), which keeps none in the pool", DYNAMIC)
    if not any(layer.paged for layer in geometry.layers) and geometry.layers:
        _refuse("no layer keeps K/V (no softmax attention layer)", DYNAMIC)


def _check_latent(config) -> None:
    """Multi-head latent attention caches a compressed latent, not per-head K/V: only the families with a latent
    attention of their own (``patches/deepseek.py``) are paged; others are refused here."""
    if latent_widths(config) is None:
        return
    patch = _registry().get(getattr(config, "model_type", None))
    if patch is None or patch.attention is None:
        paged = sorted(t for t, p in _registry().items() if p.attention is not None)
        _refuse(f"every layer uses multi-head latent attention (MLA, kv_lora_rank={config.kv_lora_rank}), which "
                f"this build pages only for {', '.join(paged)}: its cache holds a latent, not per-head K/V", DYNAMIC)


def head_sizes(config) -> tuple[int | None, int | None]:
    """``(key head size, value head size)`` of a decoder config's attention (its first paged layer's)."""
    return kinds.head_sizes(config)


def kv_shape(config) -> tuple[int, int]:
    """``(num_kv_heads, key head size)`` of the first paged layer (models whose layers differ: read
    :func:`~hf_paged.patches.kv_geometry`; an MLA layer's is one head of the latent's width)."""
    return kv_widths(config)[:2]


def kv_widths(config) -> tuple[int, int, int]:
    """``(num_kv_heads, key width, value width)`` the pool stores per token in the first paged layer (from
    :func:`~hf_paged.patches.kv_geometry`): an MLA config's one head of ``(kv_lora_rank, qk_rope_head_dim)``."""
    paged = [layer for layer in kv_geometry(config).layers if layer.paged]
    if paged:
        return paged[0].shape
    config = text_config(config)
    key, value = kinds.head_sizes(config)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads, key, value


def _check_head_sizes(config) -> None:
    if latent_widths(config) is not None:  # MLA: the pool holds the latent and the rotated key, of other widths
        return
    for idx, layer in enumerate(kv_geometry(config).layers):
        if layer.paged and layer.key_dim != layer.value_dim:
            _refuse(f"layer {idx} has different key and value head sizes ({layer.key_dim} vs {layer.value_dim}); "
                    "the paged attention reads K and V of one head size", DYNAMIC)


def _check_causal(config) -> None:
    if getattr(config, "use_bidirectional_attention", False) in (True, "all"):
        _refuse("bidirectional attention (use_bidirectional_attention="
                f"{config.use_bidirectional_attention!r}); paged attention is causal", DYNAMIC)


def check_supported(config, paged: bool = True) -> None:
    """Raise ``ValueError`` naming what this config needs that hf_paged cannot do, and the fix.

    ``paged=True`` checks the paged path (``enable_paged_attention``): also a known family and the attention
    features this build implements. ``paged=False`` checks only what a ``PagedCache`` in gathered mode cannot hold
    either: KV sharing without a paged source, models without attention, different key and value head sizes.
    (Linear-attention / state-space layers keep their states in the pool's state store: ``hf_paged/states.py``.)
    Runs on the config alone, so it can be called before any forward.
    """
    config = text_config(config)
    _check_causal(config)
    _check_latent(config)
    _check_kinds(config)
    _check_head_sizes(config)
    if not paged:
        return
    find_patch_for_config(config)
    missing = [f for f in required_features(config) if f not in available_features()]
    if missing:
        fix = DYNAMIC if "layer_windows" in missing else GATHERED
        _refuse(f"the model's attention needs {', '.join(missing)}, which this hf_paged build does not implement", fix)


MIXER_PARAMS = ("hidden_states", "cache", "attention_mask")  # how transformers' state mixers are called (5.24)


def state_mixers(model: nn.Module) -> dict[int, nn.Module]:
    """Per state layer, the module that mixes tokens through the layer's states (``Qwen3_5GatedDeltaNet``,
    ``NemotronHMamba2Mixer``, ``Lfm2ShortConv``, Falcon-H1's ``mamba`` beside its attention, ...): the one
    submodule of the decoder layer whose ``forward(hidden_states, cache, attention_mask, **kwargs)`` takes the
    cache. Layers where none or several are found are left out (:func:`check_engine_supported` names them)."""
    layers = getattr(base_decoder(model), "layers", None)
    found = {}
    for idx in kv_geometry(getattr(model, "config", None)).state_layers:
        if not isinstance(layers, nn.ModuleList) or idx >= len(layers):
            continue
        mixers = [m for m in layers[idx].modules() if m is not layers[idx]
                  and tuple(inspect.signature(m.forward).parameters)[:3] == MIXER_PARAMS]
        if len(mixers) == 1:
            found[idx] = mixers[0]
    return found


def check_engine_supported(model: nn.Module) -> None:
    """What the continuous-batching engine needs beyond :func:`check_model`: on hybrid models, the mixer of every
    state layer (the engine runs it once per group of requests, never over the packed batch)."""
    state_layers = kv_geometry(getattr(model, "config", None)).state_layers
    missing = sorted(set(state_layers) - set(state_mixers(model)))
    if missing:
        _refuse(f"layer {missing[0]} keeps a recurrent / convolution state, but no single submodule of it takes "
                f"the cache as forward({', '.join(MIXER_PARAMS)}, ...), which the engine runs per request",
                "generate() with a PagedCache (hf_paged.enable_paged_attention(model); "
                "model.generate(..., cache=PagedCache(model.config)))")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The per-layer attention modules of ``model`` (modules carrying a ``layer_idx``, whose class is an attention)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]


def check_model(model: nn.Module) -> None:
    """:func:`check_supported` on ``model.config`` plus what the modules must offer: an attention module per layer
    with ``layer_idx`` and ``head_dim`` (GPT-NeoX's has ``head_size``)."""
    config = getattr(model, "config", None)
    check_supported(config, paged=False)  # what the config says first: it names the kind of layer refused
    latent = latent_widths(text_config(config)) is not None
    for module in attention_modules(model):
        if latent:  # MLA modules have no head_dim: their parts are checked by name
            if not all(hasattr(module, name) for name in ("kv_b_proj", "qk_nope_head_dim")):
                _refuse(f"{type(module).__name__} (layer {module.layer_idx}) has no kv_b_proj / qk_nope_head_dim, "
                        "which MLA's absorbed attention reads", GATHERED)
            continue
        if not isinstance(getattr(module, "head_dim", None), int):
            _refuse(f"{type(module).__name__} (layer {module.layer_idx}) has no head_dim attribute", GATHERED)
    _check_mixers(model)
    check_supported(config)


def _check_mixers(model: nn.Module) -> None:
    """Layers whose token mixer keeps a state (Mamba, gated delta nets, short convolutions, ...) where the config's
    cache layer types do not say so (hybrids that describe their layers another way, whose states transformers' own
    cache would not keep either). Layers the geometry knows as state layers keep theirs in the state store."""
    layers = getattr(base_decoder(model), "layers", None)
    state_layers = set(kv_geometry(getattr(model, "config", None)).state_layers)
    for idx, layer in enumerate(layers if isinstance(layers, nn.ModuleList) else []):
        if idx in state_layers:
            continue
        for sub in layer.modules():
            name = type(sub).__name__
            if any(word in name for word in STATE_MIXERS):
                _refuse(f"layer {idx} mixes tokens with {name}, which keeps a recurrent / convolution state, not "
                        "K/V: hybrid and state-space models are not paged yet", DYNAMIC)
