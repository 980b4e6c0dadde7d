"""The notebooks run top to bottom with small settings (HF_PAGED_NB_QUICK=1) and show what they claim.

Each notebook executes in a fresh ipykernel started on the Python running the tests (not whatever a registered
``python3`` kernel spec points at), with ``notebooks/`` as its working directory. The stored notebooks must be what
``notebooks/build.py`` writes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: pip install -e '.[notebooks]'")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: pip install -e '.[notebooks]'")
pytest.importorskip("ipykernel", reason="ipykernel is not installed: pip install -e '.[notebooks]'")

from ipykernel.kernelspec import get_kernel_dict  # noqa: E402
from jupyter_client.kernelspec import KernelSpec  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from hf_paged import embedded  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 600


class ThisPythonKernelManager(AsyncKernelManager):
    """Starts ``sys.executable -m ipykernel_launcher`` whatever kernel name the notebook asks for."""

    @property
    def kernel_spec(self) -> KernelSpec:
        return KernelSpec(**get_kernel_dict())


def _embedded_model_missing() -> str | None:
    if (embedded.cache_dir() / "config.json").exists():
        return None
    try:
        embedded.gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


# Notebooks 01-03 run the embedded SmolLM2; test_embedded.py skips the same way when it is not installed.
MODEL_MISSING = _embedded_model_missing()
needs_model = pytest.mark.skipif(MODEL_MISSING is not None, reason=str(MODEL_MISSING))


def execute(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", kernel_manager_class=ThisPythonKernelManager,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on the first error
    return nb


def text_of(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def images_in(nb) -> int:
    return sum("image/png" in output.get("data", {}) for cell in nb.cells for output in cell.get("outputs", []))


@pytest.fixture
def quick_env(monkeypatch):
    monkeypatch.setenv("HF_PAGED_NB_QUICK", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # let ipykernel choose the inline backend: plots become outputs
    # One intra-op thread unless told otherwise: on a busy shared CPU, OpenMP threads waiting on each other made the
    # same notebook 3-10x slower and its runtime erratic; alone on a machine, one thread costs far less than that.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def test_notebooks_match_build_script():
    result = subprocess.run([sys.executable, str(NOTEBOOKS / "build.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert not any(cell.get("outputs") for cell in nb.cells), f"{path.name} is stored with outputs"


@needs_model
def test_quickstart(quick_env):
    text = text_of(execute("01_quickstart.ipynb"))
    assert "tokens identical to DynamicCache: True" in text
    assert "peak_blocks_in_use" in text and "PagedCache, peak in use" in text


@needs_model
def test_memory_anatomy(quick_env):
    nb = execute("02_memory_anatomy.ipynb")
    text = text_of(nb)
    assert re.search(r"^1 +\d+ +\d+ +\d+ +\d+ +\[", text, re.M), "no block table row printed"
    assert re.search(r"^0 +\d+ +\d+ +released", text, re.M), "the row that finished early was not released"
    assert "paged with blocks of 16" in text and "paged bs=16" in text
    assert "positions in order: True" in text
    assert images_in(nb) >= 3, "the three plots were not displayed inline"


@needs_model
def test_sharing(quick_env):
    text = text_of(execute("03_sharing.ipynb"))
    ratios = [float(r) for r in re.findall(r"sharing ratio \(peak / unshared\) ([0-9.]+)", text)]
    assert len(ratios) == 2 and all(r < 1 for r in ratios), ratios
    assert "forking copied nothing" in text
    assert "every fork's tokens identical to DynamicCache" in text


def test_kernels(quick_env):
    text = text_of(execute("04_kernels.ipynb"))
    assert re.search(r"all \d+ comparisons within bounds", text)
    assert "prefill + extend" in text
    assert "GPU figures are not measured here" in text or "Decode" in text
