"""The transformers range hf_paged declares, tests and states agree, and a release above it warns once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from hf_paged import compat
from hf_paged.patches.table import format_models_table

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_bounds_are_the_tested_range():
    """pyproject's ``transformers>=MIN,<NEXT`` is compat's tested range: the floor CI tests (make test-oldest) and the
    minor after the newest tested, so pip never resolves an untested minor release."""
    spec = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert spec, "pyproject.toml declares no transformers>=...,<... dependency"
    assert Version(spec[1]) == compat.MIN_TRANSFORMERS
    latest = compat.TESTED_LATEST
    assert Version(spec[2]) == Version(f"{latest.major}.{latest.minor + 1}")
    make = (ROOT / "Makefile").read_text()
    assert f"test_transformers.sh {compat.MIN_TRANSFORMERS}" in make  # test-oldest pins the floor
    for page in ("README.md", "docs/testing.md"):
        assert compat.TESTED_RANGE in (ROOT / page).read_text(), f"{page} does not state the tested range"


def test_versions_above_the_tested_range_are_named():
    assert compat.untested_version_warning(Version("5.25.3")) is None
    assert compat.untested_version_warning(Version("4.56.0")) is None
    assert compat.untested_version_warning(Version("5.25.0.dev0")) is None
    for above in ("5.26.0", "5.26.0.dev0", "6.0.0"):
        message = compat.untested_version_warning(Version(above))
        assert message is not None and compat.TESTED_RANGE in message and above in message
    assert compat.TESTED_RANGE in format_models_table()


def test_a_release_above_the_tested_range_warns_once():
    """A process on transformers 5.26 (the version faked before hf_paged is imported) gets exactly one warning
    naming the tested range, however much of hf_paged it imports and runs."""
    script = (
        "import warnings, transformers\n"
        "transformers.__version__ = '5.26.0'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import hf_paged, hf_paged.patches, hf_paged.engine\n"
        "    from hf_paged import PagedCache\n"
        "    from transformers import LlamaConfig\n"
        "    PagedCache(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))\n"
        "print(sum('tested range' in str(w.message) for w in caught))\n"
        "print([str(w.message) for w in caught if 'tested range' in str(w.message)])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    count, messages = out.stdout.strip().splitlines()[-2:]
    assert count == "1", messages
    assert compat.TESTED_RANGE in messages and "5.26.0" in messages
