"""Tiny random-weight vision-language models of seven families, and one prompt's processor outputs for them built by
hand (what each family's processor returns, without a download): the placeholder id repeated once per image token,
and the family's image tensors."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, BatchFeature, DynamicCache

from hf_paged import compat

VLM_VOCAB = 128
IMAGE = 100  # the placeholder id of every tiny VLM here
VIDEO, VISION_START, VISION_END = 101, 102, 103
TEXT_SHAPE = dict(vocab_size=VLM_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2)
_QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                 vision_end_token_id=VISION_END)
_MROPE = dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0)

VLM_CONFIGS = {
    "qwen2_5_vl": lambda: dict(text_config=dict(TEXT_SHAPE, rope_parameters=_MROPE),
                               vision_config=dict(_QWEN_VISION, window_size=16, fullatt_block_indexes=[1]), **_QWEN_IDS),
    "qwen3_vl": lambda: dict(text_config=dict(TEXT_SHAPE, head_dim=16, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                             vision_config=dict(_QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
                             **_QWEN_IDS),
    "llava": lambda: dict(text_config=dict(TEXT_SHAPE, model_type="llama"),
                          vision_config=dict(_VISION, model_type="clip_vision_model", image_size=16, patch_size=4,
                                             projection_dim=32),
                          image_token_index=IMAGE, image_seq_length=16),
    "mistral3": lambda: dict(text_config=dict(TEXT_SHAPE, model_type="mistral", sliding_window=None, head_dim=16),
                             vision_config=dict(_VISION, model_type="pixtral", image_size=32, patch_size=4, head_dim=16),
                             image_token_index=IMAGE, spatial_merge_size=2),
    "internvl": lambda: dict(text_config=dict(TEXT_SHAPE, model_type="qwen2"),
                             vision_config=dict(_VISION, image_size=[16, 16], patch_size=[4, 4]),
                             image_token_id=IMAGE, image_seq_length=4),
    "idefics3": lambda: dict(text_config=dict(TEXT_SHAPE, model_type="llama"),
                             vision_config=dict(_VISION, image_size=16, patch_size=4), image_token_id=IMAGE,
                             scale_factor=2),
    "smolvlm": lambda: dict(text_config=dict(TEXT_SHAPE, model_type="llama"),
                            vision_config=dict(_VISION, image_size=16, patch_size=4), image_token_id=IMAGE,
                            scale_factor=2),
    "gemma3": lambda: dict(text_config=dict(TEXT_SHAPE, sliding_window=8, head_dim=16,
                                            layer_types=["sliding_attention", "full_attention"]),
                           vision_config=dict(_VISION, model_type="siglip_vision_model", image_size=16, patch_size=4),
                           mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=VISION_START,
                           eoi_token_index=VISION_END),
}
VLM_FAMILIES = tuple(VLM_CONFIGS)
# weights large enough that each image changes the tokens (the default init hides it); Gemma 3's scaled embeddings and
# extra norms saturate at that size (every image then gives one repeated token): smaller there, where its image
# tokens' bidirectional attention changes the tokens
WEIGHT_STD = {"gemma3": 0.02}
DEFAULT_WEIGHT_STD = 0.15


def tiny_vlm_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**VLM_CONFIGS[model_type](), **overrides})


def tiny_vlm(model_type: str, seed: int = 0, attn: str = "sdpa"):
    """An eval-mode fp32 ``AutoModelForImageTextToText`` of ``model_type`` (one of :data:`VLM_FAMILIES`) with weights
    from ``seed``; generates with PAD 0 and EOS 1."""
    torch.manual_seed(seed)
    config = tiny_vlm_config(model_type)
    config._attn_implementation = attn
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, WEIGHT_STD.get(model_type, DEFAULT_WEIGHT_STD))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def _image(model_type: str, seed: int, size: int) -> tuple[dict, int]:
    """One image's tensors (batch 1, as the family's processor gives them) and its number of image tokens."""
    g = torch.Generator().manual_seed(seed)
    if model_type in ("qwen2_5_vl", "qwen3_vl"):  # patches of 3 x 2 frames x 4 x 4, merged 2 x 2
        h, w = 4, size // 4
        return {"pixel_values": torch.randn(h * w, 3 * 2 * 4 * 4, generator=g),
                "image_grid_thw": torch.tensor([[1, h, w]])}, h * w // 4
    if model_type in ("idefics3", "smolvlm"):
        return {"pixel_values": torch.randn(1, 1, 3, 16, 16, generator=g),
                "pixel_attention_mask": torch.ones(1, 1, 16, 16, dtype=torch.long)}, 4
    if model_type == "mistral3":
        return {"pixel_values": torch.randn(1, 3, 16, size, generator=g),
                "image_sizes": torch.tensor([[16, size]])}, 2 * (size // 8)
    tokens = {"llava": 16, "internvl": 4, "gemma3": 4}[model_type]
    return {"pixel_values": torch.randn(1, 3, 16, 16, generator=g)}, tokens


def _join(model_type: str, parts: list[dict]) -> dict:
    out = {}
    for key in parts[0]:
        dim = 1 if (model_type in ("idefics3", "smolvlm") and key != "image_sizes") else 0
        out[key] = torch.cat([p[key] for p in parts], dim=dim)
    return out


def vlm_prompt(model_type: str, text: list[list[int]], images: list[int], size: int = 16) -> BatchFeature:
    """A prompt of one request as its processor would give it (batch 1): ``text[0]``, image 0's placeholders,
    ``text[1]``, image 1's, ... (``len(text) == len(images) + 1``); image ``i`` drawn from seed ``images[i]``
    (``size``: the width of Qwen-VL / Mistral 3 images, in pixels, multiple of 16)."""
    assert len(text) == len(images) + 1
    ids, kinds, parts = list(text[0]), [0] * len(text[0]), []
    for seed, after in zip(images, text[1:]):
        tensors, n = _image(model_type, seed, size)
        parts.append(tensors)
        wrap = model_type in ("qwen2_5_vl", "qwen3_vl", "gemma3")
        ids += [VISION_START] * wrap + [IMAGE] * n + [VISION_END] * wrap
        kinds += [0] * wrap + [1] * n + [0] * wrap
        ids += after
        kinds += [0] * len(after)
    data = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if parts:
        data.update(_join(model_type, parts))
        if model_type in ("qwen2_5_vl", "qwen3_vl"):
            data["mm_token_type_ids"] = torch.tensor([kinds])
        if model_type == "gemma3":
            data["token_type_ids"] = torch.tensor([kinds])
    return BatchFeature(data)


def vlm_reference(model, inputs, max_new_tokens: int) -> list[int]:
    """``inputs`` alone through ``model.generate()`` (greedy) with a fresh ``DynamicCache``: the generated ids."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    return out[0, inputs["input_ids"].shape[1]:].tolist()


VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_llava(path) -> None:
    """A tiny random LLaVA saved with a processor (a byte-level BPE trained here, CLIP's image processor at 16 x 16
    pixels, a chat template taking image parts): what ``python -m hf_paged serve --model PATH`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<s>", "<image>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is in this picture?", "Describe the image.", "user assistant system", "a red square"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                        extra_special_tokens={"image_token": "<image>"})
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                                                  crop_size={"height": 16, "width": 16}),
                               tokenizer=tokenizer, patch_size=4, vision_feature_select_strategy="default",
                               image_token="<image>", num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE)
    config = tiny_vlm_config("llava", image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    config.text_config.vocab_size = len(tokenizer)
    config.text_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    processor.save_pretrained(path)
