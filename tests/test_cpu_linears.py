"""CPU linears (hf_paged/engine/cpu_linears.py): prepacked oneDNN weights give F.linear's outputs bit for bit (so the
engine's greedy tokens do not move), follow in-place weight updates, leave autograd alone; int8 weight-only linears
stay within their quantization error; the default dtype follows the CPU's native bf16."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.engine import cpu_linears
from hf_paged.engine.cpu_linears import Int8Linear, PackedLinear, linears_mode, native_dtype, prepare_cpu_linears
from hf_paged.engine.factory import generate_batch
from hf_paged.ops import cpu_kernels
from hf_paged.pool import BlockPool

from helpers.engine_oracle import random_prompts
from helpers.models import VOCAB, tiny_model


def _linear(bias: bool, dtype=torch.bfloat16, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(48, 80, bias=bias).to(dtype).eval()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (8, 48), (33, 48), (2, 5, 48), (0, 48)])
def test_packed_linear_equals_f_linear_bit_for_bit(bias, shape):
    """Every row count (a packed weight is reordered for one) and 3-D inputs: the same bits as F.linear."""
    layer = _linear(bias)
    expected_weight, expected_bias = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.clone()
    assert prepare_cpu_linears(layer, "packed") == 1 and type(layer) is PackedLinear
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, expected_weight, expected_bias))


def test_packed_linear_follows_in_place_weight_updates_and_autograd():
    """A weight sync (copy_ into the parameter) is seen at the next call; a call needing gradients backpropagates."""
    layer = _linear(True)
    prepare_cpu_linears(layer, "packed")
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        layer.weight.copy_(torch.randn_like(layer.weight))
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    out = layer(x.requires_grad_())
    out.float().sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_int8_linear_within_quantization_error():
    """Per-channel int8 weights: each output within the bound its weight rounding allows (half a step per weight)."""
    layer = _linear(True, torch.float32)
    weight = layer.weight.detach().clone()
    prepare_cpu_linears(layer, "int8")
    assert type(layer) is Int8Linear
    x = torch.randn(6, 48)
    with torch.no_grad():
        got, exact = layer(x), F.linear(x, weight, layer.bias)
    step = weight.abs().amax(dim=1) / 127  # [out]
    bound = 0.5 * step[None] * x.abs().sum(dim=1, keepdim=True) + 1e-4  # [rows, out]
    assert ((got - exact).abs() <= bound).all()
    assert not torch.equal(got, exact)  # it did quantize


@pytest.mark.parametrize("rows", [1, 8, cpu_kernels.INT8_MAX_ROWS + 1, 300])
def test_int8_linear_paths_within_quantization_error(rows):
    """bf16 activations on both paths (the C kernel up to INT8_MAX_ROWS rows, a dequantized copy above): every output
    within the weight rounding's bound plus bf16's rounding of the output, of the dequantized copy's weights (half a
    bf16 step each) and of the kernel's activation-weight products."""
    torch.manual_seed(rows)
    layer = nn.Linear(96, 80, bias=True).to(torch.bfloat16)
    weight = layer.weight.detach().float().clone()
    prepare_cpu_linears(layer, "int8")
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.no_grad():
        got = layer(x).float()
    exact = x.float() @ weight.T + layer.bias.float()
    step = weight.abs().amax(dim=1) / 127  # [out]
    size = x.float().abs() @ (weight.abs() + step[:, None]).T  # [rows, out]: what the products can add up to
    bound = 0.5 * step[None] * x.float().abs().sum(dim=1, keepdim=True) + 2 ** -8 * (size + exact.abs()) + 1e-3
    assert ((got - exact).abs() <= bound).all()
    assert not torch.equal(got, exact.to(torch.bfloat16).float())  # it did quantize


def test_engine_tokens_equal_with_packed_and_eager_linears():
    """The engine on a bf16 model: the same greedy tokens with prepacked linears as with F.linear, and the packed
    path really ran (where oneDNN has bf16; elsewhere the layers fall back to F.linear and still agree)."""
    model = tiny_model(seed=3).to(torch.bfloat16)
    prompts = random_prompts(6, VOCAB, (3, 30), seed=4)

    def tokens(mode):
        out = generate_batch(model, prompts, max_new_tokens=12, do_sample=False, progress_bar=False,
                             pool=BlockPool(block_size=4, num_blocks=128), cpu_linears=mode)
        return [list(o.generated_tokens) for o in out.values()]

    eager = tokens("eager")
    assert linears_mode(model) == "eager"
    packed = tokens("auto")
    assert linears_mode(model) == "packed"
    assert packed == eager
    if cpu_linears._packable(model.lm_head.weight):
        assert any(m._packed is not None for m in model.modules() if isinstance(m, PackedLinear))


def test_engine_int8_matches_generate_on_the_same_int8_model():
    """cpu_linears="int8": the engine's greedy tokens equal generate() on the same int8 layers. Steps of up to
    ``INT8_MAX_ROWS`` rows run the C kernel, whose rows do not depend on what else is in the step (a bigger step, a
    prefill, multiplies a dequantized copy: another rounding), so the engine's steps are held to that size. fp32
    activations: in bf16 the engine's paged attention and generate()'s SDPA round differently, and a tiny random
    model's near-ties flip on that alone."""
    model = tiny_model(seed=5)
    prompts = random_prompts(3, VOCAB, (4, 20), seed=6)
    out = generate_batch(model, prompts, max_new_tokens=8, do_sample=False, progress_bar=False,
                         pool=BlockPool(block_size=4, num_blocks=64), cpu_linears="int8",
                         max_batch_tokens=cpu_kernels.INT8_MAX_ROWS)
    assert linears_mode(model) == "int8"
    for prompt, result in zip(prompts, out.values()):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=None, max_new_tokens=8, do_sample=False)
        assert list(result.generated_tokens) == ref[0, len(prompt):].tolist()


def test_native_dtype_follows_the_cpu_flags(monkeypatch):
    """bf16 only where the CPU has native bf16 (and ATen's AVX-512 kernels); fp32 elsewhere; bf16 on a GPU."""
    monkeypatch.setattr(cpu_linears, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    assert native_dtype("cpu") == torch.float32
    monkeypatch.setattr(cpu_linears, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert native_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert native_dtype("cpu") == torch.float32
    assert native_dtype("cuda") == torch.bfloat16


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="cpu_linears must be one of"):
        prepare_cpu_linears(_linear(False), "fast")
