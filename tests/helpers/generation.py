"""Inputs, generate() and forwards under the installed transformers' cache keyword, and what a cache should hold."""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from hf_paged import compat

from .models import PAD, VOCAB, tiny_model


def left_padded(lengths: list[int], seed: int = 0):
    """input_ids/attention_mask for prompts of the given lengths, left-padded; no special tokens inside."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def ones_mask(ids: torch.Tensor) -> dict:
    """``ids`` with an all-ones attention mask: generate() inputs without padding."""
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def dynamic(model):
    """transformers' own ``DynamicCache`` for ``model``: the reference every paged run is compared with."""
    return DynamicCache(config=model.config)


def generate(model, inputs, cache, **kwargs):
    """model.generate() with ``cache`` under the installed transformers' keyword; inputs go to the model's device."""
    kwargs.setdefault("max_new_tokens", 12)
    kwargs.setdefault("do_sample", False)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    return model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: cache}, **kwargs)


def forward(model, input_ids, cache, **kwargs):
    """One manual forward ``model(input_ids=..., cache=cache)`` under the installed transformers' keyword."""
    with torch.no_grad():
        return model(input_ids=input_ids, **{compat.FORWARD_CACHE_KWARG: cache}, **kwargs)


def early_eos_model():
    """A tiny model plus inputs where row 0 emits EOS at its third new token and the other rows run on."""
    model = tiny_model("llama", seed=1)
    inputs = left_padded([6, 9, 4], seed=5)
    model.generation_config.eos_token_id = None
    free_run = generate(model, inputs, dynamic(model), max_new_tokens=14)
    width = inputs["input_ids"].shape[1]
    first = free_run[0, width + 2].item()  # row 0's third new token becomes "EOS"
    if (free_run[1:, width:width + 3] == first).any():
        import pytest

        pytest.skip("the chosen EOS token also ends another row early with this seed")
    model.generation_config.eos_token_id = first
    return model, inputs


def live_blocks_expected(cache) -> int:
    """Blocks the cache's live rows need if nothing is shared: sum of ceil(len / block_size)."""
    bs = cache.memory_stats().block_size
    return sum(-(-n // bs) for n in cache.seq_lens() if n is not None)


def dynamic_cache_bytes(cache) -> int:
    """K+V bytes a ``DynamicCache`` holds, summed over its layers."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


@contextlib.contextmanager
def decoder_token_counter(model):
    """Yields a list that gets, per decoder forward, the number of input columns reaching ``model.model``."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        seen.append((ids if ids is not None else embeds).shape[1])

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()
