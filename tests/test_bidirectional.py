"""Bidirectional spans on the paged path: Gemma 3's image tokens (``token_type_ids == 1``) attend to each other both
ways in every prefill the paged path runs (a first turn, and a second turn continuing the same PagedCache, where the
paged attention, not the model's own, reads the prompt), equal to DynamicCache; a model without spans is unchanged.

Kernel-level checks against float64 (torch and Triton) are in test_kernels.py
(``test_prefill_with_bidirectional_spans_matches_float64``); the engine's are in test_engine_bidirectional.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3Config, Gemma3ForConditionalGeneration

from helpers import dynamic, generate, left_padded, tiny_model
from hf_paged import PagedCache, enable_paged_attention
from hf_paged.step import bidirectional_spans

IMAGE, BOI, EOI = 100, 101, 102
IMAGE_TOKENS = 4


def tiny_gemma3(seed: int = 1) -> Gemma3ForConditionalGeneration:
    """A 3-layer Gemma 3 with a 1-layer SigLIP tower; weights drawn large enough (and the image projection, zero at
    init, drawn too) that an image's tokens differ and the bidirectional mask changes the tokens."""
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=32,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0,
                eos_token_id=1, bos_token_id=2, initializer_range=0.1, query_pre_attn_scalar=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                          image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    config.text_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    projector = model.model.multi_modal_projector
    with torch.no_grad():
        projector.mm_input_projection_weight.normal_(0, 0.5)
        projector.mm_soft_emb_norm.weight.normal_(0, 0.5)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def prompt(num_text: int, seed: int, image: bool = True) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE - 1, (num_text,), generator=g).tolist()
    return ids[:3] + [BOI] + [IMAGE] * IMAGE_TOKENS + [EOI] + ids[3:] if image else ids


def turn(model, cache, ids: torch.Tensor, pixels: torch.Tensor | None, types: bool = True):
    """One generate() turn (8 greedy tokens, logits kept); an image prompt gets its pixels and token_type_ids."""
    extra = {}
    if pixels is not None:
        extra["pixel_values"] = pixels
        if types:
            extra["token_type_ids"] = (ids == IMAGE).long()
    return generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache, max_new_tokens=8,
                    output_logits=True, return_dict_in_generate=True, suppress_tokens=[IMAGE, BOI, EOI], **extra)


def conversation(model, make_cache, first_image: bool, types: bool = True):
    """Turn 1 (an image prompt or text), then turn 2 on the same cache: the first turn's output plus a prompt with
    an image (generate() embeds the new columns only: their image's pixels). Returns both turns' outputs."""
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    cache = make_cache()
    ids1 = torch.tensor([prompt(6, seed=1, image=first_image)])
    out1 = turn(model, cache, ids1, pixels if first_image else None, types)
    ids2 = torch.cat([out1.sequences, torch.tensor([prompt(5, seed=2)])], 1)
    out2 = turn(model, cache, ids2, pixels.flip(-1), types)  # the pixels of the new prompt's image only
    return out1, out2


def assert_same(got, expected):
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def gemma3():
    return tiny_gemma3()


@pytest.fixture(scope="module")
def reference(gemma3):
    """DynamicCache conversations, with and without token_type_ids (the spans must change the second turn)."""
    return {first: conversation(gemma3, lambda: DynamicCache(config=gemma3.config), first) for first in (False, True)}


def test_the_spans_change_the_second_turn(gemma3, reference):
    """Without token_type_ids (no bidirectional mask) DynamicCache's second turn gives other tokens: the equality
    below depends on the spans."""
    _, causal = conversation(gemma3, lambda: DynamicCache(config=gemma3.config), False, types=False)
    assert not torch.equal(causal.sequences, reference[False][1].sequences)


@pytest.mark.parametrize("first_image", [False, True], ids=["text-then-image", "image-then-image"])
def test_gemma3_images_in_every_turn_equal_dynamic_cache(gemma3, reference, first_image):
    """A second turn with an image continues the PagedCache: its prompt is read by the paged attention with the
    image's tokens seeing each other, as DynamicCache's bidirectional mask does."""
    enable_paged_attention(gemma3, backend="torch")
    got = conversation(gemma3, lambda: PagedCache(gemma3.config), first_image)
    for paged, dyn in zip(got, reference[first_image]):
        assert_same(paged, dyn)


def test_a_model_without_spans_is_unchanged():
    """Llama (no token_type_ids): two turns on one PagedCache equal DynamicCache."""
    model = enable_paged_attention(tiny_model("llama", seed=2))
    inputs = left_padded([7, 4], seed=3)
    outputs = {}
    for name, cache in (("dynamic", dynamic(model)), ("paged", PagedCache(model.config))):
        first = generate(model, inputs, cache, max_new_tokens=5)
        more = torch.randint(3, 90, (2, 4), generator=torch.Generator().manual_seed(4))
        second = {"input_ids": torch.cat([first, more], 1),
                  "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 9, dtype=torch.long)], 1)}
        outputs[name] = (first, generate(model, second, cache, max_new_tokens=5))
    assert all(torch.equal(a, b) for a, b in zip(outputs["paged"], outputs["dynamic"]))


def test_bidirectional_spans_count_real_tokens():
    """Spans are positions among a row's real tokens (left padding skipped); marks may cover only the last
    columns of the attention mask."""
    marks = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 1]]).bool()
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    assert bidirectional_spans(marks, mask) == [[(1, 3), (4, 5)], [(2, 4), (6, 7)]]
    assert bidirectional_spans(marks[:1], None) == [[(1, 3), (4, 5)]]
