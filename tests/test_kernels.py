"""Triton kernels and the torch reference vs a float64 per-sequence computation, on scrambled block tables.

Runs on CPU under the Triton interpreter (TRITON_INTERPRET=1, set here when there is no CUDA device), or on CUDA. Error bounds come from the float64 result: the kernel may be at most a small
multiple of the same-dtype torch reference's error, with a floor of one ulp at 1.0.
"""

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
from hf_paged.ops.reference import paged_attention_torch, write_kv_torch  # noqa: E402
from hf_paged.ops.triton_kernels import choose_num_kv_splits, paged_attention_triton, write_kv_triton  # noqa: E402

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
# Case construction and the float64 oracle
# ---------------------------------------------------------------------------------------------------------------------


def make_case(seq_lens, q_lens, *, num_kv_heads, group, head_dim, block_size, dtype, window=None, seed=0):
    """A pool with each sequence's blocks at random physical places; everything never written is NaN.

    Table entries past a sequence's last block are -1, and so are blocks that slid out of the window of the
    sequence's first query. A kernel that reads an unwritten slot returns NaN; one that dereferences a -1 reads
    outside the pool.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + 2  # spare -1 columns
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    physical = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((num_seqs, width), -1, dtype=torch.int32)  # [num_seqs, width]
    taken = 0
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[s, :n_blocks] = physical[taken : taken + n_blocks].to(torch.int32)
        taken += n_blocks
        pos = torch.arange(seq_len)
        blocks, offsets = block_tables[s, pos // block_size].long(), pos % block_size
        key_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        value_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        if window is not None:
            first_visible = max(0, seq_len - q_lens[s] - window + 1)
            block_tables[s, : first_visible // block_size] = -1  # slid out of the window: freed
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    to = dict(device=DEVICE)
    return dict(
        query=query.to(**to),
        key_cache=key_cache.to(**to),
        value_cache=value_cache.to(**to),
        block_tables=block_tables.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc.to(**to),
        scale=head_dim**-0.5,
        sliding_window=window,
    )


def attention_float64(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window):
    """Per sequence, per position: gather the visible keys by hand and do softmax(q k^T) v in float64."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[s])
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if start == end:
            continue
        q_pos = torch.arange(seq_len - (end - start), seq_len)  # [q_len]
        lo = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
        pos = torch.arange(lo, seq_len)  # [L], only positions some query may see
        blocks = block_tables[s].cpu().long()[pos // block_size]
        k = key_cache.cpu()[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [L, Hq, D]
        v = value_cache.cpu()[blocks, pos % block_size].double().repeat_interleave(group, 1)
        q = query.cpu()[start:end].double()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, L]
        visible = pos[None, :] <= q_pos[:, None]  # [q_len, L]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def assert_close_to_float64(case, run_kernel, reference_case=None):
    """The kernel's max error vs float64 is within ERR_MULTIPLE x the torch reference's, or one ulp at 1.0.

    ``reference_case`` (default: ``case`` with NaN garbage zeroed) is what the torch reference runs on; it must hold
    the same sequences.
    """
    expected = attention_float64(**case)  # [num_tokens, num_q_heads, head_dim] float64
    dtype = case["query"].dtype
    if reference_case is None:
        # The reference lets NaN in masked slots through (0 * NaN in SDPA), so it gets a zeroed pool.
        zeroed = {name: case[name].nan_to_num(0.0) for name in ("key_cache", "value_cache")}
        reference_case = dict(case, **zeroed)
    reference = paged_attention_torch(**reference_case)
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
    return lambda case: paged_attention_triton(**case, **kw)


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
    out = paged_attention_triton(**case)
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
