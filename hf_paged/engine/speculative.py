"""Speculative decoding in the engine: proposers, the verify shape, acceptance, and the per-step policy.

Each step, before the schedule, :meth:`Speculation.propose` gives decoding requests a *draft*: tokens guessed to follow
their known ones, from an n-gram lookup in their own prompt and output (:class:`NgramProposer`, transformers'
``prompt_lookup_num_tokens``) or from a small draft model sharing the tokenizer (:class:`DraftModelProposer`, its K/V
in its own pool). The scheduler runs a request with a draft of m tokens as one chunk of ``1 + m`` queries (its last
known token, then the draft) beside the other requests of the packed step, and the runner keeps the logits of all
``1 + m`` positions. :meth:`Speculation.verify` then accepts a prefix of the draft and adds one token of the target
model's own:

- greedy requests: the draft's tokens are kept while they equal the target's choice at their position (the sampler's
  greedy choice, processors included), so the tokens are those of greedy decoding without speculation;
- sampled requests without a seed: rejection sampling as in the speculative sampling papers, for a proposer that puts all its
  probability on its draft token (both proposers here draft greedily): token d at a position whose target
  distribution is p is accepted with probability p(d); on a rejection the token is drawn from p with d removed
  (renormalised), and after a draft accepted whole the next token from p at the last position. Each output token is
  then distributed exactly as the target model samples it. A seeded request decodes plainly (features.py): its
  promise is the exact tokens of ``generate()`` after ``torch.manual_seed(seed)``, which acceptance draws from its
  generator, and steps that draft or not by measured timings, would break.

The scheduler cuts the rejected tokens' K/V off the request's row (``Scheduler.rollback``: the block table is
truncated, emptied blocks go back to the pool).

:class:`SpeculationPolicy` chooses per step how many draft tokens run (0: none): it learns what a decode step of T
tokens costs on this machine (forward seconds of decode-only steps; for a draft model, seconds per draft forward) and
the acceptance rates of each request and proposer, and runs the draft length with the most expected tokens per
second. A compute-bound batch (many requests, where a forward's time grows with its tokens) runs plain steps; a small
one (memory- or latency-bound, one forward per token) runs drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention import attach_attention, is_paged, paged_backend
from ..groups import LayerGroups
from ..patches import kv_geometry
from ..pool import BlockPool
from . import features
from .kv import RequestKV
from .request import Request
from .runner import ModelRunner
from .scheduler import Batch, Chunk

DEFAULT_NUM_TOKENS = 8  # draft tokens per request and step (the policy decides whether they run)
MAX_NGRAM = 3  # the longest suffix n-gram looked up (transformers' max_matching_ngram_size default is 2)
PRIOR_ACCEPTANCE = 0.5  # a request's per-token acceptance rate before it has any
ACCEPTANCE_DECAY = 0.7  # weight of the past in a request's acceptance rate
COST_DECAY = 0.8  # weight of the past in a step-cost bucket
REEXPLORE = 64  # steps after which the longest drafts run again (to measure them)


@dataclass
class SpeculationStats:
    """Counts since the engine started: steps, steps that ran a draft, draft tokens proposed and accepted, and the
    seconds spent proposing (n-gram lookups, draft-model forwards)."""

    steps: int = 0
    speculative_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    verified_requests: int = 0  # request-steps with a draft
    propose_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a request got per step in which it ran a draft (accepted + the target's own)."""
        return (self.accepted + self.verified_requests) / self.verified_requests if self.verified_requests else 0.0


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n tokens
    (n = ``max_ngram`` down to 1) in its own prompt and output. Keeps an index per request, extended as it grows."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self._index: dict[int, tuple[dict, int]] = {}  # id(request) -> (n-gram -> latest end, positions indexed)

    def propose(self, req: Request, k: int) -> list[int]:
        tokens = req.tokens
        table, done = self._index.get(id(req), ({}, 0))
        last = len(tokens) - 1
        for end in range(done, last):  # every n-gram ending before the last token
            for n in range(1, self.max_ngram + 1):
                if end - n + 1 >= 0:
                    table[tuple(tokens[end - n + 1: end + 1])] = end
        self._index[id(req)] = (table, max(done, last))
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            end = table.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []

    def forget(self, req: Request) -> None:
        self._index.pop(id(req), None)


class DraftModelProposer:
    """A small model sharing the target's tokenizer proposes ``k`` tokens greedily, for all drafting requests in one
    packed forward per draft token. Its K/V lives in its own growing pool (one row per request, kept across steps and
    cut back to what the target accepted).

    Args:
        model: the draft model (same vocabulary as the target; a family the engine serves).
        block_size: its pool's block size.
    """

    def __init__(self, model, block_size: int = 16):
        if not is_paged(model):
            attach_attention(model)
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        geometry = kv_geometry(config)
        if geometry.state_layers:
            raise ValueError("a draft model with state layers cannot be rolled back after a rejection; use an "
                             "attention-only draft model or speculative='ngram'")
        self.model = model
        self.vocab_size = config.vocab_size
        self.kv = RequestKV(BlockPool(block_size, prefix_caching=False), LayerGroups.from_geometry(geometry),
                            max_batch_tokens=1 << 20)
        self.runner = ModelRunner(model, self.kv, paged_backend(model), config.num_hidden_layers)
        self._seqs: dict[int, Request] = {}  # id(target request) -> its row in the draft's pool

    def propose_all(self, reqs: list[Request], k: int) -> list[list[int]]:
        """``k`` greedy draft tokens for each of ``reqs`` (``k`` draft forwards, the first catching each row up on
        the tokens it has not seen)."""
        seqs = [self._sync(req) for req in reqs]
        out: list[list[int]] = [[] for _ in reqs]
        for _ in range(k):
            batch = Batch([Chunk(s, s.num_computed, len(s.tokens) - s.num_computed) for s in seqs])
            with torch.no_grad():
                logits = self.runner.run(batch)  # [n, vocab]
            for s, token, o in zip(seqs, logits.argmax(dim=-1).tolist(), out):
                s.num_computed = len(s.tokens)
                s.tokens.append(token)
                o.append(token)
        return out

    def _sync(self, req: Request) -> Request:
        """The draft row of ``req``, cut back to the longest prefix it shares with ``req.tokens`` short of its last
        token: the first draft forward needs that token's logits, so it always runs. (A row can hold all of
        ``req.tokens``: the draft model ran more tokens than the request verified and the target's own token was the
        next draft token, or the request did not run the step it drafted for -- preempted, or left out of a full
        pool.)"""
        seq = self._seqs.get(id(req))
        if seq is None:
            seq = Request(request_id=f"{req.request_id}#draft", tokens=[], num_prompt=0, max_new_tokens=1,
                          max_length=1 << 40)
            seq.row = self.kv.open()
            self._seqs[id(req)] = seq
        same = 0
        limit = min(seq.num_computed, len(req.tokens) - 1)
        while same < limit and seq.tokens[same] == req.tokens[same]:
            same += 1
        if seq.num_computed > same:
            self.kv.rows.truncate(seq.row, same)
            seq.num_computed = same
        seq.tokens = list(req.tokens)
        return seq

    def forget(self, req: Request) -> None:
        seq = self._seqs.pop(id(req), None)
        if seq is not None:
            self.kv.free(seq.row)


@dataclass
class SpeculationPolicy:
    """Chooses, per step, how many draft tokens the decoding requests run (0: a plain step), for the most expected
    tokens per second.

    ``cost(T)``: the forward seconds of a decode-only step of T tokens, learned from the engine's own steps (per token
    count up to 16, per power-of-two bucket above); a draft model's seconds per draft forward likewise, per count of
    drafting requests. A request's expected tokens from a draft of m tokens at per-token acceptance rate a:
    ``(1 - a^(m+1)) / (1 - a)``. Sizes not measured are interpolated between measured ones; the plain step and the
    longest drafts are measured first, and the longest drafts run again every ``REEXPLORE`` steps (so costs and
    acceptance rates stay measured). ``max_tokens``: a step of more tokens than this never speculates (None: no cap).
    """

    max_tokens: int | None = None
    costs: dict[int, tuple[float, int]] = field(default_factory=dict)  # bucket -> (seconds, step last measured)
    draft_costs: dict[int, tuple[float, int]] = field(default_factory=dict)  # draft model: requests bucket -> s
    step: int = 0
    last_explored: int = 0

    @staticmethod
    def bucket(tokens: int) -> int:
        return tokens if tokens <= 16 else 1 << (tokens - 1).bit_length()

    def observe(self, tokens: int, seconds: float, table: dict | None = None) -> None:
        """A decode-only step of ``tokens`` took ``seconds`` (its forward); or, with ``table=draft_costs``, one draft
        forward for ``tokens`` requests."""
        table = self.costs if table is None else table
        b = self.bucket(tokens)
        old = table.get(b)
        table[b] = (seconds if old is None else COST_DECAY * old[0] + (1 - COST_DECAY) * seconds, self.step)

    def cost(self, tokens: int, table: dict | None = None) -> float | None:
        """The estimated seconds of a step of ``tokens`` (or of one draft forward for ``tokens`` requests, with
        ``table=draft_costs``): measured, else interpolated between the measured sizes around it (extrapolated past
        the largest along the last two); None while fewer than two sizes were measured."""
        table = self.costs if table is None else table
        b = self.bucket(tokens)
        if b in table:
            return table[b][0]
        known = sorted((size, entry[0]) for size, entry in table.items())
        if len(known) < 2:
            return None
        below = [k for k in known if k[0] < b]
        above = [k for k in known if k[0] > b]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
            return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
        if not below:
            return known[0][1]
        (x0, y0), (x1, y1) = known[-2], known[-1]
        return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (b - x1)

    def choose(self, options: list[tuple[int, float, int, int]]) -> int:
        """The index of the option to run. ``options[i]``: ``(step tokens, expected tokens, drafting requests,
        draft forwards)``; option 0 is the plain step, the last the longest drafts."""
        self.step += 1
        allowed = [i for i, (tokens, *_) in enumerate(options)
                   if i == 0 or self.max_tokens is None or tokens <= self.max_tokens]
        rates = {}
        for i in allowed:
            tokens, expected, drafting, forwards = options[i]
            cost = self.cost(tokens)
            per_forward = self.cost(drafting, self.draft_costs) if forwards else 0.0
            if cost is None or per_forward is None:
                continue
            rates[i] = expected / (cost + forwards * per_forward)
        if self.cost(options[0][0]) is None:
            return 0  # measure the plain step first
        largest = allowed[-1]
        if largest not in rates or (largest and self.step - self.last_explored > REEXPLORE):
            self.last_explored = self.step  # measure the longest drafts (their cost, and the acceptance rates)
            return largest
        return max(rates, key=rates.get)


class Speculation:
    """The engine's speculative decoding stage (see the module's docstring).

    Args:
        default: the engine's speculation for requests that do not choose: None (off), ``"ngram"`` (prompt lookup)
            or a draft model (an attention-only causal LM with the target's vocabulary).
        num_tokens: draft tokens per request and step (a request's ``prompt_lookup_num_tokens`` overrides it for
            n-gram lookup).
        policy: the per-step :class:`SpeculationPolicy`.
        max_draft: the longest draft a row may be cut back from (a sliding window of W tokens: W - 1), None: no cap;
            0: no speculation at all (models whose rows cannot be cut back; every request decodes plainly).

    A request speculates when it decodes (its next step runs one known token), either sets
    ``prompt_lookup_num_tokens`` > 0 (n-gram lookup) or leaves it unset under an engine default, and
    :mod:`~hf_paged.engine.features`' table does not say it decodes plainly (logprobs, a grammar, beams, stop strings,
    ``max_time``, own callables, watermarking, a seed: see ``features.RULES``). ``prompt_lookup_num_tokens=0`` turns
    speculation off for it.
    """

    def __init__(self, default=None, num_tokens: int = DEFAULT_NUM_TOKENS, policy: SpeculationPolicy | None = None,
                 max_draft: int | None = None):
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_tokens!r}")
        self.ngram = NgramProposer()
        self.draft = None
        if default is not None and default != "ngram":
            if isinstance(default, str):
                raise ValueError(f"speculative must be None, 'ngram' or a draft model, got {default!r}")
            self.draft = DraftModelProposer(default)
        self.default = default
        self.num_tokens = num_tokens
        self.max_draft = max_draft
        self.policy = policy if policy is not None else SpeculationPolicy()
        self.stats = SpeculationStats()
        self._acceptance: dict[int, float] = {}  # id(request) -> its per-token acceptance rate
        self._mode_acceptance = {"ngram": PRIOR_ACCEPTANCE, "draft": PRIOR_ACCEPTANCE}  # a new request's prior
        self._modes: dict[int, str] = {}  # id(request) -> how it drafts this step
        self._shadow: dict[int, int] = {}  # id(request) -> the first token of a draft a plain step held back
        self._plain: dict[int, tuple] = {}  # id(request) -> (it, whether features.py says it decodes plainly)

    def _mode(self, req: Request) -> tuple[str | None, int]:
        p = req.params
        if self.max_draft == 0 or p is None or req.beam is not None:
            return None, 0
        own = p.prompt_lookup_num_tokens
        if own == 0 or (own is None and self.default is None):
            return None, 0  # no speculation asked for
        known = self._plain.get(id(req))
        if known is None or known[0] is not req:  # the table's word, once per request (its params do not change)
            wanted = features.request_features(p, speculative=own is None)
            known = self._plain[id(req)] = (req, bool(features.decide(wanted).dropped & features.SPECULATION))
        if known[1]:
            return None, 0
        if own:
            return "ngram", own
        return ("ngram" if self.draft is None else "draft"), self.num_tokens

    def propose(self, running: list[Request]) -> None:
        """Set ``draft`` on the decoding requests of ``running`` that speculate this step (the policy may decide
        none does)."""
        t0 = time.perf_counter()
        self.stats.steps += 1
        decoding, ngram, drafting = [], [], []
        self._shadow = {}
        for req in running:
            req.draft = []
            if req.remaining != 1 or req.beam is not None:
                continue
            decoding.append(req)
            mode, k = self._mode(req)
            room = min(req.max_new_tokens - req.num_generated, req.max_length - len(req.tokens)) - 1
            k = min(k, room) if self.max_draft is None else min(k, room, self.max_draft)
            if mode is None or k < 1:
                continue
            (ngram if mode == "ngram" else drafting).append((req, k))
        self._modes = {id(req): "ngram" for req, _ in ngram} | {id(req): "draft" for req, _ in drafting}
        proposals = [(req, self.ngram.propose(req, k)) for req, k in ngram]
        proposals = [(req, d) for req, d in proposals if d]
        longest = max([len(d) for _, d in proposals] + [k for _, k in drafting], default=0)
        if longest:
            n = len(decoding)
            options = [(n, float(n), 0, 0)]  # option m: drafts cut to m tokens
            for m in range(1, longest + 1):
                lengths = [min(len(d), m) for _, d in proposals] + [min(k, m) for _, k in drafting]
                expected = n + sum(self._gain(req, min(len(d), m)) for req, d in proposals) + sum(
                    self._gain(req, min(k, m)) for req, k in drafting)
                options.append((n + sum(lengths), expected, len(drafting), m if drafting else 0))
            m = self.policy.choose(options)
            # a plain step still learns the n-gram drafts' acceptance: whether each one's first token is the token
            # the request then gets (free to check, so a request the policy keeps plain is not judged by the prior)
            self._shadow = {} if m else {id(req): d[0] for req, d in proposals}
            if m:
                if drafting:
                    t1 = time.perf_counter()
                    drafts = self.draft.propose_all([req for req, _ in drafting], m)
                    proposals += [(req, d[:own]) for (req, own), d in zip(drafting, drafts)]
                    self.policy.observe(len(drafting), (time.perf_counter() - t1) / m, self.policy.draft_costs)
                for req, draft in proposals:
                    req.draft = draft[:m]
                self.stats.speculative_steps += 1
        self.stats.propose_time_s += time.perf_counter() - t0

    def _gain(self, req: Request, m: int) -> float:
        """Expected extra tokens from a draft of ``m`` tokens."""
        a = min(self._acceptance.get(id(req), self._mode_acceptance[self._modes[id(req)]]), 0.99)
        return (1 - a ** (m + 1)) / (1 - a) - 1

    def observe_token(self, req: Request, token: int) -> None:
        """``req`` got ``token`` from a plain step: if the policy held back a draft for it, learn from its first
        token whether it would have been accepted."""
        first = self._shadow.pop(id(req), None)
        if first is not None:
            self._learn(req, self._modes.get(id(req), "ngram"), 1.0 if first == token else 0.0)

    def _learn(self, req: Request, mode: str, rate: float) -> None:
        """One more observation of ``req``'s per-token acceptance rate (and of its proposer's)."""
        old = self._acceptance.get(id(req), self._mode_acceptance[mode])
        self._acceptance[id(req)] = ACCEPTANCE_DECAY * old + (1 - ACCEPTANCE_DECAY) * rate
        self._mode_acceptance[mode] = ACCEPTANCE_DECAY * self._mode_acceptance[mode] + (1 - ACCEPTANCE_DECAY) * rate

    def observe_step(self, batch: Batch, forward_seconds: float) -> None:
        """The step's forward took ``forward_seconds``: a decode-only step teaches the policy its cost."""
        if all(c.sample and c.num_tokens == c.num_logits for c in batch.chunks) and batch.chunks:
            self.policy.observe(batch.num_tokens, forward_seconds)

    def verify(self, req: Request, logits: torch.Tensor, draft: list[int], sampler) -> list[int]:
        """The tokens ``req`` gets from a step that ran ``draft`` after its last known token: the accepted draft
        prefix and one token of the target's. ``logits`` ``[len(draft) + 1, vocab]``: the target's at each position."""
        p = req.params
        m = len(draft)
        histories = [req.tokens + draft[:i] for i in range(m + 1)]
        generated = [req.num_generated + i for i in range(m + 1)]
        if not p.do_sample:
            chosen = sampler(logits, [p] * (m + 1), [None] * (m + 1), histories, generated,
                             states=[req.sampling_state] * (m + 1)).tokens
            a = 0
            while a < m and chosen[a] == draft[a]:
                a += 1
            out = draft[:a] + [chosen[a]]
        else:
            out = accept_sampled(sampler.process(logits, [p] * (m + 1), histories, generated,
                                                 [req.sampling_state] * (m + 1)).softmax(-1), draft, req.generator)
        accepted = len(out) - 1
        self.stats.proposed += m
        self.stats.accepted += accepted
        self.stats.verified_requests += 1
        rate = accepted / (accepted + 1) if accepted < m else 1.0  # positions verified until the first rejection
        self._learn(req, self._modes.get(id(req), "ngram"), rate)
        return out

    def forget(self, req: Request) -> None:
        """``req`` left the engine."""
        self.ngram.forget(req)
        self._acceptance.pop(id(req), None)
        self._shadow.pop(id(req), None)
        self._plain.pop(id(req), None)
        if self.draft is not None:
            self.draft.forget(req)


def accept_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None = None) -> list[int]:
    """Rejection sampling of a greedy (one-hot) draft: ``probs`` ``[m + 1, vocab]`` the target's distribution at
    each position. Returns the accepted draft prefix and one token drawn from the target (the residual at the first
    rejection, else the last position's distribution), each distributed as the target samples it.

    Example::

        accept_sampled(torch.tensor([[0.5, 0.5], [0.9, 0.1]]), [1])   # [1, 0] w.p. 0.45, [1, 1] 0.05, [0] 0.5
    """
    device = generator.device if generator is not None else probs.device
    probs = probs.float().to(device)
    out = []
    for i, token in enumerate(draft):
        p = probs[i]  # [vocab]
        u = torch.rand(1, generator=generator, device=device)
        if float(u) < float(p[token]):
            out.append(token)
            continue
        residual = p.clone()
        residual[token] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out
