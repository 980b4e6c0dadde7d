"""MLA's absorbed attention over a paged latent (``hf_paged.ops.mla``) against transformers' own attention: the
module's ``expand_kv`` of the whole latent history through ``kv_b_proj``, then softmax attention in float64.

Every case runs on scrambled block tables (each sequence's blocks at random physical places, unwritten slots NaN)
and must stay within :func:`helpers.mla.mla_error_bound`, a bound derived from float32 rounding alone (no
tolerance tuned on a machine); the bound itself must be small against the output, so the check cannot pass vacuously.
"""

from __future__ import annotations

import pytest
import torch

from helpers.mla import MLA_TYPES, mla_case, mla_error_bound, mla_float64, tiny_mla_model
from hf_paged.ops import mla
from hf_paged.ops.metadata import AttentionMetadata
from hf_paged.ops.reference import fp8_scales, plan_torch_attention, quantize_fp8

CASES = {
    "decode": ([1, 9, 30, 17], [1, 1, 1, 1]),
    "prefill": ([12, 5], [12, 5]),
    "extend": ([20, 33], [6, 9]),  # chunks of prompts after a history
    "mixed": ([25, 1, 16, 40], [1, 1, 7, 1]),  # a continuous-batching step: decodes and a chunk
}


def _attention(model_type: str, **overrides):
    model = tiny_mla_model(model_type, seed=3, **overrides)
    return model.model.layers[0].self_attn


def _run(case, backend="torch", **kw):
    args = {k: case[k] for k in ("query", "kv_b_weight", "kv_b_bias", "nope_dim", "latent_cache", "rope_cache",
                                 "meta", "scale")}
    return mla.paged_mla(**args, backend=backend, **kw)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_absorbed_attention_within_float32_bound(model_type, name):
    """Decode, prefill, extend and mixed steps: the absorbed attention's float32 result is within the derived bound
    of transformers' expansion attended in float64, at every element; the bound is under 1e-3 of the output's
    largest value."""
    seq_lens, q_lens = CASES[name]
    case = mla_case(_attention(model_type), seq_lens, q_lens, seed=len(name))
    with torch.no_grad():
        got = _run(case).double()
    want, bound = mla_float64(case), mla_error_bound(case)
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    excess = (got - want).abs() - bound
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"
    assert bound.max() < 1e-3 * want.abs().max()  # an indexing or scaling error is of the output's size


def test_absorbed_equals_expanded_in_float64():
    """In float64 the absorption is only a reassociation: equal to the expanded attention to float64 rounding."""
    module = _attention("deepseek_v3").double()
    case = mla_case(module, [13, 30], [4, 1], seed=5)
    for key in ("query", "latent_cache", "rope_cache"):
        case[key] = case[key].double()
    case["latents"] = [c.double() for c in case["latents"]]
    case["ropes"] = [r.double() for r in case["ropes"]]
    with torch.no_grad():
        got = _run(case)
    torch.testing.assert_close(got, mla_float64(case), rtol=1e-10, atol=1e-10)


def test_step_plan_and_bias():
    """The step planner's plan (whole blocks, no NaN zeroing: a pool of zeros) and a kv_b_proj bias (its value half
    is added; its key half moves every score of a query alike) give what the expanded attention gives."""
    module = _attention("deepseek_v2", attention_bias=False)
    torch.manual_seed(0)
    module.kv_b_proj.bias = torch.nn.Parameter(torch.randn(module.kv_b_proj.out_features))
    case = mla_case(module, [9, 21], [1, 3], seed=2)
    for cache in ("latent_cache", "rope_cache"):
        case[cache] = case[cache].nan_to_num(0.0)
    meta = case["meta"]
    meta.plan = plan_torch_attention(meta.block_tables.clamp_min(0), meta.seq_lens, meta.query_start_loc, 8)
    with torch.no_grad():
        got = _run(case).double()
    excess = (got - mla_float64(case)).abs() - mla_error_bound(case)
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"


def test_fp8_latent_pool_reads_its_scales():
    """An fp8 (uint8) pool: latent and rotated key each with a scale per token; the result equals the float path run
    on the dequantized values (same bound), so every scale is read from its own slot."""
    case = mla_case(_attention("deepseek_v3"), [19, 7], [1, 2], seed=4)
    scaled = {}
    for name, key in (("latent", "latent_cache"), ("rope", "rope_cache")):
        cache = case[key]
        values = cache.nan_to_num(0.0) * 2.0 ** torch.randint(-2, 2, cache.shape[:3] + (1,)).float()
        scales = fp8_scales(values)  # [blocks, block_size, 1]
        bits = quantize_fp8(values, scales)
        scaled[name] = (bits, scales)
        case[key] = bits.view(torch.float8_e4m3fn).float() * scales.float()[..., None]  # what the pool means
    meta = case["meta"]
    case["latents"] = _by_sequence(case["latent_cache"], meta)
    case["ropes"] = _by_sequence(case["rope_cache"], meta)
    with torch.no_grad():
        got = mla.paged_mla(case["query"], case["kv_b_weight"], None, case["nope_dim"], scaled["latent"][0],
                            scaled["rope"][0], meta, case["scale"], latent_scale=scaled["latent"][1],
                            rope_scale=scaled["rope"][1]).double()
    excess = (got - mla_float64(case)).abs() - mla_error_bound(case)
    assert (excess <= 0).all(), f"max error over the bound {excess.max():.3e}"


def _by_sequence(cache, meta: AttentionMetadata):
    block_size = cache.shape[1]
    out = []
    for s, n in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(n)
        out.append(cache[meta.block_tables[s, pos // block_size].long(), pos % block_size, 0])
    return out
