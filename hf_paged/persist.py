"""A prompt cache on disk: a :class:`~hf_paged.PagedCache`'s rows in one safetensors file.

The file holds, per layer, the K/V of every row's tokens back to back (``k.{layer}``/``v.{layer}``
``[total_tokens, num_kv_heads, head_dim]`` in the pool's storage dtype, plus ``k_scale.{layer}``/``v_scale.{layer}``
for fp8 pools), the rows' token ids and lengths, and metadata describing the model it fits (model type, layer
count, each layer's KV heads, head size and dtype). Loading writes the rows into any pool serving that shape.
"""

from __future__ import annotations

import json
import os

import torch

from . import compat
from .allocator import NULL_BLOCK
from .rows import Rows

FORMAT = "hf_paged.cache/1"


def _fingerprint(config) -> dict:
    return {
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "head_dim": getattr(config, "head_dim", None),
    }


def _row_slots(table: list[int], block_size: int, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size  # [length]


def _slots(exports, group: int, block_size: int) -> torch.Tensor:
    live = [e for e in exports if not e.released]
    if not live:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([_row_slots(e.tables[group], block_size, e.length) for e in live])


def save_cache(cache, path) -> None:
    from safetensors.torch import save_file

    pool = cache.pool
    with pool.lock:
        exports = cache.rows.export()
        live = [(r, e) for r, e in enumerate(exports) if not e.released]
        for r, e in live:
            if any(NULL_BLOCK in table for table in e.tables):
                raise ValueError(
                    f"row {r} no longer holds its whole history (blocks left the sliding window and were given "
                    "back), so it cannot be saved. Save before the context outgrows the window, or keep every "
                    "block with cache.activate_past_recording() before generating.")
        tensors = {"lens": torch.tensor([e.length for _, e in live], dtype=torch.long),
                   "released": torch.tensor([r for r, e in enumerate(exports) if e.released], dtype=torch.long)}
        if all(e.tokens is not None for _, e in live):
            tensors["tokens"] = torch.tensor([t for _, e in live for t in e.tokens], dtype=torch.long)
        shapes = {}
        for layer in sorted(pool.layer_shapes):
            slots = _slots(exports, cache.groups.layer_group[layer], pool.block_size)
            key_cache, value_cache = pool.layer_kv(layer)
            for name, t in (("k", key_cache), ("v", value_cache)):
                flat = t.view(-1, *t.shape[2:])
                tensors[f"{name}.{layer}"] = flat.index_select(0, slots.to(t.device)).cpu().contiguous()
            if pool.kv_dtype is not None:
                tensors[f"k_scale.{layer}"] = pool.k_scales[layer].cpu()
                tensors[f"v_scale.{layer}"] = pool.v_scales[layer].cpu()
            s = pool.layer_shapes[layer]
            shapes[layer] = [s.num_kv_heads, s.head_dim, str(s.dtype).removeprefix("torch.")]
    metadata = {
        "format": FORMAT,
        "model": json.dumps(_fingerprint(cache.config)),
        "layers": json.dumps(shapes),
        "kv_dtype": str(pool.kv_dtype).removeprefix("torch.") if pool.kv_dtype is not None else "",
        "columns": str(cache.columns),
        "rows": str(len(exports)),
        "release_finished": str(cache.release_finished),
    }
    tmp = f"{os.fspath(path)}.tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def _read(path):
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as err:
        raise ValueError(f"{path} is not a complete hf_paged cache file ({err}). Was it truncated or written by "
                         "something else? Save it again with cache.save(path).") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not an hf_paged cache file (format {metadata.get('format')!r}, expected "
                         f"{FORMAT!r}); write one with cache.save(path).")
    return metadata, tensors


def load_cache(cls, path, config, pool=None, device=None, **kwargs):
    metadata, tensors = _read(path)
    cache = cls(config, pool=pool, **kwargs) if pool is not None else cls(config, **kwargs)
    saved_model = json.loads(metadata["model"])
    mine = _fingerprint(cache.config)
    wrong = {k: (v, mine[k]) for k, v in saved_model.items() if v is not None and mine[k] is not None and v != mine[k]}
    if wrong:
        detail = ", ".join(f"{k} {v[0]} in the file vs {v[1]}" for k, v in wrong.items())
        raise ValueError(f"{path} holds a cache of another model ({detail}); load it with that model's config.")
    pool = cache.pool
    kv_dtype = metadata["kv_dtype"] or None
    if kv_dtype != (str(pool.kv_dtype).removeprefix("torch.") if pool.kv_dtype is not None else None):
        raise ValueError(f"{path} holds KV blocks of dtype {kv_dtype or 'model dtype'} but the pool stores "
                         f"{pool.kv_dtype or 'the model dtype'}; load it into a pool with kv_dtype="
                         f"{'torch.' + kv_dtype if kv_dtype else None}.")
    shapes = {int(k): v for k, v in json.loads(metadata["layers"]).items()}
    model_dtype = compat.config_dtype(cache.config)
    for layer, (heads, head_dim, dtype) in shapes.items():
        dtype = getattr(torch, dtype)
        if isinstance(model_dtype, torch.dtype) and model_dtype != dtype:
            raise ValueError(f"{path} holds K/V in {dtype} but the model's config says {model_dtype}; load the model "
                             f"in {dtype} or save the cache again from a model in {model_dtype}.")
        known = pool.layer_shapes.get(layer)
        dev = torch.device(device) if device is not None else (known.device if known is not None else torch.device("cpu"))
        probe = torch.empty(1, heads, 1, head_dim, dtype=dtype, device=dev)
        pool.bind_layer(layer, cache.num_layers or len(shapes), probe, cache.groups.layer_slot[layer],
                        cache.groups.group_size)
    lens = tensors["lens"].tolist()
    released = set(tensors["released"].tolist())
    num_rows = int(metadata["rows"])
    tokens = tensors.get("tokens")
    live = [r for r in range(num_rows) if r not in released]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    live_tokens = [tokens[offsets[i]: offsets[i + 1]].tolist() if tokens is not None else None
                   for i in range(len(live))]
    row_lens, row_tokens = [0] * num_rows, [[] for _ in range(num_rows)]
    for i, r in enumerate(live):
        row_lens[r], row_tokens[r] = lens[i], live_tokens[i]
    rows = Rows(pool, cache.groups)
    rows.import_rows(row_lens, row_tokens, [r in released for r in range(num_rows)], publish=True)
    with pool.lock:
        pool.ensure_capacity()
        exports = rows.export()
        for layer in sorted(shapes):
            slots = _slots(exports, cache.groups.layer_group[layer], pool.block_size)
            key_cache, value_cache = pool.layer_kv(layer)
            if kv_dtype is not None:
                _restore_scales(pool, layer, tensors, key_cache.device)
            for name, t in (("k", key_cache), ("v", value_cache)):
                t.view(-1, *t.shape[2:]).index_copy_(0, slots.to(t.device), tensors[f"{name}.{layer}"].to(t.device))
    cache.restore(rows, int(metadata["columns"]), cache.release_finished)
    return cache


def _restore_scales(pool, layer: int, tensors: dict, device) -> None:
    k_scale, v_scale = tensors[f"k_scale.{layer}"].to(device), tensors[f"v_scale.{layer}"].to(device)
    mine = pool.k_scales.get(layer)
    if mine is None:
        pool.k_scales[layer], pool.v_scales[layer] = k_scale, v_scale
    elif not (torch.equal(mine, k_scale) and torch.equal(pool.v_scales[layer], v_scale)):
        raise ValueError(f"layer {layer} of this fp8 pool already uses other scales than the saved cache; load it "
                         "into a pool of its own (PagedCache.load(path, config)).")
