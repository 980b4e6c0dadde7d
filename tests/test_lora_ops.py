"""Batched LoRA ops (``hf_paged.ops.lora``): the torch path and the Triton kernels (under the interpreter on CPU)
against a float64 per-token reference, over batches whose tokens of one adapter are contiguous, interleaved or
absent, indices of different ranks padded to the largest, and shapes that are not tile multiples.

Error bound, derived: ``y + s * (x A^T) B`` computed in a floating type of unit roundoff ``u`` (products in the
adapter's dtype, a sum of ``in`` then ``r`` terms) is within ``(in + r + 3) * u * s * (|x| |A|^T) |B| + u * |y|`` of the
exact result (the standard dot-product bound, twice, plus the final add and scale); bf16 adds the rounding of
the ``r`` intermediate values to bf16 (covered by the same ``u``)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.ops.lora import add_lora_torch, check_lora_shapes, lora_groups

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}

CASES = {
    # name: (token indices, ranks per index, in_features, out_features)
    "contiguous": ([0] * 5 + [1] * 3 + [-1] * 4, [4, 8], 64, 48),
    "interleaved": ([0, 1, -1, 2, 0, 0, 1, 2, 2, -1, 1, 0], [2, 8, 6], 70, 33),
    "decode": ([2, 0, 1, 2, 1, 0, -1], [16, 1, 5], 128, 96),
    "base_only": ([-1, -1, -1], [3, 4], 32, 32),
    "one_token": ([1], [4, 2], 24, 130),
}


def make_case(name: str, dtype=torch.float32, seed: int = 0):
    indices, ranks, fin, fout = CASES[name]
    g = torch.Generator().manual_seed(seed)
    num_adapters, rank = len(ranks), max(ranks)
    lora_a = torch.zeros(num_adapters, rank, fin)  # [N, R, in], zero past each index's rank
    lora_b = torch.zeros(num_adapters, rank, fout)  # [N, R, out]
    for s, r in enumerate(ranks):
        lora_a[s, :r] = torch.randn(r, fin, generator=g) / fin**0.5
        lora_b[s, :r] = torch.randn(r, fout, generator=g)
    scales = [0.5 + s for s in range(num_adapters)]
    x = torch.randn(len(indices), fin, generator=g)  # [T, in]
    y = torch.randn(len(indices), fout, generator=g)  # [T, out]: the base output
    return dict(indices=indices, ranks=ranks, scales=scales, x=x.to(dtype), y=y.to(dtype), lora_a=lora_a.to(dtype),
                lora_b=lora_b.to(dtype))


def float64_reference(case):
    """Token by token in float64 from the (rounded) inputs, and the error bound of the header."""
    x, y = case["x"].double(), case["y"].double()
    a, b = case["lora_a"].double(), case["lora_b"].double()
    u = UNIT_ROUNDOFF[case["x"].dtype]
    out, bound = y.clone(), y.abs() * u
    for t, s in enumerate(case["indices"]):
        if s < 0:
            continue
        r, scale = case["ranks"][s], case["scales"][s]
        out[t] += scale * (a[s, :r] @ x[t]) @ b[s, :r]
        magnitude = scale * (a[s, :r].abs() @ x[t].abs()) @ b[s, :r].abs()
        bound[t] += (x.shape[1] + r + 3) * u * magnitude
    return out, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_within_bound(name, dtype):
    case = make_case(name, dtype)
    expected, bound = float64_reference(case)
    y = case["y"].clone()
    add_lora_torch(y, case["x"], case["lora_a"], case["lora_b"], case["scales"],
                   lora_groups(case["indices"], case["ranks"]))
    err = (y.double() - expected).abs()
    worst = err.argmax()
    assert (err <= bound).all(), f"{name}: worst error {float(err.max()):.3g}, bound {float(bound.flatten()[worst]):.3g}"
    base = [t for t, s in enumerate(case["indices"]) if s < 0]
    assert torch.equal(y[base], case["y"][base])  # tokens of no adapter keep the base output exactly


def test_groups_slice_contiguous_and_gather_interleaved():
    groups = {g.index: g for g in lora_groups([0, 0, 1, 1, -1, 1, 2], [3, 4, 0])}
    assert groups[0].rows == slice(0, 2) and groups[0].rank == 3
    assert groups[1].rows.tolist() == [2, 3, 5] and groups[1].num_tokens == 3
    assert 2 not in groups  # index 2 has rank 0 (its adapter does not target this layer)


def test_shapes_checked():
    case = make_case("contiguous")
    with pytest.raises(ValueError, match=r"lora_b must be \[N=2, R=8, out=48\]"):
        check_lora_shapes(case["y"], case["x"], case["lora_a"], case["lora_b"].transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_within_bound(name, dtype):
    """The shrink / expand kernels (interpreter on CPU) within the same bound as the torch path."""
    pytest.importorskip("triton")
    from hf_paged.ops.lora import add_lora_kernel

    case = make_case(name, dtype, seed=1)
    expected, bound = float64_reference(case)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    y = case["y"].clone().to(device)
    add_lora_kernel(y, case["x"].to(device), case["lora_a"].to(device), case["lora_b"].to(device),
                    torch.tensor(case["scales"], dtype=torch.float32, device=device),
                    torch.tensor(case["indices"], dtype=torch.int32, device=device))
    err = (y.cpu().double() - expected).abs()
    assert (err <= bound).all(), f"{name}: worst error {float(err.max()):.3g}"
    base = [t for t, s in enumerate(case["indices"]) if s < 0]
    assert torch.equal(y.cpu()[base], case["y"][base])
