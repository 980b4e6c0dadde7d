"""Argument checks of ``hf_paged.ops.paged_attention`` / ``write_kv``, and a fuzz of valid calls against float64.

Every bad argument must raise ValueError naming the problem before any kernel runs: the kernels are replaced by
functions that fail the test if called. Valid random configurations (scrambled block tables, GQA, sliding windows,
idle sequences) must run and match a float64 per-sequence computation done from the logical K/V, never the pool.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap
import types
from contextlib import contextmanager

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_paged import ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GARBAGE = 50.0  # what every slot nobody wrote holds: reading one by mistake shows up as a large error
ULPS = 8  # allowed error vs float64: ULPS x eps(dtype) x max(1, max|output|)


# ---------------------------------------------------------------------------------------------------------------------
# Valid cases
# ---------------------------------------------------------------------------------------------------------------------


def make_case(seq_lens, q_lens, *, num_kv_heads=2, group=2, head_dim=4, block_size=4, dtype=torch.float32,
              window=None, extra_blocks=2, extra_columns=1, seed=0):
    """A scrambled pool filled through ``ops.write_kv``, plus the logical K/V each sequence should read back.

    Returns ``(attention kwargs, write_kv kwargs, logical)``; ``logical[s] = (k, v)``, each ``[seq_len, Hkv, D]``.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq, default=0) + extra_columns
    num_blocks = sum(blocks_per_seq) + extra_blocks
    physical = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, GARBAGE, dtype=dtype)  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = torch.full(shape, -GARBAGE, dtype=dtype)
    block_tables = torch.full((num_seqs, width), -1, dtype=torch.int32)  # [num_seqs, width]
    logical, slots = [], []
    taken = 0
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[s, :n_blocks] = physical[taken : taken + n_blocks].to(torch.int32)
        taken += n_blocks
        pos = torch.arange(seq_len)
        slots.append(block_tables[s, pos // block_size].long() * block_size + pos % block_size)  # [seq_len]
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # [seq_len, Hkv, D]
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        logical.append((k, v))
    if window is not None:  # blocks wholly before every query's window were given back: -1, as the allocator does
        for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
            first_visible = max(0, seq_len - q_len - window + 1)
            block_tables[s, : first_visible // block_size] = -1
    write = dict(
        key=torch.cat([k for k, _ in logical]) if logical else torch.empty(0, num_kv_heads, head_dim, dtype=dtype),
        value=torch.cat([v for _, v in logical]) if logical else torch.empty(0, num_kv_heads, head_dim, dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.cat(slots).to(torch.int32) if slots else torch.empty(0, dtype=torch.int32),
    )
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)  # [T, Hq, D]
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    attn = dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        scale=head_dim**-0.5,
        sliding_window=window,
    )
    return attn, write, logical


def attention_float64(query, query_start_loc, seq_lens, scale, sliding_window, logical):
    """Per sequence, per query: softmax(q k^T) v over its visible positions, in float64, from the logical K/V."""
    out = torch.zeros(query.shape, dtype=torch.float64)  # [num_tokens, Hq, D]
    for s, (k, v) in enumerate(logical):
        start, end, seq_len = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(seq_lens[s])
        group = query.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, 1)  # [L, Hq, D]
        v = v.double().repeat_interleave(group, 1)
        for i in range(start, end):
            p = seq_len - (end - start) + (i - start)
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            scores = torch.einsum("hd,khd->hk", query[i].double(), k[lo : p + 1]) * scale  # [Hq, visible]
            out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : p + 1])
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Corruptions: (name, applies to the case?, change one argument, what the message must say)
# ---------------------------------------------------------------------------------------------------------------------


def _non_contiguous(t):
    strided = torch.empty((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype)[::2]  # same shape, every other block
    strided.copy_(t)
    hypothesis.assume(not strided.is_contiguous())  # one block of size-1 dims stays contiguous whatever the strides
    return strided


def _other_float(dtype):
    return torch.float16 if dtype != torch.float16 else torch.bfloat16


def _always(c):
    return True


POOL_CORRUPTIONS = [
    ("key_cache 3 dims", _always, lambda c: c.update(key_cache=c["key_cache"][0]),
     r"key_cache must be \[num_blocks, block_size, num_kv_heads, head_dim\] \(4 dims\), got shape"),
    ("value_cache shape", _always, lambda c: c.update(value_cache=torch.cat([c["value_cache"], c["value_cache"][:1]])),
     r"value_cache shape \(\d+, .*\) must equal key_cache shape"),
    ("cache float64", _always,
     lambda c: c.update(key_cache=c["key_cache"].double(), value_cache=c["value_cache"].double()),
     r"key/value caches must share one of .*got torch.float64 and torch.float64"),
    ("cache int32", _always,
     lambda c: c.update(key_cache=c["key_cache"].int(), value_cache=c["value_cache"].int()),
     r"key/value caches must share one of .*got torch.int32"),
    ("value_cache other dtype", _always,
     lambda c: c.update(value_cache=c["value_cache"].to(_other_float(c["key_cache"].dtype))),
     r"key/value caches must share one of"),
    ("key_cache non-contiguous", _always, lambda c: c.update(key_cache=_non_contiguous(c["key_cache"])),
     r"must be contiguous; call .contiguous\(\)"),
    ("value_cache non-contiguous", _always, lambda c: c.update(value_cache=_non_contiguous(c["value_cache"])),
     r"must be contiguous; call .contiguous\(\)"),
    ("value_cache on another device", _always, lambda c: c.update(value_cache=c["value_cache"].to("meta")),
     r"key_cache is on cpu but value_cache is on meta; put both on one device"),
    ("bad backend", _always, lambda c: c.update(backend="cuda"),
     r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
]

ATTENTION_CORRUPTIONS = POOL_CORRUPTIONS + [
    ("query 2 dims", _always, lambda c: c.update(query=c["query"][:, 0]),
     r"query must be \[num_tokens, num_q_heads, head_dim\], got shape"),
    ("query not a tensor", _always, lambda c: c.update(query=c["query"].tolist()),
     r"query must be \[num_tokens, num_q_heads, head_dim\]"),
    ("query head_dim", _always, lambda c: c.update(query=torch.cat([c["query"], c["query"][..., :1]], -1)),
     r"query head_dim (\d+) differs from the cache's head_dim"),
    ("q heads not a multiple of kv heads", lambda c: c["key_cache"].shape[2] > 1,
     lambda c: c.update(query=torch.cat([c["query"], c["query"][:, :1]], 1)),
     r"num_q_heads \(\d+\) must be a multiple of num_kv_heads \(\d+\)"),
    ("query float64", _always, lambda c: c.update(query=c["query"].double()),
     r"query dtype must be one of .*got torch.float64"),
    ("query int64", _always, lambda c: c.update(query=c["query"].long()),
     r"query dtype must be one of .*got torch.int64"),
    ("query on another device", _always, lambda c: c.update(query=c["query"].to("meta")),
     r"query is on meta but the KV cache is on cpu"),
    ("block_tables int64", _always, lambda c: c.update(block_tables=c["block_tables"].long()),
     r"block_tables must be torch.int32, got torch.int64; convert with .to\(torch.int32\)"),
    ("seq_lens int64", _always, lambda c: c.update(seq_lens=c["seq_lens"].long()),
     r"seq_lens must be torch.int32, got torch.int64; convert with .to\(torch.int32\)"),
    ("query_start_loc int64", _always, lambda c: c.update(query_start_loc=c["query_start_loc"].long()),
     r"query_start_loc must be torch.int32, got torch.int64; convert with .to\(torch.int32\)"),
    ("block_tables float32", _always, lambda c: c.update(block_tables=c["block_tables"].float()),
     r"block_tables must be torch.int32, got torch.float32"),
    ("block_tables not a tensor", _always, lambda c: c.update(block_tables=c["block_tables"].tolist()),
     r"block_tables must be a torch.Tensor, got list"),
    ("block_tables 1 dim", _always, lambda c: c.update(block_tables=c["block_tables"].flatten()),
     r"block_tables must have 2 dims, got shape"),
    ("seq_lens 2 dims", _always, lambda c: c.update(seq_lens=c["seq_lens"][None]), r"seq_lens must have 1 dims"),
    ("query_start_loc 2 dims", _always, lambda c: c.update(query_start_loc=c["query_start_loc"][None]),
     r"query_start_loc must have 1 dims"),
    ("block_tables on another device", _always, lambda c: c.update(block_tables=c["block_tables"].to("meta")),
     r"block_tables is on meta but the KV cache is on cpu; move it with .to\(key_cache.device\)"),
    ("seq_lens on another device", _always, lambda c: c.update(seq_lens=c["seq_lens"].to("meta")),
     r"seq_lens is on meta but the KV cache is on cpu"),
    ("block_tables extra row", _always,
     lambda c: c.update(block_tables=torch.cat([c["block_tables"], c["block_tables"][:1]])),
     r"block_tables has (\d+) rows for (\d+) sequences \(seq_lens\)"),
    ("query_start_loc too short", _always, lambda c: c.update(query_start_loc=c["query_start_loc"][:-1]),
     r"query_start_loc must have num_seqs \+ 1 = (\d+) entries, got (\d+)"),
    ("query_start_loc too long", _always,
     lambda c: c.update(query_start_loc=torch.cat([c["query_start_loc"], c["query_start_loc"][-1:]])),
     r"query_start_loc must have num_seqs \+ 1 = (\d+) entries, got (\d+)"),
    ("sliding_window 0", _always, lambda c: c.update(sliding_window=0),
     r"sliding_window must be a positive int or None, got 0"),
    ("sliding_window negative", _always, lambda c: c.update(sliding_window=-4),
     r"sliding_window must be a positive int or None, got -4"),
    ("sliding_window float", _always, lambda c: c.update(sliding_window=2.5),
     r"sliding_window must be a positive int or None, got 2.5"),
    ("sliding_window str", _always, lambda c: c.update(sliding_window="8"),
     r"sliding_window must be a positive int or None, got '8'"),
    ("scale tensor", _always, lambda c: c.update(scale=torch.tensor(0.5)), r"scale must be a Python float, got Tensor"),
]

WRITE_CORRUPTIONS = POOL_CORRUPTIONS + [
    ("key heads", _always, lambda c: c.update(key=torch.cat([c["key"], c["key"][:, :1]], 1)),
     r"key/value must be \[num_tokens, \d+, \d+\] to match the cache, got"),
    ("key head_dim", _always, lambda c: c.update(key=torch.cat([c["key"], c["key"][..., :1]], -1)),
     r"key/value must be \[num_tokens, \d+, \d+\] to match the cache, got"),
    ("key 2 dims", _always, lambda c: c.update(key=c["key"][:, 0]), r"key/value must be \[num_tokens, \d+, \d+\]"),
    ("value shape", _always,  # one more row, also when there are no tokens at all
     lambda c: c.update(value=torch.cat([c["value"], c["value"].new_zeros(1, *c["value"].shape[1:])])),
     r"key/value must be \[num_tokens, \d+, \d+\] to match the cache, got \(\d+, \d+, \d+\) and"),
    ("slot_mapping float32", _always, lambda c: c.update(slot_mapping=c["slot_mapping"].float()),
     r"slot_mapping must be torch.int32 or torch.int64, got torch.float32"),
    ("slot_mapping int16", _always, lambda c: c.update(slot_mapping=c["slot_mapping"].short()),
     r"slot_mapping must be torch.int32 or torch.int64, got torch.int16"),
    ("slot_mapping 2 dims", _always, lambda c: c.update(slot_mapping=c["slot_mapping"][None]),
     r"slot_mapping must have 1 dims"),
    ("slot_mapping too long", _always,
     lambda c: c.update(slot_mapping=torch.cat([c["slot_mapping"], c["slot_mapping"].new_zeros(1)])),
     r"slot_mapping has (\d+) entries for (\d+) tokens"),
    ("slot_mapping on another device", _always, lambda c: c.update(slot_mapping=c["slot_mapping"].to("meta")),
     r"slot_mapping is on meta but the KV cache is on cpu"),
]


@contextmanager
def no_kernels():
    """Any kernel launch (torch reference or Triton) fails the test."""

    def launched(*args, **kwargs):
        raise AssertionError("a kernel ran before the arguments were rejected")

    fake_triton = types.ModuleType("hf_paged.ops.triton_kernels")
    fake_triton.paged_attention_triton = fake_triton.write_kv_triton = launched
    with pytest.MonkeyPatch.context() as mp:
        for name in ("paged_attention_unchecked", "write_kv_unchecked", "plan_torch_attention",
                     "paged_attention_torch", "write_kv_torch", "copy_blocks_torch"):
            if hasattr(ops, name):
                mp.setattr(ops, name, launched)
        mp.setitem(sys.modules, "hf_paged.ops.triton_kernels", fake_triton)
        yield


def assert_rejected(fn, kwargs, corrupt, match):
    kwargs = dict(kwargs)
    corrupt(kwargs)
    with no_kernels(), pytest.raises(ValueError, match=match):
        fn(**kwargs)


def _ids(corruptions):
    return [c[0] for c in corruptions]


BASE_ATTN, BASE_WRITE, _ = make_case([5, 9, 0], [1, 3, 0], num_kv_heads=2, group=2, window=6)


# ---------------------------------------------------------------------------------------------------------------------
# Each bad argument, on one fixed case, for each backend
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("name, applies, corrupt, match", ATTENTION_CORRUPTIONS, ids=_ids(ATTENTION_CORRUPTIONS))
def test_paged_attention_rejects(name, applies, corrupt, match, backend):
    assert applies(BASE_ATTN)
    assert_rejected(ops.paged_attention, dict(BASE_ATTN, backend=backend), corrupt, match)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("name, applies, corrupt, match", WRITE_CORRUPTIONS, ids=_ids(WRITE_CORRUPTIONS))
def test_write_kv_rejects(name, applies, corrupt, match, backend):
    assert applies(BASE_WRITE)
    assert_rejected(ops.write_kv, dict(BASE_WRITE, backend=backend), corrupt, match)


def test_messages_carry_the_numbers():
    """Expected vs got, with the actual numbers of this case."""
    with no_kernels():
        with pytest.raises(ValueError, match=r"num_q_heads \(5\) must be a multiple of num_kv_heads \(2\)"):
            ops.paged_attention(**dict(BASE_ATTN, query=torch.randn(4, 5, 4)))
        with pytest.raises(ValueError, match=r"query head_dim 8 differs from the cache's head_dim 4"):
            ops.paged_attention(**dict(BASE_ATTN, query=torch.randn(4, 4, 8)))
        with pytest.raises(ValueError, match=r"block_tables has 4 rows for 3 sequences"):
            ops.paged_attention(**dict(BASE_ATTN, block_tables=torch.zeros(4, 3, dtype=torch.int32)))
        with pytest.raises(ValueError, match=r"query_start_loc must have num_seqs \+ 1 = 4 entries, got 3"):
            ops.paged_attention(**dict(BASE_ATTN, query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32)))
        with pytest.raises(ValueError, match=r"slot_mapping has 15 entries for 14 tokens"):
            ops.write_kv(**dict(BASE_WRITE, slot_mapping=torch.arange(15)))
        with pytest.raises(ValueError, match=r"key/value must be \[num_tokens, 2, 4\] to match the cache, got "
                                             r"\(14, 3, 4\) and \(14, 2, 4\)"):
            ops.write_kv(**dict(BASE_WRITE, key=torch.randn(14, 3, 4)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real device mismatch needs a CUDA device")
def test_cuda_cpu_mismatch_rejected():
    cuda = {k: (v.cuda() if k in ("query", "key_cache", "value_cache") else v) for k, v in BASE_ATTN.items()}
    with no_kernels(), pytest.raises(ValueError, match=r"block_tables is on cpu but the KV cache is on cuda"):
        ops.paged_attention(**cuda)


def test_write_kv_rejects_non_tensor_key():
    assert_rejected(ops.write_kv, BASE_WRITE, lambda c: c.update(key=c["key"].tolist()), r"key")


def test_write_kv_rejects_key_on_another_device():
    assert_rejected(ops.write_kv, BASE_WRITE, lambda c: c.update(key=c["key"].to("meta"), value=c["value"].to("meta")),
                    r"key/value are on meta/meta but the KV cache is on cpu")


def test_paged_attention_rejects_bool_sliding_window():
    assert_rejected(ops.paged_attention, BASE_ATTN, lambda c: c.update(sliding_window=True), r"sliding_window")


# ---------------------------------------------------------------------------------------------------------------------
# Fuzz: valid random configurations run and match float64; one corrupted argument is rejected
# ---------------------------------------------------------------------------------------------------------------------


@st.composite
def configs(draw):
    num_seqs = draw(st.integers(1, 4))
    decode = draw(st.booleans())
    seq_lens, q_lens = [], []
    for _ in range(num_seqs):
        seq_len = draw(st.integers(1 if decode else 0, 24))
        seq_lens.append(seq_len)
        q_lens.append(1 if decode else draw(st.integers(0, min(seq_len, 5))))
    return dict(
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        dtype=draw(st.sampled_from(DTYPES)),
        window=draw(st.one_of(st.none(), st.integers(1, 26))),
        extra_blocks=draw(st.integers(1, 3)),
        extra_columns=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**16)),
    )


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(cfg=configs(), backend=st.sampled_from(["auto", "torch"]),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_valid_configs_match_float64(cfg, backend, slot_dtype):
    seq_lens, q_lens = cfg.pop("seq_lens"), cfg.pop("q_lens")
    attn, write, logical = make_case(seq_lens, q_lens, **cfg)
    write["slot_mapping"] = write["slot_mapping"].to(slot_dtype)
    key_cache = attn["key_cache"]
    untouched = key_cache.clone()
    ops.write_kv(**write, backend=backend)
    written = torch.zeros(key_cache.shape[:2], dtype=torch.bool).flatten()  # [num_blocks * block_size]
    written[write["slot_mapping"].long()] = True
    flat = key_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
    assert torch.equal(flat[write["slot_mapping"].long()], write["key"])
    assert torch.equal(flat[~written], untouched.flatten(0, 1)[~written])

    out = ops.paged_attention(**attn, backend=backend)
    query = attn["query"]
    assert out.shape == query.shape and out.dtype == query.dtype
    expected = attention_float64(query, attn["query_start_loc"], attn["seq_lens"], attn["scale"],
                                 attn["sliding_window"], logical)
    err = (out.double() - expected).abs().max().item() if out.numel() else 0.0
    bound = ULPS * torch.finfo(query.dtype).eps * max(1.0, expected.abs().max().item() if out.numel() else 0.0)
    assert err <= bound, f"error {err:.3g} > {bound:.3g} ({query.dtype})"


@FUZZ
@given(cfg=configs(), data=st.data(), backend=st.sampled_from(["auto", "torch", "triton"]))
def test_one_bad_argument_is_rejected(cfg, data, backend):
    seq_lens, q_lens = cfg.pop("seq_lens"), cfg.pop("q_lens")
    attn, write, _ = make_case(seq_lens, q_lens, **cfg)
    if data.draw(st.booleans(), label="attention?"):
        fn, kwargs, corruptions = ops.paged_attention, dict(attn, backend=backend), ATTENTION_CORRUPTIONS
    else:
        fn, kwargs, corruptions = ops.write_kv, dict(write, backend=backend), WRITE_CORRUPTIONS
    name, _, corrupt, match = data.draw(st.sampled_from([c for c in corruptions if c[1](kwargs)]), label="corruption")
    assert_rejected(fn, kwargs, corrupt, match)


# ---------------------------------------------------------------------------------------------------------------------
# Soft-capping, sinks, fp8 pools: bad input, scales, copy-on-write of uint8 blocks
# ---------------------------------------------------------------------------------------------------------------------


def _fp8_pool(case):
    """The case's pool as uint8 (fp8 bits), with valid scale caches ``[num_blocks, block_size, num_kv_heads]``."""
    shape = case["key_cache"].shape
    bits, scales = torch.zeros(shape, dtype=torch.uint8), torch.ones(shape[:3], dtype=torch.bfloat16)
    return dict(case, key_cache=bits, value_cache=bits.clone(), k_scale=scales, v_scale=scales.clone())


def _fp8(update):
    return lambda c: (c.update(_fp8_pool(c)), update(c))


FEATURE_CORRUPTIONS = [
    ("softcap-zero", lambda c: c.update(softcap=0.0), r"softcap must be a positive finite float"),
    ("softcap-negative", lambda c: c.update(softcap=-30.0), r"softcap must be a positive finite float"),
    ("softcap-inf", lambda c: c.update(softcap=float("inf")), r"softcap must be a positive finite float"),
    ("softcap-bool", lambda c: c.update(softcap=True), r"softcap must be a positive finite float"),
    ("softcap-tensor", lambda c: c.update(softcap=torch.tensor(30.0)), r"softcap must be a positive finite float"),
    ("sinks-shape", lambda c: c.update(sinks=torch.zeros(5)), r"sinks must be a float tensor of shape "
                                                              r"\[num_q_heads\] = \[4\].*\(5,\)"),
    ("sinks-int", lambda c: c.update(sinks=torch.zeros(4, dtype=torch.int32)), r"sinks must be a float tensor"),
    ("sinks-list", lambda c: c.update(sinks=[0.0] * 4), r"sinks must be a float tensor"),
    ("sinks-device", lambda c: c.update(sinks=torch.zeros(4, device="meta")), r"sinks is on meta but the query is on"),
    ("fp8-no-scales", lambda c: c.update(_fp8_pool(c), k_scale=None, v_scale=None),
     r"uint8 pool holds fp8 e4m3fn blocks and needs the scale caches k_scale and v_scale \(\[7, 4, 2\] bfloat16"
     r".*torch.zeros\(key_cache.shape\[:3\], dtype=torch.bfloat16\)"),
    ("fp8-one-scale", lambda c: c.update(_fp8_pool(c), v_scale=None), r"needs the scale caches k_scale and v_scale"),
    ("scales-float-pool", lambda c: c.update(k_scale=torch.ones(2), v_scale=torch.ones(2)),
     r"k_scale/v_scale apply only to a uint8 \(fp8 e4m3fn\) pool, but the pool is torch.float32"),
    ("fp8-scale-per-head", _fp8(lambda c: c.update(k_scale=torch.ones(2, dtype=torch.bfloat16))),
     r"k_scale must be a bfloat16 scale cache of shape \[7, 4, 2\] \(\[num_blocks, block_size, num_kv_heads\].*"
     r"\(2,\)"),
    ("fp8-scale-dtype", _fp8(lambda c: c.update(v_scale=torch.ones(7, 4, 2))),
     r"v_scale must be a bfloat16 scale cache of shape \[7, 4, 2\].*torch.float32"),
    ("fp8-scale-device", _fp8(lambda c: c.update(k_scale=torch.ones(7, 4, 2, dtype=torch.bfloat16, device="meta"))),
     r"k_scale is on meta but the KV cache is on cpu"),
    ("fp8-scale-strided", _fp8(lambda c: c.update(k_scale=torch.ones(7, 4, 4, dtype=torch.bfloat16)[..., ::2])),
     r"k_scale must be contiguous"),
    ("fp8-pool-int8", lambda c: c.update(key_cache=c["key_cache"].to(torch.int8),
                                         value_cache=c["value_cache"].to(torch.int8)),
     r"key/value caches must share one of .*uint8 holds float8 e4m3fn bits"),
]


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("name, corrupt, match", FEATURE_CORRUPTIONS, ids=[c[0] for c in FEATURE_CORRUPTIONS])
def test_paged_attention_rejects_bad_options(name, corrupt, match, backend):
    assert_rejected(ops.paged_attention, dict(BASE_ATTN, backend=backend), corrupt, match)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("name, corrupt, match", [c for c in FEATURE_CORRUPTIONS if "scale" in c[0] or "fp8" in c[0]],
                         ids=[c[0] for c in FEATURE_CORRUPTIONS if "scale" in c[0] or "fp8" in c[0]])
def test_write_kv_rejects_bad_scales(name, corrupt, match, backend):
    assert_rejected(ops.write_kv, dict(BASE_WRITE, backend=backend), corrupt, match)


def test_paged_attention_rejects_max_seq_len_past_the_table():
    width = BASE_ATTN["block_tables"].shape[1] * BASE_ATTN["key_cache"].shape[1]
    assert_rejected(ops.paged_attention, BASE_ATTN, lambda c: c.update(max_seq_len=width + 1),
                    rf"max_seq_len={width + 1} exceeds what block_tables can address .* = {width}\)")


def test_fp8_scales():
    """One scale per token and KV head, from that token's amax over head_dim: amax / 448 rounded up to the next
    bfloat16 (the amax fits unclamped), 1 / 448 (rounded up) for an all-zero or non-finite head; never zero."""
    x = torch.zeros(5, 3, 8)  # [num_tokens, num_kv_heads, head_dim]
    x[2, 0, 3], x[4, 1, 0], x[1, 2, 5], x[3, 2, 1] = -448.0, 2.0, float("nan"), 1e-30
    scales = ops.fp8_scales(x)
    assert scales.dtype == torch.bfloat16 and scales.shape == (5, 3)
    wide = scales.float()
    amax = x.abs().amax(-1)
    real = torch.isfinite(amax) & (amax > 0)  # [5, 3]
    assert (wide > 0).all() and (amax[real] / wide[real] < 448).all()
    assert (amax[real] / wide[real] > 448 * (1 - 2.0**-7)).all()  # rounded up by under one bf16 step
    assert (wide[~real] == wide[0, 0]).all() and 1 / 448 < wide[0, 0] < (1 + 2.0**-7) / 448
    assert torch.equal(ops.fp8_scales(x[2:3]), scales[2:3])  # a token's scale depends on that token alone
    assert torch.equal(ops.fp8_scales(x.to(torch.bfloat16)), scales)
    for bad, match in ((torch.zeros(5), r"\[\.\.\., num_kv_heads, head_dim\]"),
                       (torch.zeros(5, 3, 8, dtype=torch.int32), r"float tensor")):
        with pytest.raises(ValueError, match=match):
            ops.fp8_scales(bad)


def test_fp8_write_then_attend_roundtrip_torch():
    # write_kv quantizes into a uint8 pool, each token with its own scales; attention reads back fp8 * scale: compare
    # with float64 attention over the dequantized logical K/V (what the pool really holds), and check the quantization
    # error is e4m3-sized.
    attn, write, logical = make_case([7, 12], [2, 1], num_kv_heads=2, group=2, head_dim=8, block_size=4)
    fp8 = _fp8_pool(attn)
    ops.write_kv(write["key"], write["value"], fp8["key_cache"], fp8["value_cache"], write["slot_mapping"],
                 backend="torch", k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
    dequantized = []
    for k, v in logical:
        dequantized.append(tuple(
            (x / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s[..., None]
            for x, s in ((k, ops.fp8_scales(k).float()), (v, ops.fp8_scales(v).float()))
        ))
        assert ((dequantized[-1][0] - k).abs() <= k.abs() / 16 + 1e-6).all()  # half a 3-bit-mantissa step
    expected = attention_float64(attn["query"], attn["query_start_loc"], attn["seq_lens"], attn["scale"], None,
                                 dequantized)
    out = ops.paged_attention(**fp8, backend="torch")
    assert (out.double() - expected).abs().max() < 1e-5


def test_copy_blocks_on_fp8_pool():
    """Copy-on-write of an fp8 pool copies the blocks' scales with their bits; a uint8 pool without its scale caches
    is refused (its bits alone mean nothing)."""
    key_cache = torch.randint(0, 0x7F, (4, 2, 1, 3), dtype=torch.uint8)
    value_cache = torch.randint(0, 0x7F, (4, 2, 1, 3), dtype=torch.uint8)
    k_scale, v_scale = torch.rand(4, 2, 1).to(torch.bfloat16), torch.rand(4, 2, 1).to(torch.bfloat16)
    before = [t.clone() for t in (key_cache, value_cache, k_scale, v_scale)]
    ops.copy_blocks(key_cache, value_cache, torch.tensor([3, 0]), torch.tensor([1, 2]), k_scale=k_scale,
                    v_scale=v_scale)
    for t, b in zip((key_cache, value_cache, k_scale, v_scale), before):
        assert torch.equal(t[[1, 2]], b[[3, 0]]) and torch.equal(t[[0, 3]], b[[0, 3]])
    with pytest.raises(ValueError, match="needs the scale caches k_scale and v_scale"):
        ops.copy_blocks(key_cache, value_cache, torch.tensor([3]), torch.tensor([1]))


# ---------------------------------------------------------------------------------------------------------------------
# Docstring examples
# ---------------------------------------------------------------------------------------------------------------------


def _literal_blocks(doc: str) -> list[str]:
    """The code blocks of a docstring: each indented block after a paragraph ending in ``::``, dedented."""
    lines = inspect.cleandoc(doc).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].rstrip().endswith("::"):
            i += 1
            continue
        j = i + 1
        block = []
        while j < len(lines) and (not lines[j].strip() or lines[j].startswith(" ")):
            block.append(lines[j])
            j += 1
        blocks.append(textwrap.dedent("\n".join(block)).strip())
        i = j
    return [b for b in blocks if b]


def _public_docstrings() -> dict:
    """name -> docstring of hf_paged.ops and everything its ``__all__`` (and the Triton module's) exports."""
    objects = {"hf_paged.ops": ops}
    objects.update({f"ops.{name}": getattr(ops, name) for name in ops.__all__})
    if ops.triton_available() or importlib.util.find_spec("triton") is not None:
        from hf_paged.ops import triton_kernels

        objects.update({f"triton_kernels.{name}": getattr(triton_kernels, name) for name in triton_kernels.__all__})
    return {name: obj.__doc__ or "" for name, obj in objects.items()}


DOCSTRINGS = _public_docstrings()
WITH_EXAMPLES = sorted(name for name, doc in DOCSTRINGS.items() if _literal_blocks(doc))


def test_public_docstrings_have_examples():
    """The public functions carry runnable examples (the ones the next test runs)."""
    assert {"hf_paged.ops", "ops.paged_attention", "ops.write_kv", "ops.copy_blocks", "ops.fp8_scales"} <= set(
        WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run_as_written(name, capsys):
    """Each docstring's code blocks, run in order in one fresh namespace (as a reader would paste them), raise
    nothing: no undefined name, no wrong shape."""
    namespace: dict = {}
    for block in _literal_blocks(DOCSTRINGS[name]):
        exec(compile(block, f"<{name} docstring>", "exec"), namespace)


# ---------------------------------------------------------------------------------------------------------------------
# The torch backend's plan in a model
# ---------------------------------------------------------------------------------------------------------------------


def test_one_torch_plan_per_step_shared_by_every_layer(monkeypatch):
    """In generate(), each forward's layers read through one plan object (built once per step on the host, not per
    layer), and a decode step's plan is one batched decode part with no index to scatter through."""
    from helpers import dynamic, generate, left_padded, tiny_model

    import hf_paged.ops
    from hf_paged import PagedCache, enable_paged_attention
    from hf_paged.ops import reference

    model = tiny_model("llama", num_hidden_layers=3)
    inputs = left_padded([3, 7])
    expected = generate(model, inputs, dynamic(model), max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    plans = []
    # the step planner holds its own reference; only a plan built inside the attention (per layer) would call this
    monkeypatch.setattr(reference, "plan_torch_attention", lambda *a, **k: pytest.fail("a plan built per layer"))

    def recording(query, key_cache, value_cache, meta, scale, **kwargs):
        plans.append(meta.plan)
        return real_attention(query, key_cache, value_cache, meta, scale, **kwargs)

    real_attention = hf_paged.ops.paged_attention_torch
    monkeypatch.setattr(hf_paged.ops, "paged_attention_torch", recording)
    out = generate(model, inputs, PagedCache(model.config, block_size=4), max_new_tokens=4)
    assert torch.equal(out, expected)
    per_step = [plans[i:i + 3] for i in range(0, len(plans), 3)]
    assert len(per_step) == 3 and all(len(step) == 3 for step in per_step)  # 3 decode steps (the prefill: no history)
    for step in per_step:
        assert step[0] is step[1] is step[2]
        (part,) = step[0].parts  # one decode part, rows in order: sliced, not gathered
        assert part.tables.shape == (2 * part.mask.shape[-1] // 4,) and part.q_index is None
    assert len({id(step[0]) for step in per_step}) == 3
