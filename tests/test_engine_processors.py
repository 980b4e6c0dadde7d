"""Every logits processor, warper and stopping rule generate() has, served per request by the engine: each request,
alone and mixed in one engine with requests of other settings (the same steps), gets the tokens generate() gives it
alone with a DynamicCache (greedy; seeded sampling for the warpers). Stop strings with the embedded SmolLM2 tokenizer;
custom logits_processor / stopping_criteria with the documented contract (the request's ids [1, n], its scores row)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.engine_shadow import one_thread
from helpers.models import EOS, VOCAB, tiny_model
from transformers import AutoTokenizer, DynamicCache, LogitsProcessorList, StoppingCriteriaList, WatermarkingConfig

import hf_paged
from hf_paged import BlockPool, compat, embedded
from hf_paged.engine.processors import NGramIndex
from hf_paged.engine.sampling import REFUSED, SamplingParams

NEW = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def reference(model, prompt: list[int], seed: int | None = None, tokenizer=None, **settings) -> list[int]:
    """``prompt`` alone through generate() with a DynamicCache (after ``torch.manual_seed(seed)`` when sampling)."""
    settings.setdefault("max_new_tokens", NEW)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             tokenizer=tokenizer, **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)},
                             **settings)
    return out[0, len(prompt):].tolist()


def engine_settings(settings: dict) -> dict:
    """generate()'s keywords as the engine takes them (LogitsProcessorList / StoppingCriteriaList as lists)."""
    out = {k: list(v) if isinstance(v, (LogitsProcessorList, StoppingCriteriaList)) else v
           for k, v in settings.items()}
    out.setdefault("max_new_tokens", NEW)
    return out


class BanParityOfLast:
    """A custom processor reading the request's own ids: bans the tokens of the last id's parity."""

    def __init__(self):
        self.shapes = []

    def __call__(self, ids, scores):
        self.shapes.append((tuple(ids.shape), tuple(scores.shape)))
        banned = torch.arange(scores.shape[-1]) % 2 == int(ids[0, -1]) % 2
        return scores.masked_fill(banned, float("-inf"))


class StopAfterToken:
    """A custom criterion: true once the request's last id is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, ids, scores):
        return ids[:, -1] == self.token


def cases(model) -> list[tuple[str, list[int], dict]]:
    """``(name, prompt, generate() settings)``: each option, set to values that change the plain greedy output."""
    prompts = [prompt_of(n, seed) for n, seed in ((9, 1), (4, 2), (17, 3))]
    plain = [reference(model, p, eos_token_id=[]) for p in prompts]
    out = []
    for j, (prompt, free) in enumerate(zip(prompts, plain)):
        a, b, c = free[0], free[1], free[2]
        out += [
            (f"plain{j}", prompt, {}),
            (f"no_repeat_ngram{j}", prompt, dict(no_repeat_ngram_size=2 + j % 2)),
            (f"bad_words{j}", prompt, dict(bad_words_ids=[[a], [free[3], free[4]], [EOS]])),
            (f"sequence_bias{j}", prompt, dict(sequence_bias=[[[b], -4.0], [[a, b], -9.0], [[c], 2.5],
                                                              [[free[5], free[6], free[7]], 50.0]])),
            (f"min_length{j}", prompt, dict(eos_token_id=c, min_length=len(prompt) + 5)),
            (f"suppress{j}", prompt, dict(suppress_tokens=[a, c])),
            (f"begin_suppress{j}", prompt, dict(begin_suppress_tokens=[a, b])),
            (f"forced_eos{j}", prompt, dict(forced_eos_token_id=[7, 8], max_new_tokens=6 + j)),
            (f"decay{j}", prompt, dict(exponential_decay_length_penalty=(2, 1.6), eos_token_id=c)),
            (f"penalty_mix{j}", prompt, dict(repetition_penalty=1.4, no_repeat_ngram_size=3,
                                            sequence_bias=[[[a], 3.0]], suppress_tokens=[b])),
            (f"invalid{j}", prompt, dict(remove_invalid_values=True)),
            (f"logits_processor{j}", prompt, dict(logits_processor=LogitsProcessorList([BanParityOfLast()]))),
            (f"prefix_fn{j}", prompt, dict(prefix_allowed_tokens_fn=lambda batch_id, ids: list(
                range(int(ids[-1]) % 5 + 3, VOCAB, 4)))),
            (f"stopping_criteria{j}", prompt, dict(stopping_criteria=StoppingCriteriaList([StopAfterToken(c)]),
                                                   eos_token_id=[])),
            (f"typical{j}", prompt, dict(do_sample=True, typical_p=0.7, seed=10 + j)),
            (f"epsilon{j}", prompt, dict(do_sample=True, epsilon_cutoff=0.02, temperature=0.8, seed=20 + j)),
            (f"eta{j}", prompt, dict(do_sample=True, eta_cutoff=0.5, top_k=0, temperature=0.3, seed=30 + j)),
            (f"top_h{j}", prompt, dict(do_sample=True, top_h=0.3, seed=40 + j)),
            (f"sampled_mix{j}", prompt, dict(do_sample=True, typical_p=0.9, no_repeat_ngram_size=2,
                                            bad_words_ids=[[a]], seed=50 + j)),
            (f"watermark{j}", prompt, dict(watermarking_config=WatermarkingConfig(bias=4.0, context_width=2))),
            (f"watermark_selfhash{j}", prompt, dict(do_sample=True, seed=60 + j, watermarking_config=WatermarkingConfig(
                bias=3.0, seeding_scheme="selfhash", context_width=3))),
        ]
    out.append(("forced_bos", [9], dict(forced_bos_token_id=5, begin_suppress_tokens=[5, 6])))
    out.append(("forced_bos_only", [9], dict(forced_bos_token_id=5)))
    return out


def expected(model, name, prompt, settings) -> list[int]:
    settings = dict(settings)
    seed = settings.pop("seed", None)
    return reference(model, prompt, seed=seed, **settings)


def test_each_option_alone_equals_generate(model):
    """Each option on a request alone in the engine: generate()'s tokens, and the option changed them (greedy
    options) from the plain output, so the test would see it ignored."""
    all_cases = cases(model)
    plain = {name[-1]: expected(model, name, p, s) for name, p, s in all_cases if name.startswith("plain")}
    per_prompt = (len(all_cases) - 2) // 3
    for name, prompt, settings in all_cases[:per_prompt] + all_cases[-2:]:  # the first prompt's options, forced BOS
        want = expected(model, name, prompt, settings)
        out = hf_paged.generate_batch(model, [prompt], progress_bar=False, pool=BlockPool(block_size=4, num_blocks=64),
                                      **engine_settings(settings))["req_0"]
        assert out.error is None, (name, out.error)
        assert out.generated_tokens == want, name
        if settings.get("do_sample"):
            base = {k: v for k, v in settings.items() if k in ("do_sample", "temperature", "top_k", "seed")}
            if "watermarking_config" in settings:
                base["watermarking_config"] = WatermarkingConfig(bias=1e-3, seeding_scheme="selfhash")
            unchanged = want == expected(model, name, prompt, base)
        else:
            unchanged = want == plain["0"] and not name.startswith(("plain", "invalid", "forced_bos"))
        assert not unchanged, f"{name} does not change the output: the test would not see it ignored"


def test_options_mixed_in_one_engine_equal_generate_alone(model):
    """Every option, on three prompts each, all queued in one engine (different settings in the same steps, rows of
    equal settings grouped with different histories, preemptions from a small pool): each request gets generate()'s
    tokens alone."""
    all_cases = cases(model)
    want = {name: expected(model, name, prompt, settings) for name, prompt, settings in all_cases}
    pool = BlockPool(block_size=4, num_blocks=40, prefix_caching=True)
    manager = hf_paged.init_continuous_batching(model, pool=pool, max_batch_tokens=64)
    order = list(range(len(all_cases)))
    random.Random(5).shuffle(order)
    ids = {}
    for i in order:
        name, prompt, settings = all_cases[i]
        ids[name] = manager.add_request(prompt, **engine_settings(settings))
    with manager:
        got = {name: manager.get_result(rid, timeout=120) for name, rid in ids.items()}
    for name, out in got.items():
        assert out.error is None, (name, out.error)
        assert out.generated_tokens == want[name], name


def test_custom_processor_and_criterion_contract(model):
    """A custom logits processor is called with that request's ids [1, n] (prompt + generated, no padding) and its
    scores row [1, vocab]; a custom criterion ends the request with finish reason "stop", its token kept."""
    processor = BanParityOfLast()
    prompt = prompt_of(6, 8)
    free = reference(model, prompt, eos_token_id=[])
    with hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=4, num_blocks=64)) as manager:
        other = manager.add_request(prompt_of(30, 9), max_new_tokens=NEW)
        rid = manager.add_request(prompt, max_new_tokens=NEW, logits_processor=[processor])
        stop = manager.add_request(prompt, max_new_tokens=NEW, eos_token_id=[], stopping_criteria=[
            StopAfterToken(free[3])])
        out, stopped = manager.get_result(rid, timeout=60), manager.get_result(stop, timeout=60)
        manager.get_result(other, timeout=60)
    n = len(out.generated_tokens)
    assert processor.shapes == [((1, len(prompt) + i), (1, VOCAB)) for i in range(n)]
    assert stopped.finish_reason == "stop" and stopped.generated_tokens == free[:free.index(free[3]) + 1]


def test_max_time_zero_stops_after_one_token(model):
    """max_time=0 ends a request after its first token, as generate() does (its clock starts when it is queued)."""
    prompt = prompt_of(5, 4)
    assert len(reference(model, prompt, max_time=0.0)) == 1
    out = hf_paged.generate_batch(model, [prompt], progress_bar=False, max_new_tokens=NEW, max_time=0.0,
                                  pool=BlockPool(block_size=4, num_blocks=64))["req_0"]
    assert out.generated_tokens == reference(model, prompt, max_new_tokens=1) and out.finish_reason == "stop"


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return AutoTokenizer.from_pretrained(embedded.local_model_dir())
    except (FileNotFoundError, OSError) as exc:  # pragma: no cover - the test setup installs it
        pytest.skip(f"the embedded SmolLM2 tokenizer is not available: {exc}")


def test_stop_strings_equal_generate(model, tokenizer):
    """Stop strings (decoded from the plain output: inside one token, across two tokens, spanning prompt and output,
    never matched) end each request where generate(stop_strings=..., tokenizer=...) ends it alone, with finish
    reason "stop" and the stop string's tokens kept; mixed with plain requests in one engine."""
    prompts = [prompt_of(n, seed) for n, seed in ((7, 21), (3, 23))]
    plain = [reference(model, p, eos_token_id=[]) for p in prompts]
    requests = []
    for prompt, free in zip(prompts, plain):
        two = tokenizer.decode(free[4:6])
        one = tokenizer.decode(free[2:3])
        across = tokenizer.decode(prompt[-1:] + free[:1])
        for strings in ([two], [one[-1:] or one, "never-in-this-output"], [across], ["zzqqxx-never"]):
            requests.append((prompt, dict(stop_strings=strings, eos_token_id=[])))
        requests.append((prompt, dict(eos_token_id=[])))
    want = [reference(model, p, tokenizer=tokenizer, **s) for p, s in requests]
    assert any(len(w) < NEW for w in want), "no stop string matched: the test would not see them ignored"
    with hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=4, num_blocks=96),
                                           tokenizer=tokenizer) as manager:
        ids = [manager.add_request(p, max_new_tokens=NEW, **s) for p, s in requests]
        outs = [manager.get_result(rid, timeout=120) for rid in ids]
    for (prompt, settings), out, w in zip(requests, outs, want):
        assert out.generated_tokens == w, settings
        assert out.finish_reason == ("stop" if len(w) < NEW and settings.get("stop_strings") else "length")
    outs = hf_paged.generate_batch(model, prompts, progress_bar=False, max_new_tokens=NEW, tokenizer=tokenizer,
                                   stop_strings=requests[0][1]["stop_strings"], eos_token_id=[],
                                   pool=BlockPool(block_size=4, num_blocks=64))
    assert outs["req_0"].generated_tokens == want[0]


def test_stop_strings_without_a_tokenizer_name_the_fix(model):
    with hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=4, num_blocks=16)) as manager:
        with pytest.raises(ValueError, match="tokenizer="):
            manager.add_request([5, 6], max_new_tokens=2, stop_strings=["x"])


def test_ngram_index_equals_transformers_on_random_histories():
    """The incremental n-gram index bans exactly what NoRepeatNGramLogitsProcessor bans, step by step, for n = 1..4,
    and a fork continues on its own."""
    from transformers import NoRepeatNGramLogitsProcessor

    rng = random.Random(0)
    for n in (1, 2, 3, 4):
        ids = [rng.randrange(6) for _ in range(3)]
        index, processor = NGramIndex(n), NoRepeatNGramLogitsProcessor(n)
        for _ in range(40):
            scores = processor(torch.tensor([ids]), torch.zeros(1, 6))
            assert index.banned(ids) == set(torch.isinf(scores[0]).nonzero().flatten().tolist()), (n, ids)
            ids.append(rng.randrange(6))
        fork = index.fork()
        assert fork.banned(ids + [1]) == set(torch.isinf(processor(torch.tensor([ids + [1]]), torch.zeros(1, 6))[0])
                                             .nonzero().flatten().tolist())


def test_refused_lists_no_processor_or_stopping_rule():
    """REFUSED keeps no logits processor, warper or stopping rule of generate(): only beams, speculation, modes that
    need more than the engine's step (contrastive search, DoLa, guidance), SynthID watermarking, token healing,
    encoder-decoder settings and generate()'s return-value options; each served one is read into SamplingParams."""
    served = {"no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length", "suppress_tokens",
              "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
              "exponential_decay_length_penalty", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "stop_strings",
              "max_time", "remove_invalid_values", "watermarking_config"}
    assert not served & set(REFUSED)
    params = SamplingParams.from_generation_config(
        None, do_sample=True, no_repeat_ngram_size=2, bad_words_ids=[[4]], sequence_bias=[[[5], 1.0]], min_length=3,
        suppress_tokens=[6], begin_suppress_tokens=[7], forced_bos_token_id=8, forced_eos_token_id=9,
        exponential_decay_length_penalty=(1, 1.1), typical_p=0.5, epsilon_cutoff=0.1, eta_cutoff=0.1, top_h=0.5,
        stop_strings=["x"], max_time=3.0, remove_invalid_values=True, logits_processor=[abs],
        stopping_criteria=[abs], prefix_allowed_tokens_fn=abs)
    p, s = params.processors, params.stopping
    assert (p.no_repeat_ngram_size, p.bad_words_ids, p.sequence_bias, p.min_length, p.suppress_tokens) == (
        2, ((4,),), (((5,), 1.0),), 3, (6,))
    assert (p.begin_suppress_tokens, p.forced_bos_token_id, p.forced_eos_token_id) == ((7,), 8, (9,))
    assert p.exponential_decay_length_penalty == (1, 1.1) and p.remove_invalid_values
    assert p.logits_processor == (abs,) and p.prefix_allowed_tokens_fn is abs
    assert (params.typical_p, params.epsilon_cutoff, params.eta_cutoff, params.top_h) == (0.5, 0.1, 0.1, 0.5)
    assert (s.stop_strings, s.max_time, s.stopping_criteria) == (("x",), 3.0, (abs,))
    plain = SamplingParams.from_generation_config(None)
    assert plain.processors is None and plain.stopping is None and not plain.uses_history


def test_a_failing_custom_processor_fails_its_request_alone(model):
    """A request whose own logits processor raises (or returns the wrong shape) fails with the reason; the requests
    sharing its steps finish with generate()'s tokens. Token ids outside the vocabulary are refused when added."""

    def broken(ids, scores):
        if ids.shape[1] > 8:
            raise RuntimeError("boom")
        return scores

    prompt = prompt_of(6, 12)
    with hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=4, num_blocks=64)) as manager:
        ids = [manager.add_request(prompt, max_new_tokens=NEW, logits_processor=[broken], eos_token_id=[]),
               manager.add_request(prompt, max_new_tokens=NEW, logits_processor=[lambda ids, scores: scores[0]]),
               manager.add_request(prompt, max_new_tokens=NEW, no_repeat_ngram_size=2)]
        outs = [manager.get_result(rid, timeout=60) for rid in ids]
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            manager.add_request(prompt, max_new_tokens=2, bad_words_ids=[[VOCAB + 3]])
    assert "boom" in outs[0].error and len(outs[0].generated_tokens) == 3  # the ids [1, 9] call raised
    assert "not scores" in outs[1].error and not outs[1].generated_tokens
    assert outs[2].error is None
    assert outs[2].generated_tokens == reference(model, prompt, no_repeat_ngram_size=2)
