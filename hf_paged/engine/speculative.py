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
- sampled requests: rejection sampling as in the speculative sampling papers, for a proposer that puts all its
  probability on its draft token (both proposers here draft greedily): token d at a position whose target
  distribution is p is accepted with probability p(d); on a rejection the token is drawn from p with d removed
  (renormalised), and after a draft accepted whole the next token from p at the last position. Each output token is
  then distributed exactly as the target model samples it.

The scheduler cuts the rejected tokens' K/V off the request's row (``Scheduler.rollback``: the block table is
truncated, emptied blocks go back to the pool).

:class:`SpeculationPolicy` decides per step whether to speculate: it learns what a decode step of T tokens costs on
this machine (forward seconds of decode-only steps, per power-of-two bucket of T) and each request's acceptance rate,
and speculates only when the expected tokens per second beat those of a plain step. A compute-bound batch (many
requests, where a forward's time grows with its tokens) turns speculation off; a small one (memory- or
latency-bound, one forward per token) turns it on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention import attach_paged_attention, is_paged, paged_backend
from ..groups import LayerGroups
from ..patches import kv_geometry
from ..pool import BlockPool
from .kv import RequestKV
from .request import Request
from .runner import ModelRunner
from .sampling import processed_scores
from .scheduler import Batch, Chunk

DEFAULT_NUM_TOKENS = 8  # draft tokens per request and step (the policy decides whether they run)
MAX_NGRAM = 3  # the longest suffix n-gram looked up (transformers' max_matching_ngram_size default is 2)
PRIOR_ACCEPTANCE = 0.5  # a request's per-token acceptance rate before it has any
ACCEPTANCE_DECAY = 0.7  # weight of the past in a request's acceptance rate
COST_DECAY = 0.8  # weight of the past in a step-cost bucket
REEXPLORE = 64  # steps after which a cost bucket is measured again


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
            attach_paged_attention(model)
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
        """The draft row of ``req``, cut back to the longest prefix it shares with ``req.tokens``."""
        seq = self._seqs.get(id(req))
        if seq is None:
            seq = Request(request_id=f"{req.request_id}#draft", tokens=[], num_prompt=0, max_new_tokens=1,
                          max_length=1 << 40)
            seq.row = self.kv.open()
            self._seqs[id(req)] = seq
        same = 0
        limit = min(seq.num_computed, len(req.tokens))
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
    """Speculate in a step only when its expected tokens per second beat a plain step's.

    ``cost(T)``: the forward seconds of a decode-only step of T tokens, learned from the engine's own steps per
    power-of-two bucket of T (a bucket not measured yet, or not for ``REEXPLORE`` steps, is measured by running it).
    A request's expected tokens from a draft of m tokens at per-token acceptance rate a: ``(1 - a^(m+1)) / (1 - a)``.
    ``max_tokens``: a step with more tokens than this never speculates (None: no such cap).
    """

    max_tokens: int | None = None
    costs: dict[int, tuple[float, int]] = field(default_factory=dict)  # bucket -> (seconds, step last measured)
    draft_costs: dict[int, tuple[float, int]] = field(default_factory=dict)  # draft model: requests bucket -> s
    step: int = 0
    last_decision: bool = False
    last_speculated: int = 0  # the step that last speculated (a policy that keeps drafts off re-tries them now and
    # then, so the acceptance rates it decides from stay measured)

    @staticmethod
    def bucket(tokens: int) -> int:
        return 1 << max(tokens - 1, 0).bit_length()

    def observe(self, tokens: int, seconds: float, table: dict | None = None) -> None:
        """A decode-only step of ``tokens`` took ``seconds`` (its forward)."""
        table = self.costs if table is None else table
        b = self.bucket(tokens)
        old = table.get(b)
        table[b] = (seconds if old is None else COST_DECAY * old[0] + (1 - COST_DECAY) * seconds, self.step)

    def _cost(self, tokens: int, table: dict) -> float | None:
        entry = table.get(self.bucket(tokens))
        if entry is None or self.step - entry[1] > REEXPLORE:
            return None
        return entry[0]

    def decide(self, plain_tokens: int, spec_tokens: int, expected: float, draft_requests: int = 0) -> bool:
        """Whether a step of ``plain_tokens`` decode tokens should run ``spec_tokens`` instead, expecting
        ``expected`` tokens out (vs ``plain_tokens``); ``draft_requests``: requests a draft model proposes for."""
        self.step += 1
        if self.max_tokens is not None and spec_tokens > self.max_tokens:
            self.last_decision = False
            return False
        spec = self._cost(spec_tokens, self.costs)
        plain = self._cost(plain_tokens, self.costs)
        drafting = self._cost(draft_requests, self.draft_costs) if draft_requests else 0.0
        if spec is None or drafting is None or self.step - self.last_speculated > REEXPLORE:
            decision = True  # measure it
        elif plain is None:
            decision = False
        else:
            decision = expected / (spec + drafting) > plain_tokens / plain
        self.last_decision = decision
        if decision:
            self.last_speculated = self.step
        return decision


class Speculation:
    """The engine's speculative decoding stage (see the module's docstring).

    Args:
        default: the engine's speculation for requests that do not choose: None (off), ``"ngram"`` (prompt lookup)
            or a draft model (an attention-only causal LM with the target's vocabulary).
        num_tokens: draft tokens per request and step (a request's ``prompt_lookup_num_tokens`` overrides it for
            n-gram lookup).
        policy: the per-step on/off :class:`SpeculationPolicy`.

    A request speculates when it decodes (its next step runs one known token), asks for no ``logprobs``, has no
    grammar and no beams, and either sets ``prompt_lookup_num_tokens`` > 0 (n-gram lookup) or leaves it unset under
    an engine default. ``prompt_lookup_num_tokens=0`` turns speculation off for it.
    """

    def __init__(self, default=None, num_tokens: int = DEFAULT_NUM_TOKENS, policy: SpeculationPolicy | None = None):
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
        self.policy = policy if policy is not None else SpeculationPolicy()
        self.stats = SpeculationStats()
        self._acceptance: dict[int, float] = {}  # id(request) -> its per-token acceptance rate
        self._mode_acceptance = {"ngram": PRIOR_ACCEPTANCE, "draft": PRIOR_ACCEPTANCE}  # a new request's prior
        self._modes: dict[int, str] = {}  # id(request) -> how it drafts this step

    def _mode(self, req: Request) -> tuple[str | None, int]:
        p = req.params
        if p is None or p.num_beams > 1 or req.matcher is not None or p.logprobs is not None:
            return None, 0
        own = p.prompt_lookup_num_tokens
        if own == 0:
            return None, 0
        if own is not None:
            return "ngram", own
        if self.default is None:
            return None, 0
        return ("ngram" if self.draft is None else "draft"), self.num_tokens

    def propose(self, running: list[Request]) -> None:
        """Set ``draft`` on the decoding requests of ``running`` that speculate this step (the policy may decide
        none does)."""
        t0 = time.perf_counter()
        self.stats.steps += 1
        decoding, ngram, drafting = [], [], []
        for req in running:
            req.draft = []
            if req.remaining != 1 or req.beam is not None:
                continue
            decoding.append(req)
            mode, k = self._mode(req)
            room = min(req.max_new_tokens - req.num_generated, req.max_length - len(req.tokens)) - 1
            k = min(k, room)
            if mode is None or k < 1:
                continue
            (ngram if mode == "ngram" else drafting).append((req, k))
        self._modes = {id(req): "ngram" for req, _ in ngram} | {id(req): "draft" for req, _ in drafting}
        proposals = [(req, self.ngram.propose(req, k)) for req, k in ngram]
        proposals = [(req, d) for req, d in proposals if d]
        n = len(decoding)
        spec_tokens = n + sum(len(d) for _, d in proposals) + sum(k for _, k in drafting)
        expected = n + sum(self._gain(req, len(d)) for req, d in proposals) + sum(self._gain(req, k)
                                                                                for req, k in drafting)
        if (proposals or drafting) and self.policy.decide(n, spec_tokens, expected, len(drafting)):
            if drafting:
                t1 = time.perf_counter()
                k = max(k for _, k in drafting)
                drafts = self.draft.propose_all([req for req, _ in drafting], k)
                proposals += [(req, d[:own]) for (req, own), d in zip(drafting, drafts)]
                self.policy.observe(len(drafting), time.perf_counter() - t1, self.policy.draft_costs)
            for req, draft in proposals:
                req.draft = draft
            self.stats.speculative_steps += 1
        self.stats.propose_time_s += time.perf_counter() - t0

    def _gain(self, req: Request, m: int) -> float:
        """Expected extra tokens from a draft of ``m`` tokens."""
        a = min(self._acceptance.get(id(req), self._mode_acceptance[self._modes[id(req)]]), 0.99)
        return (1 - a ** (m + 1)) / (1 - a) - 1

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
            chosen = sampler(logits, [p] * (m + 1), [None] * (m + 1), histories, generated).tokens
            a = 0
            while a < m and chosen[a] == draft[a]:
                a += 1
            out = draft[:a] + [chosen[a]]
        else:
            out = accept_sampled(processed_scores(logits, [p] * (m + 1), histories, generated).softmax(-1), draft,
                                 req.generator)
        accepted = len(out) - 1
        self.stats.proposed += m
        self.stats.accepted += accepted
        self.stats.verified_requests += 1
        mode = self._modes.get(id(req), "ngram")
        old = self._acceptance.get(id(req), self._mode_acceptance[mode])
        rate = accepted / m if accepted < m else 1.0
        self._acceptance[id(req)] = ACCEPTANCE_DECAY * old + (1 - ACCEPTANCE_DECAY) * rate
        self._mode_acceptance[mode] = ACCEPTANCE_DECAY * self._mode_acceptance[mode] + (1 - ACCEPTANCE_DECAY) * rate
        return out

    def forget(self, req: Request) -> None:
        """``req`` left the engine."""
        self.ngram.forget(req)
        self._acceptance.pop(id(req), None)
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
