#!/usr/bin/env bash
# Runs the randomized LMS stress suite (tests/regression/stress) on the GPU within a time
# budget, through the drop-in extension torch_lms on this machine's stock PyTorch (built
# offline in place first, the way scripts/gpu/run-regression.sh does, when
# extension/torch_lms/_C*.so is missing).
#
#   scripts/gpu/run-stress.sh                  seeds 0.. until the budget; results under $OUT
#   STRESS_START=60 scripts/gpu/run-stress.sh  continue a run that stopped before seed 60
#
# Environment: OUT (default out/stress), STRESS_BUDGET_S (default 480: seconds for cases;
# the build, if any, comes on top), STRESS_START (first seed, default 0), STRESS_SEEDS (most
# seeds to run, default 1000: the budget ends the run first), STRESS_ARGS (more runner
# arguments), PYTHON (default python3), CUDA_HOME (default /usr/local/cuda), MAX_JOBS
# (parallel compile jobs, default 8).
# Writes: run-stress.log, results.jsonl, summary.md, runs/SEED/ (each run's JSON and log),
# build.log when it built the extension. Exit status: the runner's (1 when the gate fails).
# Merge the results of several runs:
#   python -m tests.regression.stress.runner --merge DIR1 DIR2 --out DIR
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/stress}
PY=${PYTHON:-python3}
BUDGET=${STRESS_BUDGET_S:-480}
START=${STRESS_START:-0}
SEEDS=${STRESS_SEEDS:-1000}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run-stress.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY"

if "$PY" -c 'import sys, torch; sys.exit(0 if hasattr(torch.cuda, "set_enabled_lms") else 1)'; then
  echo "== PyTorch has LMS built in: no extension needed"
else
  PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log" --if-missing
fi

echo "== stress suite: seeds from $START, budget $BUDGET s"
export PYTHONPATH="$ROOT/extension${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$ROOT"
set +e
# shellcheck disable=SC2086  # STRESS_ARGS is a list of arguments
"$PY" -m tests.regression.stress.runner --start "$START" --seeds "$SEEDS" \
  --time-budget-s "$BUDGET" --out "$OUT" --python "$PY" ${STRESS_ARGS:-}
status=$?
set -e
echo "== summary: $OUT/summary.md (runner exit status $status)"
exit "$status"
