"""TRL's GRPO and RLOO trainers with ``use_transformers_continuous_batching=True`` on a paged model: their rollouts
(``model.generate_batch``, called between training steps) run on hf_paged's engine, kept across steps by
``hf_paged.keep_engine``; at every rollout, greedy generation through that same engine equals transformers' own
``generate_batch`` on a plain copy of the current weights (so no K/V of older weights is reused); training proceeds
(finite losses, weights changed).

A tiny random Llama and a byte-level BPE tokenizer trained here (offline); a toy reward (completion length).
"""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
)

from helpers.engine_shadow import one_thread  # noqa: E402

import hf_paged  # noqa: E402

pytestmark = pytest.mark.slow

CORPUS = ["the cat sat on the mat and looked at the dog", "a dog ran in the park after the ball",
          "count from one to ten and back again", "one two three four five six seven eight"]
PROMPTS = ["the cat sat on the mat and", "a dog ran in the park", "count from one to ten", "one two three four"]
NEW = 8
GREEDY_CB = dict(num_blocks=128, max_batch_tokens=128, page_size=4, auto_switch_to_flash=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of ~300 tokens trained on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=eos, pad_token_id=eos, bos_token_id=eos)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = eos
    return model


class Rollouts:
    """Stands in for ``model.generate_batch`` (hf_paged's, installed by enable_paged_attention): passes TRL's call
    through, then checks greedy generation on the same engine against transformers' own on the current weights."""

    def __init__(self, model, tokenizer):
        self.model, self.inner = model, model.generate_batch
        self.reference = tiny_llama(tokenizer)  # a plain (unpaged) model: transformers' generate_batch runs on it
        self.greedy = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.eos_token_id)
        self.calls: list[tuple[list[list[int]], dict]] = []

    def __call__(self, inputs, **kwargs):
        outputs = self.inner(inputs, **kwargs)
        self.calls.append((inputs, outputs))
        prompts = list(dict.fromkeys(map(tuple, inputs)))  # the distinct prompts, each once
        ours = self.inner([list(p) for p in prompts], generation_config=self.greedy)
        self.reference.load_state_dict(self.model.state_dict())
        theirs = self.reference.generate_batch([list(p) for p in prompts], generation_config=self.greedy,
                                               continuous_batching_config=ContinuousBatchingConfig(**GREEDY_CB))
        assert [o.generated_tokens for o in ours.values()] == [o.generated_tokens for o in theirs.values()]
        return outputs


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trl_rollouts_run_on_hf_paged_engine(kind, tmp_path):
    tokenizer = tiny_tokenizer()
    model = hf_paged.enable_paged_attention(tiny_llama(tokenizer), backend="torch")
    manager = hf_paged.keep_engine(model, pool=hf_paged.BlockPool(4, num_blocks=256, prefix_caching=True),
                                   max_batch_tokens=128)
    rollouts = Rollouts(model, tokenizer)
    model.generate_batch = rollouts  # TRL calls unwrapped_model.generate_batch
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS * 2})

    def reward(completions, **kwargs):
        return [len(c) / 10 for c in completions]

    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=NEW, max_steps=3, learning_rate=1e-2, report_to=[], use_cpu=True,
                  logging_steps=1, save_strategy="no", use_transformers_continuous_batching=True, seed=0,
                  transformers_continuous_batching_config={"page_size": 4}, bf16=False,
                  beta=0.0)  # no reference model (RLOO would load one from the hub)
    if kind == "grpo":
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=trl.GRPOConfig(**common),
                                  train_dataset=dataset, processing_class=tokenizer)
    else:
        trainer = trl.RLOOTrainer(model=model, reward_funcs=reward, args=trl.RLOOConfig(**common),
                                  train_dataset=dataset, processing_class=tokenizer)
    trainer.train()

    assert len(rollouts.calls) == 3  # one rollout per step
    stats = manager.stats()
    sampled = sum(len(o.generated_tokens) for _, outs in rollouts.calls for o in outs.values())
    assert sampled > 0 and stats.generated_tokens >= sampled  # (plus the greedy checks')
    assert stats.prefix_hit_tokens > 0  # the num_generations copies of a prompt share its blocks
    for inputs, outputs in rollouts.calls:
        assert len(outputs) == len(inputs) and all(o.error is None for o in outputs.values())
        assert [o.prompt_ids for o in outputs.values()] == [list(p) for p in inputs]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())
    model.generate_batch = rollouts.inner
    hf_paged.disable_paged_attention(model)
