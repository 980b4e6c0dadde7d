"""Multi-axis rotary positions in the engine (Qwen2-VL, Qwen2.5-VL with windowed vision attention, Qwen3-VL with
deepstack features): image requests with the image anywhere in the prompt, images of several grid sizes, with and
without the processor's ``mm_token_type_ids``, beside text-only requests and two-image requests in one step, chunked
across the image, preempted, hit in the prefix cache, and with beams — every request's tokens equal ``generate()``
of that request alone with a ``DynamicCache``. The positions come from the model's own functions
(``_prepare_position_ids_for_generation``: ``get_rope_index`` and the ``rope_deltas`` it leaves)."""

from __future__ import annotations

import pytest
import torch
from helpers.vlm import (_MROPE, _QWEN_IDS, _QWEN_VISION, DEFAULT_WEIGHT_STD, IMAGE, TEXT_SHAPE, VISION_END,
                         VISION_START)
from transformers import AutoConfig, AutoModelForImageTextToText, BatchFeature, DynamicCache

import hf_paged
from hf_paged import BlockPool, compat

NEW = 8
MERGE = 2
# the configs: patch 14 (16 for Qwen3-VL), merge 2; windowed vision attention; deepstack at two layers
FAMILIES = {
    "qwen2_vl": (14, lambda p: dict(text_config=dict(TEXT_SHAPE, rope_parameters=_MROPE),
                                    vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                                                       patch_size=p, spatial_merge_size=MERGE,
                                                       temporal_patch_size=2), **_QWEN_IDS)),
    "qwen2_5_vl": (14, lambda p: dict(text_config=dict(TEXT_SHAPE, rope_parameters=_MROPE),
                                      vision_config=dict(_QWEN_VISION, patch_size=p, window_size=56,
                                                         fullatt_block_indexes=[1]), **_QWEN_IDS)),
    "qwen3_vl": (16, lambda p: dict(text_config=dict(TEXT_SHAPE, head_dim=16,
                                                     rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                                    vision_config=dict(_QWEN_VISION, patch_size=p, num_position_embeddings=16,
                                                       deepstack_visual_indexes=[0, 1]), **_QWEN_IDS)),
}


def tiny(family: str):
    patch, make = FAMILIES[family]
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **make(patch))
    config._attn_implementation = "sdpa"
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, DEFAULT_WEIGHT_STD)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def prompt(family: str, text: list[list[int]], grids: list[tuple[int, int]], seed: int = 0,
           kinds: bool = True) -> BatchFeature:
    """``text[0]``, image 0 (a ``grid`` of h x w patches), ``text[1]``, ... as the family's processor gives them
    (``kinds``: with its ``mm_token_type_ids``)."""
    patch = FAMILIES[family][0]
    g = torch.Generator().manual_seed(seed)
    ids, types, pixels = list(text[0]), [0] * len(text[0]), []
    for (h, w), after in zip(grids, text[1:]):
        n = h * w // MERGE ** 2
        ids += [VISION_START] + [IMAGE] * n + [VISION_END] + after
        types += [0] + [1] * n + [0] + [0] * len(after)
        pixels.append(torch.randn(h * w, 3 * 2 * patch * patch, generator=g))
    data = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if grids:
        data["pixel_values"] = torch.cat(pixels)
        data["image_grid_thw"] = torch.tensor([[1, h, w] for h, w in grids])
        if kinds:
            data["mm_token_type_ids"] = torch.tensor([types])
    return BatchFeature(data)


def reference(model, inputs, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, **kwargs,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def text(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 99, (n,), generator=g).tolist()


def prompts(family: str) -> list:
    t = text(1, 30)
    return [
        prompt(family, [[], t[:12]], [(4, 4)], seed=1),  # image at the start
        prompt(family, [t[:4], t[4:20]], [(4, 8)], seed=2),  # after 4 tokens, a wide image
        prompt(family, [t[:21], []], [(4, 4)], seed=3),  # at the end
        prompt(family, [t[:5], t[5:9], t[9:13]], [(8, 4), (2, 6)], seed=4),  # two images: a tall one, a flat one
        prompt(family, [t[:4], t[4:20]], [(4, 8)], seed=2, kinds=False),  # no mm_token_type_ids: generate()'s
        prompt(family, [t[:21], []], [(6, 6)], seed=5, kinds=False),  # plain positions
        t[3:17],  # text only, beside them
    ]


def as_inputs(p):
    return p if not isinstance(p, list) else {"input_ids": torch.tensor([p])}


def run(model, items, always_draft: bool = False, **options):
    manager = hf_paged.init_continuous_batching(model, **options)
    if always_draft:  # the policy drafts at every step (the drafts' positions are checked, not speed)
        manager._core.speculation.policy.choose = lambda choices: len(choices) - 1
    rids = [manager.add_request(p, request_id=str(i), max_new_tokens=NEW, **kw) for i, (p, kw) in enumerate(items)]
    with manager:
        outs = [manager.get_result(rid, timeout=300) for rid in rids]
    assert all(o is not None and o.error is None for o in outs), [o and o.error for o in outs]
    stats = manager.stats()
    stats.drafted = manager._core.speculation.stats.proposed
    return [o.generated_tokens for o in outs], stats


@pytest.mark.parametrize("family", list(FAMILIES))
def test_image_anywhere_any_grid_equals_generate_alone(family):
    """Every prompt of :func:`prompts` in one engine: whole in one step, then 8 tokens a step (chunks end inside
    the images), then in a pool so small requests are preempted and recomputed; then again on the same prefix-caching
    pool (its blocks hit)."""
    model = tiny(family)
    ps = prompts(family)
    refs = [reference(model, as_inputs(p)) for p in ps]
    items = [(p, {}) for p in ps]
    assert run(model, items, max_batch_tokens=512)[0] == refs
    assert run(model, items, max_batch_tokens=8)[0] == refs
    drafted, stats = run(model, items, always_draft=True, speculative="ngram")
    assert drafted == refs and stats.drafted > 0
    small, stats = run(model, items, pool=BlockPool(block_size=4, num_blocks=24, prefix_caching=True), max_batch_tokens=16)
    assert small == refs and stats.preemptions > 0
    pool = BlockPool(block_size=4, num_blocks=256, prefix_caching=True)
    run(model, items, pool=pool)
    again, stats = run(model, items, pool=pool)
    assert again == refs and stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_beams_on_image_requests_equal_generate_alone(family):
    """num_beams=3 on image requests (the beam rows carry the request's images and positions) beside a greedy one:
    each the best sequence generate(num_beams=3) gives alone."""
    model = tiny(family)
    ps = prompts(family)[:3] + prompts(family)[4:5]
    refs = [reference(model, p, num_beams=3) for p in ps]
    tokens, _ = run(model, [(p, dict(num_beams=3)) for p in ps] + [(ps[0], {})])
    assert tokens[:-1] == refs
    assert tokens[-1] == reference(model, ps[0])


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_beams_on_image_requests_of_other_families(family):
    """The same on a family with bidirectional image spans (Gemma 3) and a plain one (LLaVA)."""
    from helpers.vlm import tiny_vlm, vlm_prompt

    model = tiny_vlm(family)
    ps = [vlm_prompt(family, [[2, 5, 6, 7], [8, 9, 10]], [1]), vlm_prompt(family, [[2, 5], [8, 9, 10, 11]], [2])]
    refs = [reference(model, p, num_beams=3) for p in ps]
    tokens, _ = run(model, [(p, dict(num_beams=3)) for p in ps])
    assert tokens == refs
