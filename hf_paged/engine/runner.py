"""One forward per step over the scheduler's packed batch, through the shared step planner.

The batch's chunks become one ``[1, T]`` input (each request's new tokens back to back, no padding) with explicit
per-token positions. The planner (``hf_paged.step.plan_engine_step``, over the same core as ``PagedCache``'s
``plan_generate_step``) takes each request's slots and builds the varlen step tensors; ``StepCache`` writes every
layer's K/V through the slot mapping and hands the layer its step, so every query attends through the block tables
(history, earlier chunks and prefix hits all read the pool). Logits are computed only at each sampling chunk's last
token (``logits_to_keep``), plus, for a request that asked for prompt logprobs, at the prompt positions of its chunks
(``Chunk.prompt_positions``).
"""

from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .. import compat
from ..cache import StepCache
from ..ops import resolve_backend
from ..patches.lean import lean_decoder
from ..rows import Row
from ..step import RowInput, Step, StepOptions, plan_engine_step
from .multimodal import StepMedia, position_offset
from .padding import PaddingRule, measure_padding
from .scheduler import Batch
from .states import PackedStates, segments


PAD_ROW = Row(seqs=[], tokens=None, released=True)  # holds no KV: its tokens go to the scratch block


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [T + P] int64: the chunks' tokens, back to back, then P padding tokens
    position_ids: torch.Tensor  # [T + P] int64: each token's position in its request (padding: 0..P-1)
    # [k + m (+ repeats)] int64: the last token of each sampling chunk in batch order (of a chunk with a draft, its
    # last len(draft) + 1 tokens), then the m prompt positions whose logits prompt logprobs need, chunk by chunk
    logits_index: torch.Tensor
    num_sampled: int  # k: the logits of the sampling chunks (sum of their ``num_logits``)
    padding: int  # P
    num_prompt_logits: int = 0  # m

    def moved(self, put) -> "PackedInputs":
        """The same inputs with each tensor replaced by ``put(name, tensor)`` (moved to a device, or staged)."""
        return PackedInputs(put("input_ids", self.input_ids), put("position_ids", self.position_ids),
                            put("logits_index", self.logits_index), self.num_sampled, self.padding,
                            self.num_prompt_logits)


def pack(batch: Batch, device: torch.device, bucket: int | None = None,
         rule: PaddingRule | None = None) -> PackedInputs:
    """The packed inputs of ``batch`` as host tensors (built from host lists once); ``rule``: on CPU, the sizes
    this machine runs faster padded (:func:`~hf_paged.engine.padding.measure_padding`; None: none); ``bucket``: a
    decode-only batch padded to that many one-token rows (a graph's bucket), every token's logits kept."""
    ids, positions, keep, prompt_keep = [], [], [], []
    for chunk in batch.chunks:
        base = len(ids) - chunk.start
        ids.extend(chunk.tokens)
        first = chunk.start + position_offset(chunk.request)  # (past a prompt's images: the model's mrope offset)
        positions.extend(range(first, first + chunk.num_tokens))
        prompt_keep.extend(base + p for p in chunk.prompt_positions)
        if chunk.sample:  # the last token's logits (a draft's verify: each of its last len(draft) + 1 positions)
            keep.extend(range(len(ids) - chunk.num_logits, len(ids)))
    num_sampled, num_prompt_logits, padding = len(keep), len(prompt_keep), 0
    keep += prompt_keep
    if bucket is not None:
        assert not num_prompt_logits, "a graphed decode-only step has no prompt positions"
        padding = bucket - len(ids)
        keep = list(range(bucket))
    elif device.type == "cpu" and rule is not None:
        padding = rule.step_tokens(len(ids)) - len(ids)
        if keep:
            keep.extend([keep[-1]] * (rule.logit_rows(len(keep)) - len(keep)))
    ids.extend([0] * padding)
    positions.extend(range(padding) if bucket is None else [0] * padding)
    return PackedInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                        torch.tensor(keep, dtype=torch.long), num_sampled, padding, num_prompt_logits)


class ModelRunner:
    """Runs a :class:`~hf_paged.engine.scheduler.Batch` through ``model`` on the engine's rows.

    ``run(batch) -> logits [k + m, vocab]`` (float, the model's dtype): the batch's sampling chunks' k logits (one
    per chunk, ``len(draft) + 1`` for a chunk verifying a draft), then
    the m of its chunks' ``prompt_positions``. ``plan_time`` /
    ``forward_time``: seconds of the last call's host preparation and of its forward. ``graphs``: a
    :class:`~hf_paged.engine.graphs.DecodeGraphs` replaying decode-only steps (None: every step eager). ``media``: a
    :class:`~hf_paged.engine.multimodal.MultimodalInputs` for a model that takes images (a step with image tokens,
    or a request's 3-axis positions, runs eagerly with the stage's extra inputs).
    ``padding``: on CPU, the step sizes run padded (:class:`~hf_paged.engine.padding.PaddingRule`, measured for
    this model at start unless ``measured_padding=False``, as under tensor parallelism, where every rank must pad
    alike and a rank's linears hold a shard; assignable, e.g. ``PaddingRule()`` for none).
    ``lean``: on CPU, a Llama-shaped model's steps run :class:`~hf_paged.patches.lean.LeanDecoder` (the same
    logits without transformers' per-layer plumbing) where nothing else needs the model's own forward (images,
    LoRA adapters, state layers, hooks); None: always the model's forward (``lean=False``, or another family).
    """

    def __init__(self, model, kv, backend: str, num_layers: int, graphs=None, media=None,
                 measured_padding: bool = True, lean: bool = True):
        self.model = model
        self.kv = kv
        self.backend = resolve_backend(backend, model.device)  # "auto" -> what runs on this device
        self.num_layers = num_layers
        self.device = model.device
        self.graphs = graphs
        self.media = media
        self._eager = StepOptions(self.backend, num_layers)
        # a graphed step: staged in the step buffers, tables bucketed to a few widths, read over their whole width
        self._graphed = None if graphs is None else StepOptions(self.backend, num_layers, static=True,
                                                                decode_bucket=True, full_width=True,
                                                                min_width=graphs.min_width)
        self._buffers = kv.pool.lend_step_buffers(self)
        params = inspect.signature(model.forward).parameters
        self.keeps_logits = "logits_to_keep" in params
        self.padding = measure_padding(model) if self.device.type == "cpu" and measured_padding else None
        self.plan_time = self.forward_time = 0.0
        self.before_forward = None  # called once the step is planned, before the forward (tensor parallelism)
        self._packed_states = None  # hybrid models: the running step's segments for the state mixers
        self.lora = None  # engine/lora.py's AdapterSet (set by the factory): the step's adapters around the forward
        self.lean = lean_decoder(model) if lean and self.device.type == "cpu" and graphs is None else None
        state = getattr(model, "_hf_paged_state", None)
        self._own_hooks = len(state.handles) if state is not None else 0  # the decoder's planning hooks

    def run(self, batch: Batch) -> torch.Tensor:
        t0 = time.perf_counter()
        restore = None
        if self.lora is not None:  # LoRA adapters: chunks laid out adapter by adapter, logits put back in batch order
            batch, restore = self.lora.grouped(batch)
        if self.kv.rows.stateful:
            self._packed_states = PackedStates(self.kv.pool, segments(batch.chunks), self.kv.state_layers)
        with_media = self.media is not None and self.media.needed(batch.chunks)
        adapters = self.lora.token_map(batch.chunks) if self.lora is not None else None  # None: base weights only
        graphable = self.graphs is not None and not with_media and adapters is None
        bucket = self.graphs.rows_for(batch.chunks) if graphable else None
        inputs = pack(batch, self.device, bucket, self.padding)
        media = self.media.for_step(batch.chunks, inputs.position_ids, self.device) if with_media else None
        step = self._plan(batch, inputs.padding, graphed=bucket is not None)
        t1 = time.perf_counter()
        self.plan_time = t1 - t0
        if self.before_forward is not None:
            self.before_forward()
        with self.lora.applied(adapters, self.device) if self.lora is not None else nullcontext():
            if bucket is not None:
                logits = self.graphs.run(step, inputs, self._buffers, self._forward)
            else:
                logits = self._forward(step, inputs.moved(lambda name, t: t.to(self.device, non_blocking=True)), media)
        if media is not None:
            self.media.done(batch.chunks)
        logits = logits[: inputs.num_sampled + inputs.num_prompt_logits]  # [k + m, vocab]
        if restore is not None:
            logits = logits[restore]
        if logits.device.type == "cuda":  # the time is the forward's, not the sampler's first sync
            torch.cuda.synchronize(logits.device)
        self.forward_time = time.perf_counter() - t1
        self.kv.publish([c.request.row for c in batch.chunks])
        return logits

    def _plan(self, batch: Batch, padding: int, graphed: bool) -> Step:
        """The step of ``batch``'s chunks, then ``padding`` tokens of the padding row (``graphed``: one released row
        per padding token, so every row of a graphed step has one query)."""
        # the ids the rows' blocks are keyed by (a prompt with images: content stand-ins at its image positions)
        inputs = [RowInput(c.request.row, c.num_tokens, c.request.key_tokens[c.start: c.start + c.num_tokens],
                           spans=c.request.bidirectional_spans)
                  for c in batch.chunks]
        if graphed:
            inputs += [RowInput(PAD_ROW, 1, None) for _ in range(padding)]
        elif padding:
            inputs.append(RowInput(PAD_ROW, padding, None))
        return plan_engine_step(self.kv.rows, inputs, self._graphed if graphed else self._eager)

    def _forward(self, step: Step, inputs: PackedInputs, media: StepMedia | None = None) -> torch.Tensor:
        """``[k', vocab]`` logits of the sampled chunks (``inputs`` on the model's device; ``media``: the step's image
        rows and 3-axis positions, which replace the packed 1-D positions)."""
        cache = StepCache(self.kv.rows, step, self.num_layers, self._buffers)
        cache.packed_states = self._packed_states
        if (self.lean is not None and media is None and self._packed_states is None
                and (self.lora is None or self.lora.wraps_nothing) and self.lean.usable(self._own_hooks)):
            return self.lean.forward(cache, inputs.input_ids, inputs.position_ids, inputs.logits_index)
        kwargs = {compat.FORWARD_CACHE_KWARG: cache, "use_cache": True, "position_ids": inputs.position_ids[None]}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = inputs.logits_index
        if media is not None:
            kwargs.update(media.forward_kwargs())
        out = self.model(input_ids=inputs.input_ids[None], **kwargs)
        logits = out.logits[0]  # [k', vocab] (or [T + P, vocab] for a model without logits_to_keep)
        if not self.keeps_logits:
            logits = logits.index_select(0, inputs.logits_index)
        return logits
