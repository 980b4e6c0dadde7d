"""A lean forward of the engine's step for Llama-shaped decoders: the same operations as the family's modules, in the
same order, without transformers' per-layer plumbing.

On a CPU a decode step of a small model is short (SmolLM2-135M, 8 rows: ~40 ms), and a quarter of it is Python
around the operations: 30 layers x (module calls, the kernels hub's forward wrappers, keyword plumbing, the
attention interface, seven separate linears). This forward walks the decoder's layers itself and multiplies q/k/v
and gate/up as one GEMM each (:class:`~hf_paged.engine.cpu_linears.FusedLinears`, bit-identical to the layers one
by one). Each operation is the one the family's modeling file runs (RMSNorm upcast to fp32, rotate-half rotary,
``down(act(gate) * up)``), so the logits equal the model's own forward over the same ``StepCache`` bit for bit
(``tests/test_lean_forward.py`` compares them per family, and the differential tester draws the engine with it).

:func:`lean_decoder` returns None (the model's own forward runs) for a model it does not know exactly: another
family, a module of another class or with its own ``forward`` (a hub kernel, an adapter wrapper), an RMSNorm or
rotary that computes otherwise than its inline copy (checked once on a probe). Each step, :meth:`LeanDecoder.usable`
sends the step to the model's own forward while any module has hooks, the model trains or gradients are on; the
engine's runner also does for steps with images, LoRA layers or state layers.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ..attention import paged_forward
from ..engine.cpu_linears import FusedLinears
from ..ops import cpu_kernels
from ..step import write_layer

# model_type -> (the modeling module whose classes the lean forward knows, their name prefix, whether q and k get an
# RMSNorm per head before the rotary: Qwen3)
FAMILIES = {
    "llama": ("llama", "Llama", False),
    "mistral": ("mistral", "Mistral", False),
    "qwen2": ("qwen2", "Qwen2", False),
    "qwen3": ("qwen3", "Qwen3", True),
}


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm (``LlamaRMSNorm.forward``'s operations; bf16: the C kernel, the same roundings in one
    call)."""
    out = cpu_kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    return out if out is not None else cpu_kernels.rms_norm_reference(x, norm.weight, norm.variance_epsilon)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb``'s operations on ``[T, H, D]`` with ``cos``/``sin`` ``[T, D]`` (bf16: the C kernel,
    the same roundings in one call)."""
    out = cpu_kernels.rotary(x, cos, sin)
    if out is not None:
        return out
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]: over the heads
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class LeanDecoder:
    """The lean step forward of one model (built by :func:`lean_decoder`): ``forward(cache, input_ids [T],
    position_ids [T], logits_index [k]) -> [k, vocab]``, with ``cache`` the step's ``StepCache``."""

    def __init__(self, model: nn.Module, inner: nn.Module, qk_norm: bool):
        self.model, self.inner, self.qk_norm = model, inner, qk_norm
        self.layers = list(inner.layers[: inner.config.num_hidden_layers])
        self._fused: dict[tuple, FusedLinears] = {}  # (layer, "qkv" | "gate_up") -> the fused linears
        self.modules = list(model.modules())  # whose hooks usable() counts

    def _linears(self, idx: int, part: str, layers: tuple) -> FusedLinears:
        """The fused linears of layer ``idx``'s ``part`` (remade when a layer module was replaced)."""
        fused = self._fused.get((idx, part))
        if fused is None or any(a is not b for a, b in zip(fused.layers, layers)):
            fused = self._fused[idx, part] = FusedLinears(layers)
        return fused

    def usable(self, hooks_allowed: int) -> bool:
        """Whether the model is still what it was built for: eval mode, no gradients, and no hooks beyond
        ``hooks_allowed`` (hf_paged's own on the decoder) on any of its modules."""
        if self.model.training or torch.is_grad_enabled():
            return False
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.modules)
        return hooks <= hooks_allowed and not (nn.modules.module._global_forward_hooks
                                               or nn.modules.module._global_forward_pre_hooks)

    def forward(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_index: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        hidden = inner.embed_tokens(input_ids)  # [T, C]
        cos, sin = inner.rotary_emb(hidden[None], position_ids[None])  # [1, T, D] each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, D], once for every layer
        tokens = hidden.shape[0]
        for idx, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = _rms_norm(layer.input_layernorm, hidden)
            qkv = self._linears(idx, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj))(x)
            q, k, v = (t.view(tokens, -1, attn.head_dim) for t in qkv)  # [T, H, D]
            if self.qk_norm:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
            step = write_layer(cache.pool, cache.groups, cache.step, cache._buffers, idx, cache.num_layers,
                               k.transpose(0, 1)[None], v.transpose(0, 1)[None], None)
            out = paged_forward(attn, q.transpose(0, 1)[None], attn.scaling, {}, step)  # [1, T, Hq, D]
            hidden = residual + attn.o_proj(out.reshape(tokens, -1))
            residual = hidden
            gate, up = self._linears(idx, "gate_up", (mlp.gate_proj, mlp.up_proj))(
                _rms_norm(layer.post_attention_layernorm, hidden))
            hidden = residual + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = _rms_norm(inner.norm, hidden)
        return self.model.lm_head(hidden.index_select(0, logits_index))


def _exact(module: nn.Module, cls: type) -> bool:
    return type(module) is cls and "forward" not in module.__dict__


def lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``model`` (a ``*ForCausalLM`` of a family in :data:`FAMILIES`, its modules of
    the family's own classes), or None."""
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", None))
    inner = getattr(model, "model", None)
    if family is None or inner is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return None
    name, prefix, qk_norm = family
    try:
        modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None
    classes = {part: getattr(modeling, prefix + part, None) for part in
               ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm")}
    if None in classes.values() or type(model) is not classes["ForCausalLM"] or not _exact(inner, classes["Model"]):
        return None
    norm_cls = classes["RMSNorm"]
    for layer in inner.layers[: config.num_hidden_layers]:
        if not _exact(layer, classes["DecoderLayer"]):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if not (_exact(attn, classes["Attention"]) and _exact(mlp, classes["MLP"])):
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if qk_norm
                                                                          else [])
        if not all(_exact(n, norm_cls) for n in norms):
            return None
    if not _exact(inner.norm, norm_cls) or not _same_math(modeling, inner.norm):
        return None
    return LeanDecoder(model, inner, qk_norm)


def _same_math(modeling, norm: nn.Module) -> bool:
    """The inline RMSNorm and rotary against the family's own, once, on a probe in the model's dtype."""
    generator = torch.Generator().manual_seed(0)
    dtype, width = norm.weight.dtype, norm.weight.shape[0]
    with torch.no_grad():
        x = torch.randn(3, width, generator=generator).to(dtype=dtype, device=norm.weight.device)
        if not torch.equal(norm(x), _rms_norm(norm, x)):
            return False
        q = torch.randn(1, 2, 3, 8, generator=generator).to(dtype)  # [B, H, T, D]
        cos, sin = (torch.randn(1, 3, 8, generator=generator).to(dtype) for _ in range(2))
        q_ref, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
        return torch.equal(q_ref[0].transpose(0, 1), _rotary(q[0].transpose(0, 1), cos[0], sin[0]))
