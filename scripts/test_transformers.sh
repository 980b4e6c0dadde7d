#!/usr/bin/env bash
# The tests that touch transformers (PagedCache vs DynamicCache end to end, sharing, robustness, the Triton path) on
# another transformers release, in a venv of its own sharing the main venv's torch. A few minutes on 2 cores.
#
#   bash scripts/test_transformers.sh VERSION [MAIN_VENV] [TEST_FILE ...]
#
# VERSION: a release (4.56.0: the oldest supported, `make test-oldest`) or "latest" (the newest release on the
# registry, `make test-latest`). MAIN_VENV default: .venv (the one `make setup` builds). TEST_FILE default: the
# end-to-end files below. Builds $TRANSFORMERS_VENV (default .venv-transformers-VERSION) once: a venv that sees
# MAIN_VENV's packages (torch, triton, numpy, ...: nothing big is installed twice) but holds its own transformers,
# plus the few of transformers' dependencies whose versions differ (huggingface-hub, tokenizers, ...), which take
# precedence. Later runs reuse it while the pins and MAIN_VENV are unchanged. Where MAIN_VENV already holds the
# release, the tests run there (or, with SKIP_IF_MAIN=1, not at all: `make test` covered it). Exit status: the tests' (no tests collected = 1).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: bash scripts/test_transformers.sh VERSION|latest [MAIN_VENV] [TEST_FILE ...]}
MAIN_VENV=${2:-.venv}
shift $(( $# < 2 ? $# : 2 ))
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_generate.py tests/test_sharing.py tests/test_robustness.py
                                 tests/test_triton_e2e.py)
MAIN_PY="$MAIN_VENV/bin/python"
[ -x "$MAIN_PY" ] || { echo "no python at $MAIN_PY: pass the main venv (e.g. run 'make setup' first)" >&2; exit 2; }
MAIN_PY=$(cd "$(dirname "$MAIN_PY")" && pwd)/python

if [ "$VERSION" = latest ]; then
    # the newest release pip sees on the registry (pre-releases excluded)
    VERSION=$("$MAIN_PY" -m pip index versions transformers --disable-pip-version-check 2>/dev/null \
              | sed -n 's/^transformers (\(.*\))$/\1/p')
    [ -n "$VERSION" ] || { echo "could not ask the registry for transformers' newest release" >&2; exit 2; }
    echo "newest transformers on the registry: $VERSION"
fi

# Releases whose dependencies pip would otherwise resolve from the main venv's newer ones, pinned to what they
# were tested with. Keep 4.56.0 equal to hf_paged/compat.py's MIN_TRANSFORMERS and pyproject.toml's lower bound.
case "$VERSION" in
    4.56.0) PINS=("transformers==4.56.0" "huggingface-hub==0.36.2" "tokenizers==0.22.2")
            declared=$(sed -n 's/^MIN_TRANSFORMERS = Version("\(.*\)").*/\1/p' hf_paged/compat.py)
            [ "$declared" = 4.56.0 ] || { echo "compat.MIN_TRANSFORMERS is $declared, not 4.56.0: update this script" >&2; exit 2; } ;;
    *) PINS=("transformers==$VERSION") ;;
esac

check() {
    "$1" - "$VERSION" <<'PY'
import sys
import torch, transformers, hf_paged.patches  # noqa: F401  (torch comes from the main venv)
assert transformers.__version__ == sys.argv[1], transformers.__version__
PY
}

if check "$MAIN_PY" 2>/dev/null; then
    if [ "${SKIP_IF_MAIN:-0}" = 1 ]; then  # make test-latest: `make test` ran the whole suite on this release
        echo "$MAIN_VENV already holds transformers $VERSION, which make test runs the whole suite on: nothing to add"
        exit 0
    fi
    PY=$MAIN_PY
    echo "$MAIN_VENV already holds transformers $VERSION: testing there"
else
    ENV_DIR=${TRANSFORMERS_VENV:-.venv-transformers-$VERSION}
    PY="$ENV_DIR/bin/python"
    stamp="${PINS[*]} main=$MAIN_PY"
    if [ -f "$ENV_DIR/.hf_paged-transformers" ] && [ "$(cat "$ENV_DIR/.hf_paged-transformers")" = "$stamp" ] \
            && check "$PY" 2>/dev/null; then
        echo "reusing $ENV_DIR"
    else
        echo "building $ENV_DIR: ${PINS[*]} over $MAIN_VENV's packages"
        rm -rf "$ENV_DIR"
        "$MAIN_PY" -m venv "$ENV_DIR"
        site_dir=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        # Append every site directory the main venv sees (its own and, with --system-site-packages, the system's),
        # .pth files included (so its editable hf_paged install applies here too). Appended: this venv's packages win.
        main_sites=$("$MAIN_PY" -c "import sys; print(repr([p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]))")
        echo "import site; list(map(site.addsitedir, $main_sites))" > "$site_dir/zz_hf_paged_main_venv.pth"
        # With the main venv visible pip installs only what it lacks or holds at other versions, into $ENV_DIR
        # (pip never uninstalls from outside the environment it installs into).
        "$PY" -m pip install -q --disable-pip-version-check "${PINS[@]}"
        "$PY" -c "import hf_paged.patches" 2>/dev/null \
            || "$PY" -m pip install -q --disable-pip-version-check --no-deps -e .
        check "$PY"
        echo "$stamp" > "$ENV_DIR/.hf_paged-transformers"
    fi
fi

"$PY" -c "import transformers, torch; print('transformers', transformers.__version__, '| torch', torch.__version__)"
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
set +e
# Version-independent files (allocator, kernels, op API, simulation, notebooks, packaging) run once, in `make test`.
"$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
status=$?
if [ "$status" -eq 5 ]; then echo "no tests were collected: treating as failure" >&2; exit 1; fi
exit "$status"
