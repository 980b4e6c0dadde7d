"""Drawing a case from a seed: a family, engine conditions, and a mix of requests -- only combinations the rules
the engine's feature table (``hf_paged.engine.features``) says are served; now and then one it refuses, marked
``"expect": "refused"``, which the runner checks ``add_request`` refuses by name.

A case is plain data (lists, dicts, ints: what the reproducer prints)::

    {"family": "qwen2_5_vl", "model_seed": 3,
     "engine": {"block_size": 4, "num_blocks": 40, "prefix_caching": True, "max_batch_tokens": 8,
                "speculative": None | "ngram" | "draft", "adapters": None | "several" | "peft"},
     "phases": [{"bump": None | seed, "requests": [request, ...]}, ...]}   # phases share one pool, in order

    request = {"text": [[ids], [ids], ...], "images": [[seed, [h, w]], ...], "type_ids": bool,
               "kwargs": {generate() keywords: max_new_tokens, do_sample, num_beams, eos_token_id, ...},
               "seed": int | None, "adapter": None | "sql" | "chat"}
"""

from __future__ import annotations

import random

try:
    from hf_paged.engine import features
except ImportError:  # an hf_paged before the feature table (running the tester on old code): the tester's own rules
    features = None

from .models import FAMILIES, QWEN_VL, VLM_KINDS, image_tokens, vocab_of

ADAPTER_KINDS = ("plain", "sliding", "moe")  # families whose attention has q_proj / v_proj / o_proj to adapt
MODES = ["greedy"] * 4 + ["sampled"] * 2 + ["beams", "lookup"]


def request_features(request: dict) -> set[str]:
    """The features a request uses, for the report (the feature table's names where it has one)."""
    kw = request["kwargs"]
    out = set()
    out.add("beams" if kw.get("num_beams", 1) > 1 else "sampled" if kw.get("do_sample") else "greedy")
    if kw.get("do_sample") and request["seed"] is not None:
        out.add("seeded")
    if kw.get("num_return_sequences", 1) > 1:
        out.add("n")
    if kw.get("prompt_lookup_num_tokens"):
        out.add("ngram")
    if request["images"]:
        out.add("images")
    if request["adapter"] is not None:
        out.add("adapter")
    if any(name in kw for name in PROCESSORS):
        out.add("processors")
    if "min_new_tokens" in kw:
        out.add("min_tokens")
    if isinstance(kw.get("eos_token_id"), list) and len(kw["eos_token_id"]) > 1:
        out.add("eos_ids")
    if any(name in kw for name in WARPERS):
        out.add("warpers")
    return out


PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
              "begin_suppress_tokens", "exponential_decay_length_penalty")
WARPERS = ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def table_features(kind: str, engine: dict, request: dict | None) -> set[str]:
    """``request`` (None: the engine alone) in the feature table's names, with the engine's conditions."""
    out = {"speculative"} if engine["speculative"] else set()
    if kind == "hybrid":
        out.add("state_layers")
    if request is not None:
        out |= request_features(request) - {"greedy", "warpers"}
        if request["kwargs"].get("prompt_lookup_num_tokens") == 0:
            out.discard("speculative")
    return out


def refusal(kind: str, engine: dict, request: dict) -> str | None:
    """None where the engine serves ``request`` on a ``kind`` family under ``engine``, else the reason the engine's
    feature table gives (``hf_paged.engine.features``; the request is then expected to be refused by name)."""
    if "adapter" in request_features(request) and kind not in ADAPTER_KINDS:
        return "adapters are drawn for text families with q/v/o projections only"
    if features is None:
        return _old_rules(table_features(kind, engine, request))
    decision = features.decide(table_features(kind, engine, request))
    return decision.reason if decision.outcome == features.REFUSED else None


def _old_rules(present: set[str]) -> str | None:
    """What the engine refused before its feature table (hf_paged before issue 51)."""
    if {"speculative", "state_layers"} <= present or {"ngram", "state_layers"} <= present:
        return "speculation is refused for state layers"
    if {"beams", "ngram"} <= present:
        return "prompt lookup with beams is refused by SamplingParams"
    return None


def engine_refusal(kind: str, engine: dict) -> str | None:
    if engine["adapters"] and kind not in ADAPTER_KINDS:
        return "adapters are drawn for text families only"
    if features is None:
        return _old_rules(table_features(kind, engine, None))
    decision = features.decide(table_features(kind, engine, None))
    return decision.reason if decision.outcome == features.REFUSED else None


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
    adapter = rng.choice([None, "sql", "chat"]) if engine["adapters"] else None
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
    for _ in range(100):
        engine = {"block_size": rng.choice([2, 4, 8, 16]), "prefix_caching": rng.random() < 0.7,
                  "max_batch_tokens": rng.choice([512, 64, 16, 8]),
                  "speculative": rng.choice([None, None, "ngram", "draft"]),
                  "adapters": rng.choice([None, None, "several", "peft"]), "num_blocks": None}
        if engine_refusal(kind, engine) is None:
            break
    else:
        raise AssertionError(f"no engine conditions drawn for {family}")
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
                if not request["images"] and not request["text"][0]:  # an image-only base, copied as text
                    request["text"][0] = _tokens(rng, vocab_of(family), 2)
                if base["images"] and request["images"]:
                    request["images"][0] = list(base["images"][0])
            else:
                request = draw_request(rng, family, engine, hot)
            if rng.random() < 0.08 and request["kwargs"].get("num_beams", 1) > 1:
                request["kwargs"]["prompt_lookup_num_tokens"] = 3  # a combination the table refuses
            why = refusal(kind, engine, request)
            if why is None:
                requests.append(request)
            elif "adapters are drawn" not in why and rng.random() < 0.3:
                request["expect"] = "refused"
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
