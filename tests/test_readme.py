"""The README's and the documentation pages' Python snippets run as written, in order, one namespace per page (as a
reader pasting a page's snippets into one session); and the README stays an entry page whose facts are generated.

Where a snippet says its model is an example (a line calling ``embedded_model_dir()`` with "example" in its comment),
the suite puts a tiny random-weight model with a byte-level tokenizer in its place, and where the README's line naming
this file gives a ``max_new_tokens=N``, every ``max_new_tokens=`` takes that N, so the snippets run in seconds; nothing
else is changed. A block preceded by ``<!-- not run by the suite: <reason> -->`` is skipped (for code that needs a GPU,
say). Snippets write their files into a temporary directory. A page whose snippets generate must say its
``max_new_tokens=N`` on the line naming this file, as the README does.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
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


@pytest.fixture(scope="module")
def example_model_dir(tmp_path_factory) -> str:
    return str(tiny_model_dir(tmp_path_factory.mktemp("model")))


def run_page(text: str, name: str, model_dir: str) -> dict:
    """Every runnable block of one page, in order, in a fresh namespace; returns the namespace."""
    blocks = python_blocks(text)
    assert sum(EXAMPLE_MODEL in source for _, source in blocks) <= 1, f"{name}: one snippet names the example model"
    new_tokens = suite_new_tokens(text)
    if any("max_new_tokens=" in source for _, source in blocks):
        assert new_tokens is not None and new_tokens <= 8, f"{name} says which max_new_tokens the suite uses"
    namespace = {"__name__": "__readme__", "_example_model_dir": model_dir}
    run_blocks(blocks, namespace, name, new_tokens=new_tokens)
    return namespace


def test_readme_python_snippets_run_as_written(example_model_dir, tmp_path, monkeypatch):
    """The README's quickstarts (generate(), the engine) run as written; the server's client is marked as not run."""
    text = README.read_text()
    blocks = python_blocks(text)
    assert len(blocks) >= 2, "the README's Quickstart snippets were not found"
    assert sum(EXAMPLE_MODEL in source for _, source in blocks) == 1, "one snippet names the example model"
    monkeypatch.chdir(tmp_path)
    namespace = run_page(text, "README.md", example_model_dir)
    new_tokens = suite_new_tokens(text)
    prompt_len = namespace["inputs"]["input_ids"].shape[1]
    assert prompt_len < namespace["out"].shape[1] <= prompt_len + new_tokens
    outputs = namespace["outputs"]  # the engine's results, one per prompt, each finished
    assert len(outputs) == len(namespace["prompts"])
    assert all(0 < len(result.generated_tokens) <= new_tokens for result in outputs.values())


DOC_PAGES = sorted(p for p in DOCS.rglob("*.md") if python_blocks(p.read_text()))


@pytest.mark.parametrize("page", DOC_PAGES, ids=[str(p.relative_to(DOCS)) for p in DOC_PAGES])
def test_docs_python_snippets_run_as_written(page, example_model_dir, tmp_path, monkeypatch):
    """Each documentation page's Python snippets run as written, in a fresh namespace per page."""
    monkeypatch.chdir(tmp_path)
    run_page(page.read_text(), str(page.relative_to(ROOT)), example_model_dir)


def test_the_docs_have_runnable_snippets():
    """The guide's pages are found and run (a broken finder would make the parametrized test above vacuous)."""
    names = {str(p.relative_to(DOCS)) for p in DOC_PAGES}
    assert {"guide/generate.md", "guide/sharing.md", "guide/continuous-batching.md", "design/kernels.md"} <= names


def documented_objects() -> list:
    """The objects the API reference pages document (their ``::: dotted.path`` directives), imported."""
    objects = []
    for page in sorted((DOCS / "api").glob("*.md")):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M):
            module, _, attr = path.rpartition(".")
            try:
                objects.append(importlib.import_module(path))
            except ImportError:
                objects.append(getattr(importlib.import_module(module), attr))
    return objects


def test_the_api_reference_covers_every_public_name():
    """Every name of hf_paged.__all__, hf_paged.ops.__all__, hf_paged.engine.__all__ and hf_paged.serve.__all__ has
    a mkdocstrings entry (compared by identity: an entry under any public path counts)."""
    documented = documented_objects()
    missing = []
    for module_name in ("hf_paged", "hf_paged.ops", "hf_paged.engine", "hf_paged.serve"):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not any(obj is d for d in documented):
                missing.append(f"{module_name}.{name}")
    assert not missing, f"add '::: <path>' entries for these to a page under docs/api/: {missing}"


def _families_script():
    spec = importlib.util.spec_from_file_location("readme_families", ROOT / "scripts" / "readme_families.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_families_table_is_the_generated_one():
    """The README's families table equals the one built from the patch registry (every registered family listed)."""
    families = _families_script()
    table = families.families_table()
    from hf_paged.patches import supported_model_types

    assert all(f"`{model_type}`" in table for model_type in supported_model_types())
    assert families.readme_table(README.read_text()) == table, (
        "README.md's families table is stale: run python scripts/readme_families.py --write")


def test_the_readme_is_an_entry_page():
    """At most 200 lines; its first two commands are make demo and make test; every relative link resolves."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines; move detail to docs/"
    first_block = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands[:2] == ["make demo", "make test"]
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


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
