"""The embedded SmolLM2 for the tests that need a real model: loaded once per process, skipped where absent."""

from __future__ import annotations

import functools

from hf_paged import embedded


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


def chat_inputs(tokenizer, prompts: list[str], system: str | None = None):
    """Left-padded chat-template inputs, one row per prompt (optionally after a system message)."""
    texts = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return tokenizer(texts, return_tensors="pt", padding=True)
