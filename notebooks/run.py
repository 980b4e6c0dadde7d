"""Executes the notebooks in this folder from their sources and stores them with their outputs.

    python notebooks/run.py                      # execute every notebook (quick mode, as CI runs them) and store it
    python notebooks/run.py 02_memory_anatomy    # only the named ones
    python notebooks/run.py --check              # exit 1 if a stored notebook's cells differ from its source

Each notebook's source is ``NN_name.py``, a jupytext percent-format script (``# %%`` starts a code cell,
``# %% [markdown]`` a markdown cell written as ``# `` comment lines): edit it, never the ``.ipynb``. Adding a notebook
is adding its ``NN_name.py`` and running this script on it. Notebooks execute in a fresh kernel on this Python, with
``notebooks/`` as the working directory and ``HF_PAGED_NB_QUICK=1`` (fewer prompts, tokens and requests: each runs in
well under a minute on a CPU), and are written to ``NN_name.ipynb`` only if no cell failed, warned or stored an
oversized plot. Stored outputs carry no timing metadata and no run-specific kernel information, so rerunning on the
same versions changes only what a cell prints that varies (timings). tests/test_notebooks.py checks that the stored
cells are their source's, that every cell that prints or plots has its output, and that re-executing gives the same
kinds of outputs. Jupyter with jupytext installed opens either file and keeps the pair in step (pyproject.toml's
``[tool.jupytext]``).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 600
MAX_PNG_BYTES = 60_000  # per plot stored in a notebook: keep the repository light
METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


@dataclass(frozen=True)
class Notebook:
    """One notebook: its percent-format source ``NN_name.py`` and the executed ``NN_name.ipynb`` stored beside it."""

    source: Path

    @property
    def name(self) -> str:
        return self.source.with_suffix(".ipynb").name

    @property
    def path(self) -> Path:
        return self.source.with_suffix(".ipynb")

    @property
    def needs_model(self) -> bool:
        """Whether it loads the embedded model (CI skips executing it where that is not installed)."""
        return "embedded_model_dir(" in self.source.read_text(encoding="utf-8")


NOTEBOOKS = [Notebook(path) for path in sorted(HERE.glob("[0-9][0-9]_*.py"))]


def build(notebook: Notebook) -> nbformat.NotebookNode:
    """The notebook its source describes, with stable cell ids (rebuilding changes nothing) and no outputs."""
    nb = jupytext.read(notebook.source, fmt="py:percent")
    stem = notebook.name.split("_")[0]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"nb{stem}-{i:02d}"
        cell.metadata = nbformat.NotebookNode()
    nb.metadata = nbformat.from_dict(METADATA)
    nbformat.validate(nb)
    return nb


def cells_of(nb) -> list[tuple[str, str, str]]:
    """What the source decides: each cell's type, id and text (outputs and counters aside)."""
    return [(cell.cell_type, cell.get("id", ""), cell.source) for cell in nb.cells]


def execute(nb: nbformat.NotebookNode, quick: bool = True) -> nbformat.NotebookNode:
    """Run ``nb`` top to bottom in a fresh kernel on this Python, with ``notebooks/`` as working directory.

    Raises nbclient's CellExecutionError (cell and traceback) on the first error. Outputs keep no timing metadata and
    the notebook keeps METADATA, so a rerun on the same versions stores the same bytes wherever nothing printed varies.
    """
    import nbclient
    from ipykernel.kernelspec import get_kernel_dict
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import AsyncKernelManager

    class ThisPythonKernelManager(AsyncKernelManager):
        """``sys.executable -m ipykernel_launcher`` whatever kernel the notebook names (not a registered one)."""

        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(**get_kernel_dict())

    env = {
        "HF_PAGED_NB_QUICK": "1" if quick else "0",
        # One intra-op thread unless told otherwise: on a busy shared CPU, OpenMP threads waiting on each other made
        # the same notebook 3-10x slower and its runtime erratic.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    saved = {key: os.environ.get(key) for key in [*env, "MPLBACKEND"]}
    os.environ.update(env)
    os.environ.pop("MPLBACKEND", None)  # let ipykernel choose the inline backend: plots become outputs
    try:
        client = nbclient.NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", kernel_manager_class=ThisPythonKernelManager,
            resources={"metadata": {"path": str(HERE)}}, record_timing=False, coalesce_streams=True,
        )
        client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    nb.metadata = nbformat.from_dict(METADATA)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def output_kinds(cell) -> list[str]:
    """A code cell's outputs as kinds (``stream:stdout``, ``display_data:image/png+text/plain``, ...): what a rerun
    must reproduce, whatever the numbers in them."""
    kinds = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            kind = f"stream:{output.name}"
        elif output.output_type == "error":
            kind = f"error:{output.ename}"
        else:
            kind = f"{output.output_type}:{'+'.join(sorted(output.get('data', {})))}"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def problems_in_outputs(nb) -> list[str]:
    """What must not be stored: errors, warnings printed to stderr, oversized plots."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                found.append(f"cell {i}: error {output.ename}")
            elif output.output_type == "stream" and output.name == "stderr":
                found.append(f"cell {i}: stderr {output.text[:200]!r}")
            png = output.get("data", {}).get("image/png")
            if png and len(base64.b64decode(png)) > MAX_PNG_BYTES:
                found.append(f"cell {i}: a {len(base64.b64decode(png)):,}-byte PNG (limit {MAX_PNG_BYTES:,})")
    return found


def write(nb, path: Path) -> None:
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to run (default: all), e.g. 02_memory_anatomy")
    parser.add_argument("--check", action="store_true", help="compare the stored cells with the sources, write nothing")
    parser.add_argument("--full", action="store_true", help="execute with the full settings, not the quick ones")
    args = parser.parse_args(argv)
    chosen = [n for n in NOTEBOOKS if not args.names
              or any(n.name.startswith(name.removesuffix(".ipynb").removesuffix(".py")) for name in args.names)]
    if args.names and not chosen:
        parser.error(f"no notebook named {args.names}; have {[n.source.name for n in NOTEBOOKS]}")

    if args.check:
        stale = [n.name for n in chosen
                 if not n.path.exists() or cells_of(build(n)) != cells_of(nbformat.read(n.path, as_version=4))]
        orphans = sorted({p.name for p in HERE.glob("*.ipynb")} - {n.name for n in NOTEBOOKS})
        if stale:
            print(f"out of date with their .py sources: {', '.join(stale)}; run python notebooks/run.py "
                  f"{' '.join(n.removesuffix('.ipynb') for n in stale)}", file=sys.stderr)
        if orphans:
            print(f"stored without a .py source: {', '.join(orphans)}; write its NN_name.py (jupytext --to py:percent "
                  "NN_name.ipynb) or delete it", file=sys.stderr)
        return 1 if stale or orphans else 0

    failed = 0
    for notebook in chosen:
        print(f"executing {notebook.source.name} ...", flush=True)
        nb = execute(build(notebook), quick=not args.full)
        problems = problems_in_outputs(nb)
        if problems:
            failed += 1
            print(f"{notebook.name} not written:\n  " + "\n  ".join(problems), file=sys.stderr)
            continue
        write(nb, notebook.path)
        print(f"wrote {notebook.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
