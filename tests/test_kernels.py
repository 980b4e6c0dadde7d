"""Triton kernels and the torch reference vs a float64 per-sequence computation, on scrambled block tables.

Runs on CPU under the Triton interpreter (TRITON_INTERPRET=1, set here when there is no CUDA device), or on CUDA. Error bounds come from the float64 result: the kernel may be at most a small
multiple of the same-dtype torch reference's error, with a floor of one ulp at 1.0.
"""

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the Triton kernel tests need it")

from hf_paged import ops  # noqa: E402
from hf_paged.ops import triton_kernels  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hf_paged.ops.reference import (  # noqa: E402
    fp8_scales, paged_attention_torch, plan_torch_attention, quantize_fp8, write_kv_torch,
)
from hf_paged.ops.triton_kernels import choose_num_kv_splits, paged_attention_triton, write_kv_triton  # noqa: E402
from helpers import attention_float64, on_backend, scrambled_case  # noqa: E402

if triton_kernels._INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip(
        "hf_paged.ops.triton_kernels was imported before TRITON_INTERPRET=1 was set and there is no CUDA device; "
        "run with TRITON_INTERPRET=1 in the environment.",
        allow_module_level=True,
    )

ERR_MULTIPLE = 3  # kernel error vs float64 <= ERR_MULTIPLE x the torch reference's error, or eps(dtype) if larger
REF_ULPS = 8  # sanity bound on the reference itself: <= REF_ULPS x eps(dtype) x max|output|


# ---------------------------------------------------------------------------------------------------------------------
# Cases (tests/helpers/attention.py: scrambled block tables, NaN in unwritten slots) and the float64 oracle
# ---------------------------------------------------------------------------------------------------------------------

make_case = functools.partial(scrambled_case, device=DEVICE)


def assert_close_to_float64(case, run_kernel, reference_case=None):
    """The kernel's max error vs float64 is within ERR_MULTIPLE x the torch reference's, or one ulp at 1.0.

    ``reference_case`` (default: ``case``, NaN in every unwritten slot: the torch backend must not let it through
    either) is what the torch reference runs on; it must hold the same sequences.
    """
    expected = attention_float64(**case)  # [num_tokens, num_q_heads, head_dim] float64
    dtype = case["query"].dtype
    reference = on_backend(paged_attention_torch, case if reference_case is None else reference_case)
    kernel = run_kernel(case)
    assert kernel.shape == case["query"].shape and kernel.dtype == dtype
    ref_err = (reference.cpu().double() - expected).abs().max().item()
    kernel_err = (kernel.cpu().double() - expected).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert ref_err <= REF_ULPS * eps * max(1.0, expected.abs().max().item()), f"torch reference off by {ref_err:.3g}"
    floor = eps  # one ulp at 1.0, for cases where the reference happens to be (nearly) exact
    bound = max(ERR_MULTIPLE * ref_err, floor)
    if triton_kernels._INTERPRETED and dtype == torch.bfloat16:
        # Triton 3.9's interpreter truncates fp32 -> bf16 where GPUs round to nearest: up to one more ulp of |out|.
        bound += eps * expected.abs().max().item()
    assert kernel_err <= bound, f"kernel error {kernel_err:.3g} > bound {bound:.3g} (reference error {ref_err:.3g})"


def triton_direct(**kw):
    return lambda case: on_backend(paged_attention_triton, case, **kw)


def triton_public(case):
    return ops.paged_attention(**case, backend="triton")


# ---------------------------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------------------------

# (seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window)
DECODE_CASES = {
    "fp32-d64-bs16-gqa4": ([1, 16, 17, 200], 2, 4, 64, 16, torch.float32, None),
    "fp16-d128-bs8-gqa8": ([8, 9, 150], 1, 8, 128, 8, torch.float16, None),
    "bf16-d80-bs32-gqa2-window": ([32, 33, 250], 2, 2, 80, 32, torch.bfloat16, 150),
    "fp16-d64-bs128-mha": ([1, 128, 129], 2, 1, 64, 128, torch.float16, None),
    "fp32-d48-bs64-gqa3-window": ([64, 65, 5, 190], 1, 3, 48, 64, torch.float32, 9),
}


@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["one-split", "split-kv"])
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_float64(name, num_kv_splits):
    seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window = DECODE_CASES[name]
    case = make_case(
        seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, window=window,
    )
    assert_close_to_float64(case, triton_direct(num_kv_splits=num_kv_splits))


def test_decode_with_idle_sequences_and_more_splits_than_tiles():
    # q_len 0 rows (sequences with nothing to compute this step) and splits that end up empty for short sequences.
    seq_lens, q_lens = [5, 300, 17, 260], [1, 0, 1, 1]
    case = make_case(seq_lens, q_lens, num_kv_heads=1, group=2, head_dim=64, block_size=16, dtype=torch.float32)
    assert_close_to_float64(case, triton_direct(num_kv_splits=8))


def test_decode_auto_split_through_public_api():
    seq_lens = [700, 300]
    assert choose_num_kv_splits(len(seq_lens), 1, max(seq_lens), triton_kernels._DEFAULT_NUM_SMS) > 1
    case = make_case(seq_lens, [1, 1], num_kv_heads=1, group=4, head_dim=64, block_size=32, dtype=torch.float16)
    assert_close_to_float64(case, triton_public)


def test_choose_num_kv_splits():
    sms = 132
    assert choose_num_kv_splits(num_seqs=256, num_kv_heads=8, max_kv_len=32768, num_sms=sms) == 1  # GPU already full
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_kv_len=200, num_sms=sms) == 1  # too short to split
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_kv_len=1024, num_sms=sms) == 4  # capped by length
    assert choose_num_kv_splits(num_seqs=4, num_kv_heads=8, max_kv_len=65536, num_sms=sms) == 9  # fills the GPU
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=1, max_kv_len=1 << 20, num_sms=sms) == 32  # capped


# ---------------------------------------------------------------------------------------------------------------------
# Prefill / extend
# ---------------------------------------------------------------------------------------------------------------------

# (seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, dtype, window)
PREFILL_CASES = {
    # pure prefill, extend after history, a q_len-0 row, a decode row, several query tiles
    "fp32-d64-bs16-gqa2": ([5, 40, 9, 33, 80], [5, 17, 0, 1, 75], 2, 2, 64, 16, torch.float32, None),
    "fp16-d128-bs32-gqa8": ([32, 50], [16, 33], 1, 8, 128, 32, torch.float16, None),
    "bf16-d64-bs8-gqa4-window": ([24, 41], [24, 9], 1, 4, 64, 8, torch.bfloat16, 11),
    "fp16-d96-bs64-mha-window": ([65, 130], [65, 3], 2, 1, 96, 64, torch.float16, 40),
    "fp32-d80-bs16-gqa3": ([16, 17], [3, 17], 2, 3, 80, 16, torch.float32, None),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_matches_float64(name):
    seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, dtype, window = PREFILL_CASES[name]
    case = make_case(
        seq_lens, q_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, window=window, seed=1,
    )
    assert_close_to_float64(case, triton_public)


def test_empty_batch_and_all_idle():
    case = make_case([4, 7], [0, 0], num_kv_heads=1, group=2, head_dim=64, block_size=8, dtype=torch.float32)
    out = on_backend(paged_attention_triton, case)
    assert out.shape == (0, 2, 64)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_batches_match_float64(data):
    num_seqs = data.draw(st.integers(1, 4), label="num_seqs")
    seq_lens = data.draw(st.lists(st.integers(1, 160), min_size=num_seqs, max_size=num_seqs), label="seq_lens")
    decode = data.draw(st.booleans(), label="decode")
    q_lens = [data.draw(st.integers(0, 1 if decode else min(n, 40))) for n in seq_lens]
    q_lens[0] = max(q_lens[0], 1)
    case = make_case(
        seq_lens, q_lens,
        num_kv_heads=data.draw(st.integers(1, 2), label="num_kv_heads"),
        group=data.draw(st.sampled_from([1, 2, 3, 4, 8]), label="group"),
        head_dim=data.draw(st.sampled_from([16, 48, 64, 80, 128]), label="head_dim"),
        block_size=data.draw(st.sampled_from([8, 16, 32, 64]), label="block_size"),
        dtype=data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), label="dtype"),
        window=data.draw(st.one_of(st.none(), st.integers(1, 100)), label="window"),
        seed=data.draw(st.integers(0, 1000), label="seed"),
    )
    num_kv_splits = data.draw(st.sampled_from([None, 1, 2, 5]), label="num_kv_splits") if decode else None
    assert_close_to_float64(case, triton_direct(num_kv_splits=num_kv_splits))


def test_pool_past_int32_offsets():
    # A pool of more than 2**31 elements, with data in its last blocks: 32-bit offsets would wrap (and crash).
    block_size, head_dim, seq_len = 16, 64, 40
    num_blocks = (1 << 31) // (block_size * head_dim) + 64
    try:  # 4 GiB of address space; pages are only touched where written
        pool = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError):
        pytest.skip("could not reserve a 4 GiB pool")
    block_tables = torch.tensor([[num_blocks - 1, 5, num_blocks - 40]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(seq_len, device=DEVICE)
    slot_mapping = block_tables[0].long()[pos // block_size] * block_size + pos % block_size  # int64, > 2**31
    kv = torch.randn(seq_len, 1, head_dim, device=DEVICE).half()  # keys double as values: one pool for both
    write_kv_triton(kv, kv, pool, pool, slot_mapping)
    assert torch.equal(pool.view(-1, 1, head_dim)[slot_mapping], kv)
    case = dict(
        query=torch.randn(1, 2, head_dim, device=DEVICE).half(), key_cache=pool, value_cache=pool,
        block_tables=block_tables, seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), scale=0.125, sliding_window=None,
    )
    # the same sequence in a 3-block pool, for the torch reference
    small_pool = pool[block_tables[0].long()]
    small_table = torch.arange(3, dtype=torch.int32, device=DEVICE)[None]
    compact = dict(case, key_cache=small_pool, value_cache=small_pool, block_tables=small_table)
    assert_close_to_float64(case, triton_direct(), reference_case=compact)


# ---------------------------------------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache_dtype,input_dtype,slot_dtype",
    [
        (torch.bfloat16, torch.bfloat16, torch.int32),
        (torch.float16, torch.float32, torch.int64),  # cast on write
        (torch.float32, torch.float32, torch.int64),
    ],
)
# No fp32 -> bf16 case: Triton 3.9's interpreter truncates that cast where the GPU (and torch) round to nearest even.
def test_write_kv_matches_torch_exactly(cache_dtype, input_dtype, slot_dtype):
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 80, 20
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(slot_dtype)
    # key arrives as a transposed view, as from a [num_kv_heads, num_tokens, head_dim] projection
    key = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).to(input_dtype).transpose(0, 1)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(input_dtype)
    args = [t.to(DEVICE) for t in (key, value, key_cache, value_cache, slot_mapping)]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv_torch(key, value, expected_k, expected_v, slot_mapping)
    ops.write_kv(*args, backend="triton")
    assert torch.equal(args[2].cpu(), expected_k) and torch.equal(args[3].cpu(), expected_v)


def test_write_kv_skips_negative_slots():
    key_cache = torch.zeros(2, 8, 1, 16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    kv = torch.ones(3, 1, 16, device=DEVICE)
    write_kv_triton(kv, kv, key_cache, value_cache, torch.tensor([3, -1, 9], device=DEVICE))
    written = key_cache.flatten(0, 1)[:, 0, 0]  # [num_blocks * block_size]
    assert written.nonzero().flatten().tolist() == [3, 9]
    assert torch.equal(key_cache, value_cache)


# ---------------------------------------------------------------------------------------------------------------------
# Soft-capping, attention sinks, fp8 blocks (both backends: the torch reference is checked inside
# assert_close_to_float64 too, on the same NaN-garbage pool)
# ---------------------------------------------------------------------------------------------------------------------

FEATURES = {
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=True),
    "fp8": dict(kv_fp8=True),
    "all": dict(softcap=1.5, sinks=True, kv_fp8=True),
}


@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["one-split", "split-kv"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", ["fp32-d64-bs16-gqa4", "bf16-d80-bs32-gqa2-window", "fp16-d64-bs128-mha"])
def test_decode_features_match_float64(name, feature, num_kv_splits):
    # split-KV: the sinks must join the denominator once (in the merge), not once per split
    seq_lens, num_kv_heads, group, head_dim, block_size, dtype, window = DECODE_CASES[name]
    case = make_case(
        seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, window=window, seed=3, **FEATURES[feature],
    )
    assert_close_to_float64(case, triton_direct(num_kv_splits=num_kv_splits))


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", ["fp32-d64-bs16-gqa2", "bf16-d64-bs8-gqa4-window"])
def test_prefill_features_match_float64(name, feature):
    seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, dtype, window = PREFILL_CASES[name]
    case = make_case(
        seq_lens, q_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, window=window, seed=4, **FEATURES[feature],
    )
    assert_close_to_float64(case, triton_public)


def span_limits(seq_lens, q_lens, spans) -> torch.Tensor:
    """``[num_tokens]`` int32 query limits: each query's own position, or the last position of the span (per
    sequence, ``[start, end)`` within its queries) holding it."""
    limits = []
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        for p in range(seq_len - q_len, seq_len):
            limits.append(next((end - 1 for start, end in spans.get(s, []) if start <= p < end), p))
    return torch.tensor(limits, dtype=torch.int32, device=DEVICE)


# name -> (PREFILL_CASES entry, {sequence: bidirectional spans within its queries}): a continued chunk with a span
# in its middle, a fresh prompt that is one span, spans crossing blocks and the window's edge
SPAN_CASES = {
    "fp32-d64-bs16-gqa2": ("fp32-d64-bs16-gqa2", {1: [(25, 33)], 3: [(32, 33)], 4: [(10, 30), (40, 70)]}),
    "bf16-d64-bs8-gqa4-window": ("bf16-d64-bs8-gqa4-window", {0: [(3, 12)], 1: [(33, 41)]}),
    "fp32-d80-bs16-gqa3": ("fp32-d80-bs16-gqa3", {0: [(13, 16)], 1: [(0, 17)]}),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(SPAN_CASES))
def test_prefill_with_bidirectional_spans_matches_float64(name, backend):
    """A query inside a bidirectional span sees every position of its span (later ones too), its window still
    counting back from its own position; torch (the read layout's mask) and Triton (per-query limits in the prefill
    kernel) both match float64, and the spans change the result."""
    entry, spans = SPAN_CASES[name]
    seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, dtype, window = PREFILL_CASES[entry]
    case = make_case(seq_lens, q_lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, window=window, seed=6)
    causal = attention_float64(**case)
    case["query_limits"] = span_limits(seq_lens, q_lens, spans)
    assert (attention_float64(**case) - causal).abs().max() > 1e-2  # the spans matter here
    if backend == "torch":
        got = ops.paged_attention(**case, backend="torch")
        expected = attention_float64(**case)
        eps = torch.finfo(dtype).eps
        assert (got.cpu().double() - expected).abs().max() <= REF_ULPS * eps * max(1.0, expected.abs().max().item())
        # the step planner's path: the read layout built once, with the limits in its masks
        layout = plan_torch_attention(case["block_tables"], case["seq_lens"], case["query_start_loc"], block_size,
                                      sliding_window=window, zero_unowned=True, query_limits=case["query_limits"])
        assert torch.equal(on_backend(paged_attention_torch, case, plan=layout), got)
    else:
        assert_close_to_float64(case, triton_public)


def test_features_change_the_result():
    # The options are not no-ops on these cases: each moves the float64 result well past the error bounds above.
    base = dict(num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32, seed=5)
    plain = attention_float64(**make_case([40, 9], [1, 1], **base))
    for options in FEATURES.values():
        changed = attention_float64(**make_case([40, 9], [1, 1], **base, **options))
        assert (changed - plain).abs().max() > 1e-2, options


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["float-pool", "fp8-pool"])
def test_torch_backend_never_reads_unowned_nan(decode, kv_fp8):
    # Unwritten slots (tails of last blocks, blocks nobody owns, blocks behind -1 table entries) hold NaN; the torch
    # backend must return the float64 result, not NaN. Removing its zeroing of unowned slots fails this test.
    q_lens = [1, 1, 1] if decode else [3, 20, 1]
    case = make_case([3, 20, 37], q_lens, num_kv_heads=2, group=2, head_dim=32, block_size=8, dtype=torch.float32,
                     window=12, kv_fp8=kv_fp8)
    out = ops.paged_attention(**case, backend="torch")
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - attention_float64(**case)).abs().max() < 1e-5


@pytest.mark.parametrize("options", [{}, dict(softcap=1.5, sinks=True), dict(kv_fp8=True)], ids=["plain", "cap+sinks",
                                                                                                   "fp8"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_bucketed_width_and_zero_padded_tables(decode, options):
    # The step planner's shape: tables padded with block 0 (not -1), max_seq_len = the full table width (above every
    # seq_len), one read layout shared by layers; block 0 holds another sequence's (finite) data. Positions past seq_lens
    # must be masked by seq_lens alone.
    seq_lens, q_lens = [9, 30], ([1, 1] if decode else [4, 4])  # one part: it takes the bucketed width
    case = make_case(seq_lens, q_lens, num_kv_heads=1, group=4, head_dim=32, block_size=8, dtype=torch.float32,
                     seed=6, **options)
    garbage = 0x38 if options.get("kv_fp8") else 7.0  # large finite values (0x38 = 1.0 in e4m3fn)
    for cache in (case["key_cache"], case["value_cache"]):
        cache[cache.isnan() if cache.is_floating_point() else cache == 0x7F] = garbage
    for scales in (case.get("k_scale"), case.get("v_scale")):  # fp8: finite scales in the unwritten slots too
        if scales is not None:
            scales[scales.isnan()] = 3.0
    tables = case["block_tables"].clone()
    tables[tables < 0] = 0
    block_size, width = case["key_cache"].shape[1], tables.shape[1]
    case = dict(case, block_tables=tables)
    expected = attention_float64(**case)
    max_seq_len, max_query_len = width * block_size, max(q_lens)
    layout = plan_torch_attention(tables, case["seq_lens"], case["query_start_loc"], block_size, max_seq_len=max_seq_len)
    assert len(layout.parts) == 1 and layout.parts[0].mask.shape[-1] == max_seq_len > max(seq_lens)
    sizes = dict(max_query_len=max_query_len, max_seq_len=max_seq_len)
    torch_out = on_backend(functools.partial(ops.paged_attention_unchecked, backend="torch"), case, plan=layout, **sizes)
    triton_out = on_backend(functools.partial(ops.paged_attention_unchecked, backend="triton"), case, **sizes)
    for out in (torch_out, triton_out):
        assert (out.cpu().double() - expected).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# fp8 conversion and the fp8 KV write
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _encode_kernel(x_ptr, bits_ptr, N: tl.constexpr, FP8_NATIVE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(bits_ptr + offs, triton_kernels._float_to_fp8(tl.load(x_ptr + offs), FP8_NATIVE))


@triton.jit
def _decode_bits_kernel(bits_ptr, x_ptr, N: tl.constexpr, FP8_NATIVE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, triton_kernels._fp8_to_float(tl.load(bits_ptr + offs), FP8_NATIVE))


def _native_fp8_modes():
    # The interpreter's fp32 -> fp8 cast mis-rounds (no carry into the exponent); native encode only on sm_89+.
    native = DEVICE == "cuda" and triton_kernels._capability(torch.device("cuda")) >= 89
    return [False, True] if native else [False]


@pytest.mark.parametrize("native", [False, True], ids=["bitwise", "native"])
def test_fp8_decode_is_exact_for_every_code(native):
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bits = bits[(bits & 0x7F) != 0x7F].contiguous()  # all but the two NaN codes
    n = triton.next_power_of_2(bits.numel())
    padded = torch.zeros(n, dtype=torch.uint8)
    padded[: bits.numel()] = bits
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _decode_bits_kernel[(1,)](padded.to(DEVICE), out, N=n, FP8_NATIVE=native)
    expected = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu()[: bits.numel()], expected)


@pytest.mark.parametrize("native", _native_fp8_modes(), ids=lambda n: "native" if n else "bitwise")
def test_fp8_encode_rounds_like_torch(native):
    # every e4m3fn value, the midpoints between neighbours (ties to even), just either side of them, out-of-range
    # values (clamped to +-448), subnormals and random values over the whole range
    codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # [127]
    mids = (codes[1:] + codes[:-1]) / 2
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([codes, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                   torch.tensor([448.0, 449.0, 464.0, 1e6, 1e-12, 2.0**-10, 3 * 2.0**-11]),
                   torch.randn(1500, generator=gen) * 2.0 ** torch.randint(-12, 9, (1500,), generator=gen)])
    x = torch.cat([x, -x])
    n = triton.next_power_of_2(x.numel())
    padded = torch.zeros(n)
    padded[: x.numel()] = x
    bits = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(1,)](padded.to(DEVICE), bits, N=n, FP8_NATIVE=native)
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    mismatch = (bits.cpu()[: x.numel()] != expected).nonzero().flatten()
    assert mismatch.numel() == 0, f"{x[mismatch[:5]].tolist()} -> {bits.cpu()[mismatch[:5]].tolist()}"


def test_fp8_write_kv_matches_torch_bits():
    """The Triton write stores the torch reference's fp8 bits and per-(token, KV head) bf16 scales, bit for bit; each
    scale is the token's own amax / 448 rounded up to bf16 (nothing clamped) and the bits quantize the input."""
    gen = torch.Generator().manual_seed(8)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 8, 3, 48, 17
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * torch.tensor([0.1, 1.0, 30.0])[:, None]
    key *= 2.0 ** torch.randint(-20, 20, (num_tokens, 1, 1), generator=gen)  # every token its own range
    key[3, 1] = 0.0  # an all-zero head still gets a nonzero scale
    value = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).transpose(0, 1)  # a strided view
    value[5, 2, 7] = 1e4  # one outlier: under a shared scale it would crush its neighbours
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    expected = [torch.full(pool_shape, 0x7F, dtype=torch.uint8) for _ in "kv"] + [
        torch.full(pool_shape[:3], float("nan"), dtype=torch.bfloat16) for _ in "kv"]
    got = [t.clone().to(DEVICE) for t in expected]
    write_kv_torch(key, value, expected[0], expected[1], slot_mapping, expected[2], expected[3])
    ops.write_kv(key.to(DEVICE), value.to(DEVICE), got[0], got[1], slot_mapping.to(DEVICE), backend="triton",
                 k_scale=got[2], v_scale=got[3])
    for g, e in zip(got, expected):  # bits (NaN in the slots nobody wrote compares equal as bits)
        assert torch.equal(g.cpu().view(torch.uint8), e.view(torch.uint8))
    for x, bits, scales in ((key, expected[0], expected[2]), (value, expected[1], expected[3])):
        scale = scales.view(-1, num_kv_heads)[slot_mapping].float()  # [num_tokens, Hkv]
        assert torch.equal(scale, fp8_scales(x).float())
        amax = x.abs().amax(-1)  # [num_tokens, Hkv]
        real = amax > 0
        assert (amax[real] / scale[real] < 448).all() and (amax[real] / scale[real] > 448 * (1 - 2.0**-7)).all()
        assert (scale[~real] == fp8_scales(torch.ones(1, 1, 1))[0, 0].float()).all()  # as for amax 1: 1 / 448 up
        stored = bits.view(-1, num_kv_heads, head_dim)[slot_mapping].view(torch.float8_e4m3fn).float()
        dequant = stored * scale[..., None]  # within half an e4m3 step (2**-4 relative, subnormals 2**-10 * scale)
        assert ((dequant - x).abs() <= x.abs() / 16 + scale[..., None] * 2.0**-10).all()


# ---------------------------------------------------------------------------------------------------------------------
# Launch choices (shared with the build check) and graph-capturable launches
# ---------------------------------------------------------------------------------------------------------------------


def _params(kernel_name):
    import inspect

    kernel = getattr(triton_kernels, kernel_name)
    return list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


@pytest.mark.parametrize("kind,split", [("decode", False), ("decode", True), ("prefill", False), ("write_kv", False)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.uint8])
def test_launch_choices_cover_every_constexpr(kind, split, kv_dtype):
    for cap in (80, 90):
        choices = triton_kernels.launch_choices(torch.bfloat16, kv_dtype, 128, 4, 16, split, kind, softcap=True,
                                                sinks=True, capability=cap, interpreted=False)
        assert [c.kernel for c in choices] == {
            "decode": ["_decode_kernel", "_merge_splits_kernel"] if split else ["_decode_kernel"],
            "prefill": ["_prefill_kernel"], "write_kv": ["_write_kv_kernel"]}[kind]
        for c in choices:
            assert list(c.signature) == _params(c.kernel)
            assert {n for n, t in c.signature.items() if t == "constexpr"} == set(c.constexprs)
            if "KV_FP8" in c.constexprs:
                assert c.constexprs["KV_FP8"] == (kv_dtype == torch.uint8)
                assert c.signature["k_cache_ptr"] == ("*u8" if kv_dtype == torch.uint8 else "*bf16")
                assert c.constexprs["FP8_NATIVE"] == (cap >= 89)  # Triton has no float8e4nv before sm_89
            if c.kernel == "_decode_kernel":  # sinks: in the merge when split, else in the decode kernel
                assert c.constexprs["USE_SINKS"] == (not split)
            if c.kernel in ("_merge_splits_kernel", "_prefill_kernel"):
                assert c.constexprs["USE_SINKS"]


class _RecordingKernel:
    """Stands in for a @triton.jit kernel: records grid and arguments instead of running."""

    def __init__(self, kernel, calls):
        self.fn, self.calls, self.name = getattr(kernel, "fn", kernel), calls, kernel.__name__

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid, args, kwargs))


def _record_launches(monkeypatch):
    calls = []
    for name in ("_decode_kernel", "_merge_splits_kernel", "_prefill_kernel", "_write_kv_kernel"):
        monkeypatch.setattr(triton_kernels, name, _RecordingKernel(getattr(triton_kernels, name), calls))
    return calls


def _forbid_host_sync(monkeypatch):
    def sync(*args, **kwargs):
        raise AssertionError("the launcher read a tensor's value on the host (a device sync)")

    for method in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, method, sync)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_launchers_do_not_sync_when_maxima_are_given(monkeypatch, decode):
    q_lens = [1, 1] if decode else [5, 2]
    case = make_case([600, 20], q_lens, num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=torch.bfloat16,
                     softcap=2.0, sinks=True, kv_fp8=True)
    calls = _record_launches(monkeypatch)
    grids = []
    for seq_lens in ([600, 20], [9, 3]):  # different values, same shapes: same grid
        case["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        with monkeypatch.context() as m:
            _forbid_host_sync(m)
            on_backend(paged_attention_triton, case, max_query_len=max(q_lens), max_seq_len=640)
        grids.append([grid for _, grid, _, _ in calls])
        calls.clear()
    assert grids[0] == grids[1]
    with monkeypatch.context() as m, pytest.raises(AssertionError, match="device sync"):
        _forbid_host_sync(m)  # the guard sees a sync: without the maxima the launcher must read them
        on_backend(paged_attention_triton, case)
    expected = triton_kernels.launch_choices(
        torch.bfloat16, torch.uint8, 64, 4, 16, len(grids[0]) > 1, "decode" if decode else "prefill", softcap=True,
        sinks=True, max_query_len=max(q_lens), num_splits=grids[0][0][2] if decode else None)
    assert len(grids[0]) == len(expected)
    calls.clear()
    on_backend(paged_attention_triton, case, max_query_len=max(q_lens), max_seq_len=640)
    for (name, _, _, kwargs), choice in zip(calls, expected):  # the launchers launch what launch_choices says
        assert name == choice.kernel
        assert {k: kwargs[k] for k in choice.constexprs} == choice.constexprs
        assert (kwargs["num_warps"], kwargs["num_stages"]) == (choice.num_warps, choice.num_stages)


# ---------------------------------------------------------------------------------------------------------------------
# Launch specs: decisions made once per key
# ---------------------------------------------------------------------------------------------------------------------


def test_launch_spec_cache_returns_the_same_spec_per_key(monkeypatch):
    """Same shapes, dtypes, device and options: the very same spec, and no decision work (launch_choices, the split
    count) on the way; a changed shape, dtype or option: another spec, whose launches follow the change."""
    case = make_case([600, 20], [1, 1], num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=torch.float32)
    q, kc, bt = case["query"], case["key_cache"], case["block_tables"]
    spec = triton_kernels.attention_spec(q, kc, bt, 0.125, None, 1, 640)
    with monkeypatch.context() as m:
        for name in ("launch_choices", "choose_num_kv_splits", "_build_attention_spec"):
            m.setattr(triton_kernels, name, lambda *a, **k: pytest.fail("a cached spec was worked out again"))
        assert triton_kernels.attention_spec(q.clone(), kc, bt.clone(), 0.125, None, 1, 640) is spec
        calls = _record_launches(m)
        on_backend(paged_attention_triton, case, max_query_len=1, max_seq_len=640)  # the launcher too: from the cache
    assert [(name, grid) for name, grid, _, _ in calls] == [(launch.kernel, launch.grid) for launch in spec.launches]

    three = make_case([600, 20, 7], [1, 1, 1], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                      dtype=torch.float32)
    other_batch = triton_kernels.attention_spec(three["query"], three["key_cache"], three["block_tables"], 0.125,
                                                None, 1, 640)
    assert other_batch is not spec and other_batch.launches[0].grid[0] == 3
    half = triton_kernels.attention_spec(q.half(), kc.half(), bt, 0.125, None, 1, 640)
    assert half is not spec and half.launches[0].options["DOT_PRECISION"] == "tf32"
    windowed = triton_kernels.attention_spec(q, kc, bt, 0.125, 64, 1, 640)
    assert windowed is not spec and windowed.launches[0].scalars[2] == 64  # the window argument
    short = triton_kernels.attention_spec(q, kc, bt, 0.125, None, 1, 32)  # too short to split
    assert len(spec.launches) == 2 and len(short.launches) == 1
    prefill = triton_kernels.attention_spec(q, kc, bt, 0.125, None, 5, None)
    assert [launch.kernel for launch in prefill.launches] == ["_prefill_kernel"]
    assert triton_kernels.attention_spec(q, kc, bt, 0.125, None, 5, 999) is prefill  # max_seq_len: decode only

    key = case["query"][:, :2].contiguous()  # [2, Hkv, D]: two tokens written
    write = triton_kernels.write_kv_spec(key, key, kc)
    assert triton_kernels.write_kv_spec(key.clone(), key.clone(), kc) is write
    more = triton_kernels.write_kv_spec(torch.cat([key, key]), torch.cat([key, key]), kc)
    assert more is not write and more.launches[0].grid == (4,) and write.launches[0].grid == (2,)
    strided = case["query"][:, :2]  # a view with other strides: another spec, launched with its strides
    assert triton_kernels.write_kv_spec(strided, strided, kc).launches[0].scalars[1:4] == strided.stride()


def test_split_kv_partials_are_reused():
    """Split-KV scratch comes back for the same device and shape (nothing allocated per call) and is another buffer
    for another shape; results stay exact call after call."""
    device = torch.device(DEVICE)
    first = triton_kernels._partials(device, (2, 8, 3, 64))
    assert triton_kernels._partials(device, (2, 8, 3, 64)) is first
    assert triton_kernels._partials(device, (2, 8, 4, 64))[0].data_ptr() != first[0].data_ptr()
    case = make_case([300, 90], [1, 1], num_kv_heads=1, group=4, head_dim=32, block_size=16, dtype=torch.float32)
    for _ in range(2):
        assert_close_to_float64(case, triton_direct(num_kv_splits=3, max_query_len=1, max_seq_len=304))


# ---------------------------------------------------------------------------------------------------------------------
# The torch backend's layout: rows grouped by query count, runs of blocks read as views
# ---------------------------------------------------------------------------------------------------------------------


def test_read_layout_groups_rows_by_query_count():
    """A mixed step (a 40-token chunk over a long history, three decode rows, an idle row): the decode rows are one
    call over their own longest context, the chunk another, padded to nothing; the result is the float64 one."""
    seq_lens, q_lens, block_size = [200, 30, 45, 12, 70], [40, 1, 1, 0, 1], 16
    case = make_case(seq_lens, q_lens, num_kv_heads=2, group=3, head_dim=32, block_size=block_size,
                     dtype=torch.float32, seed=9)
    layout = plan_torch_attention(case["block_tables"], case["seq_lens"], case["query_start_loc"], block_size,
                                zero_unowned=True)  # NaN pool: unowned slots zeroed
    decode, chunk = layout.parts  # the decode rows first (contexts 30-70: one part), then the chunk
    assert chunk.q_index.tolist() == list(range(40)) and chunk.mask.shape == (1, 1, 40, 208)
    assert decode.tables.shape == (3 * 5,) and decode.mask.shape == (3, 1, 1, 80)  # 70 tokens -> 5 blocks, not 13
    assert not layout.ordered and decode.q_index.tolist() == [40, 41, 42]  # the chunk comes first: scattered
    expected = attention_float64(**case)
    out = on_backend(paged_attention_torch, case, plan=layout)
    assert (out.double() - expected).abs().max() < 1e-5
    decode_only = plan_torch_attention(case["block_tables"][1:], case["seq_lens"][1:],
                                       case["query_start_loc"][1:] - 40, block_size)
    assert len(decode_only.parts) == 1 and decode_only.ordered  # rows in order: no scatter


@pytest.mark.parametrize("window", [None, 6, 24])
def test_read_layout_packed_step_reads_slices_and_fresh_chunks_unmasked(window):
    """A continuous-batching step: decode rows first, then chunks of 17, 9 and 17 tokens (two fresh prompts, one over
    a history, one fresh with 9): the layout is ordered (queries sliced, outputs concatenated), rows with the same count
    share one call, a fresh segment runs causal with no mask unless a window cuts it, and the result is the float64
    one, windowed or not."""
    seq_lens, q_lens, block_size = [50, 33, 17, 60, 9, 17], [1, 1, 17, 17, 9, 17], 8
    case = make_case(seq_lens, q_lens, num_kv_heads=2, group=2, head_dim=32, block_size=block_size,
                     dtype=torch.float32, seed=12, window=window)
    layout = plan_torch_attention(case["block_tables"], case["seq_lens"], case["query_start_loc"], block_size,
                                sliding_window=window, zero_unowned=True)
    assert layout.ordered is False  # the 9-token row sits between 17-token rows: one call for the 17s cannot slice
    by_count = {part.sizes()[1]: part for part in layout.parts}
    assert sorted(by_count) == [1, 9, 17] and by_count[17].sizes() == (3, 17)
    assert (by_count[9].mask is None) == (window is None or window >= 9)  # fresh: causal, unless the window cuts
    assert by_count[17].mask is not None  # one of its rows has history
    assert (on_backend(paged_attention_torch, case, plan=layout).double() - attention_float64(**case)).abs().max() < 1e-5
    in_order = [0, 1, 4, 2, 3, 5]  # decode, then the 9, then the 17s: the engine's order
    reordered = {k: case[k] for k in ("key_cache", "value_cache", "scale", "sliding_window")}
    reordered["block_tables"] = case["block_tables"][in_order]
    reordered["seq_lens"] = case["seq_lens"][in_order]
    counts = torch.tensor([q_lens[r] for r in in_order])
    reordered["query_start_loc"] = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    starts = case["query_start_loc"].tolist()
    reordered["query"] = torch.cat([case["query"][starts[r]:starts[r + 1]] for r in in_order])
    layout = plan_torch_attention(reordered["block_tables"], reordered["seq_lens"], reordered["query_start_loc"],
                                block_size, sliding_window=window, zero_unowned=True)
    assert layout.ordered and all(part.q_index is None for part in layout.parts)
    expected = attention_float64(**reordered)
    assert (on_backend(paged_attention_torch, reordered, plan=layout).double() - expected).abs().max() < 1e-5
    # a longer chunk before a shorter one (the engine's CPU padding row comes last) stays ordered too
    tail = make_case([50, 33, 40, 5], [1, 1, 17, 5], num_kv_heads=2, group=2, head_dim=32, block_size=block_size,
                     dtype=torch.float32, seed=13, window=window)
    layout = plan_torch_attention(tail["block_tables"], tail["seq_lens"], tail["query_start_loc"], block_size,
                                sliding_window=window, zero_unowned=True)
    assert layout.ordered and [part.sizes()[1] for part in layout.parts] == [1, 17, 5]
    assert (on_backend(paged_attention_torch, tail, plan=layout).double() - attention_float64(**tail)).abs().max() < 1e-5


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_read_layout_reads_a_run_of_blocks_as_a_view(decode):
    """One row whose blocks are consecutive in the pool is read as a view of it (nothing gathered), at the right
    place: every other block holds large finite garbage, which would show. A compiled step's layout never does."""
    q_len = 1 if decode else 6
    case = make_case([45], [q_len], num_kv_heads=2, group=2, head_dim=32, block_size=8, dtype=torch.float32, seed=10)
    blocks = case["block_tables"][0, :6].long()
    pool_k, pool_v = torch.full_like(case["key_cache"], 7.0), torch.full_like(case["value_cache"], -7.0)
    pool_k[2:8], pool_v[2:8] = case["key_cache"][blocks], case["value_cache"][blocks]  # the row at blocks 2..7
    pool_k[7, 5:], pool_v[7, 5:] = 0.0, 0.0  # past the row's 45 tokens: zeros, as hf_paged's own pools hold
    tables = torch.arange(2, 8, dtype=torch.int32, device=DEVICE)[None]
    case = dict(case, key_cache=pool_k, value_cache=pool_v, block_tables=tables)
    layout = plan_torch_attention(tables, case["seq_lens"], case["query_start_loc"], 8)
    assert layout.parts[0].run == 2
    out = on_backend(paged_attention_torch, case, plan=layout)
    assert (out.double() - attention_float64(**case)).abs().max() < 1e-5
    compiled = plan_torch_attention(tables, case["seq_lens"], case["query_start_loc"], 8, always_mask=True)
    assert all(part.run is None for part in compiled.parts)
    scrambled = tables.flip(1)
    assert plan_torch_attention(scrambled, case["seq_lens"], case["query_start_loc"], 8).parts[0].run is None


def test_read_layout_splits_decode_rows_by_context():
    """Decode rows of very different contexts (a few blocks and many) are read in separate parts, each only as wide
    as its own rows need; rows of similar context stay together (a split costs a call); the result is the float64
    one either way, the rows' outputs scattered back to their places."""
    seq_lens, block_size = [20, 300, 25, 290, 18, 30], 8
    case = make_case(seq_lens, [1] * 6, num_kv_heads=2, group=2, head_dim=32, block_size=block_size,
                     dtype=torch.float32, seed=14)
    layout = plan_torch_attention(case["block_tables"], case["seq_lens"], case["query_start_loc"], block_size,
                                zero_unowned=True)
    short, long = layout.parts
    assert short.sizes() == (4, 1) and short.mask.shape[-1] == 32 and long.mask.shape[-1] == 304
    assert short.q_index.tolist() == [0, 2, 4, 5] and long.q_index.tolist() == [1, 3] and not layout.ordered
    assert (on_backend(paged_attention_torch, case, plan=layout).double() - attention_float64(**case)).abs().max() < 1e-5
    similar = plan_torch_attention(case["block_tables"][[0, 2, 4, 5]], case["seq_lens"][[0, 2, 4, 5]],
                                   case["query_start_loc"][:5], block_size)
    assert len(similar.parts) == 1 and similar.ordered  # 18-30 tokens: splitting would save too little
    compiled = plan_torch_attention(case["block_tables"], case["seq_lens"], case["query_start_loc"], block_size,
                                    always_mask=True)
    assert len(compiled.parts) == 1  # a compiled step's shapes: one part per query count
