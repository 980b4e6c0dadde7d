"""The engine's lean step forward (``patches/lean.py``) and the fused linears it multiplies with
(``cpu_linears.FusedLinears``): the same logits as the model's own forward bit for bit, and the model's own
forward wherever the lean one does not know the model exactly."""

import pytest
import torch
from torch import nn

from hf_paged.engine import runner as runner_module
from hf_paged.engine.cpu_linears import FusedLinears, Int8Linear, PackedLinear
from hf_paged.engine.factory import generate_batch
from hf_paged.ops import cpu_kernels
from hf_paged.patches import lean
from hf_paged.pool import BlockPool

from helpers.engine_oracle import random_prompts
from helpers.models import VOCAB, tiny_family_model, tiny_model


def _model(family: str, seed: int):
    return tiny_model(seed=seed) if family == "llama" else tiny_family_model(family, seed=seed)


def _step_logits(monkeypatch, model, prompts, use_lean: bool, **options):
    """Every step's logits of a greedy generate_batch, with the lean forward or the model's own; and how many
    steps the lean forward ran (and whether it ran fused linears: ``fused``)."""
    logits, lean_steps = [], [0]
    fused = options.pop("fused", [])
    run, forward = runner_module.ModelRunner.run, lean.LeanDecoder.forward

    def recording_run(self, batch):
        out = run(self, batch)
        logits.append(out.clone())
        return out

    def counting_forward(self, *args):
        lean_steps[0] += 1
        out = forward(self, *args)
        fused.append(any(f._weight is not None for f in self._fused.values()))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(runner_module.ModelRunner, "run", recording_run)
        patch.setattr(lean.LeanDecoder, "forward", counting_forward)
        if not use_lean:
            patch.setattr(runner_module, "lean_decoder", lambda model: None)
        out = generate_batch(model, prompts, max_new_tokens=10, do_sample=False, progress_bar=False, **options)
    tokens = [list(o.generated_tokens) for o in out.values()]
    return logits, tokens, lean_steps[0]


# the families the lean forward knows: llama (GQA), mistral (a window), qwen2 (q/k/v biases, a window on one layer),
# qwen3 (q/k norms); fp32 (F.linear, unfused), bf16 (packed, fused), int8 (the C kernel, fused)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("linears", ["fp32", "packed", "int8"])
def test_lean_step_logits_equal_the_models_forward(monkeypatch, family, linears):
    model = _model(family, seed=11)
    if linears != "fp32":
        model = model.to(torch.bfloat16)
    shared = [[5 + i for i in range(9)]]  # prefix-cache hits, chunked prefills beside decode rows
    prompts = random_prompts(6, VOCAB, (2, 30), seed=12, shared=shared)
    options = dict(cpu_linears={"fp32": "auto", "packed": "auto", "int8": "int8"}[linears],
                   max_batch_tokens=16 if linears != "int8" else cpu_kernels.INT8_MAX_ROWS)
    own, own_tokens, none = _step_logits(monkeypatch, model, prompts, False,
                                         pool=BlockPool(block_size=4, num_blocks=160), **options)
    fused = []
    got, got_tokens, lean_steps = _step_logits(monkeypatch, model, prompts, True, fused=fused,
                                               pool=BlockPool(block_size=4, num_blocks=160), **options)
    assert none == 0 and lean_steps == len(got) > 5
    packs = getattr(model.model.layers[0].mlp.down_proj, "_packed", None) is not None  # (no bf16 GEMM at AVX2)
    if linears == "packed" and packs or linears == "int8" and cpu_kernels.library():
        assert all(fused)  # q/k/v and gate/up ran as one GEMM each
    assert got_tokens == own_tokens
    assert len(got) == len(own) and all(torch.equal(a, b) for a, b in zip(got, own))


def test_lean_forward_steps_aside_for_hooks_training_and_unknown_modules(monkeypatch):
    model = tiny_model(seed=13)
    prompts = random_prompts(3, VOCAB, (3, 12), seed=14)
    calls = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: calls.append(1))
    _, _, lean_steps = _step_logits(monkeypatch, model, prompts, True, pool=BlockPool(block_size=4, num_blocks=64))
    handle.remove()
    assert lean_steps == 0 and calls  # the hook ran: the model's own forward did
    _, _, lean_steps = _step_logits(monkeypatch, model, prompts, True, pool=BlockPool(block_size=4, num_blocks=64))
    assert lean_steps > 0

    assert lean.lean_decoder(model) is not None
    model.model.layers[0].input_layernorm.forward = lambda x: x  # a hub kernel's or a user's own forward
    assert lean.lean_decoder(model) is None
    del model.model.layers[0].input_layernorm.forward
    model.model.layers[1].mlp = nn.Sequential()  # a module of another class
    assert lean.lean_decoder(model) is None
    assert lean.lean_decoder(tiny_family_model("gemma", seed=0)) is None  # a family it does not know

    model = tiny_model(seed=13)
    decoder = lean.lean_decoder(model)
    with torch.no_grad():
        assert decoder.usable(0)
        model.train()
        assert not decoder.usable(0)
        model.eval()
    assert not decoder.usable(0)  # gradients on


def _layers(kind, bias: bool, dtype=torch.bfloat16, widths=(48, 16, 16)):
    torch.manual_seed(0)
    layers = tuple(nn.Linear(32, n, bias=bias).to(dtype) for n in widths)
    for layer in layers:
        layer.__class__ = kind
    return layers


@pytest.mark.parametrize("kind", [PackedLinear, Int8Linear, nn.Linear])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 8, 40])
def test_fused_linears_equal_the_layers_one_by_one(kind, bias, rows):
    layers = _layers(kind, bias)
    fused = FusedLinears(layers)
    x = torch.randn(rows, 32).to(torch.bfloat16)
    with torch.no_grad():
        got = fused(x)
        want = tuple(layer(x) for layer in layers)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    fusing = (kind is PackedLinear and all(layer._packed is not None for layer in layers)) or (
        kind is Int8Linear and cpu_kernels.library() is not None)
    assert (fused._weight is not None) == fusing


@pytest.mark.parametrize("kind", [PackedLinear, Int8Linear])
def test_fused_linears_follow_weight_writes_and_replacements(kind):
    layers = _layers(kind, bias=True)
    fused = FusedLinears(layers)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.no_grad():
        before = fused(x)[1]
        layers[1].weight.mul_(-2)  # in place (a weight sync, merge_adapter)
        after = fused(x)[1]
        assert torch.equal(after, layers[1](x)) and not torch.equal(after, before)
        layers[2].weight.data = torch.randn(16, 32).to(torch.bfloat16)  # replaced (p.data = ...)
        assert torch.equal(fused(x)[2], layers[2](x))
        layers[0].bias.add_(1)
        assert torch.equal(fused(x)[0], layers[0](x))
        layers[0].__class__ = nn.Linear  # prepare_cpu_linears(model, "eager") put it back
        assert all(torch.equal(a, b) for a, b in zip(fused(x), (layer(x) for layer in layers)))


def test_fused_linears_leave_mixed_biases_and_gradients_to_the_layers():
    layers = _layers(PackedLinear, bias=False)
    layers[1].bias = nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))
    fused = FusedLinears(layers)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(fused(x), (layer(x) for layer in layers)))
    assert fused._weight is None
    layers = _layers(PackedLinear, bias=False)
    out = FusedLinears(layers)(x.requires_grad_())
    out[0].sum().backward()  # autograd through F.linear
    want = torch.ones(3, 48) @ layers[0].weight.detach().float()
    assert torch.allclose(x.grad.float(), want, atol=0.05, rtol=0.02)
