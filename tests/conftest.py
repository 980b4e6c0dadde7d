"""Tiny random-weight Llama/Mistral models and helpers shared by the tests."""

from __future__ import annotations

import os
import warnings

import torch

if not torch.cuda.is_available():  # the Triton kernels run in the CPU interpreter; on a GPU they run for real
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from hf_paged import compat

warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2
# GPU-relevant tests (the Triton backend) put their models here; the rest stay on the CPU.
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def tiny_config(kind: str = "llama", **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    common.update(overrides)
    if kind == "llama":
        return LlamaConfig(**common)
    common.setdefault("sliding_window", None)
    return MistralConfig(**common)


def tiny_model(kind: str = "llama", seed: int = 0, attn: str = "sdpa", device="cpu", **overrides):
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    config._attn_implementation = attn
    cls = LlamaForCausalLM if kind == "llama" else MistralForCausalLM
    model = cls(config).eval().to(device)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def left_padded(lengths: list[int], seed: int = 0):
    """input_ids/attention_mask for prompts of the given lengths, left-padded; no special tokens inside."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, inputs, cache, **kwargs):
    """model.generate() with ``cache`` under the installed transformers' keyword; inputs go to the model's device."""
    kwargs.setdefault("max_new_tokens", 12)
    kwargs.setdefault("do_sample", False)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    return model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: cache}, **kwargs)


def ones_mask(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def early_eos_model():
    """A tiny model plus inputs where row 0 emits EOS at its third new token and the other rows run on."""
    model = tiny_model("llama", seed=1)
    inputs = left_padded([6, 9, 4], seed=5)
    model.generation_config.eos_token_id = None
    free_run = generate(model, inputs, dynamic(model), max_new_tokens=14)
    width = inputs["input_ids"].shape[1]
    first = free_run[0, width + 2].item()  # row 0's third new token becomes "EOS"
    if (free_run[1:, width:width + 3] == first).any():
        pytest.skip("the chosen EOS token also ends another row early with this seed")
    model.generation_config.eos_token_id = first
    return model, inputs


def live_blocks_expected(cache) -> int:
    """Blocks the cache's live rows need if nothing is shared: sum of ceil(len / block_size)."""
    bs = cache.memory_stats().block_size
    return sum(-(-n // bs) for n in cache.seq_lens() if n is not None)


def dynamic(model):
    return DynamicCache(config=model.config)


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture
def mistral():
    return tiny_model("mistral", sliding_window=6)
