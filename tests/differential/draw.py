"""Drawing a case from a seed: a family, engine conditions, and a mix of requests -- only combinations the rules
below say the engine serves (the one place the tester decides that; :func:`refusal` is swapped for the engine's
feature table once it has one).

A case is plain data (lists, dicts, ints: what the reproducer prints)::

    {"family": "qwen2_5_vl", "model_seed": 3,
     "engine": {"block_size": 4, "num_blocks": 40, "prefix_caching": True, "max_batch_tokens": 8,
                "speculative": None | "ngram" | "draft", "adapters": None | "several" | "peft"},
     "phases": [{"bump": None | seed, "requests": [request, ...]}, ...]}   # phases share one pool, in order

    request = {"text": [[ids], [ids], ...], "images": [[seed, [h, w]], ...], "type_ids": bool,
               "kwargs": {generate() keywords: max_new_tokens, do_sample, num_beams, eos_token_id, ...},
               "seed": int | None, "adapter": None | "a" | "b"}
"""

from __future__ import annotations

import random

from .models import FAMILIES, QWEN_VL, VLM_KINDS, image_tokens, vocab_of

ADAPTER_KINDS = ("plain", "sliding", "moe")  # families whose attention has q_proj / v_proj / o_proj to adapt
MODES = ["greedy"] * 4 + ["sampled"] * 2 + ["beams", "lookup"]


def request_features(request: dict) -> set[str]:
    """The features a request uses (names of the feature table's rows)."""
    kw = request["kwargs"]
    out = set()
    out.add("beams" if kw.get("num_beams", 1) > 1 else "sampled" if kw.get("do_sample") else "greedy")
    if kw.get("num_beams", 1) > 1 and kw.get("do_sample"):
        out.add("beam_sampling")
    if kw.get("prompt_lookup_num_tokens"):
        out.add("prompt_lookup")
    if request["images"]:
        out.add("images")
    if request["adapter"] is not None:
        out.add("adapter")
    for name in ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
                 "begin_suppress_tokens", "exponential_decay_length_penalty"):
        if name in kw:
            out.add("processors")
    if "min_new_tokens" in kw:
        out.add("min_length")
    if isinstance(kw.get("eos_token_id"), list) and len(kw["eos_token_id"]) > 1:
        out.add("several_eos")
    for name in ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"):
        if name in kw:
            out.add("warpers")
    return out


def refusal(kind: str, engine: dict, request: dict) -> str | None:
    """None where the engine serves ``request`` on a ``kind`` family under ``engine``, else why not (the draw
    skips it). The tester's own rules until the engine's feature table exists."""
    features = request_features(request)
    if kind == "hybrid" and (engine["speculative"] or "prompt_lookup" in features):
        return "speculation needs rows that can be cut back: not served with state layers"
    if "beams" in features and "prompt_lookup" in features:
        return "prompt lookup with beams is refused by SamplingParams"
    if "adapter" in features and kind not in ADAPTER_KINDS:
        return "adapters are drawn for text families with q/v/o projections only"
    return None


def engine_refusal(kind: str, engine: dict) -> str | None:
    if kind == "hybrid" and engine["speculative"]:
        return "speculation is refused at init for state layers"
    if engine["adapters"] and kind not in ADAPTER_KINDS:
        return "adapters are drawn for text families only"
    return None


def _tokens(rng, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, min(vocab, 100)) for _ in range(n)]  # ids 100+ are the VLMs' image / vision ids


def _text_runs(rng, family: str, n_images: int, vocab: int) -> list[list[int]]:
    runs = []
    for i in range(n_images + 1):
        edge = i == 0 or i == n_images
        length = rng.choice([0, 1, 3, rng.randint(2, 12), rng.randint(10, 28)] if edge and n_images
                            else [1, 3, rng.randint(2, 12), rng.randint(10, 28)])
        runs.append(_tokens(rng, vocab, length))
    if not n_images and not runs[0]:
        runs[0] = _tokens(rng, vocab, 2)
    return runs


def draw_request(rng: random.Random, family: str, engine: dict, hot: list[int], mode: str | None = None) -> dict:
    kind = FAMILIES[family]
    vocab = vocab_of(family)
    mode = mode or rng.choice(MODES)
    images = []
    if kind in VLM_KINDS and rng.random() < 0.8:
        for _ in range(rng.choice([1, 1, 2])):
            grid = [rng.choice([2, 4, 6]), rng.choice([2, 4, 6])] if family in QWEN_VL else [4, 4]
            images.append([rng.randrange(1000), grid])
    text = _text_runs(rng, family, len(images), vocab)
    kw = {"max_new_tokens": rng.choice([1, 2, rng.randint(3, 10), rng.randint(8, 20)])}
    seed = None
    if mode == "lookup":  # a prompt that repeats itself, so n-grams find drafts
        text[-1] = text[-1] + text[-1][:rng.randint(2, 6)] + text[-1]
        kw["prompt_lookup_num_tokens"] = rng.randint(2, 5)
    if mode == "sampled":
        kw["do_sample"] = True
        seed = rng.randrange(10_000)
        kw["temperature"] = rng.choice([0.6, 1.0, 1.3])
        for name, values in (("top_k", [3, 10, 40]), ("top_p", [0.5, 0.9]), ("min_p", [0.05, 0.2]),
                             ("typical_p", [0.7, 0.95]), ("epsilon_cutoff", [0.01, 0.05]),
                             ("eta_cutoff", [0.01, 0.3])):
            if rng.random() < 0.25:
                kw[name] = rng.choice(values)
    elif mode == "beams":
        k = rng.randint(2, 4)
        kw["num_beams"] = k
        kw["num_return_sequences"] = rng.randint(1, k)
        kw["length_penalty"] = rng.choice([1.0, 0.5, -1.0, 2.0])
        kw["early_stopping"] = rng.choice([False, True, "never"])
        if rng.random() < 0.2:
            kw["do_sample"] = True
            seed = rng.randrange(10_000)
    else:
        kw["do_sample"] = False
    # processors (any mode), EOS ids, min length
    if rng.random() < 0.15:
        kw["repetition_penalty"] = rng.choice([1.3, 2.0, 0.8])
    if rng.random() < 0.12:
        kw["no_repeat_ngram_size"] = rng.randint(2, 3)
    if rng.random() < 0.1 and hot:
        kw["bad_words_ids"] = [[rng.choice(hot)], [rng.choice(hot), rng.choice(hot)]]
    if rng.random() < 0.1 and hot:
        kw["sequence_bias"] = [[[rng.choice(hot)], -5.0], [[rng.choice(hot)], 3.0]]
    if rng.random() < 0.08 and hot:
        kw["suppress_tokens"] = [rng.choice(hot)]
    if rng.random() < 0.08 and hot:
        kw["begin_suppress_tokens"] = [rng.choice(hot)]
    if rng.random() < 0.3 and hot:
        kw["eos_token_id"] = sorted({1, *rng.sample(hot, min(len(hot), rng.randint(1, 3)))})
        if rng.random() < 0.4:
            kw["min_new_tokens"] = rng.randint(1, kw["max_new_tokens"])
    adapter = rng.choice([None, "a", "b"]) if engine["adapters"] else None
    request = {"text": text, "images": images, "type_ids": rng.random() < 0.7, "kwargs": kw, "seed": seed,
               "adapter": adapter}
    return request


def prompt_length(family: str, request: dict) -> int:
    wrap = 2 if family in QWEN_VL or family == "gemma3" else 0
    return sum(len(r) for r in request["text"]) + sum(image_tokens(family, tuple(g)) + wrap
                                                      for _, g in request["images"])


def draw_case(seed: int, hot_tokens, families: list[str] | None = None, max_requests: int = 8) -> dict:
    """A case from ``seed``: ``hot_tokens(family, model_seed)`` gives tokens the model tends to emit (for EOS ids,
    bad words, biases that change the output)."""
    rng = random.Random(seed)
    family = rng.choice(families or list(FAMILIES))
    kind = FAMILIES[family]
    model_seed = rng.randrange(3)
    while True:
        engine = {"block_size": rng.choice([2, 4, 8, 16]), "prefix_caching": rng.random() < 0.7,
                  "max_batch_tokens": rng.choice([512, 64, 16, 8]),
                  "speculative": rng.choice([None, None, "ngram", "draft"]),
                  "adapters": rng.choice([None, None, "several", "peft"]), "num_blocks": None}
        if engine_refusal(kind, engine) is None:
            break
    hot = hot_tokens(family, model_seed)
    phases = []
    for p in range(rng.choice([1, 1, 2])):
        requests = []
        target = rng.randint(1, max_requests)
        while len(requests) < target:
            if p and phases and rng.random() < 0.6:  # a later phase repeats earlier prompts' starts: prefix hits
                base = rng.choice(phases[0]["requests"])
                request = draw_request(rng, family, engine, hot)
                request["text"][0] = base["text"][0] + request["text"][0][:rng.randint(0, 3)]
                if base["images"] and request["images"]:
                    request["images"][0] = list(base["images"][0])
            else:
                request = draw_request(rng, family, engine, hot)
            if refusal(kind, engine, request) is None:
                requests.append(request)
        phases.append({"bump": rng.randrange(1000) if p and rng.random() < 0.5 and not engine["adapters"] else None,
                       "requests": requests})
    # the pool: roomy, or just above the largest request's worst case (preemptions)
    bs = engine["block_size"]
    groups = 2  # sliding and full layers take blocks each (mixed-window families); over-counted for the others
    worst = max(groups * (-(-(prompt_length(family, r) + r["kwargs"]["max_new_tokens"] + 8) // bs) + 1)
                * r["kwargs"].get("num_beams", 1) + 2 for ph in phases for r in ph["requests"])
    engine["num_blocks"] = rng.choice([max(1024, worst), worst + rng.randint(0, 6)])
    return {"family": family, "model_seed": model_seed, "engine": engine, "phases": phases}
