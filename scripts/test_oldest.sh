#!/usr/bin/env bash
# The tests that touch transformers (PagedCache vs DynamicCache end to end, sharing, robustness, the Triton path)
# on the OLDEST transformers hf_paged supports. A few minutes on 2 cores.
#
#   bash scripts/test_oldest.sh [MAIN_VENV]      (MAIN_VENV default: .venv, e.g. the one `make setup` builds)
#
# Builds $OLDEST_VENV (default .venv-oldest) once: a venv that sees MAIN_VENV's packages (torch, triton, numpy, ...:
# nothing big is installed twice) but holds its own transformers, pinned to the oldest supported release, plus the
# few of transformers' dependencies whose versions differ (huggingface-hub, tokenizers, ...), which take precedence.
# Later runs reuse it while the pins and MAIN_VENV are unchanged. Exit status: the tests' (no tests collected = 1).
set -euo pipefail
cd "$(dirname "$0")/.."

# Keep TRANSFORMERS_OLDEST equal to hf_paged/compat.py's MIN_TRANSFORMERS and pyproject.toml's lower bound.
TRANSFORMERS_OLDEST=4.56.0
PINS=("transformers==$TRANSFORMERS_OLDEST" "huggingface-hub==0.36.2" "tokenizers==0.22.2")

MAIN_VENV=${1:-.venv}
OLD=${OLDEST_VENV:-.venv-oldest}
MAIN_PY="$MAIN_VENV/bin/python"
[ -x "$MAIN_PY" ] || { echo "no python at $MAIN_PY: pass the main venv (e.g. run 'make setup' first)" >&2; exit 2; }
MAIN_PY=$(cd "$(dirname "$MAIN_PY")" && pwd)/python

declared=$(sed -n 's/^MIN_TRANSFORMERS = Version("\(.*\)").*/\1/p' hf_paged/compat.py)
if [ "$declared" != "$TRANSFORMERS_OLDEST" ]; then
    echo "scripts/test_oldest.sh pins transformers $TRANSFORMERS_OLDEST but compat.MIN_TRANSFORMERS is $declared" >&2
    exit 2
fi

stamp="${PINS[*]} main=$MAIN_PY"
check() {
    "$OLD/bin/python" - "$TRANSFORMERS_OLDEST" <<'EOF'
import sys
import torch, transformers, hf_paged.patches  # noqa: F401  (torch comes from the main venv)
assert transformers.__version__ == sys.argv[1], transformers.__version__
EOF
}

if [ -f "$OLD/.hf_paged-oldest" ] && [ "$(cat "$OLD/.hf_paged-oldest")" = "$stamp" ] && check 2>/dev/null; then
    echo "reusing $OLD"
else
    echo "building $OLD: ${PINS[*]} over $MAIN_VENV's packages"
    rm -rf "$OLD"
    "$MAIN_PY" -m venv "$OLD"
    site_dir=$("$OLD/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # Append every site directory the main venv sees (its own and, with --system-site-packages, the system's), .pth
    # files included (so its editable hf_paged install applies here too). Appended, so this venv's packages win.
    main_sites=$("$MAIN_PY" -c "import sys; print(repr([p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]))")
    echo "import site; list(map(site.addsitedir, $main_sites))" > "$site_dir/zz_hf_paged_main_venv.pth"
    # With the main venv visible pip installs only what it lacks or holds at other versions, into $OLD
    # (pip never uninstalls from outside the environment it installs into).
    "$OLD/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}"
    "$OLD/bin/python" -c "import hf_paged.patches" 2>/dev/null \
        || "$OLD/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
    check
    echo "$stamp" > "$OLD/.hf_paged-oldest"
fi

"$OLD/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, '| torch', torch.__version__)"
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
set +e
# Version-independent files (allocator, kernels, op API, simulation, notebooks, packaging) run once, in `make test`.
"$OLD/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_generate.py tests/test_sharing.py tests/test_robustness.py tests/test_triton_e2e.py
status=$?
if [ "$status" -eq 5 ]; then echo "no tests were collected: treating as failure" >&2; exit 1; fi
exit "$status"
