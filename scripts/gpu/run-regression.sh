#!/usr/bin/env bash
# Builds the torch_lms extension against this machine's stock PyTorch (offline: no pip
# downloads) and runs the end-to-end LMS regression suite (tests/regression) on the GPU;
# the stress suite under tests/regression/stress has its own runner (run-stress.sh).
#
#   scripts/gpu/run-regression.sh            results under $OUT (default: out/regression)
#
# Environment: PYTHON (default python3, the interpreter that has torch and torchvision),
# CUDA_HOME (default /usr/local/cuda), MAX_JOBS (parallel compile jobs, default 8),
# PYTEST_ARGS (extra pytest arguments, split as shell words: quotes work, e.g.
# '-k "resnet50 and not reduce"'), REGRESSION_TESTS (the test
# paths, default tests/regression), REGRESSION_TIMEOUT (seconds for the whole pytest run,
# default 420). The whole suite can take longer than that on an H100 (the compiled models
# compile several times); run it in two parts, each with its own OUT:
#   REGRESSION_TESTS=tests/regression/test_compile.py scripts/gpu/run-regression.sh
#   PYTEST_ARGS=--ignore=tests/regression/test_compile.py scripts/gpu/run-regression.sh
# Writes: run-regression.log, build.log, regression-results.json/.csv, junit.xml.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/regression}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/run-regression.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY" torchvision "the torchvision model tests will be skipped"

PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log" --if-missing

echo "== regression suite"
export PYTHONPATH="$ROOT/extension${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export LMS_RESULTS_DIR="$OUT"
cd "$ROOT"
eval "extra=(${PYTEST_ARGS:-})"
read -ra tests <<<"${REGRESSION_TESTS:-tests/regression}"
set +e
# SIGINT first: pytest then stops like on Ctrl-C and still writes the results and junit.
timeout -s INT -k 60 "${REGRESSION_TIMEOUT:-420}" "$PY" -m pytest "${tests[@]}" \
  --ignore=tests/regression/stress -v -ra -p no:cacheprovider \
  --junitxml="$OUT/junit.xml" "${extra[@]}"
status=$?
set -e
if [ "$status" -eq 124 ]; then
  echo "the regression suite ran past ${REGRESSION_TIMEOUT:-420} s and was stopped"
fi
exit "$status"
