"""Images through the engine: vision-language requests (processor outputs of one prompt) give, token for token, what
``generate()`` alone with a ``DynamicCache`` gives for each; image-aware prefix caching never shares K/V between
different images and reuses it (without the vision encoder) for the same image."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import tiny_model
from helpers.vlm import IMAGE, VLM_FAMILIES, tiny_vlm, vlm_prompt, vlm_reference

import hf_paged
from hf_paged import BlockPool
from hf_paged.engine.multimodal import MultimodalInputs, image_spans

ENGINE_FAMILIES = list(VLM_FAMILIES)  # gemma3: with its bidirectional image spans


def counting_encoder(model) -> list[int]:
    """Count ``model.get_image_features`` calls (the vision encoder) in the returned list's length."""
    calls, encode = [], model.get_image_features

    @functools.wraps(encode)
    def counted(*args, **kwargs):
        calls.append(1)
        return encode(*args, **kwargs)

    model.get_image_features = counted
    return calls


def serve(model, prompts, max_new: int = 8, chunks: list | None = None, **options):
    """``prompts`` through one engine (all queued before it starts), ``chunks`` collecting ``(request index,
    start, num_tokens)`` of every chunk run. Returns the results in order and the engine's stats."""
    manager = hf_paged.init_continuous_batching(model, **options)
    core = manager._core
    if chunks is not None:
        run = core.runner.run

        def recording(batch):
            chunks.extend((int(c.request.request_id), c.start, c.num_tokens) for c in batch.chunks)
            return run(batch)

        core.runner.run = recording
    rids = [manager.add_request(p, request_id=str(i), max_new_tokens=max_new) for i, p in enumerate(prompts)]
    with manager:
        outs = [manager.get_result(rid, timeout=300) for rid in rids]
    assert all(o is not None and o.error is None for o in outs), [o and o.error for o in outs]
    return outs, manager.stats()


def references(model, prompts, max_new: int = 8) -> list[list[int]]:
    return [vlm_reference(model, p if not isinstance(p, list) else {"input_ids": torch.tensor([p])}, max_new)
            for p in prompts]


def mixed_prompts(family: str) -> list:
    """Two one-image prompts, a two-image prompt, and a text-only prompt holding the placeholder id as text."""
    return [vlm_prompt(family, [[2, 5, 6, 7], [8, 9, 10]], [1]),
            vlm_prompt(family, [[2, 5, 6, 7, 11, 12], [8, 9]], [2], size=32),
            vlm_prompt(family, [[2, 5], [8, 9, 10], [11, 12, 13]], [3, 4]),
            [2, 5, IMAGE, 7, 8, 9]]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_image_requests_equal_generate_alone(family):
    """Several image requests in one step (one with two images), a text-only request beside them (holding the
    placeholder id as text), then the same with images split across prefill chunks (8 tokens a step): every request's
    tokens equal generate() alone with a DynamicCache."""
    model = tiny_vlm(family)
    prompts = mixed_prompts(family)
    refs = references(model, prompts)
    media = [MultimodalInputs(model).prepare(p) if not isinstance(p, list) else None for p in prompts]
    for budget in (512, 8):
        chunks = []
        outs, stats = serve(model, prompts, chunks=chunks, max_batch_tokens=budget)
        assert [o.generated_tokens for o in outs] == refs, budget
        assert stats.encoder_calls == 3
        with_images = [(i, s, n) for i, s, n in chunks if media[i] is not None
                       and any(s <= p < s + n for p in media[i].image_positions)]
        if budget == 512:  # the first step: every prompt, whole
            assert len(with_images) == 3 and chunks[:4] == [(i, 0, len(outs[i].prompt_ids)) for i in range(4)]
        elif media[0].bidirectional_spans:  # Gemma 3: a chunk never ends inside an image's span
            for i, s, n in with_images:
                assert all(not (a < s + n < b) for a, b in media[i].bidirectional_spans), (i, s, n)
        else:
            assert any(not all(s <= p < s + n for p in media[i].image_positions) for i, s, n in with_images), (
                "no chunk ended inside a prompt's image tokens")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3"])
@pytest.mark.parametrize("encoder_cache_bytes", [0, 1 << 20])
def test_preempted_image_requests(family, encoder_cache_bytes):
    """A pool too small for every request at once: image requests are preempted and recomputed (their images
    encoded again, or taken from the encoder cache) and still give generate()'s tokens."""
    model = tiny_vlm(family)
    prompts = [vlm_prompt(family, [[2, 5 + i, 6], [8, 9, 10 + i]], [10 + i]) for i in range(4)]
    calls = counting_encoder(model)
    outs, stats = serve(model, prompts, max_new=16, pool=BlockPool(num_blocks=16, block_size=4, prefix_caching=True),
                        max_batch_tokens=16, encoder_cache_bytes=encoder_cache_bytes)
    assert stats.preemptions > 0
    assert len(calls) == stats.encoder_calls
    if encoder_cache_bytes:
        assert stats.encoder_calls == 4
    assert [o.generated_tokens for o in outs] == references(model, prompts, 16)


@pytest.mark.parametrize("family", ["qwen3_vl", "idefics3"])
def test_same_text_other_image_never_shares(family):
    """Prefix caching with the same text and different images: the image's blocks are keyed by its content, so the
    second request shares only the blocks before its image; both equal their own references and differ."""
    model = tiny_vlm(family)
    text = [[2, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    prompts = [vlm_prompt(family, text, [1]), vlm_prompt(family, text, [2])]
    pool = BlockPool(num_blocks=64, block_size=4, prefix_caching=True)
    first, _ = serve(model, prompts[:1], pool=pool)
    second, stats = serve(model, prompts[1:], pool=pool)
    refs = references(model, prompts)
    assert [first[0].generated_tokens, second[0].generated_tokens] == refs
    assert refs[0] != refs[1]
    before_image = MultimodalInputs(model).prepare(prompts[1]).image_positions[0]
    assert stats.prefix_hit_tokens == before_image // 4 * 4
    assert stats.encoder_calls == 1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "mistral3"])
def test_same_image_twice_is_a_hit_without_the_encoder(family):
    """The same prompt and image twice: the second request's blocks, image included, come from the prefix cache,
    and the vision encoder is not run again (even with no encoder cache)."""
    model = tiny_vlm(family)
    prompt = vlm_prompt(family, [[2, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]], [7])
    again = vlm_prompt(family, [[2, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]], [7])
    calls = counting_encoder(model)
    pool = BlockPool(num_blocks=64, block_size=4, prefix_caching=True)
    first, _ = serve(model, [prompt], pool=pool, encoder_cache_bytes=0)
    second, stats = serve(model, [again], pool=pool, encoder_cache_bytes=0)
    media = MultimodalInputs(model).prepare(again)
    assert stats.prefix_hit_tokens >= media.text_from, (stats.prefix_hit_tokens, media.text_from)
    assert len(calls) == 1 and stats.encoder_calls == 0
    assert first[0].generated_tokens == second[0].generated_tokens == references(model, [prompt])[0]


def test_key_ids_follow_the_image_content():
    """The ids blocks are keyed by: the prompt, with content stand-ins (negative, never a real id) at the image
    positions; the same images give the same stand-ins, other images other ones; text positions keep their ids."""
    model = tiny_vlm("llava")
    media = MultimodalInputs(model)
    a = media.prepare(vlm_prompt("llava", [[2, 5], [8]], [1]))
    b = media.prepare(vlm_prompt("llava", [[2, 5], [8]], [1]))
    c = media.prepare(vlm_prompt("llava", [[2, 5], [8]], [2]))
    assert a.key_ids == b.key_ids and a.digest == b.digest
    image = set(a.image_positions)
    assert all((a.key_ids[i] == c.key_ids[i]) == (i not in image) for i in range(len(a.tokens)))
    assert all(a.key_ids[i] < 0 for i in image) and all(a.key_ids[i] == a.tokens[i] for i in range(len(a.tokens))
                                                        if i not in image)


def test_refusals_name_the_problem():
    """What the engine cannot take is refused at add_request, by name: videos, a batch of several prompts, image
    tensors without placeholders, a mapping for a text model. (Bidirectional families other than Gemma 3 are refused
    likewise: patches.refused_image_families.)"""
    model = tiny_vlm("qwen2_5_vl")
    prompt = vlm_prompt("qwen2_5_vl", [[2, 5], [8]], [1])
    with hf_paged.init_continuous_batching(model) as manager:
        with pytest.raises(ValueError, match="videos"):
            manager.add_request({**prompt, "pixel_values_videos": prompt["pixel_values"]})
        with pytest.raises(ValueError, match="batch 1"):
            manager.add_request({**prompt, "input_ids": prompt["input_ids"].repeat(2, 1)})
        with pytest.raises(ValueError, match="no image placeholder"):
            manager.add_request({**prompt, "input_ids": torch.tensor([[2, 5, 8]])})
    text_model = hf_paged.init_continuous_batching(tiny_model())
    with pytest.raises(ValueError, match="takes no images"):
        text_model.add_request({"input_ids": torch.tensor([[2, 5]]), "pixel_values": torch.zeros(1, 3, 4, 4)})


def test_image_spans_are_the_runs_of_image_tokens():
    """Gemma 3's bidirectional spans: one half-open range per image, from token_type_ids (else from the runs of
    placeholder positions)."""
    prompt = vlm_prompt("gemma3", [[2, 5], [8], [9, 10]], [1, 2])
    kinds = prompt["token_type_ids"][0].tolist()
    spans = image_spans(prompt["token_type_ids"], [])
    assert len(spans) == 2 and all(set(kinds[s:e]) == {1} for s, e in spans)
    assert sum(e - s for s, e in spans) == sum(kinds)
    assert image_spans(None, [3, 4, 5, 9, 10]) == [(3, 6), (9, 11)]
