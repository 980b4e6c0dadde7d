"""The notebooks are stored executed, written as user code, and re-executing them gives what is stored.

Each notebook's source is ``notebooks/NN_name.py`` (jupytext percent format); ``notebooks/run.py`` executes it and
stores ``NN_name.ipynb`` with its outputs (quick mode, ``HF_PAGED_NB_QUICK=1``, as here). The static checks read the
stored files: cells equal to their source's, every cell that prints or plots stored with its output, no private
``hf_paged`` module imported. The execution tests run each notebook in a fresh kernel on this Python and compare the
outputs' kinds cell by cell with the stored ones (numbers vary, kinds must not), then check what each one claims.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: pip install -e '.[notebooks]'")
pytest.importorskip("nbclient", reason="nbclient is not installed: pip install -e '.[notebooks]'")
pytest.importorskip("ipykernel", reason="ipykernel is not installed: pip install -e '.[notebooks]'")
pytest.importorskip("jupytext", reason="jupytext is not installed: pip install -e '.[notebooks]'")

import hf_paged  # noqa: E402
from hf_paged import embedded  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_run", NOTEBOOKS / "run.py")
run = sys.modules["notebook_run"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)

PUBLIC_MODULES = {"hf_paged", "hf_paged.ops"}
PUBLIC_NAMES = set(hf_paged.__all__) | {"__version__"}


def _embedded_model_missing() -> str | None:
    if (embedded.cache_dir() / "config.json").exists():
        return None
    try:
        embedded.gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


MODEL_MISSING = _embedded_model_missing()


# ------------------------------------------------------------------------------------------------ static checks
def _tree(cell) -> ast.Module:
    lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]  # IPython magics
    return ast.parse("\n".join(lines))


def _name(func) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _plots(name: str) -> bool:
    return name == "show" or name.startswith("plot_")


def expected_outputs(cell) -> set[str]:
    """``"text"`` if the cell prints, displays or ends in a value (a name, attribute, subscript...: not a call, which
    may return None); ``"image"`` if it plots (``plt.show()``, ``plot_*()``)."""
    tree = _tree(cell)
    called = {_name(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    expected = {"text"} if {"print", "display"} & called else set()
    last = tree.body[-1] if tree.body else None
    if (isinstance(last, ast.Expr) and not isinstance(last.value, (ast.Call, ast.Constant))
            and not cell.source.rstrip().endswith(";")):
        expected.add("text")
    if any(_plots(name) for name in called):
        expected.add("image")
    return expected


def missing_outputs(nb) -> list[str]:
    """Code cells that should print or plot, stored without that output."""
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        has_text = any(o.output_type == "stream" and o.name == "stdout" or "text/plain" in o.get("data", {})
                       for o in outputs)
        has_image = any("image/png" in o.get("data", {}) for o in outputs)
        expected = expected_outputs(cell)
        if "text" in expected and not has_text:
            missing.append(f"cell {i} prints but has no output: {cell.source.splitlines()[0]!r}")
        if "image" in expected and not has_image:
            missing.append(f"cell {i} plots but has no image: {cell.source.splitlines()[0]!r}")
    return missing


def private_imports(nb) -> list[str]:
    """Uses of ``hf_paged`` beyond its public API: ``hf_paged`` (names in ``__all__``) and ``hf_paged.ops``."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for node in ast.walk(_tree(cell)):
            if isinstance(node, ast.Import):
                found += [f"cell {i}: import {a.name}" for a in node.names
                          if a.name.startswith("hf_paged.") and a.name not in PUBLIC_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_paged":
                if node.module not in PUBLIC_MODULES:
                    found.append(f"cell {i}: from {node.module} import ...")
                elif node.module == "hf_paged":
                    found += [f"cell {i}: from hf_paged import {a.name}" for a in node.names
                              if a.name not in PUBLIC_NAMES]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "hf_paged" and node.attr not in PUBLIC_NAMES):
                found.append(f"cell {i}: hf_paged.{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"hf_paged\.\w+(\.\w+)*", node.value) and node.value not in PUBLIC_MODULES:
                found.append(f"cell {i}: {node.value!r}")  # importlib.import_module("hf_paged.compat")
    return found


def stored(notebook) -> nbformat.NotebookNode:
    return nbformat.read(notebook.path, as_version=4)


EACH = pytest.mark.parametrize("notebook", run.NOTEBOOKS, ids=[n.source.stem for n in run.NOTEBOOKS])


def test_stored_cells_are_their_sources(capsys):
    assert len(run.NOTEBOOKS) >= 8
    assert run.main(["--check"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(n.name for n in run.NOTEBOOKS)


def test_check_sees_an_edited_source(tmp_path, monkeypatch, capsys):
    """``run.py --check`` fails when a source no longer matches its stored notebook, naming the notebook."""
    source = tmp_path / run.NOTEBOOKS[0].source.name
    source.write_text(run.NOTEBOOKS[0].source.read_text(encoding="utf-8") + "\n# %%\nprint('a new cell')\n")
    (tmp_path / run.NOTEBOOKS[0].name).write_bytes(run.NOTEBOOKS[0].path.read_bytes())
    monkeypatch.setattr(run, "HERE", tmp_path)
    monkeypatch.setattr(run, "NOTEBOOKS", [run.Notebook(source)])
    assert run.main(["--check"]) == 1
    assert run.NOTEBOOKS[0].name in capsys.readouterr().err


@EACH
def test_stored_with_outputs(notebook):
    nb = stored(notebook)
    assert missing_outputs(nb) == []
    assert run.problems_in_outputs(nb) == []
    assert nb.metadata == run.METADATA, "run-specific notebook metadata stored: rerun notebooks/run.py"
    assert not any("execution" in cell.metadata for cell in nb.cells), "timing metadata stored"
    counts = [cell.execution_count for cell in nb.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), "not executed top to bottom in one go"


@EACH
def test_only_public_api(notebook):
    assert private_imports(stored(notebook)) == []


def test_checks_see_a_stripped_notebook_and_private_imports():
    nb = stored(run.NOTEBOOKS[1])  # 02: prints and plots
    printing = [c for c in nb.cells if c.cell_type == "code" and expected_outputs(c)]
    assert any("image" in expected_outputs(c) for c in printing) and missing_outputs(nb) == []
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    assert len(missing_outputs(nb)) >= len(printing)

    cell = nbformat.v4.new_code_cell
    public = nbformat.v4.new_notebook(cells=[cell(
        "import hf_paged\nimport hf_paged.ops\nfrom hf_paged import PagedCache, ops\nfrom hf_paged.ops import "
        "paged_attention\nprint(hf_paged.__version__, hf_paged.PagedCache)")])
    assert private_imports(public) == []
    for source in ["from hf_paged.compat import GENERATE_CACHE_KWARG", "from hf_paged import embedded",
                   "import hf_paged.report", "import hf_paged\nhf_paged.tools.simulate.sample_workload",
                   "%time x = 1\nimport importlib\nimportlib.import_module('hf_paged.compat')"]:
        assert private_imports(nbformat.v4.new_notebook(cells=[cell(source)])), source


# ---------------------------------------------------------------------------------------------- execution checks
def text_of(nb) -> str:
    return "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     for cell in nb.cells for o in cell.get("outputs", []))


def images_in(nb) -> int:
    return sum("image/png" in o.get("data", {}) for cell in nb.cells for o in cell.get("outputs", []))


def claims_quickstart(nb):
    text = text_of(nb)
    assert "tokens identical to DynamicCache: True" in text
    assert "peak_blocks_in_use" in text and "PagedCache, peak in use" in text


def claims_memory_anatomy(nb):
    text = text_of(nb)
    assert re.search(r"^ +1 +\d+ +\d+ +\d+ +\d+ +\[", text, re.M), "no block table row printed"
    assert re.search(r"^ +0 +\d+ +\d+ +released", text, re.M), "the row that finished early was not released"
    paged_waste = float(re.search(r"PagedCache \(block 16.*? ([0-9.]+)%$", text, re.M).group(1))
    dynamic_waste = float(re.search(r"DynamicCache \(padded.*? ([0-9.]+)%$", text, re.M).group(1))
    assert paged_waste < 10 < dynamic_waste
    assert re.search(r"paged, block 16 *: [0-3]\.\d%", text), "paged waste at block 16 is not under 4%"
    assert re.search(r"request \d+: \d+ tokens in physical blocks \[", text)
    assert images_in(nb) >= 3, "the three plots were not displayed inline"


def claims_sharing(nb):
    text = text_of(nb)
    ratios = [float(r) for r in re.findall(r"sharing ratio \(peak / unshared\) ([0-9.]+)", text)]
    assert len(ratios) == 2 and all(r < 1 for r in ratios), ratios
    assert "forking copied nothing" in text
    assert "every fork's tokens identical to DynamicCache" in text


def claims_kernels(nb):
    text = text_of(nb)
    assert re.search(r"all \d+ comparisons within bounds", text)
    assert "prefill + extend" in text
    assert "GPU figures are not measured here" in text or "Decode" in text


def claims_compiled_decoding(nb):
    text = text_of(nb)
    assert re.search(r"^(quick|full) mode: torch.compile backend", text, re.M)
    seconds = {}
    for label in ("compiled, 1st", "compiled, 2nd", "compiled, 3rd", "eager \\(disable_compile\\)"):
        match = re.search(rf"^{label}.*? ([0-9.]+) +True$", text, re.M)
        assert match, f"{label}: no timing, or tokens differ from DynamicCache"
        seconds[label] = float(match.group(1))
    assert seconds["compiled, 1st"] > 2 * max(seconds["compiled, 2nd"], seconds["compiled, 3rd"]), seconds
    assert "compiled decoding needs a KV pool of fixed size" in text
    assert "ran eagerly in" in text and text.rstrip().endswith("tokens equal to DynamicCache: True")


def claims_model_families(nb):
    text = text_of(nb)
    assert re.search(r"^gpt_oss +patch +sliding_window, layer_windows, sinks +verified", text, re.M)
    rows = dict(re.findall(r"^(qwen2|gemma2|gemma3_text|gpt_oss) +(.*)$", text, re.M))
    assert set(rows) == {"qwen2", "gemma2", "gemma3_text", "gpt_oss"}, rows
    assert all(row.endswith("True") and re.search(r"\b8: \d+", row) and "full: " in row for row in rows.values()), rows
    assert rows["gemma2"].split()[0] == "1.0" and rows["gpt_oss"].split()[1] == "yes"
    assert "hybrid model, tokens equal to DynamicCache: True" in text
    groups = re.findall(r"^\d +(32|full) +\d+ +([0-9.]+)$", text, re.M)
    assert [w for w, _ in groups].count("32") == 5 and [w for w, _ in groups].count("full") == 1, groups
    kb = {label: float(v) for label, v in re.findall(r"^((?:Paged|Dynamic)Cache, [\w ]+?) +([0-9.]+) KB", text, re.M)}
    assert abs(sum(float(v) for _, v in groups) - kb["PagedCache, hybrid"]) < 0.5, (groups, kb)
    full = kb["PagedCache, every layer full"]
    assert kb["PagedCache, hybrid"] < full / 2 and kb["DynamicCache, hybrid"] < full / 2, kb
    assert images_in(nb) >= 1


def claims_prefix_caching(nb):
    text = text_of(nb)
    (prompt_1, computed_1), (prompt_2, computed_2) = [
        tuple(map(int, m)) for m in re.findall(r"^[12] +(\d+) +(\d+) +True$", text, re.M)]
    assert computed_1 == prompt_1 and computed_2 < prompt_2 // 4
    hits = int(re.search(r"prefix_hit_tokens (\d+)", text).group(1))
    assert hits > 0 and hits % 16 == 0 and computed_2 == prompt_2 - hits
    assert int(re.search(r"blocks_cached (\d+)", text).group(1)) > 0
    assert float(re.search(r"second / first: ([0-9.]+)x", text).group(1)) < 1
    questions = re.findall(r"question \d: (\d+) prompt tokens computed, tokens equal to DynamicCache True", text)
    assert len(questions) == 2 and all(int(n) < 32 for n in questions)
    assert re.search(r"continued from disk: \d+ prompt tokens computed; .*: True", text)


def claims_fp8_blocks(nb):
    text = text_of(nb)
    per_token = dict(re.findall(r"^(float32|float8_e4m3fn) +[0-9.]+ +([0-9,]+)$", text, re.M))
    # a quarter of float32, plus 2 bytes of scale per 64 fp8 bytes (SmolLM2's head size)
    assert int(per_token["float8_e4m3fn"].replace(",", "")) * 4 * 32 == int(per_token["float32"].replace(",", "")) * 33
    assert abs(float(re.search(r"perplexity ([+-][0-9.]+)%", text).group(1))) < 5
    same, rows = map(int, re.search(r"rows identical: (\d+) of (\d+)", text).groups())
    assert 1 <= same <= rows
    capacity = re.findall(r"^\d+[MG]iB +([0-9,]+) +([0-9,]+)$", text, re.M)
    assert len(capacity) == 4 and all(int(b.replace(",", "")) * 33 >= 4 * 32 * int(a.replace(",", "")) - 16 * 33
                                      for a, b in capacity)
    blocks = int(re.search(r"kv_dtype=float8_e4m3fn\): a cap of (\d+) blocks", text).group(1))
    assert 0 < int(capacity[0][1].replace(",", "")) // 16 - blocks <= 1  # the scratch block
    assert images_in(nb) >= 1


def claims_continuous_batching(nb):
    text = text_of(nb)
    used, size = map(int, re.search(r"most blocks in use: (\d+) of (\d+)", text).groups())
    assert 0 < used <= size
    assert re.search(r"at the end: 0 in use", text), "blocks still in use after every request ended"
    assert int(re.search(r"most running at once: (\d+)", text).group(1)) > 1
    assert "tokens equal to generate() alone: True" in text
    assert re.search(r"same seed among \d+ other requests, same tokens: True", text)
    assert len(re.findall(r"logprob +-?[0-9.]+ +top 2: ", text)) == 8
    assert images_in(nb) >= 1


def claims_images(nb):
    text = text_of(nb)
    assert len(re.findall(r"equal to generate\(\) alone: True", text)) == 7
    assert "different pictures, different answers: True" in text
    hits = {label: (int(hit), int(runs)) for label, hit, runs in re.findall(
        r"^(picture 1 again|picture 1|picture 2) +prompt \d+ tokens, from the prefix cache +(\d+), vision encoder "
        r"runs (\d+)", text, re.M)}
    assert hits["picture 1"] == (0, 1) and hits["picture 1 again"][1] == 0 and hits["picture 2"][1] == 1
    assert hits["picture 1 again"][0] > hits["picture 2"][0] > 0


CLAIMS = {
    "01_quickstart.ipynb": claims_quickstart,
    "02_memory_anatomy.ipynb": claims_memory_anatomy,
    "03_sharing.ipynb": claims_sharing,
    "04_kernels.ipynb": claims_kernels,
    "05_compiled_decoding.ipynb": claims_compiled_decoding,
    "06_model_families.ipynb": claims_model_families,
    "07_prefix_caching_and_disk.ipynb": claims_prefix_caching,
    "08_fp8_blocks.ipynb": claims_fp8_blocks,
    "09_continuous_batching.ipynb": claims_continuous_batching,
    "10_images.ipynb": claims_images,
}


@pytest.mark.slow  # each notebook end to end (3 minutes for all): `make test-slow`, run by CI
@EACH
def test_rerun_gives_the_stored_outputs(notebook):
    if notebook.needs_model and MODEL_MISSING:
        pytest.skip(MODEL_MISSING)
    fresh = run.execute(run.build(notebook))  # raises with the failing cell and its traceback
    old = stored(notebook)
    assert run.cells_of(fresh) == run.cells_of(old)
    for i, (new_cell, old_cell) in enumerate(zip(fresh.cells, old.cells)):
        assert run.output_kinds(new_cell) == run.output_kinds(old_cell), (
            f"cell {i} of {notebook.name}: outputs differ in kind from the stored ones; rerun "
            f"python notebooks/run.py {notebook.source.stem}")
    assert run.problems_in_outputs(fresh) == []
    CLAIMS.get(notebook.name, lambda nb: None)(fresh)
