"""The Triton MLA kernel (``hf_paged.ops.triton_mla``, under the interpreter on CPU) against the float64 oracle:
transformers' expansion of the latent through ``kv_b_proj``, attended in float64.

float32: within the same derived rounding bound as the torch path (helpers.mla.mla_error_bound). bfloat16 queries and
pool: the kernel's error against float64 is at most 1.5x the torch path's own bfloat16 error plus 2**-8 of the
output's largest value (both read the same rounded inputs; they differ in summation order, as PyTorch's flex-decoding
tests compare a kernel with the eager result of the same dtype). fp8 pools: equal to the torch path on the same bits
within float32's bound of the float64 oracle on the values the pool means.
"""

from __future__ import annotations

import pytest
import torch

from helpers import generate, left_padded
from helpers.mla import mla_case, mla_error_bound, mla_float64, tiny_mla_model
from hf_paged import PagedCache, enable_paged_attention
from hf_paged.ops import mla
from hf_paged.ops.reference import fp8_scales, quantize_fp8
from hf_paged.tools import kernel_check as kc

pytest.importorskip("triton")

CASES = {
    "decode": ([1, 9, 30, 17], [1, 1, 1, 1]),
    "prefill": ([12, 5], [12, 5]),
    "extend": ([20, 33], [6, 9]),
    "mixed": ([25, 1, 16, 40], [1, 1, 7, 1]),
}


def _module(**overrides):
    return tiny_mla_model("deepseek_v3", seed=3, **overrides).model.layers[0].self_attn


def _run(case, backend, dtype=torch.float32, **kw):
    args = dict(query=case["query"].to(dtype), kv_b_weight=case["kv_b_weight"].to(dtype), kv_b_bias=None,
                nope_dim=case["nope_dim"], latent_cache=case["latent_cache"], rope_cache=case["rope_cache"],
                meta=case["meta"], scale=case["scale"])
    args.update(kw)
    with torch.no_grad():
        return mla.paged_mla(**args, backend=backend).double()


@pytest.mark.parametrize("name", list(CASES))
def test_triton_float32_within_bound(name):
    """Decode, prefill, extend, and a mixed continuous-batching step on scrambled tables (unwritten slots NaN)."""
    case = mla_case(_module(), *CASES[name], seed=len(name))
    got = _run(case, "triton")
    assert torch.isfinite(got).all()
    excess = (got - mla_float64(case)).abs() - mla_error_bound(case)
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"


@pytest.mark.parametrize("splits", [2, 5])
def test_triton_split_kv_decode_within_bound(splits):
    """Decode with the context split (some splits empty for the short sequences) and merged by log-sum-exp."""
    case = mla_case(_module(), [1, 9, 70, 33], [1, 1, 1, 1], seed=11)
    heads = case["query"].shape[1]
    w_uk, w_uv = mla.split_kv_b(case["kv_b_weight"], heads, case["nope_dim"])
    with torch.no_grad():
        q_lat = mla.absorb_query(case["query"][..., :case["nope_dim"]], w_uk)
        out_lat = mla._triton_mla().mla_attention_triton(
            q_lat, case["query"][..., case["nope_dim"]:], case["latent_cache"], case["rope_cache"], case["meta"],
            case["scale"], num_kv_splits=splits)
        got = mla.project_out(out_lat, w_uv).double()
    excess = (got - mla_float64(case)).abs() - mla_error_bound(case)
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"


def test_triton_many_heads_and_odd_rank():
    """More heads than a program's 16 rows (two head groups), a rank and a rope width that are not powers of two."""
    module = _module(num_attention_heads=20, num_key_value_heads=20, kv_lora_rank=24, qk_rope_head_dim=6)
    case = mla_case(module, [7, 21], [3, 1], seed=9)
    excess = (_run(case, "triton") - mla_float64(case)).abs() - mla_error_bound(case)
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"


def test_triton_bfloat16_like_torch():
    case = mla_case(_module(), [9, 30], [3, 1], seed=4)
    for key in ("latent_cache", "rope_cache"):
        case[key] = case[key].to(torch.bfloat16)
    case["latents"] = [c.to(torch.bfloat16).float() for c in case["latents"]]  # what the pool holds
    case["ropes"] = [r.to(torch.bfloat16).float() for r in case["ropes"]]
    case["query"] = case["query"].to(torch.bfloat16).float()
    case["kv_b_weight"] = case["kv_b_weight"].to(torch.bfloat16).float()
    case["module"].kv_b_proj.weight.data = case["kv_b_weight"].clone()
    want = mla_float64(case)
    torch_err = (_run(case, "torch", torch.bfloat16) - want).abs().max()
    triton_err = (_run(case, "triton", torch.bfloat16) - want).abs().max()
    assert triton_err <= 1.5 * torch_err + 2**-8 * want.abs().max(), (triton_err, torch_err)


def test_triton_fp8_pool_within_bound():
    """uint8 (e4m3fn) latent and rope caches with a bf16 scale per token: within float32's bound of the float64
    oracle run on the values the pool means (bits times scale), so every token's two scales are read from its slot."""
    case = mla_case(_module(), [19, 7], [1, 2], seed=6)
    caches = {}
    for name in ("latent", "rope"):
        values = case[f"{name}_cache"].nan_to_num(0.0)
        values = values * 2.0 ** torch.randint(-2, 2, values.shape[:3] + (1,)).float()
        scales = fp8_scales(values)  # [blocks, block_size, 1]
        caches[f"{name}_cache"], caches[f"{name}_scale"] = quantize_fp8(values, scales), scales
        meant = caches[f"{name}_cache"].view(torch.float8_e4m3fn).float() * scales.float()[..., None]
        case[f"{name}_cache"] = meant
    case["latents"], case["ropes"] = _by_sequence(case["latent_cache"], case), _by_sequence(case["rope_cache"], case)
    got = _run(case, "triton", **caches)
    excess = (got - mla_float64(case)).abs() - mla_error_bound(case)
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"


def _by_sequence(cache, case):
    meta, block_size = case["meta"], cache.shape[1]
    rows = []
    for s, n in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(n)
        rows.append(cache[meta.block_tables[s, pos // block_size].long(), pos % block_size, 0])
    return rows


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_generate_on_the_triton_backend_equals_torch(kv_dtype):
    """generate() on the Triton backend (the latent written by the Triton write kernel, one pass for the latent and
    one for the rotated key; decode and a second turn's extend through ``_mla_kernel``) gives the torch backend's
    tokens, on a full-precision and an fp8 pool."""
    model = tiny_mla_model("deepseek_v3", seed=2)
    inputs = left_padded([4, 9], seed=8)
    runs = {}
    for backend in ("torch", "triton"):
        enable_paged_attention(model, backend=backend)
        cache = PagedCache(model.config, block_size=4, kv_dtype=kv_dtype, release_finished=False)
        first = generate(model, inputs, cache, max_new_tokens=4)
        follow = {"input_ids": torch.cat([first, first[:, -3:]], 1),
                  "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 7, dtype=torch.long)], 1)}
        runs[backend] = generate(model, follow, cache, max_new_tokens=4)
    assert torch.equal(runs["triton"], runs["torch"])


def test_check_kernels_builds_mla_at_deepseek_v3_shape_without_spills(tmp_path):
    """``python -m hf_paged check-kernels`` covers the MLA kernel at DeepSeek-V3's shape (rank 512, rope 64, 128
    heads): the CI set holds its decode and prefill in bf16 and fp16 as defaults; the launcher's own launch on meta
    tensors is what gets built, and the bf16 decode variant builds for sm_90 without spills."""
    mla_configs = [c for c in kc.configurations() if c.kind.startswith("mla")]
    defaults = {(c.kind, c.dtype) for c in mla_configs if c.default}
    assert {("mla_decode", "bf16"), ("mla_prefill", "bf16"), ("mla_decode", "fp16")} <= defaults
    config = next(c for c in mla_configs if c.kind == "mla_decode" and c.dtype == "bf16" and c.default)
    captured = kc.capture_in_worker(kc.KERNELS_MODULE, [config], (90,), kc.default_cache_dir())
    ((_, _, (variant,)),) = captured
    consts = dict(variant.constexprs)
    assert variant.kernel.endswith("triton_mla:_mla_kernel")
    assert (consts["RANK"], consts["ROPE"], consts["BLOCK_H"]) == (512, 64, 16)
    report = kc.check(captured, jobs=1, cache_dir=kc.default_cache_dir())
    assert report.problems() == []
    (build,) = report.builds
    assert build.error is None and build.spill_bytes == 0 and build.default
