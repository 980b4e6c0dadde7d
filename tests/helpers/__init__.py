"""Helpers shared by the tests and the notebooks: tiny models, inputs, generate() under the installed transformers'
keyword, the embedded SmolLM2, and the float64 oracle for paged attention with its scrambled-table cases.

Tests import them as ``from helpers import tiny_model, generate`` (pytest puts ``tests/`` on ``sys.path``: the
``pythonpath`` setting in pyproject.toml); a notebook adds ``../tests`` to ``sys.path`` first.
"""

from .attention import attention_float64, on_backend, scrambled_case
from .generation import (
    decoder_token_counter, dynamic, dynamic_cache_bytes, early_eos_model, forward, generate, left_padded,
    live_blocks_expected, ones_mask,
)
from .models import (
    BOS, DEVICE, EOS, FAMILIES, FAMILY_WINDOW, GENERIC_FAMILIES, LLAMA4_CHUNK, PAD, SLIDING_THEN_FULL, TINY_SHAPE,
    VOCAB, tiny_config,
    tiny_family_config, tiny_family_model, tiny_model,
)
from .smollm import chat_inputs, require_smollm, smollm

__all__ = [
    "BOS", "DEVICE", "EOS", "FAMILIES", "FAMILY_WINDOW", "GENERIC_FAMILIES", "LLAMA4_CHUNK", "PAD", "SLIDING_THEN_FULL", "TINY_SHAPE", "VOCAB",
    "attention_float64", "chat_inputs", "on_backend", "decoder_token_counter", "dynamic", "dynamic_cache_bytes", "early_eos_model",
    "forward", "generate", "left_padded", "live_blocks_expected", "ones_mask", "require_smollm", "scrambled_case",
    "smollm", "tiny_config", "tiny_family_config", "tiny_family_model", "tiny_model",
]
