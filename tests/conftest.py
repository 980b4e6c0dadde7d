"""Test setup: the Triton interpreter where there is no CUDA device, quiet deprecations, the tiny-model fixtures.

Helpers (models, inputs, the float64 oracle) live in ``tests/helpers``: ``from helpers import tiny_model, generate``.
"""

from __future__ import annotations

import os
import warnings

import torch

if not torch.cuda.is_available():  # the Triton kernels run in the CPU interpreter; on a GPU they run for real
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import tiny_model  # noqa: E402

warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture
def mistral():
    return tiny_model("mistral", sliding_window=6)
