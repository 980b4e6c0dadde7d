"""generate() keywords that reach the attention function without changing attention (transformers forwards its
model kwargs there: ``tokenizer=`` for stop strings, ``assistant_tokenizer=``, a model's custom kwargs) pass through
the paged path untouched, equal to DynamicCache; an argument that does change attention is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from helpers import dynamic, generate, left_padded, require_smollm, tiny_model
from hf_paged import PagedCache, embedded, enable_paged_attention
from hf_paged.attention import REFUSED_ATTENTION_KWARGS

require_smollm()


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.flatten().tolist())

    def end(self):
        self.tokens.append("end")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(embedded.local_model_dir())
    model = tiny_model("llama", seed=3, vocab_size=len(tokenizer))
    return enable_paged_attention(model), tokenizer


def test_stop_strings_with_tokenizer_equal_dynamic_cache(model_and_tokenizer):
    """``stop_strings`` needs ``tokenizer=``, which generate() forwards to every layer's attention; the stop string
    is a piece of the unstopped reference's text, so stopping happens mid-way on both caches."""
    model, tokenizer = model_and_tokenizer
    inputs = left_padded([7], seed=1)
    full = generate(model, inputs, dynamic(model), max_new_tokens=16)
    stop = tokenizer.decode(full[0, inputs["input_ids"].shape[1] + 5:][:1])
    expected = generate(model, inputs, dynamic(model), max_new_tokens=16, stop_strings=[stop], tokenizer=tokenizer)
    got = generate(model, inputs, PagedCache(model.config), max_new_tokens=16, stop_strings=[stop],
                   tokenizer=tokenizer)
    assert expected.shape[1] < full.shape[1]  # the stop string stopped it
    assert torch.equal(got, expected)


def test_streamer_and_tokenizers_and_custom_kwargs_equal_dynamic_cache(model_and_tokenizer):
    """A streamer sees the same tokens; ``assistant_tokenizer`` / ``tokenizer`` without an assistant model and a
    keyword the model's forward takes and ignores (``num_items_in_batch``, a loss argument) reach the attention
    untouched."""
    model, tokenizer = model_and_tokenizer
    inputs = left_padded([9, 4], seed=2)
    extra = dict(tokenizer=tokenizer, assistant_tokenizer=tokenizer, num_items_in_batch=torch.tensor(3))
    streams = {}
    outputs = {}
    for name, cache in (("dynamic", dynamic(model)), ("paged", PagedCache(model.config))):
        streams[name] = Collect()
        single = {k: v[:1] for k, v in inputs.items()}  # streamers take one row
        outputs[name] = (generate(model, single, cache, streamer=streams[name]),
                         generate(model, inputs, dynamic(model) if name == "dynamic" else PagedCache(model.config),
                                  **extra))
    assert streams["paged"].tokens == streams["dynamic"].tokens
    assert all(torch.equal(a, b) for a, b in zip(outputs["paged"], outputs["dynamic"]))


def test_an_argument_that_changes_attention_is_refused_by_name():
    """``position_bias`` (a bias added to the scores) is one of the documented refused arguments."""
    assert "position_bias" in REFUSED_ATTENTION_KWARGS
    model = enable_paged_attention(tiny_model("llama"))
    inputs = left_padded([5], seed=0)
    with pytest.raises(ValueError, match="position_bias"):
        generate(model, inputs, PagedCache(model.config), max_new_tokens=3, position_bias=torch.zeros(1))
