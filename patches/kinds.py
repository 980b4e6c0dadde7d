"""Each decoder layer's kind and K/V shape, from the config: the :class:`~hf_paged.geometry.KVGeometry` every part of
hf_paged reads (layer groups, pool, sizing, files, engine).

The kinds come from transformers' own cache layer types (``compat.cache_layer_types``: ``layer_types`` and
``get_layer_types_and_kwargs``), the KV-sharing modes (``kv_sharing_modes``: ``"reuse"`` layers read the last
``"store"`` layer of their attention type) and the family's window rule (:func:`~hf_paged.patches.layer_windows`);
the shapes from each layer's own config (``per_layer_config`` on heterogeneous configs such as Gemma 4, whose full
layers have their own head size and KV-head count: ``config.head_dim`` is never read there).
"""

from __future__ import annotations

from hf_paged import compat
from hf_paged.geometry import KVGeometry, LayerKV

from .latent import latent_widths
from .registry import layer_windows
from .windows import layer_config, layer_types, num_layers, text_config

# transformers' cache layer types of layers keeping a fixed-size state rather than K/V
STATE_TYPES = ("conv", "linear_attention", "mamba", "mamba2", "recurrent", "ssm", "linear", "deltanet")
# ... and of layers keeping K/V and a state (Falcon-H1: attention and Mamba2 side by side in one layer)
HYBRID_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
NO_CACHE_TYPES = ("moe", "mlp", "dummy")


def head_sizes(config) -> tuple[int | None, int | None]:
    """``(key head size, value head size)`` of one layer's config (the shared config on homogeneous models)."""
    heads = getattr(config, "num_attention_heads", None)
    default = config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    key = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None) or default
    value = getattr(config, "v_head_dim", None) or getattr(config, "value_head_dim", None) or key
    return key, value


def _layer_shape(config, layer_idx: int) -> tuple[int, int, int]:
    lc = layer_config(config, layer_idx)
    latent = latent_widths(lc)
    if latent is not None:  # MLA: one "head" per token, the latent (key tensor) and the rotated key (value tensor)
        return 1, *latent
    heads = getattr(lc, "num_key_value_heads", None) or getattr(lc, "num_attention_heads", None) or 0
    key, value = head_sizes(lc)
    return int(heads), int(key or 0), int(value or 0)


def _kind(cache_type: str | None, window: int | None) -> str:
    if cache_type == "chunked_attention":
        return "chunked"
    if cache_type in STATE_TYPES:
        return "state"
    if cache_type in NO_CACHE_TYPES:
        return "none"
    if cache_type not in (None, "full_attention", "sliding_attention"):
        return cache_type  # an attention kind this build does not know: check_supported names it
    return "full" if window is None else "sliding"


def kv_geometry(config) -> KVGeometry:
    """The :class:`~hf_paged.geometry.KVGeometry` of a model config (its decoder's).

    Raises ``ValueError`` naming the layer for a layer type hf_paged does not know (see :func:`check_supported`,
    which refuses the kinds it cannot page).

    Example: ``kv_geometry(Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8192)).kinds()``
    -> ``{"chunked": 3, "full": 1}``.
    """
    config = text_config(config)
    count = num_layers(config)
    windows = layer_windows(config)
    types = compat.cache_layer_types(config) if count else None
    declared = layer_types(config)
    modes = list(getattr(config, "kv_sharing_modes", None) or [None] * count)
    stores: dict = {}
    layers = []
    for i in range(count):
        declared_type = declared[i] if declared is not None and i < len(declared) else None
        cache_type = types[i] if types is not None else declared_type
        if modes[i] == "reuse":
            source = stores.get(declared_type)
            layers.append(LayerKV("reuse", source=source))
            continue
        hybrid = cache_type in HYBRID_TYPES
        kind = _kind(HYBRID_TYPES.get(cache_type, cache_type), windows[i])
        if kind in ("state", "none"):
            layers.append(LayerKV(kind))
            continue
        if kind not in ("full", "sliding", "chunked"):
            raise ValueError(f"layer {i} is a {cache_type!r} layer, a kind hf_paged does not know (it pages "
                             "'full_attention', 'sliding_attention' and 'chunked_attention' layers). Fix: use "
                             "transformers' DynamicCache for this model.")
        heads, key, value = _layer_shape(config, i)
        chunk = getattr(layer_config(config, i), "attention_chunk_size", None) if kind == "chunked" else None
        layers.append(LayerKV(kind, window=windows[i] if kind == "sliding" else None,
                              chunk=int(chunk) if chunk is not None else None,
                              num_kv_heads=heads, key_dim=key, value_dim=value, state=hybrid))
        stores[declared_type] = i
    return KVGeometry(tuple(layers))
