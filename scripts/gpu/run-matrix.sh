#!/usr/bin/env bash
# Runs the LMS regression matrix (tests/regression/test_families.py) on the GPU through the
# torch_lms extension (built in place first when extension/torch_lms/_C*.so is missing;
# offline: no pip downloads), then prints the results as a markdown table.
#
#   scripts/gpu/run-matrix.sh                                  everything this machine can run
#   PYTEST_ARGS='-k capped' scripts/gpu/run-matrix.sh                 7 families x 2 caps (1 GPU)
#   PYTEST_ARGS='-k "nocap or share or host"' scripts/gpu/run-matrix.sh
#                               need > device (1.25x, 2x), shared GPU (2 x 60%, 4 x 50%), host
#                               budget (too low for one process; one for 4 processes)
#   PYTEST_ARGS='-k nocap' scripts/gpu/run-matrix.sh                  need > device only
#   PYTEST_ARGS='-k host' scripts/gpu/run-matrix.sh                   the host-budget rows only
#   PYTEST_ARGS='-k disk_tier' scripts/gpu/run-matrix.sh              4 processes beyond device and
#                               host budget, with the disk tier (all finish) and without it
#   PYTEST_ARGS='-k ddp' scripts/gpu/run-matrix.sh                    DDP (2 GPUs)
#
# The rows beyond the device skip where the host has less memory than their pinned page-outs
# need (tests/regression/lms_matrix_plan.py; 107 GiB for 2x an 80 GB H100), and the
# host-budget rows where LMS has no host budget (torch.cuda.set_host_limit_lms).
#
# Environment: OUT (default out/matrix), PYTHON (default python3, the interpreter that has
# torch and torchvision), CUDA_HOME (default /usr/local/cuda), MAX_JOBS (parallel compile
# jobs, default 8), PYTEST_ARGS (extra pytest arguments, split as shell words: quotes work),
# MATRIX_TIMEOUT (seconds for the whole pytest run, default 540; run the matrix in parts
# with PYTEST_ARGS, each part with its own OUT, and summarize them together:
# python -m tests.regression.lms_matrix_summary out/matrix-*/regression-results.json).
# Writes under OUT: run-matrix.log, build.log (when it builds), junit.xml,
# regression-results.json/.csv, matrix-summary.md. Every row of the results names the engine
# commit, dirty flag and engine sources hash (git; on a copy of the checkout without its .git,
# export LMS_ENGINE_COMMIT and LMS_ENGINE_DIRTY=0|1), torch, CUDA, driver and device.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/matrix}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/run-matrix.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY" torchvision \
  "the DDP row uses a CNN of its own instead of ResNet-50"

PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log" --if-missing

echo "== regression matrix"
export PYTHONPATH="$ROOT/extension${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export LMS_RESULTS_DIR="$OUT"
export LMS_MATRIX=1
cd "$ROOT"
eval "extra=(${PYTEST_ARGS:-})"
set +e
# SIGINT first: pytest then stops like on Ctrl-C and still writes the results and junit.
timeout -s INT -k 60 "${MATRIX_TIMEOUT:-540}" "$PY" -m pytest tests/regression/test_families.py -v -ra \
  -p no:cacheprovider --junitxml="$OUT/junit.xml" "${extra[@]}"
status=$?
set -e
if [ "$status" -eq 124 ]; then
  echo "the regression matrix ran past ${MATRIX_TIMEOUT:-540} s and was stopped"
fi

echo "== summary"
if [ -f "$OUT/regression-results.json" ]; then
  "$PY" -m tests.regression.lms_matrix_summary "$OUT/regression-results.json" \
    --output "$OUT/matrix-summary.md" || true
else
  echo "no regression-results.json was written"
fi
exit "$status"
