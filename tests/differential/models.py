"""The differential tester's tiny random models, one builder per family kind, cached per (family, seed) within a run,
and the prompts (token ids, or one prompt's processor outputs for a vision-language model) built from a case's plain
description (text runs and ``(image seed, grid)`` pairs)."""

from __future__ import annotations

import torch
from helpers.mla import tiny_mla_model
from helpers.models import EOS, PAD, TINY_SHAPE, tiny_family_model, tiny_model
from helpers.vlm import (
    DEFAULT_WEIGHT_STD, IMAGE, TEXT_SHAPE, VISION_END, VISION_START, VLM_CONFIGS, VLM_VOCAB, WEIGHT_STD,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, BatchFeature

# Qwen2-VL: plain multi-axis rope, a vision tower of its own shape (embed_dim, mlp_ratio)
_QWEN2_VL = lambda: dict(  # noqa: E731
    text_config=dict(TEXT_SHAPE, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                      rope_theta=10000.0)),
    vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2),
    image_token_id=IMAGE, video_token_id=101, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
VLM_BUILDERS = {"qwen2_vl": _QWEN2_VL, **{k: VLM_CONFIGS[k] for k in ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava")}}
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)

# family -> kind; the kind decides which request features the draw rules consider (draw.py)
FAMILIES = {
    "llama": "plain",
    "mistral": "sliding",
    "gemma3_text": "sliding",
    "qwen3_moe": "moe",
    "deepseek_v3": "mla",
    "qwen3_5_text": "hybrid",
    "qwen2_vl": "mrope_vlm",
    "qwen2_5_vl": "mrope_vlm",
    "qwen3_vl": "mrope_vlm",
    "gemma3": "bidirectional_vlm",
    "llava": "vlm",
}
VLM_KINDS = ("mrope_vlm", "bidirectional_vlm", "vlm")


def vocab_of(family: str) -> int:
    return VLM_VOCAB if FAMILIES[family] in VLM_KINDS else TINY_SHAPE["vocab_size"]


def build(family: str, seed: int):
    """A fresh eval-mode tiny model of ``family`` with weights from ``seed`` (PAD 0, EOS 1)."""
    kind = FAMILIES[family]
    if family == "llama":
        return tiny_model("llama", seed=seed)
    if kind in ("sliding", "moe"):
        return tiny_family_model(family, seed=seed)
    if kind == "mla":
        return tiny_mla_model(family, seed=seed)
    if kind == "hybrid":
        config = AutoConfig.for_model(family, **{**TINY_SHAPE, "head_dim": 16, "num_hidden_layers": 4, **_LINEAR})
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    else:
        torch.manual_seed(seed)
        config = AutoConfig.for_model(family, **VLM_BUILDERS[family]())
        config._attn_implementation = "sdpa"
        model = AutoModelForImageTextToText.from_config(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, WEIGHT_STD.get(family, DEFAULT_WEIGHT_STD))
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def build_draft(family: str, seed: int):
    """A smaller draft model with the same vocabulary (1 layer llama)."""
    torch.manual_seed(seed + 1000)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_SHAPE, "vocab_size": vocab_of(family), "num_hidden_layers": 1})
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


ADAPTER_SPECS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),  # (peft warns of names inside "lora_")
    "chat": dict(r=8, lora_alpha=16, target_modules=["o_proj", "q_proj"], use_rslora=True),
}


def build_peft(family: str, seed: int):
    """A ``PeftModel`` over a fresh :func:`build` holding adapters ``sql`` and ``chat`` (random B, scaled to steer)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 100)
    names = list(ADAPTER_SPECS)
    model = get_peft_model(build(family, seed), LoraConfig(init_lora_weights=False, **ADAPTER_SPECS[names[0]]),
                           adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(init_lora_weights=False, **ADAPTER_SPECS[name]))
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_B" in key:
                param.mul_(0.3)
    model.set_adapter(names[0])
    return model.eval()


class ModelCache:
    """Models per (what, family, seed) for the run: building one is most of a trial's cost."""

    def __init__(self):
        self.models = {}

    def get(self, what: str, family: str, seed: int):
        key = (what, family, seed)
        if key not in self.models:
            make = {"model": build, "draft": build_draft, "peft": build_peft}[what]
            self.models[key] = make(family, seed)
        return self.models[key]


def bump_weights(model, seed: int) -> list:
    """Change the weights in place (a seeded perturbation of every 2-D weight of the first decoder layer), as a
    training step would; returns what :func:`restore_weights` needs."""
    g = torch.Generator().manual_seed(seed)
    saved = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and ".layers.0." in name and "lora_" not in name and "visual" not in name:
                saved.append((param, param.detach().clone()))
                param.add_(torch.randn(param.shape, generator=g) * param.std() * 0.5)
    return saved


def restore_weights(saved: list) -> None:
    with torch.no_grad():
        for param, value in saved:
            param.copy_(value)


def _qwen_image(seed: int, grid: tuple[int, int], patch: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    return {"pixel_values": torch.randn(h * w, 3 * 2 * patch * patch, generator=g),
            "image_grid_thw": torch.tensor([[1, h, w]])}


def image_tokens(family: str, grid: tuple[int, int]) -> int:
    if family in QWEN_VL:
        return grid[0] * grid[1] // 4
    return {"llava": 16, "gemma3": 4}[family]


def make_prompt(family: str, text: list[list[int]], images: list[tuple[int, tuple[int, int]]],
                type_ids: bool = True):
    """Token ids (no images) or one prompt's processor outputs: ``text[0]``, image 0, ``text[1]``, ... Each image
    is ``(seed, grid)``; ``grid`` (h, w in patches, even) matters for the Qwen-VL families only. ``type_ids``: also
    give ``mm_token_type_ids`` / ``token_type_ids`` as the family's processor does (some processors do not)."""
    if not images:
        return [t for run in text for t in run]
    ids, kinds, parts = list(text[0]), [0] * len(text[0]), []
    for (seed, grid), after in zip(images, text[1:]):
        if family in QWEN_VL:
            parts.append(_qwen_image(seed, grid, 4))
        else:
            g = torch.Generator().manual_seed(seed)
            parts.append({"pixel_values": torch.randn(1, 3, 16, 16, generator=g)})
        wrap = family in QWEN_VL or family == "gemma3"
        n = image_tokens(family, grid)
        ids += [VISION_START] * wrap + [IMAGE] * n + [VISION_END] * wrap
        kinds += [0] * wrap + [1] * n + [0] * wrap
        ids += after
        kinds += [0] * len(after)
    data = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    for key in parts[0]:
        data[key] = torch.cat([p[key] for p in parts], dim=0)
    if type_ids and family in QWEN_VL:
        data["mm_token_type_ids"] = torch.tensor([kinds])
    if family == "gemma3":  # Gemma 3's generate() needs them for its bidirectional image spans
        data["token_type_ids"] = torch.tensor([kinds])
    return BatchFeature(data)
