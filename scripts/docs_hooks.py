"""MkDocs hooks for the documentation site (mkdocs.yml's ``hooks:``).

- The committed, executed notebooks (``notebooks/NN_name.ipynb``) become pages ``notebooks/NN_name.md``: markdown
  cells as they are, code cells as Python blocks, their outputs (text, images) below them. Nothing is executed here:
  ``python notebooks/run.py`` executes them and ``tests/test_notebooks.py`` checks the stored outputs are current.
- The nav's "Notebooks" section lists them, in file order, titled by each notebook's first heading.
- Nav entries for pages that other branches add (``PENDING_PAGES``) are left out until the file exists, so the strict
  build passes before and after they land; any other missing nav entry still fails it.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.hf_paged")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PENDING_PAGES = {"guide/families.md", "guide/serving-clients.md", "design/kv-geometry.md", "design/mla.md"}


def notebook_title(nb: dict, fallback: str) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def notebook_markdown(nb: dict, stem: str) -> tuple[str, dict[str, bytes]]:
    """The page's markdown and its images (``{file name: PNG bytes}``) from an executed notebook's JSON."""
    out, images = [f"*Rendered from `notebooks/{stem}.ipynb` (source: `notebooks/{stem}.py`), outputs as committed.*",
                   ""], {}
    for cell in nb["cells"]:
        source = "".join(cell["source"]).rstrip()
        if cell["cell_type"] == "markdown":
            out += [source, ""]
            continue
        if cell["cell_type"] != "code" or not source:
            continue
        out += ["```python", source, "```", ""]
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if output["output_type"] == "stream":
                text = "".join(output["text"])
            elif "image/png" in data:
                name = f"{stem}_{len(images) + 1}.png"
                images[name] = base64.b64decode(data["image/png"])
                out += [f"![output]({name})", ""]
                continue
            elif "text/plain" in data:
                text = "".join(data["text/plain"])
            else:
                continue
            text = text.rstrip().replace("```", "'''")
            if text:
                out += ["```text", text, "```", ""]
    return "\n".join(out), images


def on_config(config):
    docs_dir = Path(config["docs_dir"])
    notebooks = []
    for path in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        nb = json.loads(path.read_text())
        notebooks.append({notebook_title(nb, path.stem): f"notebooks/{path.stem}.md"})

    def keep(entry) -> bool:
        target = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(target, str) and target in PENDING_PAGES and not (docs_dir / target).exists():
            log.info("nav: %s is not written yet (another branch); left out", target)
            return False
        return True

    def walk(entries):
        result = []
        for entry in entries:
            if not keep(entry):
                continue
            if isinstance(entry, dict):
                (title, target), = entry.items()
                if title == "Notebooks":
                    target = notebooks
                elif isinstance(target, list):
                    target = walk(target)
                entry = {title: target}
            result.append(entry)
        return result

    config["nav"] = walk(config["nav"])
    return config


def on_files(files, config):
    for path in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        page, images = notebook_markdown(json.loads(path.read_text()), path.stem)
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=page))
        for name, png in images.items():
            files.append(File.generated(config, f"notebooks/{name}", content=png))
    return files
