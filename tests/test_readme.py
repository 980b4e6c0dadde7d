"""The README's Python snippets run as written, in order, in one namespace (as a reader pasting them into one session).

Where a snippet says its model is an example (a line calling ``embedded_model_dir()`` with "example" in its comment),
the suite puts a tiny random-weight model with a byte-level tokenizer in its place, and where the README's line naming
this file gives a ``max_new_tokens=N``, every ``max_new_tokens=`` takes that N, so the snippets run in seconds; nothing
else is changed. A block preceded by ``<!-- not run by the suite: <reason> -->`` is skipped (for code that needs a GPU,
say). Snippets write their files into a temporary directory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_MODEL = "embedded_model_dir()"
SKIP_MARK = "<!-- not run by the suite:"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of every fenced ``python`` block not marked as skipped."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not before.startswith(SKIP_MARK):
            blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


def suite_new_tokens(text: str) -> int | None:
    """The ``max_new_tokens`` the README says the suite runs its snippets with (on the line naming this file)."""
    for line in text.split("\n\n"):
        if "tests/test_readme.py" in line:
            match = re.search(r"max_new_tokens=(\d+)", line)
            return int(match.group(1)) if match else None
    return None


def with_example_model(source: str, name: str) -> str:
    """``source`` with the example model's directory replaced by the variable ``name``, on example lines only."""
    lines = []
    for line in source.split("\n"):
        if EXAMPLE_MODEL in line:
            assert "example" in line, f"this line would load the real embedded model in the suite: {line!r}"
            line = line.replace(EXAMPLE_MODEL, name)
        lines.append(line)
    return "\n".join(lines)


def run_blocks(blocks: list[tuple[int, str]], namespace: dict, name: str = "README.md",
               new_tokens: int | None = None) -> None:
    for line, source in blocks:
        source = with_example_model(source, "_example_model_dir")
        if new_tokens is not None:
            source = re.sub(r"max_new_tokens=\d+", f"max_new_tokens={new_tokens}", source)
        exec(compile(source, f"{name}, block at line {line}", "exec"), namespace)  # noqa: S102 - the README's code


def tiny_model_dir(path: Path) -> Path:
    """A 2-layer random Llama and a byte-level tokenizer (every text tokenizes, no download), saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_readme_python_snippets_run_as_written(tmp_path, monkeypatch):
    text = README.read_text()
    blocks = python_blocks(text)
    assert len(blocks) >= 3, "the README's Quickstart snippets were not found"
    assert sum(EXAMPLE_MODEL in source for _, source in blocks) == 1, "one snippet names the example model"
    model_dir = tiny_model_dir(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__", "_example_model_dir": str(model_dir)}
    new_tokens = suite_new_tokens(text)
    assert new_tokens is not None and new_tokens <= 8, "the README says which max_new_tokens the suite uses"
    run_blocks(blocks, namespace, new_tokens=new_tokens)
    question_len = namespace["question"]["input_ids"].shape[1]
    assert question_len < namespace["out"].shape[1] <= question_len + new_tokens
    assert (tmp_path / "prompt.safetensors").exists()  # the last snippet ran to its end


def test_a_failing_snippet_fails_the_run_naming_its_line(tmp_path):
    """The runner is not lenient: an error in any snippet surfaces with the README line of its block."""
    text = ("intro\n```python\nx = 1\n```\n<!-- not run by the suite: needs a GPU -->\n```python\nraise SystemError\n"
            "```\n```python\nassert x == 2, 'stale snippet'\n```\n")
    blocks = python_blocks(text)
    assert [line for line, _ in blocks] == [3, 10]
    with pytest.raises(AssertionError, match="stale snippet") as err:
        run_blocks(blocks, {}, "FAKE.md")
    assert any(entry.path == "FAKE.md, block at line 10" for entry in err.traceback)
    with pytest.raises(AssertionError, match="would load the real embedded model"):
        with_example_model("path = embedded_model_dir()", "_dir")
