"""A stand-in for the model and the planner, to test the engine's scheduling and API in milliseconds.

``ShadowRunner.run(batch)`` does what the real runner's planner does to the pool (allocate the chunks' slots, copy on
write, release blocks outside a window, publish the written blocks) on a bare allocator, and records in a shadow of the
KV tensors which (token, position) each slot holds. Before "attending", it checks that every chunk's history -- the
slots its block table maps positions ``0 .. start-1`` to -- holds exactly the request's tokens: a wrong prefix hit, a
missing copy-on-write or a reused block would show there. Its "logits" put the next token at
:func:`next_token` of the request's tokens, a deterministic function, so each request's expected tokens are known
without running anything (:func:`expected_tokens`).
"""

from __future__ import annotations

import torch

from hf_paged import BlockPool
from hf_paged.allocator import NULL_BLOCK
from hf_paged.engine.core import EngineCore
from hf_paged.engine.kv import RequestKV
from hf_paged.engine.scheduler import Scheduler
from hf_paged.groups import LayerGroups

VOCAB = 64
EOS = 1


def next_token(tokens: list[int]) -> int:
    """The shadow model's greedy next token: depends on the last tokens and the length."""
    last = tokens[-3:]
    return (sum((i + 7) * t for i, t in enumerate(last)) * 31 + 17 * len(tokens)) % (VOCAB - 2) + 2


def expected_tokens(prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == eos:
            break
    return out


class ShadowRunner:
    def __init__(self, kv: RequestKV):
        self.kv = kv
        self.slots: dict[int, tuple[int, int]] = {}
        self.fail = None  # callable(batch) -> bool: raise in that step, after allocating, before writing K/V
        self.plan_time = self.forward_time = 0.0
        self.steps = []  # per step: [(request_id, start, num_tokens)]

    def run(self, batch):
        kv, bs, a = self.kv, self.kv.block_size, self.kv.allocator
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks])
        for chunk in batch.chunks:
            self._check_history(chunk)
        plan = kv.append([(c.request.row, c.tokens) for c in batch.chunks])
        if self.fail is not None and self.fail(batch):  # slots taken, K/V never written
            raise RuntimeError("shadow forward failed")
        for src, dst in plan.copies:
            for off in range(bs):
                if src * bs + off in self.slots:
                    self.slots[dst * bs + off] = self.slots[src * bs + off]
        for chunk in batch.chunks:
            for g, seq in enumerate(chunk.request.row.seqs):
                table = a.block_table(seq)
                for i, tok in enumerate(chunk.tokens):
                    pos = chunk.start + i
                    self.slots[table[pos // bs] * bs + pos % bs] = (tok, pos)
                window = kv.groups.windows[g]
                if window is not None:
                    a.release_outside_window(seq, chunk.start - window + 1)
        kv.publish([c.request.row for c in batch.chunks])
        sampled = [c for c in batch.chunks if c.sample]
        logits = torch.full((len(sampled), VOCAB), -1.0)
        for i, c in enumerate(sampled):
            logits[i, next_token(c.request.tokens)] = 1.0
        return logits

    def _check_history(self, chunk) -> None:
        req, bs, a = chunk.request, self.kv.block_size, self.kv.allocator
        for g, seq in enumerate(req.row.seqs):
            table = a.block_table(seq)
            assert a.seq_len(seq) == chunk.start, (req.request_id, a.seq_len(seq), chunk.start)
            window = self.kv.groups.windows[g]
            first = 0 if window is None else max(0, chunk.start - window + 1)
            for pos in range(first, chunk.start):
                block = table[pos // bs]
                assert block != NULL_BLOCK, (req.request_id, pos)
                got = self.slots.get(block * bs + pos % bs)
                assert got == (req.tokens[pos], pos), (req.request_id, pos, got, req.tokens[pos])


def shadow_engine(num_blocks: int | None = 32, block_size: int = 4, max_batch_tokens: int = 16,
                  prefix_caching: bool = True, windows=(None,), **scheduler_options):
    pool = BlockPool(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching)
    groups = LayerGroups.from_windows(list(windows))
    kv = RequestKV(pool, groups, max_batch_tokens)
    scheduler = Scheduler(kv, max_batch_tokens, **scheduler_options)
    return EngineCore(scheduler, ShadowRunner(kv), max_context=10_000)


def run_to_end(core: EngineCore, max_steps: int = 100_000, check=True) -> int:
    steps = 0
    while core.has_work:
        core.step()
        steps += 1
        if check:
            core.scheduler.check_invariants()
            core.kv.allocator.check_invariants()
        assert steps < max_steps, "the engine made no progress"
    return steps
