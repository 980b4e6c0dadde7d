"""`pip install .` alone gives a working package: the per-model patches ship inside the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
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
    assert not any(name.startswith("patches/") for name in names)


def test_patches_import_as_subpackage():
    from hf_paged.patches import supported_model_types

    families = set(supported_model_types())
    assert {"llama", "mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss"} <= families
