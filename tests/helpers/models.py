"""Tiny random-weight models: Llama / Mistral for most tests, and one of every supported family from its config."""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
)

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2
# GPU-relevant tests (the Triton backend) put their models here; the rest stay on the CPU.
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

TINY_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
                  bos_token_id=BOS)


def tiny_config(kind: str = "llama", **overrides):
    """A 2-layer ``LlamaConfig`` (``kind="llama"``) or ``MistralConfig`` (anything else; no window unless given)."""
    shape = {**TINY_SHAPE, **overrides}
    if kind == "llama":
        return LlamaConfig(**shape)
    shape.setdefault("sliding_window", None)
    return MistralConfig(**shape)


def tiny_model(kind: str = "llama", seed: int = 0, attn: str = "sdpa", device="cpu", **overrides):
    """An eval-mode model of :func:`tiny_config` with weights drawn from ``seed``; generates with PAD and EOS."""
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    config._attn_implementation = attn
    cls = LlamaForCausalLM if kind == "llama" else MistralForCausalLM
    model = cls(config).eval().to(device)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


# model_type -> overrides on top of the tiny shape: sliding families get a window of FAMILY_WINDOW and, where the
# family can mix windows, both kinds of layer.
FAMILY_WINDOW = 8
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=FAMILY_WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=FAMILY_WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=FAMILY_WINDOW, max_window_layers=1),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=FAMILY_WINDOW, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    "phi3": dict(sliding_window=FAMILY_WINDOW),
    "gemma": {},
    # large enough weights and a small cap that soft-capping and the window both change the tokens
    "gemma2": dict(sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL, attn_logit_softcapping=1.0,
                   query_pre_attn_scalar=1, initializer_range=0.06),
    "gemma3_text": dict(sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL),
    "olmo2": {},
    "granite": {},
    "starcoder2": dict(sliding_window=FAMILY_WINDOW),
    "mixtral": dict(sliding_window=FAMILY_WINDOW, **_MOE),
    "smollm3": dict(use_sliding_window=True, sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL),
    # max_position_embeddings: YaRN's 32 x 4096 original positions (transformers warns at any other length)
    "gpt_oss": dict(sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL, max_position_embeddings=131072,
                    **_MOE),
    "olmo": {},
    "stablelm": {},
    "cohere": {},
    "cohere2": dict(sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL),
    "glm": {},
    "phi": {},
    "exaone4": dict(sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL),
}


# Families taken generically (no ModelPatch; hf_paged.patches.GENERIC_VERIFIED): overrides on the tiny shape.
LLAMA4_CHUNK = 8
GENERIC_FAMILIES = {
    "olmo3": dict(sliding_window=FAMILY_WINDOW, layer_types=SLIDING_THEN_FULL),
    "glm4": {},
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1),
    "seed_oss": {},
    "apertus": {},
    "ernie4_5": {},
    "arcee": {},
    "hunyuan_v1_dense": {},
    # three chunked (RoPE) layers per full (NoPE) one; chunks of 8 tokens, so prompts cross chunk boundaries
    "llama4_text": dict(num_hidden_layers=4, attention_chunk_size=LLAMA4_CHUNK, layer_types=None,
                        num_local_experts=2, intermediate_size_mlp=128),
    # full layers with their own head size and KV-head count (per_layer_config), K = V on them
    "gemma4_text": dict(num_hidden_layers=4, sliding_window=FAMILY_WINDOW, global_head_dim=32,
                        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0),
    # two KV-shared layers reading the last sliding and the last full layer before them; per-layer inputs, AltUp
    "gemma3n_text": dict(num_hidden_layers=4, sliding_window=FAMILY_WINDOW, num_kv_shared_layers=2,
                         layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
                         hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2),
}


def tiny_family_config(model_type: str, **overrides):
    """The tiny shape (head_dim 16) plus ``FAMILIES[model_type]`` (or ``GENERIC_FAMILIES``) plus ``overrides``,
    through ``AutoConfig``."""
    family = FAMILIES.get(model_type, GENERIC_FAMILIES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **{**TINY_SHAPE, "head_dim": 16, **family, **overrides})


def tiny_family_model(model_type: str, seed: int = 0, **overrides):
    """Random weights; SDPA, except eager for soft-cap and sinks (SDPA ignores soft-cap in older transformers)."""
    from hf_paged import patches

    config = tiny_family_config(model_type, **overrides)
    features = patches.find_patch_for_config(config).features
    attn = "eager" if {"softcap", "sinks"} & set(features) else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model
