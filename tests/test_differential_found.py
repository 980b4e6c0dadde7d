"""What the differential tester (tests/differential) found, each shrunk case as a regular test: the engine gives the
request what generate() gives it alone on a DynamicCache (or refuses it by name). Each test's docstring says what was
found and how (docs/testing.md, "Randomized differential testing", has the tester itself)."""

from __future__ import annotations

import pytest
import torch
from differential.models import build, build_draft, make_prompt
from helpers.engine_shadow import one_thread
from transformers import DynamicCache

import hf_paged
from hf_paged import BlockPool, compat

QWEN_VL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def alone(model, prompt, seed=None, **kwargs):
    """generate() of ``prompt`` alone on a DynamicCache (after ``torch.manual_seed(seed)`` when given)."""
    inputs = dict(prompt) if not isinstance(prompt, list) else {"input_ids": torch.tensor([prompt])}
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs, return_dict_in_generate=True,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    n = inputs["input_ids"].shape[1]
    if kwargs.get("num_beams", 1) == 1:
        return [out.sequences[0, n:].tolist()]
    return [out.sequences[j, n:n + int((out.beam_indices[j] != -1).sum())].tolist()
            for j in range(kwargs.get("num_return_sequences", 1))]


def engine(model, prompt, n: int = 1, block_size: int = 2, **kwargs):
    manager = hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=block_size, num_blocks=1024,
                                                                      prefix_caching=False), max_batch_tokens=512)
    rid = manager.add_request(prompt, request_id="r", **kwargs)
    with manager:
        outs = [manager.get_result(r, timeout=300) for r in [rid] + [f"{rid}__child#{j}" for j in range(n - 1)]]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [list(o.generated_tokens) for o in outs]


@pytest.mark.parametrize("family", QWEN_VL)
@pytest.mark.parametrize("layout", ["image_only", "image_at_end"])
def test_qwen_vl_image_without_type_ids_equals_generate_or_is_refused(family, layout):
    """F1 (issue 50 item 5): processor outputs without ``mm_token_type_ids``: generate() (transformers 5.25) then
    gives every token text positions; the engine gave the image its 3-axis positions, so the tokens differed from
    the first or second one. The engine must give generate()'s tokens or refuse the request naming the field.
    (With ``mm_token_type_ids``, as the processors return them, both agree: the next test.)"""
    model = build(family, 0)
    text = [[], []] if layout == "image_only" else [[5, 6, 7, 8], []]
    prompt = make_prompt(family, text, [[236, [4, 4]]], type_ids=False)
    want = alone(model, prompt, max_new_tokens=6, do_sample=False)
    try:
        got = engine(model, prompt, max_new_tokens=6, do_sample=False)
    except ValueError as err:
        assert "mm_token_type_ids" in str(err)
        return
    assert got == want


@pytest.mark.parametrize("family", QWEN_VL)
def test_qwen_vl_image_with_type_ids_equals_generate(family):
    """The same prompts with ``mm_token_type_ids``: the engine's tokens are generate()'s (this held on the old code
    too: the tester's sweep of layouts found the difference only without the type ids)."""
    model = build(family, 0)
    for text in ([[], []], [[5, 6, 7, 8], [9, 10, 11]], [[5, 6, 7, 8], []]):
        prompt = make_prompt(family, text, [[236, [4, 4]]], type_ids=True)
        assert engine(model, prompt, max_new_tokens=6, do_sample=False) == alone(model, prompt, max_new_tokens=6,
                                                                                 do_sample=False), text


@pytest.mark.parametrize("family", QWEN_VL)
def test_beams_on_an_image_request_equal_generate(family):
    """F2 (issue 50 item 6): beam search on a Qwen-VL image request (type ids given): the engine's sequences are
    generate(num_beams=3, num_return_sequences=2)'s (they differed from the second token: the extra beam rows had
    no media, so they decoded at offset 0)."""
    model = build(family, 0)
    prompt = make_prompt(family, [[5, 6, 7], [9]], [[236, [4, 4]]], type_ids=True)
    settings = dict(max_new_tokens=4, num_beams=3, num_return_sequences=2)
    assert engine(model, prompt, n=2, **settings) == alone(model, prompt, **settings)


# the shrunk cases of the old-code campaign (seed 3): (family, model seed, text runs, images, new tokens, seed, mode)
SEEDED_UNDER_SPECULATION = [
    ("llama", 2, [[48]], [], 3, 196, "draft"),
    ("mistral", 2, [[20]], [], 6, 6794, "ngram"),
    ("mistral", 1, [[31, 78, 30, 84]], [], 6, 2887, "ngram"),
    ("gemma3", 0, [[], [21, 26, 67, 60, 86]], [[16, [4, 4]]], 6, 2504, "ngram"),
    ("gemma3", 0, [[], []], [[281, [4, 4]]], 4, 4876, "draft"),
]


@pytest.mark.parametrize("family,model_seed,text,images,new,seed,mode", SEEDED_UNDER_SPECULATION)
def test_seeded_sampled_request_under_speculation_keeps_its_seed_guarantee(family, model_seed, text, images, new,
                                                                           seed, mode):
    """F3 (and issue 51's n-gram case): a seeded sampled request in an engine that speculates (drafting forced at
    every step) gets the tokens of generate() after ``torch.manual_seed(seed)`` -- the feature table decodes it
    plainly. On the old code each of these differed (e.g. llama, draft model, a 1-token prompt: ``[65, 48, 76]``
    against generate()'s ``[65, 33, 63]``)."""
    model = build(family, model_seed)
    prompt = make_prompt(family, text, images)
    want = alone(model, prompt, seed=seed, max_new_tokens=new, do_sample=True)
    spec = build_draft(family, model_seed) if mode == "draft" else "ngram"
    manager = hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=8, num_blocks=1024,
                                                                      prefix_caching=False), speculative=spec)
    manager._core.speculation.policy.choose = lambda choices: len(choices) - 1  # draft whenever allowed
    rid = manager.add_request(prompt, max_new_tokens=new, do_sample=True, seed=seed)
    with manager:
        got = manager.get_result(rid, timeout=300).generated_tokens
    assert [list(got)] == want


F5_CASE = {"family": "gemma3", "model_seed": 1,
           "engine": {"block_size": 2, "prefix_caching": False, "max_batch_tokens": 512, "speculative": "draft",
                      "adapters": None, "num_blocks": 73},
           "phases": [{"bump": None, "requests": [
               {"text": [[], [31, 21, 99, 74, 58, 70, 21, 20, 29, 14, 63, 42, 54, 90, 98, 79, 7, 93, 60, 53, 31, 21,
                              99, 31, 21, 99, 74, 58, 70, 21, 20, 29, 14, 63, 42, 54, 90, 98, 79, 7, 93, 60, 53]],
                "images": [[897, [4, 4]]], "type_ids": True, "seed": None, "adapter": None,
                "kwargs": {"max_new_tokens": 7, "prompt_lookup_num_tokens": 3, "do_sample": False}},
               {"text": [[40, 64, 36, 44, 60, 61, 72, 20, 20, 54, 89, 19, 58, 74, 72, 64],
                         [71, 44, 88, 68, 29, 87, 43, 85, 55, 35, 23, 21, 30, 30, 19, 40, 70, 42]],
                "images": [[982, [4, 4]]], "type_ids": False, "seed": None, "adapter": None,
                "kwargs": {"max_new_tokens": 6, "do_sample": False, "sequence_bias": [[[121], -5.0], [[40], 3.0]]}},
           ]}]}


def test_draft_model_engine_with_ngram_and_image_requests_under_pool_pressure():
    """F5: Gemma 3 image requests in an engine with a draft model, one asking for prompt lookup, a 73-block pool of
    2-token blocks: the engine thread died in the draft's forward (0 tokens: "cannot reshape tensor of 0
    elements"). Each request must equal generate() alone."""
    from differential.run import Runner

    assert Runner().run(F5_CASE) == []
