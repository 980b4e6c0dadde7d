"""A progress bar for generate(), as a stopping criterion that never stops."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria


class GenerationProgress(StoppingCriteria):
    """``generate(..., stopping_criteria=[GenerationProgress(max_new_tokens, "label")])`` shows a tqdm bar."""

    def __init__(self, total: int, desc: str = "generate", disable: bool | None = None):
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, disable=disable)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self) -> None:
        self.bar.close()
