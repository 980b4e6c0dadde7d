"""A prompt cache on disk: a :class:`~hf_paged.PagedCache`'s rows in one safetensors file.

The file holds, per layer, the K/V of every row's tokens back to back (``k.{layer}``/``v.{layer}``
``[total_tokens, num_kv_heads, head_dim]`` in the pool's storage dtype, plus, for fp8 pools, each token's scales
``k_scale.{layer}``/``v_scale.{layer}`` ``[total_tokens, num_kv_heads]`` bfloat16), the rows' token ids and lengths,
and metadata describing the model it fits (model type, layer count, each layer's KV heads, head size and dtype) and,
from format 2 on, a digest of all of it. Formats 1 and 2 held one float32 scale per layer and KV head
(``[num_kv_heads]``); they still load, that scale (rounded to bfloat16) going to every token's slot. Format 4 (caches
of hybrid models) adds each live row's states (``state.{kind}.{layer}.{state_idx}`` ``[num_live, *shape]``, ``kind``
conv or recurrent, in the dtype the model wrote), their shapes (metadata ``states``) and the states the rows hold
(``states_written``). Any format may carry ``weights``: the fingerprint (``hf_paged.weights``, 32 hex digits) of the
weights that computed the K/V; loading against a model whose fingerprint differs is refused by name (with
``model=``, at load; else at the first ``generate()`` on the loaded cache), and a trusted file's blocks are published
under it, so only the same weights find them.

A cache file is untrusted input: loading runs in two parts.

(a) :func:`read_cache_file` parses and checks everything the file says (every metadata field's type and range, every
    tensor's dtype and shape against the metadata and each other) into a :class:`CacheFile`, reading only the header
    and the small index tensors; :func:`check_fits` checks it against the model and the pool; :meth:`CacheFile.verify`
    reads the K/V once, layer by layer, for the digest and for NaN / inf. Any failure is a :class:`CacheFileError`
    with nothing bound, sized or allocated in the pool.
(b) :func:`_build` then writes the rows into the pool. Unless the caller says the file is trusted, the loaded blocks
    are never keyed for prefix caching: they serve the loaded rows only (and the rows' later blocks are unkeyed too,
    since a key names the whole prefix before it).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import compat
from .allocator import NULL_BLOCK, cdiv, slot_of
from .errors import CacheFileError
from .ops.reference import FP8_SCALE_DTYPE
from .patches import kv_geometry
from .pool import LayerShape
from .rows import Rows

FORMAT = "hf_paged.cache/3"
STATE_FORMAT = "hf_paged.cache/4"  # format 3 plus the rows' states (models with state layers)
FORMATS = ("hf_paged.cache/1", "hf_paged.cache/2", FORMAT, STATE_FORMAT)  # 1: no digest; 1, 2: fp8 scales per
# layer and KV head
_NO_DIGEST = "hf_paged.cache/1"
_HEAD_SCALES = ("hf_paged.cache/1", "hf_paged.cache/2")
MAX_HEADER_BYTES = 4 << 20  # a real header takes ~200 bytes a layer
MAX_HEADS_OR_DIM = 1 << 16

LAYER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
KV_DTYPES = {"": None, "float8_e4m3fn": torch.float8_e4m3fn}
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.uint8: "U8", torch.int64: "I64"}  # safetensors' dtype names
FINGERPRINT_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim")
METADATA_KEYS = {"format", "model", "layers", "kv_dtype", "columns", "rows", "release_finished"}
STATE_KEYS = {"states", "states_written"}  # format 4's further metadata
OPTIONAL_KEYS = {"weights"}  # any format: the weights fingerprint of the rows' K/V
STATE_DTYPES = {**LAYER_DTYPES}
MAX_STATE_DIMS = 6
_INT = re.compile(r"0|[1-9][0-9]{0,17}")


def _fingerprint(config) -> dict:
    # None for what a heterogeneous config keeps per layer: each layer's shape is checked against the file instead
    return {key: compat.global_config_value(config, key) for key in FINGERPRINT_KEYS}


def _row_slots(table: list[int], block_size: int, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return slot_of(torch.tensor(table, dtype=torch.long)[pos // block_size], pos, block_size)  # [length]


def _slots(exports, group: int, block_size: int) -> torch.Tensor:
    """The slots of every live row's tokens in layer group ``group``, rows back to back."""
    live = [e for e in exports if not e.released]
    if not live:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([_row_slots(e.tables[group], block_size, e.length) for e in live])


def _digest(metadata: dict, named_tensors) -> str:
    """blake2b over the metadata (but the digest) and every tensor's name, dtype, shape and bytes, by name."""
    h = hashlib.blake2b(digest_size=32)
    h.update(json.dumps(sorted((k, v) for k, v in metadata.items() if k != "digest")).encode())
    for name, t in named_tensors:
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------------------- save
def save_cache(cache, path) -> None:
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
            for name, t in zip(("k_scale", "v_scale"), pool.layer_scales(layer)):  # fp8: each token's [n, Hkv]
                if t is not None:
                    flat = t.view(-1, t.shape[2])
                    tensors[f"{name}.{layer}"] = flat.index_select(0, slots.to(t.device)).cpu().contiguous()
            s = pool.layer_shapes[layer]
            shapes[layer] = [s.num_kv_heads, s.head_dim, str(s.dtype).removeprefix("torch.")]
            if s.value_dim is not None:  # MLA: the value tensor (rotated key) is narrower than the key (latent)
                shapes[layer].append(s.value_dim)
    states = {}
    if cache.state_layers:
        store = pool.states
        cells = [cache.rows[r].state for r, _ in live]  # the live rows' state cells
        for (kind, layer, idx), t in sorted(store.tensors.items()):
            name = f"state.{kind}.{layer}.{idx}"
            tensors[name] = t.index_select(0, torch.tensor(cells, dtype=torch.long, device=t.device)).cpu().contiguous()
            states[name] = [list(t.shape[1:]), str(t.dtype).removeprefix("torch.")]
    metadata = {
        "format": STATE_FORMAT if cache.state_layers else FORMAT,
        "model": json.dumps(_fingerprint(cache.config)),
        "layers": json.dumps(shapes),
        "kv_dtype": str(pool.kv_dtype).removeprefix("torch.") if pool.kv_dtype is not None else "",
        "columns": str(cache.columns),
        "rows": str(len(exports)),
        "release_finished": str(cache.release_finished),
    }
    if cache.state_layers:
        metadata["states"] = json.dumps(states)
        metadata["states_written"] = json.dumps(sorted(list(k) for k in cache.states_written))
    roots = {cache.rows[r].root for r, _ in live} - {b""}
    if len(roots) == 1:
        metadata["weights"] = roots.pop().hex()
    metadata["digest"] = _digest(metadata, sorted(tensors.items()))
    tmp = f"{os.fspath(path)}.tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- (a) read and check the file
@dataclasses.dataclass(frozen=True)
class LayerSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's dtype for this layer (fp8 pools store uint8 bits, see CacheFile.kv_dtype)
    value_dim: int | None = None  # the value tensor's width where it differs from head_dim (MLA)


@dataclasses.dataclass
class CacheFile:
    """A cache file whose header and index tensors passed every check; K/V are read on demand.

    ``lens``: tokens per live row (``[num_live]``); ``released``: sorted released row indices; ``tokens``: the live
    rows' token ids back to back (``[sum(lens)]``), or ``None`` (the rows were fed embeddings).
    """

    path: str
    format: str
    model: dict
    layers: dict[int, LayerSpec]
    kv_dtype: torch.dtype | None
    rows: int
    columns: int
    release_finished: bool
    lens: list[int]
    released: list[int]
    tokens: torch.Tensor | None
    digest: str | None
    _file: object = dataclasses.field(repr=False)
    _metadata: dict = dataclasses.field(repr=False)
    states: dict = dataclasses.field(default_factory=dict)  # (kind, layer, state_idx) -> (shape, dtype)
    states_written: set = dataclasses.field(default_factory=set)  # (layer, state_idx)

    @property
    def weights(self) -> bytes:
        """The fingerprint of the weights that computed the K/V (``b""``: not recorded)."""
        return bytes.fromhex(self._metadata.get("weights", ""))

    def state(self, key) -> torch.Tensor:
        """The live rows' state ``key`` = ``(kind, layer, state_idx)``: ``[num_live, *shape]``."""
        return self._file.get_tensor("state.{}.{}.{}".format(*key))

    @property
    def live(self) -> list[int]:
        released = set(self.released)
        return [r for r in range(self.rows) if r not in released]

    @property
    def total_tokens(self) -> int:
        return sum(self.lens)

    def row_tokens(self) -> list[list[int]] | None:
        if self.tokens is None:
            return None
        return [chunk.tolist() for chunk in torch.split(self.tokens, self.lens)] if self.lens else []

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V ``[total_tokens, num_kv_heads, head_dim]`` (uint8 bits on fp8 pools)."""
        return self._file.get_tensor(f"k.{layer}"), self._file.get_tensor(f"v.{layer}")

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 files: layer ``layer``'s ``(k_scale, v_scale)`` ``[total_tokens, num_kv_heads]`` bfloat16, one per token
        and KV head (formats 1 and 2: the layer's one scale per KV head, rounded to bfloat16, for every token)."""
        out = []
        for name in (f"k_scale.{layer}", f"v_scale.{layer}"):
            t = self._file.get_tensor(name)
            if self.format in _HEAD_SCALES:  # [Hkv] float32 -> [total_tokens, Hkv]
                t = t.to(FP8_SCALE_DTYPE)[None].expand(self.total_tokens, -1).contiguous()
            out.append(t)
        return out[0], out[1]

    def verify(self) -> None:
        """Read every tensor once (one at a time): K/V and scales finite, fp8 scales > 0, the digest (format 2)."""
        names = sorted(self._file.keys())
        if self.digest is not None:
            digest = _digest(self._metadata, ((name, self._read_checked(name)) for name in names))
            if digest != self.digest:
                raise CacheFileError(self.path, "digest", "the tensors or metadata do not match the file's digest "
                                     "(the file was corrupted or edited after it was saved)")
        else:
            for name in names:
                self._read_checked(name)

    def _read_checked(self, name: str) -> torch.Tensor:
        t = self._file.get_tensor(name)
        if name.startswith(("k.", "v.", "state.")) and t.numel():
            if self.kv_dtype is not None:
                finite = int((t & 0x7F).max()) != 0x7F  # e4m3fn's only non-finite values: NaN, bits S.1111.111
            else:
                finite = all(math.isfinite(x) for x in torch.aminmax(t))  # NaN and inf reach the min or max
            if not finite:
                raise CacheFileError(self.path, name, "holds NaN or infinite values")
        elif name.startswith(("k_scale.", "v_scale.")) and t.numel():
            # finite and > 0, and so is the largest value they give (448 * scale); a NaN fails every comparison
            wide = t.to(torch.float32)
            good = (wide > 0) & torch.isfinite(wide * 448.0)
            if not bool(good.all()):
                bad = wide[~good][:5].tolist()
                raise CacheFileError(self.path, name, f"fp8 scales must be finite and > 0 (with 448 * scale "
                                     f"finite), got {bad}")
        return t


def read_cache_file(path, opened) -> CacheFile:
    """Check ``path``'s header, metadata and index tensors (``opened``: its ``safe_open`` handle) into a CacheFile."""
    path = os.fspath(path)
    metadata = opened.metadata() or {}
    fmt = metadata.get("format")
    if fmt not in FORMATS:
        raise CacheFileError(path, "format", f"{fmt!r} is not one of {FORMATS}; write the file with cache.save(path)")
    expected = METADATA_KEYS | ({"digest"} if fmt != _NO_DIGEST else set()) | (STATE_KEYS if fmt == STATE_FORMAT
                                                                               else set())
    if set(metadata) - OPTIONAL_KEYS != expected:
        raise CacheFileError(path, "metadata", f"fields {sorted(metadata)}, expected {sorted(expected)}")
    weights = metadata.get("weights")
    if weights is not None and not re.fullmatch(r"[0-9a-f]{32}", weights):
        raise CacheFileError(path, "weights", f"{weights[:80]!r} is not a 32-digit hex fingerprint")
    if fmt != _NO_DIGEST and not re.fullmatch(r"[0-9a-f]{64}", metadata["digest"]):
        raise CacheFileError(path, "digest", f"{metadata['digest'][:80]!r} is not a 64-digit hex digest")

    model = _json(path, metadata, "model")
    if not isinstance(model, dict) or set(model) != set(FINGERPRINT_KEYS):
        raise CacheFileError(path, "model", f"expected a mapping with keys {list(FINGERPRINT_KEYS)}")
    for key, value in model.items():
        if not (value is None or isinstance(value, str) and len(value) < 256
                or type(value) is int and 0 < value < 1 << 40):
            raise CacheFileError(path, "model", f"{key} = {value!r} is not a name or a positive int")
    layers = _parse_layers(path, _json(path, metadata, "layers"))
    if metadata["kv_dtype"] not in KV_DTYPES:
        raise CacheFileError(path, "kv_dtype", f"{metadata['kv_dtype'][:80]!r} is not one of {list(KV_DTYPES)}")
    kv_dtype = KV_DTYPES[metadata["kv_dtype"]]
    rows, columns = _int(path, metadata, "rows"), _int(path, metadata, "columns")
    if metadata["release_finished"] not in ("True", "False"):
        raise CacheFileError(path, "release_finished", f"{metadata['release_finished'][:80]!r} is not True or False")

    states, states_written = ({}, set()) if fmt != STATE_FORMAT else _parse_states(path, metadata)
    index = {"lens", "released"}
    names = set(opened.keys())
    wanted = index | {f"{kv}.{layer}" for layer in layers for kv in ("k", "v")}
    wanted |= {"state.{}.{}.{}".format(*key) for key in states}
    if kv_dtype is not None:
        wanted |= {f"{kv}_scale.{layer}" for layer in layers for kv in ("k", "v")}
    if names - wanted - {"tokens"} or wanted - names:
        raise CacheFileError(path, "tensors", f"missing {sorted(wanted - names)}, unexpected "
                             f"{sorted(names - wanted - {'tokens'})} (for the layers and kv_dtype of the metadata)")
    for name in sorted(index | ({"tokens"} & names)):
        _check_header(path, opened, name, "I64", [None])
    num_live = opened.get_slice("lens").get_shape()[0]
    num_released = opened.get_slice("released").get_shape()[0]
    if rows != num_live + num_released:
        raise CacheFileError(path, "rows", f"{rows} rows, but the file holds {num_live} live and {num_released} "
                             "released ones")
    lens_t = opened.get_tensor("lens")  # [num_live], at most the file's size
    released_t = opened.get_tensor("released")  # [num_released]
    lens = lens_t.tolist()
    if any(n < 0 for n in lens):
        raise CacheFileError(path, "lens", f"a row has {min(lens)} tokens")
    total_tokens = sum(lens)
    if total_tokens and not layers:
        raise CacheFileError(path, "layers", f"no layer holds the {total_tokens} tokens of the rows")
    held = {}  # tokens each K/V tensor holds
    for layer, spec in layers.items():
        code = "U8" if kv_dtype is not None else _CODES[spec.dtype]
        for kv in ("k", "v"):
            width = spec.value_dim if kv == "v" and spec.value_dim is not None else spec.head_dim
            held[f"{kv}.{layer}"] = _check_header(path, opened, f"{kv}.{layer}", code,
                                                  [None, spec.num_kv_heads, width])[0]
            if kv_dtype is not None and fmt in _HEAD_SCALES:
                _check_header(path, opened, f"{kv}_scale.{layer}", "F32", [spec.num_kv_heads])
            elif kv_dtype is not None:  # one scale per token and KV head: as many tokens as the K/V
                held[f"{kv}_scale.{layer}"] = _check_header(path, opened, f"{kv}_scale.{layer}", "BF16",
                                                            [None, spec.num_kv_heads])[0]
    if held:
        count = collections.Counter(held.values()).most_common(1)[0][0]
        for name, n in held.items():
            if n != count:
                raise CacheFileError(path, name, f"holds {n} tokens but the other K/V tensors hold {count}")
        if count != total_tokens:
            raise CacheFileError(path, "lens", f"the rows' lengths add up to {total_tokens} tokens but the K/V "
                                 f"hold {count}")
    if columns < max(lens, default=0):
        raise CacheFileError(path, "columns", f"{columns} columns, fewer than the longest row ({max(lens)} tokens)")
    for key, (shape, dtype) in states.items():
        _check_header(path, opened, "state.{}.{}.{}".format(*key), _CODES[dtype], [num_live, *shape])
    released = released_t.tolist()
    if released != sorted(set(released)) or any(not 0 <= r < rows for r in released):
        raise CacheFileError(path, "released", f"{released[:20]} are not distinct, sorted rows in [0, {rows})")
    tokens = None
    if "tokens" in names:
        _check_header(path, opened, "tokens", "I64", [total_tokens])
        tokens = opened.get_tensor("tokens")  # [sum(lens)]
        if total_tokens and int(tokens.min()) < 0:
            raise CacheFileError(path, "tokens", f"token id {int(tokens.min())} is negative")
    return CacheFile(path, fmt, model, layers, kv_dtype, rows, columns, metadata["release_finished"] == "True", lens,
                     released, tokens, metadata.get("digest"), opened, metadata, states, states_written)


def _parse_states(path: str, metadata: dict) -> tuple[dict, set]:
    """Format 4's ``states`` (name -> [shape, dtype]) and ``states_written`` ([[layer, state_idx], ...])."""
    raw = _json(path, metadata, "states")
    if not isinstance(raw, dict):
        raise CacheFileError(path, "states", "expected a mapping of state.{kind}.{layer}.{state_idx} to [shape, dtype]")
    states = {}
    for name, value in raw.items():
        parts = name.split(".") if isinstance(name, str) else []
        if not (len(parts) == 4 and parts[0] == "state" and parts[1] in ("conv", "recurrent")
                and all(_INT.fullmatch(p) and int(p) < 1 << 20 for p in parts[2:])):
            raise CacheFileError(path, "states", f"{str(name)[:80]!r} is not state.{{conv|recurrent}}.{{layer}}."
                                 "{state_idx}")
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], list)
                and 0 < len(value[0]) <= MAX_STATE_DIMS
                and all(type(d) is int and 0 < d <= MAX_HEADS_OR_DIM for d in value[0])
                and isinstance(value[1], str) and value[1] in STATE_DTYPES):
            raise CacheFileError(path, "states", f"{name}: {str(value)[:80]} is not [shape, dtype] with up to "
                                 f"{MAX_STATE_DIMS} positive sizes up to {MAX_HEADS_OR_DIM} and a dtype in "
                                 f"{list(STATE_DTYPES)}")
        states[(parts[1], int(parts[2]), int(parts[3]))] = (value[0], STATE_DTYPES[value[1]])
    written = _json(path, metadata, "states_written")
    if not (isinstance(written, list) and all(isinstance(w, list) and len(w) == 2 and all(
            type(v) is int and 0 <= v < 1 << 20 for v in w) for w in written)):
        raise CacheFileError(path, "states_written", "expected a list of [layer, state_idx]")
    written = {tuple(w) for w in written}
    conv = {(layer, idx) for kind, layer, idx in states if kind == "conv"}
    if written != conv:
        raise CacheFileError(path, "states_written", f"{sorted(written)} but the file holds the conv states of "
                             f"{sorted(conv)}")
    return dict(sorted(states.items())), written


def _json(path: str, metadata: dict, field: str):
    try:
        return json.loads(metadata[field])
    except (ValueError, RecursionError):
        raise CacheFileError(path, field, f"{metadata[field][:80]!r}... is not valid JSON") from None


def _int(path: str, metadata: dict, field: str) -> int:
    value = metadata[field]
    if not _INT.fullmatch(value):
        raise CacheFileError(path, field, f"{value[:80]!r} is not a non-negative integer")
    return int(value)


def _parse_layers(path: str, layers) -> dict[int, LayerSpec]:
    if not isinstance(layers, dict):
        raise CacheFileError(path, "layers", "expected a mapping of layer index to [num_kv_heads, head_dim, dtype]")
    specs = {}
    for key, value in layers.items():
        if not _INT.fullmatch(key) or int(key) >= 1 << 20:
            raise CacheFileError(path, "layers", f"layer {key[:80]!r} is not a layer index")
        if not (isinstance(value, list) and len(value) in (3, 4)  # 4: [..., value width] (MLA)
                and all(type(v) is int and 0 < v <= MAX_HEADS_OR_DIM for v in value[:2] + value[3:])
                and isinstance(value[2], str) and value[2] in LAYER_DTYPES):
            raise CacheFileError(path, "layers", f"layer {key}: {str(value)[:80]} is not [num_kv_heads, head_dim, "
                                 f"dtype] with positive sizes up to {MAX_HEADS_OR_DIM} and a dtype in "
                                 f"{list(LAYER_DTYPES)}")
        specs[int(key)] = LayerSpec(value[0], value[1], LAYER_DTYPES[value[2]], *value[3:])
    return dict(sorted(specs.items()))


def _check_header(path: str, opened, name: str, dtype: str, shape: list) -> list[int]:
    """``name``'s dtype and shape from the header, without reading the tensor (``None`` in ``shape``: any size)."""
    view = opened.get_slice(name)
    got_dtype, got_shape = view.get_dtype(), list(view.get_shape())
    if got_dtype != dtype or len(got_shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(got_shape, shape)):
        want = "[" + ", ".join("n" if d is None else str(d) for d in shape) + "]"
        raise CacheFileError(path, name, f"{got_dtype} {got_shape}, expected {dtype} {want}")
    return got_shape


def open_cache_file(path):
    """``safe_open`` of ``path`` after checking its header size; ``CacheFileError`` if safetensors refuses it."""
    path = os.fspath(path)
    size = os.path.getsize(path)  # FileNotFoundError as it is
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise CacheFileError(path, "header", f"the file has {size} bytes: it was truncated, or is not a cache file")
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        raise CacheFileError(path, "header", f"declares {header_bytes} header bytes in a file of {size} (at most "
                             f"{MAX_HEADER_BYTES}): it was truncated, or is not a cache file")
    try:
        return safe_open(path, framework="pt")
    except Exception as err:
        raise CacheFileError(path, "header", f"safetensors cannot read it ({err}): the file was truncated, or "
                             "written by something else") from None


# ------------------------------------------------------------------------------------- the file against model, pool
def check_fits(cf: CacheFile, cache, device) -> None:
    """``CacheFileError`` unless ``cf``'s rows fit ``cache``'s model and pool; reads nothing, changes nothing."""
    path, config, pool = cf.path, cache.config, cache.pool
    mine = _fingerprint(config)
    wrong = {k: (v, mine[k]) for k, v in cf.model.items() if v is not None and mine[k] is not None and v != mine[k]}
    if wrong:
        detail = ", ".join(f"{k} {v[0]} in the file vs {v[1]}" for k, v in wrong.items())
        raise CacheFileError(path, "model", f"a cache of another model ({detail})",
                             "Load it with that model's config.")
    pool_kv = str(pool.kv_dtype).removeprefix("torch.") if pool.kv_dtype is not None else None
    if cf.kv_dtype != pool.kv_dtype:
        raise CacheFileError(path, "kv_dtype", f"KV blocks of dtype {cf.kv_dtype or 'model dtype'} but the pool "
                             f"stores {pool_kv or 'the model dtype'}",
                             f"Load it into a pool with kv_dtype={cf.kv_dtype}.")
    num_layers = cache.num_layers
    if num_layers is not None:
        if any(layer >= num_layers for layer in cf.layers):
            raise CacheFileError(path, "layers", f"layer {max(cf.layers)} in a model of {num_layers} layers")
        groups = cache.groups.layer_group
        # every layer keeping K/V in the pool (not the KV-shared ones, which read their source's)
        paged = [i for i in range(num_layers) if len(groups) != num_layers or groups[i] >= 0]
        if cf.total_tokens and sorted(cf.layers) != paged:
            raise CacheFileError(path, "layers", f"K/V for layers {sorted(cf.layers)} of a model of {num_layers}")
    shapes = _model_kv_shapes(config)
    model_dtype = compat.config_dtype(config)
    for layer, spec in cf.layers.items():
        heads, head_dim = shapes.get(layer, (None, None))
        if heads is not None and (spec.num_kv_heads, spec.head_dim) != (heads, head_dim):
            raise CacheFileError(path, "layers", f"layer {layer} holds {spec.num_kv_heads} KV heads x "
                                 f"{spec.head_dim} but the model has {heads} x {head_dim}",
                                 "Load it with that model's config.")
        if model_dtype is not None and model_dtype != spec.dtype:
            raise CacheFileError(path, "layers", f"K/V in {spec.dtype} but the model's config says {model_dtype}",
                                 f"Load the model in {spec.dtype} or save the cache again from a model in "
                                 f"{model_dtype}.")
        known = pool.layer_shapes.get(layer)
        if known is not None:
            if (known.num_kv_heads, known.head_dim, known.value_dim, known.dtype) != (
                    spec.num_kv_heads, spec.head_dim, spec.value_dim, spec.dtype):
                raise CacheFileError(path, "layers", f"layer {layer} holds {spec.num_kv_heads} KV heads x "
                                     f"{spec.head_dim} ({spec.dtype}) but the pool's holds {known.num_kv_heads} x "
                                     f"{known.head_dim} ({known.dtype})", "Load it into a pool of its own.")
            if device is not None and not _same_device(torch.device(device), known.device):
                raise CacheFileError(path, "layers", f"device={device} but the pool keeps layer {layer} on "
                                     f"{known.device}", "Leave device= out to load onto the pool's devices.")
    _check_states(cf, cache)
    vocab = getattr(config, "vocab_size", None)
    if cf.tokens is not None and cf.total_tokens and isinstance(vocab, int) and int(cf.tokens.max()) >= vocab:
        raise CacheFileError(path, "tokens", f"token id {int(cf.tokens.max())} is past the vocabulary of {vocab}")
    max_positions = getattr(config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and cf.columns > max_positions:
        raise CacheFileError(path, "columns", f"{cf.columns} columns, past the model's max_position_embeddings "
                             f"({max_positions})")
    _check_room(cf, cache)


def check_weights(cf: CacheFile, root: bytes) -> None:
    """``CacheFileError`` when ``cf`` names the weights that computed its K/V and they are not the ones whose
    fingerprint is ``root``."""
    if cf.weights and cf.weights != root:
        raise CacheFileError(cf.path, "weights", f"K/V computed with other weights (fingerprint {cf.weights.hex()}) "
                             f"than the model's (fingerprint {root.hex()})",
                             "Load it with the weights that saved it (the same checkpoint, adapters merged or not "
                             "alike), or compute the prompt again with these weights and save that.")


def _check_states(cf: CacheFile, cache) -> None:
    """The file's states against the model's state layers and the states its pool's store already holds."""
    path, state_layers = cf.path, cache.state_layers
    if state_layers and cf.live and not cf.states:
        raise CacheFileError(path, "format", f"{cf.format} holds no states, but the model keeps states in layers "
                             f"{sorted(state_layers)}", "Save the cache again with this hf_paged.")
    for kind, layer, idx in cf.states:
        if layer not in state_layers:
            raise CacheFileError(path, "states", f"a {kind} state of layer {layer}, which keeps no state in this "
                                 f"model (its state layers: {sorted(state_layers)})",
                                 "Load it with that model's config.")
        known = cache.pool.states.get(kind, layer, idx)
        shape, dtype = cf.states[(kind, layer, idx)]
        if known is not None and (list(known.shape[1:]), known.dtype) != (shape, dtype):
            raise CacheFileError(path, "states", f"the {kind} state of layer {layer} is {shape} {dtype} but the "
                                 f"pool's is {list(known.shape[1:])} {known.dtype}", "Load it into a pool of its own.")


def _model_kv_shapes(config) -> dict[int, tuple[int, int]]:
    """Per paged layer of ``config``, the KV heads (this rank's share under tensor parallelism) and key head size
    it writes (``hf_paged.patches.kv_geometry``); empty where the config does not say."""
    try:
        geometry = kv_geometry(config)
    except (AttributeError, TypeError, ValueError):
        return {}
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    return {i: (layer.num_kv_heads // world if layer.num_kv_heads % world == 0 else layer.num_kv_heads,
                layer.key_dim)
            for i, layer in enumerate(geometry.layers) if layer.paged and layer.num_kv_heads and layer.key_dim}


def _same_device(asked: torch.device, known: torch.device) -> bool:
    return asked.type == known.type and (asked.index is None or asked.index == (known.index or 0))


def _check_room(cf: CacheFile, cache) -> None:
    """Blocks the rows need against what a capped pool has free (sized from ``max_memory`` if not yet)."""
    pool, a, groups = cache.pool, cache.pool.allocator, cache.groups
    needed = sum(cdiv(n, a.block_size) for n in cf.lens) * groups.num_groups
    if a.max_blocks is not None:
        free = a.num_free
    elif pool.max_memory is not None and cf.layers:
        spec = next(iter(cf.layers.values()))  # the first layer bound sizes the pool, as on a forward
        if groups.tensor_shapes:  # the config's shapes per K/V tensor, as a forward sizes it
            per_block = pool.block_id_bytes([shape for _, shape in groups.tensor_shapes], spec.dtype)
        else:
            tensors = groups.group_size if groups.layer_tensor else (cache.num_layers or len(cf.layers))
            per_block = tensors * pool.block_bytes(LayerShape(spec.num_kv_heads, spec.head_dim, spec.dtype,
                                                              torch.device("cpu"), spec.value_dim))
        free = max(0, pool.max_memory // per_block - 1)
    else:
        return  # a growing pool: the rows hold what the file's tensors hold
    if needed > free:
        raise CacheFileError(cf.path, "lens", f"the rows need {needed} blocks of {a.block_size} tokens but the pool "
                             f"has {free} free", "Load it into a larger pool (num_blocks=, max_memory=) or one with "
                             "fewer blocks in use.")


# ---------------------------------------------------------------------------------------------------------- load
def load_cache(cls, path, config, pool=None, device=None, trusted: bool = False, model=None, **kwargs):
    """See :meth:`PagedCache.load`. Checks the whole file before the pool is touched; ``trusted=False`` (default)
    keeps the loaded blocks out of the pool's prefix cache; ``model``: refuse a file whose K/V other weights
    computed (:func:`check_weights`)."""
    if not isinstance(trusted, bool):
        raise TypeError(f"trusted must be True or False, got {trusted!r}.")
    with open_cache_file(path) as opened:
        cf = read_cache_file(path, opened)
        if "release_finished" not in kwargs:
            kwargs["release_finished"] = cf.release_finished
        cache = cls(config, pool=pool, **kwargs) if pool is not None else cls(config, **kwargs)
        check_fits(cf, cache, device)
        root = cf.weights
        if model is not None:
            root = cache.pool.weights_root(model)
            check_weights(cf, root)
        cf.verify()
        _build(cache, cf, device, trusted, root)
    return cache


# ------------------------------------------------------------------------------------------- (b) build the cache
def _build(cache, cf: CacheFile, device, trusted: bool, root: bytes = b"") -> None:
    """Write ``cf``'s rows into ``cache``'s pool; blocks are keyed for prefix caching only when ``trusted``, under
    ``root`` (the fingerprint of the weights that computed them: a file without one is findable only by ``b""``)."""
    pool, groups = cache.pool, cache.groups
    for layer, spec in cf.layers.items():
        known = pool.layer_shapes.get(layer)
        dev = known.device if known is not None else torch.device(device) if device is not None else torch.device("cpu")
        probe = torch.empty(1, spec.num_kv_heads, 1, spec.head_dim, dtype=spec.dtype, device=dev)  # [B, H, S, D]
        value = None if spec.value_dim is None else probe.new_empty(1, spec.num_kv_heads, 1, spec.value_dim)
        pool.bind_layer(layer, cache.num_layers or len(cf.layers), probe, groups.layer_tensor[layer], groups.group_size,
                        value, tensor_shapes=[shape for _, shape in groups.tensor_shapes])
    live, row_tokens = cf.live, cf.row_tokens()
    lengths, tokens = [0] * cf.rows, [None if row_tokens is None else [] for _ in range(cf.rows)]
    for i, r in enumerate(live):
        lengths[r] = cf.lens[i]
        if row_tokens is not None:
            tokens[r] = row_tokens[i]
    released = set(cf.released)
    rows = Rows(pool, groups, bool(cache.state_layers))
    rows.root = root  # keys (trusted) and names the weights that made them
    # Untrusted: the rows record their tokens but key no block, so no later prompt can start from them.
    rows.import_rows(lengths, tokens, [r in released for r in range(cf.rows)], publish=trusted)
    try:
        with pool.lock:
            pool.ensure_capacity()
            exports = rows.export()
            for layer in cf.layers:
                slots = _slots(exports, groups.layer_group[layer], pool.block_size)
                key_cache, value_cache = pool.layer_kv(layer)
                pairs = list(zip((key_cache, value_cache), cf.kv(layer)))
                if cf.kv_dtype is not None:  # each token's scales go to its slot, beside its fp8 bits
                    pairs += zip(pool.layer_scales(layer), cf.scales(layer))
                for t, saved in pairs:
                    t.view(-1, *t.shape[2:]).index_copy_(0, slots.to(t.device), saved.to(t.device))
            held = [rows[r].state for r in live]
            for (kind, layer, idx), (shape, dtype) in cf.states.items():
                known = pool.states.get(kind, layer, idx)
                dev = known.device if known is not None else torch.device(device) if device is not None else \
                    torch.device("cpu")
                t = pool.states.ensure(kind, layer, idx, tuple(shape), dtype, dev)
                pool.fit_blocks_to_states()
                if held:
                    t[torch.tensor(held, device=t.device)] = cf.state((kind, layer, idx)).to(t.device)
    except BaseException:
        rows.discard()  # never publishes a block whose K/V were not all written
        raise
    cache.restore(rows, cf.columns, cache.release_finished, cf.states_written)
