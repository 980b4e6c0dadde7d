"""The oracle of the engine's token tests: each request alone through ``model.generate()`` with a ``DynamicCache``."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from hf_paged import compat
from hf_paged.engine.sampling import SamplingParams

from .models import EOS

TIE = 1e-4  # a differing greedy token is accepted only where the reference's top-2 logits are closer than this


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # per generated token, the raw logits it was chosen from [vocab]


@dataclass
class TieCount:
    requests: int = 0
    ties: list[tuple[str, int, float]] = field(default_factory=list)  # (request, position, top-2 gap)


def reference(model, prompt: list[int], max_new_tokens: int, cache=None) -> Reference:
    """``prompt`` alone through ``model.generate()`` (greedy), with ``cache`` (default a fresh ``DynamicCache``)."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), attention_mask=None,
                             max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                             output_logits=True, **{compat.GENERATE_CACHE_KWARG: cache})
    logits = [step[0].float().cpu() for step in out.logits]  # [vocab] per generated token
    return Reference(out.sequences[0, len(prompt):].tolist(), logits)


def check_tokens(name: str, got: list[int], ref: Reference, ties: TieCount) -> None:
    """``got`` equals the reference, or first differs where the reference's top-2 logits tie within :data:`TIE`
    (counted in ``ties``); after such a tie the continuations may differ and are not compared."""
    ties.requests += 1
    for i, (g, r) in enumerate(zip(got, ref.tokens)):
        if g == r:
            continue
        top2 = ref.logits[i].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE, f"{name}: token {i} is {g}, generate() alone gives {r} (top-2 gap {gap:.2e})"
        ties.ties.append((name, i, gap))
        return
    assert len(got) == len(ref.tokens), f"{name}: {len(got)} tokens, generate() alone gives {len(ref.tokens)}"


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int, shared: list[list[int]] = ()):
    """``n`` prompts of random lengths; with ``shared`` prefixes, most start with one of them."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        prefix = list(shared[i % len(shared)]) if shared and i % 4 != 3 else []
        length = rng.randint(*lengths)
        prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def drive(core, requests, seed: int, steps_between: int = 2, chunks: list | None = None) -> dict:
    """Add ``requests`` (``(rid, prompt, max_new)``; ``max_new`` may be full ``SamplingParams``) to an engine core
    the test steps itself, in an order shuffled by ``seed``, 0 to ``steps_between`` steps apart; run to the end,
    checking the scheduler's invariants after each step. ``chunks`` collects ``(rid, start, num_tokens,
    prompt_len)`` of every chunk run. Returns the requests by id."""
    if chunks is not None:
        run = core.runner.run

        def recording(batch):
            chunks.extend((c.request.request_id, c.start, c.num_tokens, c.request.num_prompt) for c in batch.chunks)
            return run(batch)

        core.runner.run = recording
    rng = random.Random(seed)
    order = list(requests)
    rng.shuffle(order)
    reqs = {}
    with torch.no_grad():
        for rid, prompt, new in order:
            params = new if isinstance(new, SamplingParams) else SamplingParams(max_new_tokens=new,
                                                                                eos_token_ids=(EOS,))
            core.check_fits(len(prompt), params.max_new_tokens)
            reqs[rid] = req = core.new_request(rid, prompt, params)
            core.add(req)
            for _ in range(rng.randint(0, steps_between)):
                core.step()
        while core.has_work:
            core.step()
            core.scheduler.check_invariants()
    return reqs
