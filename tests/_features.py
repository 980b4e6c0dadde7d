"""Helpers shared by the feature tests (test_compile, test_reuse, test_fp8, test_hybrid)."""

from __future__ import annotations

import contextlib
import functools

import torch

from hf_paged import compat, embedded


@functools.cache
def smollm():
    """``(model, tokenizer)`` of the embedded SmolLM2, loaded once per test process; callers leave it unpatched."""
    return embedded.load()


def require_smollm():
    """Skip the calling module when the embedded model is not installed."""
    import pytest

    try:
        embedded.gguf_path()
    except FileNotFoundError as exc:  # pragma: no cover - the test setup installs it
        pytest.skip(str(exc), allow_module_level=True)


def forward(model, input_ids, cache, **kwargs):
    """One manual forward ``model(input_ids=..., cache=cache)`` under the installed transformers' keyword."""
    with torch.no_grad():
        return model(input_ids=input_ids, **{compat.FORWARD_CACHE_KWARG: cache}, **kwargs)


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


def dynamic_cache_bytes(cache) -> int:
    """K+V bytes a ``DynamicCache`` holds, summed over its layers."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def chat_inputs(tokenizer, prompts: list[str], system: str | None = None):
    """Left-padded chat-template inputs, one row per prompt (optionally after a system message)."""
    texts = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return tokenizer(texts, return_tensors="pt", padding=True)
