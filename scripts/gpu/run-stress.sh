#!/usr/bin/env bash
# Runs the randomized LMS stress suite (tests/regression/stress) on the GPU within a time
# budget, through the drop-in extension torch_lms on this machine's stock PyTorch (built
# offline in place first, the way scripts/gpu/run-regression.sh does, when
# extension/torch_lms/_C*.so is missing).
#
#   scripts/gpu/run-stress.sh                  seeds 0.. until the budget; results under $OUT
#   STRESS_START=60 scripts/gpu/run-stress.sh  continue a run that stopped before seed 60
#
# Each case runs four processes: two uncapped references without LMS (the first measures the
# largest operator working set, in tensor bytes and as the allocator maps it), the capped run
# with LMS and the same cap without LMS (a case counts only where the cap binds), all with the
# capped run's allocator setting (expandable segments: as PYTORCH_CUDA_ALLOC_CONF sets them,
# else on, as LMS sets them; STRESS_ARGS="--expandable-segments on|off" to choose). The gate
# judges every record of $OUT, earlier attempts of a seed run again included; each record
# carries the engine commit, dirty flag and engine sources hash (LMS_ENGINE_COMMIT and
# LMS_ENGINE_DIRTY override git where this tree's .git is stale), torch, CUDA, cuDNN, driver
# and device.
#
# Environment: OUT (default out/stress), STRESS_BUDGET_S (default 480: seconds for cases;
# the build, if any, comes on top), STRESS_START (first seed, default 0), STRESS_SEEDS (most
# seeds to run, default 1000: the budget ends the run first), STRESS_ARGS (more runner
# arguments, e.g. "--jobs 12": cases at once; see python -m tests.regression.stress.runner
# --help), PYTHON (default python3), CUDA_HOME (default /usr/local/cuda), MAX_JOBS (parallel
# compile jobs, default 8). Cases at once share the host's cores with every other GPU's: 18
# per GPU on four GPUs and 64 cores (72 at once) ran capped runs a median 4 times slower, and
# four passed the runner's 120 s run timeout, counted as crashes; 12 per GPU had none.
# Writes: run-stress.log, results.jsonl (one line per case and attempt), summary.md,
# runs/SEED/ (each run's JSON and log; runs/SEED/attempt-N/ for a seed's later attempts),
# build.log when it built the extension. Exit status: the runner's (1 when the gate fails).
# 200 seeds in two halves, then their records merged and judged together:
#   OUT=out/stress-a STRESS_START=0 STRESS_SEEDS=100 STRESS_ARGS="--jobs 12" \
#     scripts/gpu/run-stress.sh
#   OUT=out/stress-b STRESS_START=100 STRESS_SEEDS=100 STRESS_ARGS="--jobs 12" \
#     scripts/gpu/run-stress.sh
#   python3 -m tests.regression.stress.runner --merge out/stress-a out/stress-b --out out/stress
# The failing seeds of earlier runs again: STRESS_ARGS="--failed-of DIR ..." (STRESS_START and
# STRESS_SEEDS are then not used).
# A half that the budget stops early prints "continue with: --start S": run it again with
# STRESS_START=S (and the remaining STRESS_SEEDS) into the same OUT.
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
which=(--start "$START" --seeds "$SEEDS")
if [[ " ${STRESS_ARGS:-} " == *" --failed-of "* ]]; then
  which=()
fi
"$PY" -m tests.regression.stress.runner "${which[@]}" \
  --time-budget-s "$BUDGET" --out "$OUT" --python "$PY" ${STRESS_ARGS:-}
status=$?
set -e
echo "== summary: $OUT/summary.md (runner exit status $status)"
exit "$status"
