"""The shared planner on a packed, unpadded batch (what the continuous-batching engine runs): rows of different
lengths, some continuing with history, in one ``[1, T]`` forward."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from hf_paged import BlockPool, enable_paged_attention
from hf_paged.cache import StepCache
from hf_paged.groups import LayerGroups
from hf_paged.patches import layer_windows
from hf_paged.rows import Rows
from hf_paged.step import RowInput, StepBuffers, StepOptions, plan_engine_step


def packed_forward(model, rows: Rows, chunks: list[tuple[object, list[int]]]) -> torch.Tensor:
    """One forward over ``(row, new token ids)`` pairs packed in order; the last logits of each row ``[n, V]``."""
    inputs = [RowInput(row, len(ids), ids) for row, ids in chunks]
    starts = [rows.length(row) for row, _ in chunks]
    step = plan_engine_step(rows, inputs, StepOptions("torch", model.config.num_hidden_layers))
    ids = torch.tensor([t for _, chunk in chunks for t in chunk])
    pos = torch.cat([torch.arange(s, s + len(chunk)) for s, (_, chunk) in zip(starts, chunks)])
    last = torch.cumsum(torch.tensor([len(c) for _, c in chunks]), 0) - 1
    cache = StepCache(rows, step, model.config.num_hidden_layers, StepBuffers())
    out = model(input_ids=ids[None], position_ids=pos[None], cache=cache, use_cache=True, logits_to_keep=last)
    return out.logits[0]


def test_packed_rows_give_each_prompts_own_logits():
    """Two prompts prefilled together, then one continued with a chunk while the other decodes, in single packed
    forwards: each row's last logits equal a plain forward of that row's whole token sequence alone."""
    model = tiny_model("llama", seed=4)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=4)
    rows = Rows(pool, LayerGroups.from_windows(layer_windows(model.config)))
    g = torch.Generator().manual_seed(0)
    a_ids, b_ids = torch.randint(3, 96, (11,), generator=g).tolist(), torch.randint(3, 96, (6,), generator=g).tolist()
    a, b = rows.new(), rows.new()
    with torch.no_grad():
        first = packed_forward(model, rows, [(a, a_ids), (b, b_ids)])
        more_a, next_b = torch.randint(3, 96, (5,), generator=g).tolist(), [int(first[1].argmax())]
        second = packed_forward(model, rows, [(b, next_b), (a, more_a)])
        for whole, got in ((a_ids, first[0]), (b_ids, first[1]), (b_ids + next_b, second[0]),
                           (a_ids + more_a, second[1])):
            alone = model(torch.tensor([whole])).logits[0, -1]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert rows.length(a) == 16 and rows.length(b) == 7
    rows.remove(a)
    rows.remove(b)
    assert pool.allocator.blocks_in_use == 0


def test_engine_step_records_each_rows_tokens():
    """A planned step gives every row slots for its new tokens and records their ids on the row (what prefix keys
    and ``save`` read); a step fed embeddings (ids unknown) leaves the row's ids unknown for good."""
    pool = BlockPool(block_size=4)
    rows = Rows(pool, LayerGroups.from_windows([None, None]))
    a, b = rows.new(), rows.new()
    options = StepOptions("triton", 2)  # no torch read layout: nothing attends here
    step = plan_engine_step(rows, [RowInput(a, 3, [5, 6, 7]), RowInput(b, 2, [8, 9])], options)
    assert step.groups[0].slot_mapping.shape == (5,) and step.query_len == step.max_query_len == 3
    assert a.tokens == [5, 6, 7] and b.tokens == [8, 9]
    plan_engine_step(rows, [RowInput(a, 2, None), RowInput(b, 1, [4])], options)
    assert a.tokens is None and b.tokens == [8, 9, 4]
    plan_engine_step(rows, [RowInput(a, 1, [3])], options)
    assert a.tokens is None and rows.length(a) == 6 and rows.length(b) == 3
    rows.clear()
    assert pool.allocator.blocks_in_use == 0


def test_step_options_refuse_an_unresolved_backend():
    """The planner builds the torch read layout only for "torch": an unresolved "auto" would silently plan none,
    so the options refuse it and name the fix."""
    with pytest.raises(ValueError, match="resolve_backend"):
        StepOptions("auto", 2)
