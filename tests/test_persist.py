"""A prompt cache on disk: ``cache.save(path)`` / ``PagedCache.load(path, config)``.

A cache file is untrusted input. Continuing from a loaded cache gives the tokens continuing from the original gives;
an edited, corrupted or forged file gives a :class:`~hf_paged.CacheFileError` naming the file and the field, with the
pool left as it was, or (forged consistently) a cache that serves its own rows only: a file is published to a
prefix-caching pool only when loaded with ``trusted=True``.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, dynamic, generate, left_padded, ones_mask, tiny_config, tiny_model
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from hf_paged import BlockPool, CacheFileError, PagedCache, enable_paged_attention
from hf_paged.persist import _digest

TESTS_DIR = Path(__file__).resolve().parent
BS = 4
FP8 = torch.float8_e4m3fn
MB = 1 << 20


# --------------------------------------------------------------------------------------------------------- helpers
def read_parts(path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}


def write_parts(path, metadata: dict, tensors: dict, digest: str = "recompute") -> Path:
    """Write a cache file from its parts; ``digest``: "recompute" (as a forger would), "keep" (stale after an edit)."""
    metadata = dict(metadata)
    if digest == "recompute" and "digest" in metadata:
        metadata["digest"] = _digest(metadata, sorted(tensors.items()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return Path(path)


def pool_state(pool) -> tuple:
    """Everything a failed load must leave as it was: sizes, bindings, scales, blocks, sequences, keys."""
    a = pool.allocator
    return (a.capacity, a.max_blocks, a.num_free, a.num_cached, a.blocks_in_use, sorted(a.sequences),
            a.prefix_queries, a.prefix_hits,
            {layer: (s.num_kv_heads, s.head_dim, s.dtype) for layer, s in pool.layer_shapes.items()},
            {slot: t.data_ptr() for slot, t in pool.key_caches.items()}, sorted(pool.k_scale_caches))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rss_growth(fn):
    """``(result or exception, bytes)``: the peak resident set while ``fn`` ran, over the resident set before it
    (Linux: the peak is reset through /proc/self/clear_refs; where that is refused, the resident set after)."""
    before = _status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        peak = "VmHWM"
    except OSError:
        peak = "VmRSS"
    try:
        result = fn()
    except Exception as err:
        result = err
    return result, max(0, _status_kb(peak) - before) * 1024


def shared_pool(**kw) -> BlockPool:
    return BlockPool(block_size=BS, num_blocks=kw.pop("num_blocks", 64), prefix_caching=True, **kw)


def prefix_hits(pool) -> int:
    return pool.memory_stats().prefix_hit_tokens


def cache_state(cache) -> tuple:
    """What a cache holds, bit for bit: its columns, each row's length and each layer's K/V (and fp8 scales) for the
    row's tokens, read through its block tables (the scales are per slot: ``[n, Hkv]``)."""
    pool, bs = cache.pool, cache.pool.block_size
    rows = []
    for table, n in zip(cache.block_tables(), cache.seq_lens()):
        if table is None:
            rows.append(None)
            continue
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)  # [n]
        rows.append([t.view(-1, *t.shape[2:])[slots] for layer in sorted(pool.layer_shapes)
                     for t in (*pool.layer_kv(layer), *pool.layer_scales(layer)) if t is not None])
        # per layer, K and V [n, Hkv, D] (fp8: then their scales [n, Hkv])
    return cache.get_seq_length(), cache.seq_lens(), rows, []


def same_state(a: tuple, b: tuple) -> bool:
    (cols_a, lens_a, rows_a, scales_a), (cols_b, lens_b, rows_b, scales_b) = a, b
    return (cols_a, lens_a) == (cols_b, lens_b) and len(scales_a) == len(scales_b) and all(
        torch.equal(x, y) for x, y in zip(scales_a, scales_b)) and all(
        (ra is None) == (rb is None) and (ra is None or all(torch.equal(x, y) for x, y in zip(ra, rb)))
        for ra, rb in zip(rows_a, rows_b))


# -------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    enable_paged_attention(m, backend="torch")
    return m


class Saved:
    """A saved 3-row cache (prompts of 8, 13 and 6 tokens plus 4 generated ones, blocks of 4), with the tokens that
    continuing it gives and a later one-row request on the same tokens as row 1 (its DynamicCache output)."""

    def __init__(self, model, directory: Path, kv_dtype=None):
        inputs = left_padded([8, 13, 6], seed=3)
        cache = PagedCache(model.config, block_size=BS, kv_dtype=kv_dtype)
        out = generate(model, inputs, cache, max_new_tokens=4)  # [3, 17]
        self.path = directory / f"saved_{kv_dtype is not None}.safetensors"
        cache.save(self.path, model=model)  # names the weights that computed it
        self.more = {"input_ids": torch.cat([out, torch.full((3, 2), 7)], 1),
                     "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(3, 6, dtype=torch.long)], 1)}
        self.expected = generate(model, self.more, copy.deepcopy(cache), max_new_tokens=3)
        self.seq_lens = cache.seq_lens()
        self.state = cache_state(cache)
        self.victim = ones_mask(torch.cat([out[1:2], torch.tensor([[11, 12, 13]])], 1))  # row 1's 17 tokens + 3
        self.victim_expected = generate(model, self.victim, dynamic(model), max_new_tokens=3)
        self.kv_dtype = kv_dtype
        self.metadata, self.tensors = read_parts(self.path)

    def load(self, model, path=None, **kw):
        if self.kv_dtype is not None and "pool" not in kw:
            kw["kv_dtype"] = self.kv_dtype
        return PagedCache.load(path or self.path, model.config, **kw)

    def continues_the_same(self, model, cache, max_new_tokens: int = 3) -> bool:
        out = generate(model, self.more, cache, max_new_tokens=max_new_tokens)
        return torch.equal(out, self.expected[:, : out.shape[1]])

    def victim_unaffected(self, model, pool, max_new_tokens: int = 3) -> bool:
        """A later one-row request on the pool, starting with row 1's tokens, gives DynamicCache's tokens."""
        out = generate(model, self.victim, PagedCache(model.config, pool=pool), max_new_tokens=max_new_tokens)
        return torch.equal(out, self.victim_expected[:, : out.shape[1]])


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    return Saved(model, tmp_path_factory.mktemp("saved"))


@pytest.fixture(scope="module")
def saved_fp8(model, tmp_path_factory):
    return Saved(model, tmp_path_factory.mktemp("saved_fp8"), kv_dtype=FP8)


# ---------------------------------------------------------------------------------------------- round trips
CHILD = """
import sys, json, torch
sys.path.insert(0, {tests!r})
from helpers import generate, tiny_model
from hf_paged import PagedCache, enable_paged_attention
model = tiny_model("llama")
model.generation_config.eos_token_id = None
enable_paged_attention(model, backend="torch")
outs = []
for path, kv_dtype, inputs in json.loads(sys.argv[1]):
    cache = PagedCache.load(path, model.config, kv_dtype=torch.float8_e4m3fn if kv_dtype else None)
    inputs = {{k: torch.tensor(v) for k, v in inputs.items()}}
    outs.append(generate(model, inputs, cache, max_new_tokens=5).tolist())
print(json.dumps(outs))
"""


def test_save_and_load_in_a_fresh_process(tmp_path):
    """Model-dtype and fp8 caches continue in another process exactly as the originals do."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    enable_paged_attention(model, backend="torch")
    inputs = left_padded([5, 11], seed=2)
    jobs, expected = [], []
    for name, kv_dtype in (("model_dtype", None), ("fp8", FP8)):
        cache = PagedCache(model.config, block_size=4, kv_dtype=kv_dtype)
        out = generate(model, inputs, cache, max_new_tokens=6)
        path = tmp_path / f"{name}.safetensors"
        cache.save(path)
        more = {"input_ids": out, "attention_mask": torch.cat([inputs["attention_mask"],
                                                                torch.ones(2, 6, dtype=torch.long)], 1)}
        expected.append(generate(model, more, copy.deepcopy(cache), max_new_tokens=5))
        jobs.append((str(path), kv_dtype is not None, {k: v.tolist() for k, v in more.items()}))
    child = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(TESTS_DIR)), json.dumps(jobs)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    for g, e in zip(got, expected):
        assert torch.equal(torch.tensor(g), e)


def test_loaded_cache_continues_like_the_original_on_a_shared_pool(model, saved):
    """Loaded into a pool other caches use (untrusted, the default): same tokens, same lengths, nothing leaked."""
    pool = shared_pool()
    generate(model, left_padded([7], seed=9), PagedCache(model.config, pool=pool), max_new_tokens=2)
    cache = saved.load(model, pool=pool)
    assert cache.seq_lens() == saved.seq_lens and same_state(cache_state(cache), saved.state)
    assert saved.continues_the_same(model, cache)
    del cache
    gc.collect()
    pool.allocator.check_invariants()
    assert pool.allocator.blocks_in_use == 0


def test_version_1_file_still_loads(model, saved, tmp_path):
    """Files written before the digest (format 1) load and continue the same."""
    metadata = {k: v for k, v in saved.metadata.items() if k != "digest"} | {"format": "hf_paged.cache/1"}
    path = write_parts(tmp_path / "v1.safetensors", metadata, saved.tensors)
    loaded = saved.load(model, path)
    assert same_state(cache_state(loaded), saved.state)
    assert saved.continues_the_same(model, loaded)


def test_released_rows_round_trip(model, tmp_path):
    """A row released before saving is released after loading; the others keep their lengths and tables' sizes."""
    cache = PagedCache(model.config, block_size=BS)
    generate(model, left_padded([5, 9, 7], seed=4), cache, max_new_tokens=3)
    cache.release_rows([1])
    cache.save(tmp_path / "r.safetensors")
    loaded = PagedCache.load(tmp_path / "r.safetensors", model.config, block_size=BS)
    assert loaded.seq_lens() == cache.seq_lens() == [7, None, 9]
    assert [None if t is None else len(t) for t in loaded.block_tables()] == [2, None, 3]
    loaded.pool.allocator.check_invariants()


# ----------------------------------------------------------------------------------- files that do not fit
@pytest.mark.parametrize("config", [
    tiny_config(num_hidden_layers=3),
    tiny_config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
    tiny_config(dtype=torch.bfloat16),
], ids=["layers", "hidden_size", "dtype"])
def test_load_into_another_model_shape_or_dtype_is_refused(saved, config):
    """A file from a model of other layers, width or dtype is refused with what to load it with."""
    with pytest.raises(CacheFileError, match="Load it|Load the model"):
        PagedCache.load(saved.path, config)


def test_load_into_a_model_with_other_kv_heads_is_refused(saved):
    """The error names the field that differs, with both values."""
    with pytest.raises(CacheFileError, match="num_key_value_heads 2 in the file vs 1"):
        PagedCache.load(saved.path, tiny_config(num_key_value_heads=1))


def test_loaded_cache_refuses_a_model_of_another_dtype(saved):
    """A bf16 model whose config names no dtype: the loaded fp32 cache refuses its keys with a clear error (a file
    that names no weights: the dtype check; one that does: the weights check, first)."""
    model = tiny_model("llama").to(torch.bfloat16)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache.load(saved.path, model.config)
    with pytest.raises(ValueError, match="computed with other weights"):
        generate(model, saved.more, cache, max_new_tokens=2)
    cache = PagedCache.load(saved.path, model.config)
    for row in cache.rows:
        row.root = b""  # as a file without the weights' fingerprint loads
    with pytest.raises(ValueError, match="float32"):
        generate(model, saved.more, cache, max_new_tokens=2)


def test_file_larger_than_a_capped_pool_is_refused_before_anything_is_taken(model, saved):
    """The rows need 10 blocks of 4 tokens; a 9-block pool refuses the file and stays as it was."""
    for pool in (shared_pool(num_blocks=9), BlockPool(block_size=BS, max_memory=10 * 2 * BS * 2 * 16 * 4 * 2)):
        before = pool_state(pool)
        with pytest.raises(CacheFileError, match="need 10 blocks of 4 tokens but the pool has 9 free"):
            saved.load(model, pool=pool)
        assert pool_state(pool) == before


# --------------------------------------------------------------------------------- edited and forged files
def _set(meta=None, **tensors):
    def edit(metadata, parts):
        metadata.update(meta or {})
        for name, fn in tensors.items():
            parts[name] = fn(parts[name]) if callable(fn) else fn
    return edit


def _put(value, index=(3, 0, 0)):
    def fn(t):
        t = t.clone()
        t[index] = value
        return t
    return fn


def _longs(*values):
    return torch.tensor(values, dtype=torch.long)


EDITS = {  # the edits of the issue and a few more -> the field the error must name
    "lens_a_billion": (_set(lens=_longs(1_000_000_000, 5, 6)), "lens"),
    "lens_negative": (_set(lens=_longs(-3, 5, 6)), "lens"),
    "lens_as_floats": (_set(lens=lambda t: t.float()), "lens"),
    "rows_a_billion": (_set({"rows": "1000000000"}), "rows"),
    "rows_4": (_set({"rows": "4"}), "rows"),
    "rows_1": (_set({"rows": "1"}), "rows"),
    "rows_negative": (_set({"rows": "-5"}), "rows"),
    "released_out_of_range": (_set({"rows": "4"}, released=_longs(7)), "released"),
    "tokens_cut_to_5": (_set(tokens=lambda t: t[:5]), "tokens"),
    "token_past_the_vocabulary": (_set(tokens=_put(VOCAB, 0)), "tokens"),
    "k0_one_token_short": (_set(**{"k.0": lambda t: t[:-1]}), "k.0"),
    "k0_in_float16": (_set(**{"k.0": lambda t: t.half()}), "k.0"),
    "k1_nan": (_set(**{"k.1": _put(math.nan)}), "k.1"),
    "v0_inf": (_set(**{"v.0": _put(math.inf)}), "v.0"),
    "extra_tensor": (_set(evil=torch.zeros(3)), "tensors"),
    "columns_a_billion": (_set({"columns": "1000000000"}), "columns"),
    "columns_negative": (_set({"columns": "-5"}), "columns"),
    "columns_below_the_longest_row": (_set({"columns": "3"}), "columns"),
    "release_finished_abc": (_set({"release_finished": "abc"}), "release_finished"),
    "model_5": (_set({"model": "5"}), "model"),
    "model_missing_a_key": (_set({"model": json.dumps({"model_type": "llama"})}), "model"),
    "layer_dtype_not_a_dtype": (_set({"layers": json.dumps({"0": [2, 16, "Tensor"], "1": [2, 16, "float32"]})}),
                                "layers"),
    "layer_heads_negative": (_set({"layers": json.dumps({"0": [-2, 16, "float32"], "1": [2, 16, "float32"]})}),
                             "layers"),
    "layers_deeply_nested": (_set({"layers": "[" * 100_000}), "layers"),
    "kv_dtype_float32": (_set({"kv_dtype": "float32"}), "kv_dtype"),
    "format_9": (_set({"format": "hf_paged.cache/9"}), "format"),
}


@pytest.mark.parametrize("edit,field", EDITS.values(), ids=EDITS.keys())
def test_edited_file_is_refused_naming_the_field_with_the_pool_untouched(model, saved, tmp_path, edit, field):
    """Each edit (digest recomputed, as a forger would) gives CacheFileError naming the file and the field; neither
    a fresh pool nor one in use is bound, sized or allocated from."""
    metadata, tensors = dict(saved.metadata), dict(saved.tensors)
    edit(metadata, tensors)
    path = write_parts(tmp_path / "edited.safetensors", metadata, tensors)
    used = shared_pool()
    generate(model, left_padded([9], seed=8), PagedCache(model.config, pool=used), max_new_tokens=2)
    for pool in (shared_pool(), used):
        before = pool_state(pool)
        with pytest.raises(CacheFileError) as err:
            saved.load(model, path, pool=pool)
        assert err.value.field == field and str(path) in str(err.value), str(err.value)
        assert pool_state(pool) == before


def test_stale_digest_catches_changed_tensor_bytes(model, saved, tmp_path):
    """A K value nudged after saving (the digest left as it was): the digest names the corruption."""
    metadata, tensors = dict(saved.metadata), dict(saved.tensors)
    tensors["k.0"] = tensors["k.0"] + 1e-3
    path = write_parts(tmp_path / "stale.safetensors", metadata, tensors, digest="keep")
    with pytest.raises(CacheFileError, match="digest") as err:
        saved.load(model, path)
    assert err.value.field == "digest"


@pytest.mark.parametrize("edit,field", [
    (_set(**{"k_scale.0": lambda t: t * 0}), "k_scale.0"),
    (_set(**{"v_scale.1": _put(math.nan, 0)}), "v_scale.1"),
    (_set(**{"k.0": _put(0x7F)}), "k.0"),  # e4m3fn NaN bits
    (_set(**{"v_scale.0": lambda t: t[:1]}), "v_scale.0"),
    (_set(**{"k_scale.1": _put(-1.0, (2, 0))}), "k_scale.1"),
    (_set(**{"v_scale.1": _put(1e38, (2, 1))}), "v_scale.1"),  # finite, but 448 x it is not
    (_set(**{"k_scale.0": lambda t: t.float()}), "k_scale.0"),
    (_set(**{"k_scale.0": lambda t: t[:, :1]}), "k_scale.0"),
    (_set({"format": "hf_paged.cache/2"}), "k_scale.0"),  # per-token scales in a file of the per-head format
], ids=["zero_scale", "nan_scale", "nan_fp8_bits", "scale_shape", "negative_scale", "huge_scale", "scale_dtype",
        "scale_heads", "format_2_with_token_scales"])
def test_edited_fp8_file_is_refused(model, saved_fp8, tmp_path, edit, field):
    """fp8 scales (one per token and KV head, bfloat16) must be finite, > 0, with 448 x scale finite, and as many as
    the tokens; K/V bits must not encode NaN."""
    metadata, tensors = dict(saved_fp8.metadata), dict(saved_fp8.tensors)
    edit(metadata, tensors)
    path = write_parts(tmp_path / "edited.safetensors", metadata, tensors)
    with pytest.raises(CacheFileError) as err:
        saved_fp8.load(model, path)
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize("cut", ["header_length_a_terabyte", "half", "last_bytes_missing", "eight_bytes"])
def test_damaged_bytes_are_refused(saved, tmp_path, cut):
    """A header claiming more bytes than the file has, or a cut file, is refused before safetensors maps it."""
    data = saved.path.read_bytes()
    damaged = {"header_length_a_terabyte": struct.pack("<Q", 1 << 40) + data[8:], "half": data[: len(data) // 2],
               "last_bytes_missing": data[: int(len(data) * 0.999)], "eight_bytes": data[:8]}[cut]
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(damaged)
    with pytest.raises(CacheFileError, match="truncated") as err:
        PagedCache.load(path, tiny_config())
    assert err.value.field == "header"


# ------------------------------------------------------------------------------------ trusted and untrusted
def forged_prompt_file(model, path, prompt) -> Path:
    """The issue's attack: a prompt's cache saved, its K/V replaced by random values, the digest recomputed."""
    cache = PagedCache(model.config, block_size=BS)
    generate(model, ones_mask(prompt), cache, max_new_tokens=1)  # the prompt's K/V only
    cache.save(path, model=model)  # names the weights: a trusted load publishes its blocks under them
    metadata, tensors = read_parts(path)
    g = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n[:2] in ("k.", "v.")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=g) * 3
    return write_parts(path, metadata, tensors)


def test_forged_kv_do_not_reach_a_later_request_on_a_prefix_caching_pool(model, tmp_path):
    """A 32-token prompt's file with random K/V, loaded into a prefix-caching pool and dropped: a later request
    on the same prompt plus a question gives DynamicCache's tokens and finds nothing cached. Loaded with
    trusted=True, the same file's 8 blocks are found by the later request (so the default is what protects it)."""
    prompt = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    path = forged_prompt_file(model, tmp_path / "forged.safetensors", prompt)
    request = ones_mask(torch.cat([prompt, torch.tensor([[21, 22, 23, 24]])], 1))
    expected = generate(model, request, dynamic(model), max_new_tokens=6)
    for trusted in (False, True):
        pool = shared_pool()
        loaded = PagedCache.load(path, model.config, pool=pool, trusted=trusted)
        del loaded
        gc.collect()
        assert pool.allocator.num_cached == (8 if trusted else 0)
        out = generate(model, request, PagedCache(model.config, pool=pool), max_new_tokens=6)
        assert prefix_hits(pool) == (32 if trusted else 0)
        if not trusted:
            assert torch.equal(out, expected)
        pool.allocator.check_invariants()


def test_trusted_file_serves_later_requests_from_its_blocks(model, saved):
    """trusted=True on an honest file: its blocks are published; a later request on row 1's tokens hits all 16
    tokens of its full blocks and still gives DynamicCache's tokens."""
    pool = shared_pool()
    loaded = saved.load(model, pool=pool, trusted=True)
    del loaded
    gc.collect()
    assert saved.victim_unaffected(model, pool)
    assert prefix_hits(pool) == 16


def test_untrusted_rows_key_nothing_even_after_they_grow(model, saved):
    """Blocks appended to a loaded row, and to its copies, extend a prefix that was never verified: after
    continuing the loaded cache and a deepcopy of it, and dropping both, the pool caches no block. The same run
    with trusted=True caches blocks (what this test would catch)."""
    for trusted in (False, True):
        pool = shared_pool()
        cache = saved.load(model, pool=pool, trusted=trusted)
        twin = copy.deepcopy(cache)
        assert saved.continues_the_same(model, cache)  # 17 -> 22+ tokens a row: new full blocks
        assert saved.continues_the_same(model, twin)
        del cache, twin
        gc.collect()
        pool.allocator.check_invariants()
        assert pool.allocator.blocks_in_use == 0
        assert (pool.allocator.num_cached > 0) == trusted


def test_trusted_must_be_a_bool(model, saved):
    """A truthy string does not opt a file into the prefix cache."""
    with pytest.raises(TypeError, match="trusted"):
        saved.load(model, trusted="yes")


def test_fp8_file_on_a_shared_pool_leaves_the_other_caches_as_they_were(model, saved_fp8):
    """An fp8 file's scales are its own tokens' (one per slot): loaded, untrusted, into a pool another cache already
    uses, it continues as the original did, and the other cache's blocks, scales included, are unchanged; loading it
    twice works the same."""
    pool = BlockPool(block_size=BS, kv_dtype=FP8)
    other = PagedCache(model.config, pool=pool)
    generate(model, left_padded([9, 5], seed=11), other, max_new_tokens=2)
    other_state = cache_state(other)
    first = saved_fp8.load(model, pool=pool)
    assert same_state(cache_state(first), saved_fp8.state) and saved_fp8.continues_the_same(model, first)
    assert saved_fp8.continues_the_same(model, saved_fp8.load(model, pool=pool))
    assert same_state(cache_state(other), other_state)


def _as_format_2(saved) -> tuple[dict, dict, dict]:
    """``saved``'s fp8 file as the per-head format (2) wrote it: one float32 scale per layer and KV head (the old
    policy, amax x 2 / 448) and the K/V bits quantized with it. Returns (metadata, tensors, head scales)."""
    from hf_paged.ops.reference import dequantize_fp8, quantize_fp8

    metadata, tensors = dict(saved.metadata) | {"format": "hf_paged.cache/2"}, dict(saved.tensors)
    heads = {}
    for name in [n for n in tensors if n[:2] in ("k.", "v.")]:
        kv, layer = name.split(".")
        values = dequantize_fp8(tensors[name], tensors[f"{kv}_scale.{layer}"], torch.float32)  # [n, Hkv, D]
        heads[name] = values.abs().amax((0, 2)) * (2 / 448)  # [Hkv] float32
        tensors[name], tensors[f"{kv}_scale.{layer}"] = quantize_fp8(values, heads[name]), heads[name]
    return metadata, tensors, heads


def test_format_2_fp8_file_loads_with_its_head_scales_on_every_slot(model, saved_fp8, tmp_path):
    """A file of the per-head format still loads: every token's slot gets its head's scale (rounded to bfloat16), the
    bits are the file's, and the cache continues; its hostile scales are refused as before."""
    metadata, tensors, heads = _as_format_2(saved_fp8)
    loaded = saved_fp8.load(model, write_parts(tmp_path / "v2.safetensors", metadata, tensors))
    _, _, rows, _ = cache_state(loaded)
    offsets = [0] + torch.tensor(loaded.seq_lens()).cumsum(0).tolist()
    names = [f"{kv}.{layer}" for layer in sorted(loaded.pool.layer_shapes) for kv in "kv"]
    for r, got in enumerate(rows):  # per layer: K, V, K scales, V scales
        for i, name in enumerate(names):
            layer_part = got[(i // 2) * 4: (i // 2) * 4 + 4]
            bits, scales = layer_part[i % 2], layer_part[2 + i % 2]  # [n, Hkv, D], [n, Hkv]
            assert torch.equal(bits, tensors[name][offsets[r]: offsets[r + 1]])
            assert torch.equal(scales, heads[name].to(torch.bfloat16).expand_as(scales))
    out = generate(model, saved_fp8.more, loaded, max_new_tokens=3)
    assert out.shape == saved_fp8.expected.shape
    tensors["k_scale.0"] = tensors["k_scale.0"] * 0
    with pytest.raises(CacheFileError) as err:
        saved_fp8.load(model, write_parts(tmp_path / "v2_zero.safetensors", metadata, tensors))
    assert err.value.field == "k_scale.0"


# ----------------------------------------------------------------------------------------- mutated files
META_VALUES = ["", "0", "1", "2", "3", "4", "-5", "17", "18", "1000000000", "abc", "True", "False", "null", "[]",
               "{}", "5", "1e9", " 3", "[[[[", "hf_paged.cache/1", "float8_e4m3fn", "float32",
               '{"0": [2, 16, "Tensor"], "1": [2, 16, "float32"]}', '{"0": [2, 16, "float32"]}',
               '{"0": [2, 16, "float16"], "1": [2, 16, "float16"]}']
TENSOR_DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.float32, torch.int64, torch.int32, torch.uint8]


def _mutations(metadata: dict, tensors: dict):
    meta_keys, names = sorted(metadata), sorted(tensors)
    kv_names = [n for n in names if n[:2] in ("k.", "v.")]
    return st.one_of(
        st.tuples(st.just("resave")),
        st.tuples(st.just("scale_kv"), st.sampled_from(kv_names), st.sampled_from([0.0, -1.0, 3.0, 1e4])),
        st.tuples(st.just("meta"), st.sampled_from(meta_keys), st.sampled_from(META_VALUES) | st.text(max_size=8)),
        st.tuples(st.just("drop_meta"), st.sampled_from(meta_keys)),
        st.tuples(st.just("ints"), st.sampled_from(["lens", "released", "tokens"]),
                  st.lists(st.integers(-3, 40) | st.sampled_from([VOCAB, 2**40, 2**62]), max_size=5)),
        st.tuples(st.just("rows"), st.sampled_from(names), st.integers(-3, 3)),
        st.tuples(st.just("flatten"), st.sampled_from(names)),
        st.tuples(st.just("dtype"), st.sampled_from(names), st.sampled_from(TENSOR_DTYPES)),
        st.tuples(st.just("value"), st.sampled_from(names),
                  st.sampled_from([math.nan, math.inf, 0.0, -1.0, 1e30, 127])),
        st.tuples(st.just("drop_tensor"), st.sampled_from(names)),
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("flip_header"), st.integers(0, 10**6), st.integers(1, 255)),
        st.tuples(st.just("flip_data"), st.integers(0, 10**6), st.integers(1, 255)),
    )


def _mutate(base: Saved, mutation, forge: bool, path: Path) -> bool:
    """Write ``base`` with ``mutation`` to ``path``; True when the digest was recomputed over the change (a forgery)."""
    kind, *args = mutation
    if kind in ("truncate", "flip_header", "flip_data"):
        data = bytearray(base.path.read_bytes())
        header_end = 8 + struct.unpack("<Q", data[:8])[0]
        if kind == "truncate":
            data = data[: int(len(data) * args[0])]
        elif kind == "flip_header":
            data[args[0] % header_end] ^= args[1]
        else:
            data[header_end + args[0] % (len(data) - header_end)] ^= args[1]
        path.write_bytes(bytes(data))
        return False
    metadata, tensors = dict(base.metadata), dict(base.tensors)
    if kind == "resave":
        pass
    elif kind == "meta":
        metadata[args[0]] = args[1]
    elif kind == "drop_meta":
        del metadata[args[0]]
    elif kind == "ints":
        tensors[args[0]] = torch.tensor(args[1], dtype=torch.long)
    elif kind == "drop_tensor":
        del tensors[args[0]]
    elif kind == "scale_kv":
        t = tensors[args[0]]
        tensors[args[0]] = (t.float() * args[1]).clamp(0, 255).to(t.dtype) if t.dtype == torch.uint8 else t * args[1]
    else:
        t = tensors[args[0]].clone()
        if kind == "rows":
            t = t[: max(0, t.shape[0] + args[1])] if args[1] < 0 else torch.cat([t, t[: args[1]]])
        elif kind == "flatten":
            t = t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)
        elif kind == "dtype":
            t = t.to(args[1])
        elif t.numel():
            t.view(-1)[t.numel() // 2] = args[1] if t.is_floating_point() else int(args[1]) if math.isfinite(
                args[1]) and 0 <= args[1] < 256 else 255
        tensors[args[0]] = t
    write_parts(path, metadata, tensors, digest="recompute" if forge else "keep")
    return forge


@pytest.fixture(scope="module")
def bases(saved, saved_fp8):
    return {"model_dtype": saved, "fp8": saved_fp8}


@settings(max_examples=60, deadline=1000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), which=st.sampled_from(["model_dtype", "fp8"]), forge=st.booleans())
def test_mutated_files_give_the_error_or_the_same_tokens(model, bases, tmp_path_factory, data, which, forge):
    """A real cache file mutated (metadata values, tensor shapes, dtypes, values and lengths, truncation, bytes
    flipped in the header or the data), forged or not. Loading takes at most 1 s (the deadline) and at most the
    file's size + 50 MB of memory, and gives either CacheFileError naming the file (the pool as it was) or a cache
    that: unforged, holds what the original held, bit for bit, and continues with its next token; forged, is
    consistent, frees every block, and (untrusted) changes nothing a later request on the same prefix-caching pool
    generates. (One new token per generate(): the deadline covers the whole example.)"""
    base = bases[which]
    mutation = data.draw(_mutations(base.metadata, base.tensors), label="mutation")
    path = tmp_path_factory.mktemp("mutated") / "m.safetensors"
    forged = _mutate(base, mutation, forge, path)
    pool = shared_pool() if which == "model_dtype" else BlockPool(block_size=BS, kv_dtype=FP8)
    before = pool_state(pool)
    # fp8: a pool of its own (pool=None): the victim's DynamicCache tokens are not what an fp8 pool gives
    result, growth = peak_rss_growth(lambda: base.load(model, path, pool=pool) if which == "model_dtype"
                                     else base.load(model, path))
    assert growth <= path.stat().st_size + 50 * MB, f"loading took {growth / MB:.0f} MB"
    if isinstance(result, Exception):
        if not isinstance(result, CacheFileError):
            raise result
        assert str(path) in str(result) and pool_state(pool) == before
        event(f"refused: {result.field}")
        return
    cache, result = result, None
    cache.pool.allocator.check_invariants()
    if not forged:
        event("loaded unforged")
        assert same_state(cache_state(cache), base.state)
        assert base.continues_the_same(model, cache, max_new_tokens=1)
        return
    event("loaded forged")
    lens = cache.seq_lens()
    tables = cache.block_tables()
    assert all((n is None) == (t is None) and (n is None or len(t) == -(-n // cache.pool.block_size))
               for n, t in zip(lens, tables))
    own = cache.pool
    del cache
    gc.collect()
    own.allocator.check_invariants()
    assert own.allocator.blocks_in_use == 0
    if which == "model_dtype":
        assert pool.allocator.num_cached == 0
        assert base.victim_unaffected(model, pool, max_new_tokens=1) and prefix_hits(pool) == 0
