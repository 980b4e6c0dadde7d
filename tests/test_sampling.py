"""The engine's sampler: settings read as generate() reads them, tokens as generate() picks them, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EOS, VOCAB, tiny_model
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SynthIDTextWatermarkingConfig,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.engine.sampling import SamplingParams, Sampler

WARPED = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)


def _generate(model, prompt: torch.Tensor, seed: int | None = None, **settings):
    """generate()'s tokens and raw per-step logits for equal-length prompts ``[B, L]`` (no padding)."""
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                         output_logits=True, return_dict_in_generate=True, **settings)
    return out.sequences[:, prompt.shape[1]:], out.logits  # [B, new], new x [B, vocab]


def _replay(sampler, steps, params, generators, prompts, generated):
    """Feed each step's logits to the sampler with the histories generate() had; the sampler's tokens per row."""
    chosen = [[] for _ in params]
    for step, logits in enumerate(steps):
        histories = [prompts[row] + generated[row][:step] for row in range(len(params))]
        result = sampler(logits, params, generators, histories)
        for row, token in enumerate(result.tokens):
            chosen[row].append(token)
    return chosen


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_tokens_replay_generate_greedy_and_seeded_rows_in_one_call():
    """Greedy rows with a repetition penalty and a seeded row with every warper, sampled together in one call, give
    generate()'s tokens: greedy from its batched run, the seeded row from a run alone after torch.manual_seed."""
    model = tiny_model("llama", seed=3)
    prompts = torch.randint(3, VOCAB, (4, 7), generator=torch.Generator().manual_seed(1))  # [4, 7]
    greedy_tokens, greedy_logits = _generate(model, prompts[:3], do_sample=False, repetition_penalty=1.5)
    sampled_tokens, sampled_logits = _generate(model, prompts[3:], seed=11, **WARPED)
    n = min(len(greedy_logits), len(sampled_logits))
    steps = [torch.cat([greedy_logits[t], sampled_logits[t]]) for t in range(n)]  # n x [4, vocab]

    sampler = Sampler()
    params = [SamplingParams.from_generation_config(model.generation_config, repetition_penalty=1.5)] * 3
    params.append(SamplingParams.from_generation_config(model.generation_config, seed=11, **WARPED))
    generators = [sampler.new_generator(p) for p in params]
    expected = torch.cat([greedy_tokens, sampled_tokens])[:, :n].tolist()
    chosen = _replay(sampler, steps, params, generators, prompts.tolist(), expected)
    assert [_until_eos(row) for row in chosen] == [_until_eos(row) for row in expected]
    assert params[3].top_k == 20 and generators[3] is not None and generators[0] is None


def _oracle(logits_row: torch.Tensor, history: list[int], settings: dict) -> torch.Tensor:
    """The log-distribution transformers' processors give one row, built here in generate()'s order."""
    chain = LogitsProcessorList()
    if settings.get("repetition_penalty"):
        chain.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if settings.get("do_sample"):
        if settings.get("temperature", 1.0) != 1.0:
            chain.append(TemperatureLogitsWarper(settings["temperature"]))
        if settings.get("top_k"):
            chain.append(TopKLogitsWarper(settings["top_k"]))
        if settings.get("top_p"):
            chain.append(TopPLogitsWarper(settings["top_p"]))
        if settings.get("min_p"):
            chain.append(MinPLogitsWarper(settings["min_p"]))
    return torch.log_softmax(chain(torch.tensor([history]), logits_row[None].float()), dim=-1)[0]


ROW_SETTINGS = [
    dict(do_sample=True, temperature=0.7, top_k=5),
    dict(do_sample=True, top_p=0.6),
    dict(do_sample=False),
    dict(do_sample=True, min_p=0.2, temperature=1.3),
    dict(do_sample=True, temperature=0.7, top_k=5),
    dict(do_sample=True, top_k=9, top_p=0.8, min_p=0.01, repetition_penalty=1.7),
    dict(do_sample=False, repetition_penalty=0.6),
    dict(do_sample=True),
]


def test_each_row_gets_its_own_processed_distribution():
    """Rows with different settings in one call each get the log-distribution transformers' processors give that
    row alone (the same -inf support, the same finite values); repeated settings are processed as one group."""
    vocab = 64
    logits = torch.randn(len(ROW_SETTINGS), vocab, generator=torch.Generator().manual_seed(0)) * 3  # [8, 64]
    histories = [[row, 2 * row + 1, 40, 40, 63 - row] for row in range(len(ROW_SETTINGS))]
    params = [SamplingParams(logprobs=vocab, **settings) for settings in ROW_SETTINGS]
    sampler = Sampler()
    result = sampler(logits, params, [None] * len(params), histories)
    for row, settings in enumerate(ROW_SETTINGS):
        got = torch.full((vocab,), float("nan"))
        for token, logprob in result.top_logprobs[row]:
            got[token] = logprob
        want = _oracle(logits[row], histories[row], settings)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"row {row} ({settings}): support differs"
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-5)
        assert math.isfinite(result.logprobs[row]) and result.logprobs[row] == pytest.approx(
            want[result.tokens[row]].item(), abs=1e-5)
    assert len(sampler._chains) == len(ROW_SETTINGS) - 2  # one warper chain per setting; the greedy rows share one


def test_draws_follow_the_processed_distribution():
    """4,000 unseeded draws of one row's settings land in its top-k / top-p support with the processed frequencies."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])  # [8]
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=4, top_p=0.95)
    want = _oracle(logits, [], dict(do_sample=True, temperature=0.9, top_k=4, top_p=0.95)).exp()  # [8]
    torch.manual_seed(0)
    n = 4000
    result = Sampler()(logits.expand(n, -1), [params] * n, [None] * n, [[]] * n)
    counts = torch.bincount(torch.tensor(result.tokens), minlength=8).float() / n
    assert counts[want == 0].sum() == 0
    assert (counts - want).abs().max() < 0.03, (counts, want)


def test_seeded_request_gets_the_same_tokens_whatever_shares_its_steps():
    """A seeded request's tokens over 12 steps are the same alone and among 7 others (other seeds, unseeded, greedy,
    other settings) whose order changes every step; another seed gives other tokens, a fork its own stream."""
    vocab, steps = 50, 12
    g = torch.Generator().manual_seed(4)
    step_logits = [torch.randn(vocab, generator=g) for _ in range(steps)]
    mine = SamplingParams(do_sample=True, top_p=0.95, temperature=1.5, seed=123)
    others = [SamplingParams(do_sample=True, seed=7), SamplingParams(do_sample=True), SamplingParams(),
              SamplingParams(do_sample=True, top_p=0.95, temperature=1.5, seed=124),
              SamplingParams(do_sample=True, top_k=3), SamplingParams(do_sample=True, seed=123, top_k=2),
              SamplingParams(do_sample=True, top_p=0.95, temperature=1.5)]
    sampler = Sampler()

    def run(params_of_step, ids_of_step):
        generators = {}
        tokens = []
        for step in range(steps):
            params, ids = params_of_step(step), ids_of_step(step)
            for p, rid in zip(params, ids):
                if rid not in generators:
                    generators[rid] = sampler.new_generator(p, index=rid[1])
            logits = torch.stack([step_logits[step] + (0 if rid[0] == "mine" else torch.randn(vocab))
                                  for rid in ids])  # [rows, vocab]
            result = sampler(logits, params, [generators[rid] for rid in ids], [[]] * len(ids))
            tokens.append(result.tokens[ids.index(("mine", 0))])
        return tokens

    alone = run(lambda s: [mine], lambda s: [("mine", 0)])
    ids = [("mine", 0)] + [(f"other{j}", 0) for j in range(len(others))]
    params = [mine] + others

    def shuffled(step):
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(step)).tolist()
        return order

    together = run(lambda s: [params[i] for i in shuffled(s)], lambda s: [ids[i] for i in shuffled(s)])
    assert together == alone
    other_seed = run(lambda s: [others[3]], lambda s: [("mine", 0)])
    assert other_seed != alone
    fork = [sampler.new_generator(mine, index=1) for _ in range(2)]
    draws = [torch.rand(4, generator=f).tolist() for f in fork]
    assert draws[0] == draws[1] and draws[0] != torch.rand(4, generator=sampler.new_generator(mine)).tolist()


def test_logprobs_are_normalised_and_name_the_sampled_token():
    """Full-vocabulary logprobs sum to 1, come most likely first, give the sampled token's value; rows asking for k
    get k; rows asking for none get None; a greedy row's value is the model's log-softmax at the argmax."""
    vocab = 32
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2)) * 2  # [4, 32]
    params = [SamplingParams(do_sample=True, temperature=0.5, logprobs=vocab),
              SamplingParams(do_sample=True, top_k=4, logprobs=3),
              SamplingParams(logprobs=0),
              SamplingParams(do_sample=True)]
    torch.manual_seed(1)
    result = Sampler()(logits, params, [None] * 4, [[]] * 4)
    full = result.top_logprobs[0]
    values = torch.tensor([lp for _, lp in full])
    assert len(full) == vocab and torch.logsumexp(values, 0).item() == pytest.approx(0.0, abs=1e-5)
    assert values.tolist() == sorted(values.tolist(), reverse=True)
    assert dict(full)[result.tokens[0]] == pytest.approx(result.logprobs[0], abs=1e-6)
    assert len(result.top_logprobs[1]) == 3 and result.tokens[1] in logits[1].topk(4).indices.tolist()
    assert result.tokens[2] == logits[2].argmax().item()
    assert result.logprobs[2] == pytest.approx(torch.log_softmax(logits[2], -1).max().item(), abs=1e-6)
    assert result.top_logprobs[2] == [] and result.logprobs[3] is None and result.top_logprobs[3] == []
    assert Sampler()(logits, [SamplingParams()] * 4, [None] * 4, [[]] * 4).logprobs is None


def test_settings_follow_generate_defaults_and_overrides():
    """Unset values take generate()'s defaults (top_k=50 when sampling), greedy drops the warpers, EOS and stop ids
    merge, max_length less the prompt bounds new tokens, None overrides mean not given, model-specific keys pass."""
    sampled = SamplingParams.from_generation_config(GenerationConfig(do_sample=True, top_p=0.9))
    assert (sampled.top_k, sampled.top_p, sampled.temperature, sampled.max_new_tokens) == (50, 0.9, 1.0, 16)
    greedy = SamplingParams.from_generation_config(GenerationConfig(temperature=0.0, top_p=0.5, top_k=3))
    assert (greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p) == (False, 1.0, None, None)
    config = GenerationConfig(eos_token_id=[5, 9], max_length=30, repetition_penalty=1.0, custom_chat_flag=True)
    params = SamplingParams.from_generation_config(config, prompt_length=12, stop_token_ids=[9, 17], top_k=None,
                                                   logprobs=2)
    assert params.eos_token_ids == (5, 9, 9, 17) and params.max_new_tokens == 18
    assert params.repetition_penalty is None and params.logprobs == 2 and not params.uses_history
    assert SamplingParams.from_generation_config(config, max_new_tokens=4).max_new_tokens == 4
    assert SamplingParams.from_generation_config(None, eos_token_id=3).eos_token_ids == (3,)
    assert params.finish_reason(17, 1) == "stop" and params.finish_reason(4, 18) == "length"
    assert params.finish_reason(4, 17) is None


@pytest.mark.parametrize("settings, named", [
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences=3 is more than num_beams=2"),
    (dict(do_sample=True, num_beam_groups=2, num_beams=2), "num_beam"),
    (dict(force_words_ids=[[3]]), "force_words_ids"),
    (dict(penalty_alpha=0.6), "penalty_alpha"),
    (dict(no_repeat_ngram_size=-3), "no_repeat_ngram_size"),
    (dict(min_new_tokens=20, max_new_tokens=8), "min_tokens=20"),  # honoured as min_tokens, checked
    (dict(bad_words_ids=[[4, -1]]), "bad_words_ids"),
    (dict(sequence_bias={(4,): "x"}), "sequence_bias"),
    (dict(guidance_scale=2.0), "guidance_scale=2.0"),
    (dict(do_sample=True, typical_p=1.5), "typical_p"),
    (dict(do_sample=True, eta_cutoff=-0.5), "eta_cutoff"),
    (dict(stop_strings=[3]), "stop_strings"),
    (dict(output_scores=True), "logprobs"),
    (dict(max_time=-1.0), "max_time"),
    (dict(exponential_decay_length_penalty=(2, 0.5)), "exponential_decay_length_penalty"),
    (dict(suppress_tokens=[-2]), "suppress_tokens"),
    (dict(logits_processor=[3]), "logits_processor"),
    (dict(stopping_criteria=["x"]), "stopping_criteria"),
    (dict(watermarking_config={"greenlist_ratio": 2.0}), "watermarking_config"),
    (dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[1, 2], ngram_len=2)), "SynthID"),
    (dict(not_a_setting=1), "not_a_setting"),
    (dict(do_sample=True, temperature=0.0), "do_sample=False"),
    (dict(do_sample=True, top_k=2.5), "top_k"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(seed=-1), "seed"),
    (dict(seed=True), "seed"),
    (dict(logprobs=-2), "logprobs"),
    (dict(eos_token_id=[1, "x"]), "eos_token_id"),
    (dict(num_return_sequences=3), "do_sample=True"),
    (dict(max_length=10), "max_length=10"),
])
def test_unsupported_or_invalid_settings_are_refused_by_name(settings, named):
    """Each setting the engine cannot apply, or a value out of range, raises a ValueError naming it."""
    config_keys = {"num_beams", "num_beam_groups", "force_words_ids", "penalty_alpha", "min_new_tokens",
                   "guidance_scale", "output_scores"}
    in_config = {k: v for k, v in settings.items() if k in config_keys}
    overrides = {k: v for k, v in settings.items() if k not in config_keys}
    config = GenerationConfig(**in_config) if in_config else None
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams.from_generation_config(config, prompt_length=10, **overrides)


def test_settings_at_their_defaults_are_accepted():
    """Refusable settings left at generate()'s defaults (one beam, no n-gram block, scores off) do not refuse."""
    config = GenerationConfig(num_beams=1, no_repeat_ngram_size=0, output_scores=False, typical_p=1.0,
                              length_penalty=2.0, use_cache=True, pad_token_id=0)
    assert SamplingParams.from_generation_config(config) == SamplingParams()
