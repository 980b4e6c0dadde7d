"""Test setup: the Triton interpreter where there is no CUDA device, a compile cache of the run's own, quiet
deprecations, the tiny-model fixtures.

Helpers (models, inputs, the float64 oracle) live in ``tests/helpers``: ``from helpers import tiny_model, generate``.
"""

from __future__ import annotations

import os
import tempfile
import warnings

# torch.compile's on-disk cache is per user, shared by every checkout on the machine: an artifact compiled for
# another version of hf_paged was seen to abort a compiled decode step here. Each run compiles into its own.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="hf_paged_tests_inductor_"))

import torch  # noqa: E402

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
