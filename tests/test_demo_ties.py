"""The demo's check of two greedy runs that round differently (``hf_paged.demo.near_ties``): a row that parts at a
near-tie passes, a row that parts at a clear margin fails, identical runs report nothing."""

from __future__ import annotations

import torch
from helpers import dynamic, generate, left_padded, tiny_model

from hf_paged.demo import near_ties


def runs():
    model = tiny_model("llama", seed=5)
    model.generation_config.eos_token_id = None
    inputs = left_padded([7, 4, 9], seed=2)
    return model, inputs, generate(model, inputs, dynamic(model), max_new_tokens=6)


def test_identical_runs_part_nowhere():
    model, inputs, out = runs()
    assert near_ties(model, inputs, out.clone(), out) == []


def test_a_token_taken_at_a_clear_margin_is_not_a_near_tie():
    model, inputs, out = runs()
    width = inputs["input_ids"].shape[1]
    ours = out.clone()
    logits = model(out[1:2, :width + 3][:, inputs["attention_mask"][1].bool().tolist() + [True] * 3]).logits[0, -1]
    ours[1, width + 3] = int(logits.argmin())  # the least likely token: parts at the widest margin there is
    parted = near_ties(model, inputs, ours, out)
    assert [(p["row"], p["column"], p["near_tie"]) for p in parted] == [(1, 3, False)]
    assert parted[0]["ulps"] > 100


def test_two_tokens_with_equal_logits_are_a_near_tie():
    """Give another token the output row of the token greedy picked: their logits are equal everywhere, so
    whichever a run picks at that position is a near-tie (gap 0)."""
    model, inputs, out = runs()
    width = inputs["input_ids"].shape[1]
    picked, twin = int(out[0, width + 2]), 1
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[picked]
    ours = out.clone()
    ours[0, width + 2] = twin
    parted = near_ties(model, inputs, ours, out)
    assert [(p["row"], p["column"], p["near_tie"], p["gap"]) for p in parted] == [(0, 2, True, 0.0)]
