#!/usr/bin/env bash
# Mutation testing of the core's pure-Python parts with mutmut (pinned), in a scratch copy of the working tree.
#
#   bash scripts/mutation.sh [TARGET] [SCRATCH_DIR]
#
#   TARGET     allocator (default): hf_paged/allocator.py against the allocator tests
#              reference:           hf_paged/ops/reference.py against the op tests
#   SCRATCH_DIR  where the copy goes (default: a new /tmp/hf_paged-mutation.XXXX); the checkout is never touched.
#
# Environment: REV (copy this commit, e.g. HEAD, instead of the working tree), PY (default .venv/bin/python),
# RESUME=1 (with SCRATCH_DIR of a run stopped by the cap: go on with the mutants not yet run),
# JOBS (mutmut --max-children, default 2; runs under nice -n 19), LIMIT_S (wall-clock cap of the mutmut run, default 1800).
# Slow on 2 cores (tens of minutes), so not part of `make test` or CI. Prints the score and the surviving mutants;
# `cd SCRATCH_DIR && $PY -m mutmut show NAME` shows one mutant's diff.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MUTMUT_VERSION=3.8.1
PY=${PY:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-2}
LIMIT_S=${LIMIT_S:-1800}
TARGET=${1:-allocator}

case "$TARGET" in
    allocator)
        MUTATE=hf_paged/allocator.py
        TESTS=(tests/test_allocator.py)
        # prefix caching's state machines, where the copy has them (not before the prefix-caching commit)
        if [ -z "${REV:-}" ] || git cat-file -e "${REV}:tests/test_reuse.py" 2>/dev/null; then
            TESTS+=(tests/test_reuse.py::TestPrefixCachingMachine tests/test_reuse.py::TestPrefixCachingMachineWithCrop)
        fi ;;
    reference)
        MUTATE=hf_paged/ops/reference.py
        TESTS=(tests/test_ops_api.py tests/test_kernels.py) ;;
    *) echo "unknown target $TARGET: allocator or reference" >&2; exit 2 ;;
esac

installed=$("$PY" -c "import importlib.metadata as m; print(m.version('mutmut'))" 2>/dev/null || true)
if [ "$installed" != "$MUTMUT_VERSION" ]; then
    "$PY" -m pip install -q --disable-pip-version-check "mutmut==$MUTMUT_VERSION"
fi

SCRATCH=${2:-$(mktemp -d /tmp/hf_paged-mutation.XXXX)}
if [ "${RESUME:-0}" = 1 ]; then
    [ -d "$SCRATCH/mutants" ] || { echo "RESUME=1 needs the SCRATCH_DIR of an earlier run" >&2; exit 2; }
    cd "$SCRATCH"
else
    mkdir -p "$SCRATCH"
    if [ -n "${REV:-}" ]; then
        git archive "$REV" | tar -xf - -C "$SCRATCH"
    else  # the working tree as it is (tracked and untracked files, not ignored ones), uncommitted changes included
        git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c '[ -e "{}" ] && printf "%s\0" "{}"' \
            | tar --null -cf - -T - | tar -xf - -C "$SCRATCH"
    fi
    cd "$SCRATCH"
    rm -rf mutants
    # mutmut reads [mutmut] from setup.cfg when pyproject.toml has no [tool.mutmut]. The whole package is copied (so
    # its imports resolve to the mutated copy), only $MUTATE is mutated.
    {
        echo "[mutmut]"
        echo "source_paths=hf_paged"
        echo "only_mutate=$MUTATE"
        echo "pytest_add_cli_args_test_selection="
        printf '    %s\n' "${TESTS[@]}"
        echo "pytest_add_cli_args=-p no:cacheprovider"
    } >> setup.cfg
fi

export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=1
echo "mutating $MUTATE ($([ "${RESUME:-0}" = 1 ] && echo resumed || echo "${REV:-working tree}")) with ${TESTS[*]} in $SCRATCH (mutmut $MUTMUT_VERSION, $JOBS children, cap ${LIMIT_S}s)"
start=$(date +%s)
set +e
nice -n 19 timeout "$LIMIT_S" "$PY" -m mutmut run --max-children "$JOBS" > mutmut-run.log 2>&1
rc=$?
set -e
echo "mutmut run exited $rc after $(( $(date +%s) - start ))s (log: $SCRATCH/mutmut-run.log)"
"$PY" -m mutmut export-cicd-stats >/dev/null 2>&1 || true
"$PY" - <<'EOF'
import json, pathlib
stats = json.loads(pathlib.Path("mutants/mutmut-cicd-stats.json").read_text())
caught = stats["killed"] + stats["timeout"]
done = caught + stats["survived"] + stats["suspicious"] + stats["no_tests"] + stats["segfault"]
print("stats:", stats)
print(f"score: {caught}/{done} caught = {caught / max(done, 1):.1%} "
      "(killed or timed out, of mutants run or reached by no test; not run before the cap: left out)")
EOF
"$PY" -m mutmut results --all true > mutmut-results.txt 2>/dev/null || true
echo "not run before the cap: $(grep -c ': not checked' mutmut-results.txt || true)"
echo "surviving, untested, timed-out or suspicious mutants:"
grep -E ": (survived|no tests|timeout|suspicious|segfault)" mutmut-results.txt || true
