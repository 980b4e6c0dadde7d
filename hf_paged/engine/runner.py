"""One forward per step over the scheduler's packed batch, through the shared step planner.

The batch's chunks become one row of ``T`` tokens (each request's new tokens back to back, no padding) with explicit
per-token positions. The planner (``hf_paged.step.plan``, the same one ``PagedCache`` uses) takes each request's
slots and builds the varlen step tensors; ``StepCache`` writes every layer's K/V through the slot mapping and hands
the layer its step, so every query attends through the block tables (history, earlier chunks and prefix hits all
read the pool). Logits are computed only at each sampling chunk's last token (``logits_to_keep``).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from .. import compat
from .scheduler import Batch


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [T] int64: the chunks' tokens, back to back
    position_ids: torch.Tensor  # [T] int64: each token's position in its request
    logits_index: torch.Tensor  # [k] int64: the last token of each sampling chunk, in batch order


def pack(batch: Batch, device: torch.device) -> PackedInputs:
    """The packed inputs of ``batch`` (host lists built once, then one copy each to ``device``)."""
    ids, positions, keep = [], [], []
    for chunk in batch.chunks:
        ids.extend(chunk.tokens)
        positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
        if chunk.sample:
            keep.append(len(ids) - 1)
    return PackedInputs(
        torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),  # [T]
        torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),  # [T]
        torch.tensor(keep, dtype=torch.long).to(device, non_blocking=True),  # [k]
    )


class ModelRunner:
    """Runs a :class:`~hf_paged.engine.scheduler.Batch` through ``model`` on the engine's rows.

    ``run(batch) -> logits [k, vocab]`` (float, the model's dtype) for the batch's k sampling chunks. ``plan_time`` /
    ``forward_time``: seconds of the last call's host preparation and of its forward.
    """

    def __init__(self, model, kv, backend: str, num_layers: int):
        from ..cache import StepCache
        from ..step import RowInput, plan

        self.model = model
        self.kv = kv
        self.backend = backend
        self.num_layers = num_layers
        self.device = model.device
        self._plan, self._row_input, self._step_cache = plan, RowInput, StepCache
        self._buffers = kv.pool.lend_step_buffers(self)
        params = inspect.signature(model.forward).parameters
        self.keeps_logits = "logits_to_keep" in params
        self.plan_time = self.forward_time = 0.0

    def run(self, batch: Batch) -> torch.Tensor:
        t0 = time.perf_counter()
        inputs = pack(batch, self.device)
        step = self._plan(self.kv.rows, [self._row_input(c.request.row, c.num_tokens, c.tokens) for c in batch.chunks],
                          backend=self.backend, num_layers=self.num_layers)
        t1 = time.perf_counter()
        self.plan_time = t1 - t0
        cache = self._step_cache(self.kv.rows, step, self.num_layers, self._buffers)
        kwargs = {compat.FORWARD_CACHE_KWARG: cache, "use_cache": True}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = inputs.logits_index
        out = self.model(input_ids=inputs.input_ids[None], position_ids=inputs.position_ids[None], **kwargs)
        logits = out.logits[0]  # [k, vocab] (or [T, vocab] for a model without logits_to_keep)
        if not self.keeps_logits:
            logits = logits.index_select(0, inputs.logits_index)
        if logits.device.type == "cuda":  # the time is the forward's, not the sampler's first sync
            torch.cuda.synchronize(logits.device)
        self.forward_time = time.perf_counter() - t1
        self.kv.publish([c.request.row for c in batch.chunks])
        return logits
