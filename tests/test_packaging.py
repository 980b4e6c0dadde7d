"""`pip install .` alone gives a working package: the per-model patches ship inside the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_patches_as_hf_paged_patches(tmp_path):
    try:
        import setuptools  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("setuptools is not installed, so the wheel cannot be built offline")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("hf_paged-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.stem for p in (ROOT / "patches").glob("*.py"))
    for module in shipped:
        assert f"hf_paged/patches/{module}.py" in names
    for module in ("triton_kernels", "custom_ops", "reference"):
        assert f"hf_paged/ops/{module}.py" in names
    for module in ("simulate", "plots"):  # the tools bench/memory.py and the notebooks use
        assert f"hf_paged/tools/{module}.py" in names
    assert not any(name.startswith("patches/") for name in names)


SCRIPT_FOLDERS = ("bench", "scripts", "notebooks", "examples")


def test_no_script_folder_module_shadows_an_installed_package():
    """``python bench/x.py`` puts ``bench/`` first on ``sys.path``: a module there named like an installed package
    (or the standard library's) is imported in its place by anything, transformers included (5.25 imports the
    Hub's ``kernels`` when it finds one, and found ``bench/kernels.py``). Every top-level module and package of the
    script folders is checked against the installed distributions' top-level import names."""
    taken = set(packages_distributions()) | set(sys.stdlib_module_names)
    assert "kernels" in taken or "transformers" in taken  # the check sees the environment
    shadowing = []
    for folder in SCRIPT_FOLDERS:
        for path in sorted((ROOT / folder).glob("*")):
            is_module = path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists())
            name = path.stem if path.suffix == ".py" else path.name
            if is_module and name in taken:
                shadowing.append(f"{folder}/{path.name} ({name}: {', '.join(packages_distributions().get(name, ['stdlib']))})")
    assert not shadowing, f"rename these, they shadow installed packages when a script runs from its folder: {shadowing}"


def test_patches_import_as_subpackage():
    from hf_paged.patches import supported_model_types

    families = set(supported_model_types())
    assert {"llama", "mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss"} <= families


def test_checkout_without_install_finds_the_patches(tmp_path):
    """``PYTHONPATH=<checkout>`` with no install (bench/gpu.sh on a bare GPU machine): ``python -S`` skips the
    editable install's finder, so hf_paged comes from the checkout and ``patches/`` must become hf_paged.patches."""
    import site

    script = ("import hf_paged, hf_paged.patches as p; from transformers import LlamaConfig, LlamaForCausalLM; "
              "m = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, "
              "num_key_value_heads=1, intermediate_size=32, vocab_size=50)); hf_paged.enable_paged_attention(m); "
              "print(hf_paged.__file__); print(p.__file__)")
    env = {"PYTHONPATH": ":".join([str(ROOT), *site.getsitepackages()]), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    package, patches = run.stdout.split()
    assert package == str(ROOT / "hf_paged" / "__init__.py")
    assert patches == str(ROOT / "hf_paged" / "patches" / "__init__.py")  # the committed link to patches/
    assert Path(patches).resolve() == ROOT / "patches" / "__init__.py"
