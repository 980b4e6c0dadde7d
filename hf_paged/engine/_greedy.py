"""Stand-in for ``sampling.py`` until the sampler lands: greedy decoding only, same interface (SAMPLING.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int = 16
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    num_return_sequences: int = 1

    @classmethod
    def from_generation_config(cls, config=None, *, prompt_length=None, **overrides):
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("do_sample") or (config is not None and getattr(config, "do_sample", False)
                                      and given.get("do_sample") is None):
            raise ValueError("do_sample=True: sampling is not available in this build yet; use greedy decoding.")
        max_new = given.get("max_new_tokens", getattr(config, "max_new_tokens", None) if config is not None else None)
        eos = given.get("eos_token_id", getattr(config, "eos_token_id", None) if config is not None else None)
        eos = () if eos is None else tuple([eos] if isinstance(eos, int) else eos)
        eos += tuple(given.get("stop_token_ids", ()))
        return cls(max_new_tokens=max_new or 16, eos_token_ids=eos, seed=given.get("seed"),
                   logprobs=given.get("logprobs"))


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list | None = None
    top_logprobs: list | None = None


class Sampler:
    def __init__(self, device=None):
        self.device = device

    def new_generator(self, params, index: int = 0, device=None):
        return None

    def __call__(self, logits: torch.Tensor, params, generators, histories) -> SampleResult:
        return SampleResult(logits.argmax(-1).tolist())
