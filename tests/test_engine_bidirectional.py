"""The engine with bidirectional spans (``Request.bidirectional_spans``, which the engine's inputs fill from Gemma
3's ``token_type_ids``): set directly here on a tiny Llama, every request's greedy tokens equal a DynamicCache
reference whose prompt forward has the same bidirectional mask, under chunked prefill (no chunk ends inside a span),
prefix-cache hits and preemption; the spans change the tokens."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from helpers import EOS, VOCAB, tiny_model
from helpers.engine_shadow import one_thread
from hf_paged import BlockPool, RequestStatus, compat, init_continuous_batching
from hf_paged.engine.sampling import SamplingParams
from hf_paged.engine.scheduler import outside_spans

BLOCK = 4
NEW_TOKENS = 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=5, initializer_range=0.1)


def bidirectional_reference(model, prompt: list[int], spans, new_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` alone on a DynamicCache, its prompt forward under a 4D mask: causal, plus every
    span's tokens seeing each other."""
    n = len(prompt)
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]  # [q, kv]
    for start, end in spans:
        inside = (pos >= start) & (pos < end)
        mask |= inside[:, None] & inside[None, :]
    cache = DynamicCache(config=model.config)
    kwargs = {compat.FORWARD_CACHE_KWARG: cache}
    tokens = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), attention_mask=mask[None, None], **kwargs).logits[0, -1]
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax()))
            if tokens[-1] == EOS:
                break
            logits = model(torch.tensor([[tokens[-1]]]), **kwargs).logits[0, -1]
    return tokens


def cases(seed: int, shared_prefix: bool):
    """(rid, prompt, spans): prompts of 9-30 tokens with one or two spans of 3-9 tokens; with ``shared_prefix``
    most start with the same 12 tokens holding a span (so prefix-cache hits end inside or after it)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(12)]
    out = []
    for i in range(8):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(9, 30))]
        spans = []
        if shared_prefix and i % 4 != 3:
            prompt, spans = prefix + prompt, [(2, 10)]
        start = len(prompt) - rng.randint(5, 9) - rng.randint(0, 3)
        spans.append((start, start + rng.randint(3, 5)))
        if len(prompt) > 20 and i % 2:
            first = rng.randint(spans[0][1] if spans[0][0] < 12 else 0, 8) if not spans[:-1] else None
            if first is not None and first + 3 < spans[-1][0]:
                spans.insert(0, (first, first + 3))
        out.append((f"r{i}", prompt, sorted(spans)))
    return out


SCENARIOS = {  # name: (num_blocks, max_batch_tokens, prefix_caching, shared prefix)
    "roomy": (256, 256, False, False),
    "chunked_prefill": (256, 7, False, False),
    "prefix_hits_chunks": (256, 9, True, True),
    "preemption": (24, 16, True, True),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_spans_equal_a_bidirectional_reference(model, scenario):
    num_blocks, budget, prefix_caching, shared = SCENARIOS[scenario]
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix_caching)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=budget)
    core = manager._core
    chunks = []
    run = core.runner.run

    def recording(batch):
        chunks.extend((c.request, c.start, c.num_tokens) for c in batch.chunks)
        return run(batch)

    core.runner.run = recording
    specs = cases(seed=len(scenario), shared_prefix=shared)
    reqs = {}
    with torch.no_grad():
        for rid, prompt, spans in specs:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, eos_token_ids=(EOS,))
            reqs[rid] = req = core.new_request(rid, prompt, params)
            req.bidirectional_spans = spans
            core.add(req)
            core.step()
        while core.has_work:
            core.step()
            core.scheduler.check_invariants()
    changed = 0
    for rid, prompt, spans in specs:
        req = reqs[rid]
        assert req.status == RequestStatus.FINISHED, (rid, req.status, req.error)
        expected = bidirectional_reference(model, prompt, spans, NEW_TOKENS)
        assert req.generated == expected, rid
        changed += expected != bidirectional_reference(model, prompt, [], NEW_TOKENS)
    assert changed  # the spans matter for some request
    for req, start, n in chunks:  # no chunk ends inside a span
        assert all(not (s < start + n < e) for s, e in req.bidirectional_spans), (req.request_id, start, n)
    if budget < 10:
        assert any(n < len(r.tokens) - s for r, s, n in chunks)  # prompts were chunked
    manager.stop()


class _Req:
    def __init__(self, spans):
        self.bidirectional_spans = spans


def test_outside_spans_cuts_chunks_back_to_a_span_start():
    req = _Req([(4, 10), (12, 14)])
    assert outside_spans(req, 0, 6) == 4  # would end inside the first span: stop before it
    assert outside_spans(req, 0, 10) == 10 and outside_spans(req, 0, 11) == 11  # ends at / after its end
    assert outside_spans(req, 4, 3) == 0  # starts the span but cannot finish it: waits
    assert outside_spans(req, 4, 3, most=5) == 6  # the span is longer than a whole step: all of it at once
    assert outside_spans(req, 10, 3) == 2 and outside_spans(_Req([]), 0, 5) == 5
