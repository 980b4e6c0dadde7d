"""The C int8 weight-only linear (``hf_paged/ops/int8_linear.c`` through ``cpu_kernels.int8_linear``) against its
float64 reference: bf16 activations (the AVX512-BF16 form where the CPU has it: widths a multiple of 16, depths a
multiple of 32) and fp32 ones, 1 to 32 rows (chunks of 8 and what is left), widths with and without a tail, biases;
each row's result does not depend on the other rows of the step; what it does not take returns None; without a
compiler ``Int8Linear`` runs torch's int8 matmul."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_paged.engine.cpu_linears import Int8Linear, prepare_cpu_linears
from hf_paged.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler builds the CPU kernels here")

SHAPES = [  # (rows, out, in)
    (1, 576, 576),  # SmolLM2's q/o projection, one row
    (8, 1536, 576),  # gate/up at 8 decode rows
    (5, 576, 1536),  # down
    (3, 192, 576),  # k/v
    (13, 96, 64),  # a chunk of 8 and one of 5
    (32, 48, 128),  # the most rows the kernel takes
    (7, 40, 96),  # a width that is not a multiple of 16: its last 8 columns one at a time
    (6, 64, 48),  # a depth that is not a multiple of 32: the fp32 form for bf16 activations
]


def _case(rows, out, inp, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).to(dtype)
    qweight = torch.randint(-127, 128, (out, inp), generator=g, dtype=torch.int8)
    scales = torch.rand(out, generator=g) * 0.02 + 1e-3
    b = (torch.randn(out, generator=g) * 0.5).to(dtype) if bias else None
    return x, qweight, scales, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{o}x{i}" for r, o, i in SHAPES])
def test_int8_kernel_matches_float64(shape, dtype):
    x, qweight, scales, bias = _case(*shape, dtype, bias=shape[0] % 2 == 1, seed=shape[1])
    got = cpu_kernels.int8_linear(x, qweight, scales, bias)
    assert got is not None and got.dtype == dtype and got.shape == (shape[0], shape[1])
    want = (x.double() @ (qweight.double() * scales.double()[:, None]).T
            + (0 if bias is None else bias.double()))
    size = x.double().abs() @ (qweight.double().abs() * scales.double()[:, None]).T  # what fp32 sums round against
    if dtype == torch.float32:
        tol = 1e-6 * size + 1e-6
    else:  # the output's rounding to bf16: one step of 2^-7 of the value, and fp32 sums may flip it
        tol = 2 ** -7 * want.abs() + 1e-6 * size + 1e-6
    assert ((got.double() - want).abs() <= tol).all()
    reference = cpu_kernels.int8_linear_reference(x, qweight, scales, bias)
    assert ((reference.double() - want).abs() <= tol).all()  # the reference is as close: the oracle is right


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_result_does_not_depend_on_the_step(dtype):
    """Row i alone, among 8, among 13 or among 32 rows: the same bits (the engine's steps and generate()'s agree)."""
    x, qweight, scales, bias = _case(32, 576, 576, dtype)
    whole = cpu_kernels.int8_linear(x, qweight, scales, bias)
    for rows in (1, 3, 8, 13):
        for first in (0, 32 - rows):
            part = cpu_kernels.int8_linear(x[first:first + rows], qweight, scales, bias)
            assert torch.equal(part, whole[first:first + rows]), (rows, first)


def test_what_the_kernel_does_not_take_returns_none(monkeypatch):
    x, qweight, scales, _ = _case(4, 32, 64, torch.bfloat16)
    assert cpu_kernels.int8_linear(torch.randn(cpu_kernels.INT8_MAX_ROWS + 1, 64).bfloat16(), qweight, scales,
                                   None) is None  # a prefill's rows: the caller dequantizes
    assert cpu_kernels.int8_linear(x[:, :40], qweight[:, :40].contiguous(), scales, None) is None  # depth 40
    assert cpu_kernels.int8_linear(x.half(), qweight, scales, None) is None  # fp16 activations
    assert cpu_kernels.int8_linear(x, qweight, scales.bfloat16(), None) is None  # scales not fp32
    monkeypatch.setenv("HF_PAGED_CPU_KERNELS", "0")
    assert cpu_kernels.int8_linear(x, qweight, scales, None) is None


def test_int8_linear_runs_the_kernel_and_falls_back_without_it(monkeypatch):
    """A decode step's rows go to the kernel; where it is not built, torch's int8 matmul gives the same values to
    bf16's rounding."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    prepare_cpu_linears(layer, "int8")
    assert type(layer) is Int8Linear
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    calls = []
    real = cpu_kernels.int8_linear
    monkeypatch.setattr(cpu_kernels, "int8_linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        kernel = layer(x)
    assert calls and kernel.shape == (2, 3, 48)
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    with torch.no_grad():
        fallback = layer(x)
    assert (kernel.float() - fallback.float()).abs().max() <= 2 ** -7 * fallback.float().abs().max() * 2
