"""Beam search in the engine: a request with ``num_beams = k`` runs as a group of k rows.

The request's prompt runs as one row (its prefill chunks like any request's). When its prompt is in, the group forks
k - 1 more rows from it (the rows share every block; the pool copies a shared last block when a row writes it), and
from then on each step runs one token per beam, beside whatever else is in the packed batch. After the step,
:meth:`BeamSearch.step` scores the k beams' next-token log-probabilities the way ``generate(num_beams=k)`` does —
the same candidates (``2k``, or more with several EOS ids), the same ``length_penalty``, ``early_stopping`` and
finished-hypothesis bookkeeping, in the same float32 tensor operations — and returns a :class:`BeamPlan`: for each new
beam, the old beam it continues and its token. The scheduler applies a plan through the row model (a beam continued
twice is forked, a beam continued by nobody is released: block tables move, K/V is never copied).

Admission counts a beam request's worst case (k rows to its full length, the prompt's full blocks once), and a
preempted beam request gives back every row and starts again from its prompt: the search is deterministic (greedy
beams) or reseeded from its own generator's state, so it is recomputed whole.

Tensor operations here run on the CPU: one ``[k, vocab]`` score matrix per request and step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG = -1.0e9  # generate()'s score of a slot that holds nothing / a beam that may not continue


@dataclass
class BeamPlan:
    """The next step's beams: new beam i continues old beam ``sources[i]`` with token ``tokens[i]``."""

    sources: list[int]
    tokens: list[int]


class BeamSearch:
    """One request's beam search state (``generate()``'s ``_beam_search`` for a batch of one).

    Args:
        params: the request's ``SamplingParams`` (``num_beams``, ``length_penalty``, ``early_stopping``,
            ``num_return_sequences``, ``do_sample``, ``eos_token_ids``).
        prompt_len: the prompt's tokens.
        max_length: prompt + generated tokens at which every beam stops (``generate()``'s ``max_length``).
        generator: the request's ``torch.Generator`` for beam sampling (``do_sample``), else None (global RNG).

    Example::

        search = BeamSearch(params, prompt_len=len(prompt), max_length=len(prompt) + 20)
        plan = search.step(log_probs)        # [k, vocab] processed log-probabilities of the k beams (or [1, vocab]
        # at the first step), returns the BeamPlan to apply; search.done once the search is over
        search.best()                        # [(tokens, score)] * num_return_sequences, best first
    """

    def __init__(self, params, prompt_len: int, max_length: int, generator: torch.Generator | None = None):
        self.params = params
        self.num_beams = k = params.num_beams
        self.prompt_len = prompt_len
        self.max_length = max_length
        self.generator = generator
        self.eos = frozenset(params.eos_token_ids)
        self.beams_to_keep = max(2, 1 + len(self.eos)) * k
        self.requests: list = []  # the group's rows as requests, beam order; [0] is the user's request
        self.reset()

    def reset(self) -> None:
        """Back to the start (a preempted beam request is recomputed whole)."""
        k = self.num_beams
        self.running_scores = torch.zeros(k)  # [k]
        self.running_scores[1:] = NEG  # the first step takes candidates from beam 0 only
        self.running: list[list[int]] = [[] for _ in range(k)]  # generated ids per running beam
        self.finished_scores = torch.full((k,), NEG)  # [k]
        self.finished: list[list[int]] = [[] for _ in range(k)]
        self.is_finished = torch.zeros(k, dtype=torch.bool)  # [k]
        self.improvable = True  # generate()'s is_early_stop_heuristic_unsatisfied
        self.cur_len = self.prompt_len
        self.done = False
        self.started = False
        del self.requests[1:]

    @property
    def hidden(self) -> list:
        """The rows besides the user's request (beams 1 .. k-1)."""
        return self.requests[1:]

    def step(self, log_probs: torch.Tensor) -> BeamPlan:
        """Score one step. ``log_probs`` ``[k, vocab]`` (``[1, vocab]`` at the first step: the prompt's, for every
        beam): each beam's processed next-token log-probabilities. Sets :attr:`done` when the search is over."""
        k, p = self.num_beams, self.params
        log_probs = log_probs.float().cpu()
        if log_probs.shape[0] == 1 and k > 1:
            log_probs = log_probs.expand(k, -1)  # [k, vocab]
        vocab = log_probs.shape[-1]
        scores = (log_probs + self.running_scores[:, None]).reshape(1, -1)  # [1, k * vocab]
        if p.do_sample:
            index = torch.multinomial(torch.softmax(scores, dim=-1), self.beams_to_keep, generator=self.generator)
            top = scores.gather(1, index)
            top, order = top.sort(dim=-1, descending=True)
            index = index.gather(1, order)
        else:
            top, index = torch.topk(scores, k=self.beams_to_keep)  # [1, 2k]
        top, index = top[0], index[0]  # [2k]
        sources, tokens = (index // vocab).tolist(), (index % vocab).tolist()
        candidates = [self.running[s] + [t] for s, t in zip(sources, tokens)]
        last = self.cur_len + 1 >= self.max_length
        hits = torch.tensor([last or t in self.eos for t in tokens])  # [2k]

        # the beams that go on: the k best candidates that did not stop
        running_top = top + hits.float() * NEG  # [2k]
        keep = torch.topk(running_top, k=k)[1].tolist()
        self.running = [candidates[i] for i in keep]
        self.running_scores = running_top[keep]
        plan = BeamPlan([sources[i] for i in keep], [tokens[i] for i in keep])

        # finished hypotheses: the candidates among the top k that stopped, if they beat the ones kept
        just_finished = hits & (torch.arange(self.beams_to_keep) < k)  # [2k]
        finished_top = top / ((self.cur_len + 1 - self.prompt_len) ** p.length_penalty)
        full = bool(self.is_finished.all()) and p.early_stopping is True
        finished_top = finished_top + float(full) * NEG + float(not self.improvable) * NEG
        finished_top = finished_top + (~just_finished).float() * NEG
        merged = torch.cat((self.finished_scores, finished_top))  # [3k]
        merged_seqs = self.finished + candidates
        merged_done = torch.cat((self.is_finished, just_finished))
        best = torch.topk(merged, k=k)[1].tolist()
        self.finished = [merged_seqs[i] for i in best]
        self.finished_scores = merged[best]
        self.is_finished = merged_done[best]

        self.cur_len += 1
        self.started = True
        if self.improvable:
            if p.early_stopping == "never" and p.length_penalty > 0.0:
                length = self.max_length - self.prompt_len
            else:
                length = self.cur_len - self.prompt_len
            best_running = self.running_scores[0] / (length ** p.length_penalty)
            worst_finished = torch.where(self.is_finished, self.finished_scores.min(), torch.tensor(NEG))  # [k]
            self.improvable = bool((best_running > worst_finished).any())
        open_beam = not (bool(self.is_finished.all()) and p.early_stopping is True)
        self.done = not (self.improvable and open_beam and not bool(hits.all()))
        return plan

    def best(self) -> list[tuple[list[int], float]]:
        """The ``num_return_sequences`` best finished hypotheses, best first: ``(generated ids, score)``."""
        n = self.params.num_return_sequences
        return [(list(self.finished[i]), float(self.finished_scores[i])) for i in range(n)]

    def worst_case_blocks(self, kv, total_tokens: int) -> int:
        """Blocks the group may hold at once when every beam reaches ``total_tokens``: the prompt's full blocks once,
        the rest per beam (``kv``: the engine's :class:`~hf_paged.engine.kv.RequestKV`)."""
        per_beam = kv.worst_case_blocks(total_tokens)
        shared = min(self.prompt_len // kv.block_size, per_beam) if kv.groups.num_groups == 1 else 0
        return per_beam + (self.num_beams - 1) * (per_beam - shared)
