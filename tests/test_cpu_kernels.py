"""The C decode-attention kernel (``hf_paged/ops/decode_attention.c`` through ``hf_paged.ops.cpu_kernels``) against
the float64 oracle and the PyTorch reference it stands in for, on the model path's pools (zeros where nothing was
written, -1 table entries clamped by the plan): bf16 and fp32, head sizes with their loops as constants (64, 128)
and not (16 lanes x 5 = 80), 1 to 8 query heads per KV head, blocks of 1 to 16, sliding windows, rows of any length
side by side (odd lengths: the value pass pairs positions), head sizes up to 256; shapes outside the kernel (a head size not a multiple of 16, 9 query heads per KV head) run the
reference; and the fallback when no compiler builds it."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import attention_float64, on_backend, scrambled_case

from hf_paged.ops import cpu_kernels
from hf_paged.ops.reference import paged_attention_torch, plan_torch_attention

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler builds the CPU kernels here")

CASES = [  # (seq_lens, num_kv_heads, group, head_dim, block_size, window)
    ([272, 270, 1, 17, 300, 256, 33, 64], 3, 3, 64, 16, None),  # SmolLM2's attention shape, 8 decode rows
    ([5, 40, 129], 2, 4, 128, 8, None),
    ([31, 7, 64], 1, 1, 64, 1, None),
    ([50, 19], 4, 2, 80, 4, None),  # 80: five 16-lane chunks, the loops' general form
    ([23, 9, 41], 2, 8, 128, 16, None),  # 8 heads per KV head: the most the kernel takes
    ([100, 60, 9], 2, 3, 64, 16, 32),  # sliding window: masked positions and freed blocks
    ([45, 3, 70], 2, 8, 256, 4, None),  # the largest head the kernel takes, 8 query heads per KV head
    ([29, 64], 1, 2, 96, 8, None),  # 96: three 32-wide pairs of chunks in the AVX512-BF16 form
]
OUTSIDE = [  # shapes the kernel does not take: the reference runs
    ([23, 9, 41], 2, 9, 64, 16, None),  # 9 heads per KV head
    ([37, 12], 2, 2, 24, 4, None),  # 24: not a multiple of 16
]


def model_path_case(seq_lens, num_kv_heads, group, head_dim, block_size, window, dtype, seed=0):
    case = scrambled_case(seq_lens, [1] * len(seq_lens), num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                          block_size=block_size, dtype=dtype, window=window, seed=seed)
    for name in ("key_cache", "value_cache"):  # hf_paged's own pools hold zeros where nothing was written
        case[name] = torch.nan_to_num(case[name], nan=0.0)
    return case


def run(case, kernels: bool, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CPU_KERNELS", "1" if kernels else "0")
    plan = plan_torch_attention(case["block_tables"], case["seq_lens"], case["query_start_loc"],
                                case["key_cache"].shape[1], sliding_window=case["sliding_window"])
    return on_backend(paged_attention_torch, case, plan=plan)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", CASES, ids=[f"d{c[3]}-g{c[2]}-b{c[4]}-w{c[5]}" for c in CASES])
def test_kernel_matches_float64_and_the_reference(shape, dtype, monkeypatch):
    case = model_path_case(*shape, dtype=dtype)
    calls = []
    real = cpu_kernels.decode_attention

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cpu_kernels, "DTYPES", (torch.bfloat16, torch.float32))
    monkeypatch.setattr(cpu_kernels, "decode_attention", counted)
    got = run(case, True, monkeypatch)
    assert calls, "the kernel did not run"
    want = attention_float64(**{k: case[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                                     "seq_lens", "query_start_loc", "scale", "sliding_window")})
    reference = run(case, False, monkeypatch)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # bf16: the output's rounding (2^-8 of values up to ~2)
    assert (got.double() - want).abs().max() <= tol
    assert (reference.double() - want).abs().max() <= tol  # the reference is as close: the oracle is right
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("shape", OUTSIDE, ids=[f"d{c[3]}-g{c[2]}" for c in OUTSIDE])
def test_shapes_outside_the_kernel_run_the_reference(shape, monkeypatch):
    case = model_path_case(*shape, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *args: pytest.fail("the kernel ran"))
    got = run(case, True, monkeypatch)
    want = attention_float64(**{k: case[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                                     "seq_lens", "query_start_loc", "scale", "sliding_window")})
    assert (got.double() - want).abs().max() <= 1.6e-2


def test_bf16_is_where_the_model_path_takes_it(monkeypatch):
    """By default the kernel serves bf16 queries only (fp32 keeps SDPA, whose roundings fp32 token tests pin)."""
    assert cpu_kernels.DTYPES == (torch.bfloat16,)
    bf16 = model_path_case(*CASES[0], dtype=torch.bfloat16)
    fp32 = model_path_case(*CASES[0], dtype=torch.float32)
    assert cpu_kernels.supports(bf16["query"], bf16["key_cache"])
    assert not cpu_kernels.supports(fp32["query"], fp32["key_cache"])
    monkeypatch.setenv("HF_PAGED_CPU_KERNELS", "0")
    assert not cpu_kernels.supports(bf16["query"], bf16["key_cache"])


def test_without_a_compiler_the_reference_runs(monkeypatch, tmp_path):
    case = model_path_case(*CASES[1], dtype=torch.bfloat16)
    want = run(case, False, monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="did not build"):
            assert cpu_kernels.library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run(case, True, monkeypatch)
        assert torch.equal(got, want)
    finally:
        cpu_kernels.library.cache_clear()


@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (8, 12, 64), (37, 6, 128), (5, 3, 32), (3, 2, 256)])
def test_rotary_equals_torchs_bf16_operations_bit_for_bit(tokens, heads, dim):
    """The lean forward's rotary (``rotary.c``) against transformers' ``apply_rotary_pos_emb`` in bf16: the heads a
    view of a wider row (a fused q/k/v output), values over many binades so products and sums round at ties."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(tokens * 1000 + dim)
    row = torch.randn(tokens, (heads + 3) * dim, generator=gen) * torch.exp2(torch.randint(-8, 8, (1, (heads + 3) * dim),
                                                                                          generator=gen).float())
    row = row.to(torch.bfloat16)
    x = row.view(tokens, heads + 3, dim)[:, 1: heads + 1]  # [T, H, D], tokens at the row's stride
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    got = cpu_kernels.rotary(x, cos, sin)
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, want[0].transpose(0, 1))


def test_rotary_leaves_what_it_does_not_take_to_torch():
    x = torch.randn(2, 3, 64)
    cos = sin = torch.ones(2, 64)
    assert cpu_kernels.rotary(x, cos, sin) is None  # fp32: torch's operations
    x, cos = torch.randn(2, 3, 48).to(torch.bfloat16), torch.ones(2, 48).to(torch.bfloat16)
    assert cpu_kernels.rotary(x, cos, cos) is None  # a head size that is not a multiple of 32


@pytest.mark.parametrize("width", [16, 64, 100, 576, 896, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_rms_norm_equals_transformers_rmsnorm_bit_for_bit(width, rows):
    """The lean forward's RMSNorm (``rms_norm.c``) against transformers' own module in bf16: the squares summed in
    ATen's order (widths below one vector, with a scalar tail, past the sum's cascade levels), values over many
    binades."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(width + rows)
    norm = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
        x = (torch.randn(rows, width, generator=gen) * torch.exp2(torch.randint(-8, 8, (rows, width),
                                                                                generator=gen))).to(torch.bfloat16)
        want = norm(x)
    got = cpu_kernels.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert got is not None and torch.equal(got, want)


def test_rms_norm_leaves_what_it_does_not_take_to_torch(monkeypatch):
    x, weight = torch.randn(3, 64), torch.ones(64)
    assert cpu_kernels.rms_norm(x, weight, 1e-6) is None  # fp32
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    assert cpu_kernels.rms_norm(torch.randn(64, 3).to(torch.bfloat16).t(), weight, 1e-6) is None  # strided rows
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_kernels, "_RMS_AGREES", {64: False})  # another ATen summing in another order
    assert cpu_kernels.rms_norm(x, weight, 1e-6) is None
    monkeypatch.setattr(cpu_kernels, "_RMS_AGREES", {})
    assert cpu_kernels.rms_norm(x, weight, 1e-6) is not None
