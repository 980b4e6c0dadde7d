"""A stand-in for the model and the planner, to test the engine's scheduling and API in milliseconds.

``ShadowRunner.run(batch)`` plans the batch with the real step planner (slots, copy-on-write, window release) on a
pool whose tensors are never made, publishes the written blocks as the real runner does, and records in a shadow of
the KV tensors which (token, position) each slot holds (through the step's slot mappings). Before "attending", it
checks that every chunk's history -- the slots its block table maps positions ``0 .. start-1`` to -- holds exactly
the request's tokens: a wrong prefix hit, a missing copy-on-write or a reused block would show there. Its "logits" put the next token at
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
from hf_paged.step import RowInput, StepOptions, plan_engine_step

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
        self.fail = None  # callable(batch) -> bool: raise in that step, after planning, before writing K/V
        self.plan_time = self.forward_time = 0.0
        self.steps = []  # per step: [(request_id, start, num_tokens)]

    def run(self, batch):
        kv, bs, a = self.kv, self.kv.block_size, self.kv.allocator
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks])
        partial = []  # (group seq, block index, block) of shared-able partly filled last blocks, before the step
        for chunk in batch.chunks:
            self._check_history(chunk)
            for seq in chunk.request.row.seqs:
                if chunk.start % bs:
                    partial.append((seq, chunk.start // bs, a.block_table(seq)[chunk.start // bs]))
        step = plan_engine_step(kv.rows, [RowInput(c.request.row, c.num_tokens, c.tokens) for c in batch.chunks],
                                StepOptions("triton", 1))  # (no torch read layout: nothing attends here)
        if self.fail is not None and self.fail(batch):  # slots taken, K/V never written
            raise RuntimeError("shadow forward failed")
        for seq, index, old in partial:  # copy-on-write: the planner replaced a shared last block
            new = a.block_table(seq)[index]
            if new != old:
                for off in range(bs):
                    if old * bs + off in self.slots:
                        self.slots[new * bs + off] = self.slots[old * bs + off]
        written = [(t, c.start + i) for c in batch.chunks for i, t in enumerate(c.tokens)]
        for group in step.groups:
            for slot, token_pos in zip(group.slot_mapping.tolist(), written, strict=True):
                self.slots[slot] = token_pos
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


def one_thread():
    """A pytest fixture body: torch ops on one thread for the test, then as before. These tests run tiny tensors, and
    on a shared 2-core machine a second intra-op thread mostly waits (a 14-element repeat_interleave took 27 ms on
    2 threads under load, 0.014 ms on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
