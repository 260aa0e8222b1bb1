#!/usr/bin/env bash
# Builds the torch_lms extension against this machine's stock PyTorch (offline, when not built
# yet) and runs benchmarks/compile_peers.py: a GPT-style decoder under torch.compile, uncapped
# and at 1/2 and 1/4 of its compiled peak, with activation_memory_budget, compile-time
# activation offloading (where this torch has it), LMS, and eager + LMS.
#
#   scripts/gpu/run-compile-peers.sh [compile_peers.py arguments...]
#       results under $OUT (default: out/compile-peers)
#
# Environment: PYTHON (default python3, the interpreter with torch and Triton), CUDA_HOME
# (default /usr/local/cuda), MAX_JOBS (parallel compile jobs, default 8), TOTAL_S (whole-script
# budget in seconds, default 530: the build's time is taken from it and the rest given to
# compile_peers.py --time-budget-s, so the script ends within ~9 minutes).
# Writes: run-compile-peers.log, build.log, compile-peers.csv, compile-peers.json, logs/.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/compile-peers}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-530}
began=$(date +%s)
mkdir -p "$OUT"
exec > >(tee "$OUT/run-compile-peers.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY" triton "torch.compile cannot generate GPU kernels"

PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log" --if-missing

export PYTHONPATH="$ROOT/extension${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
left=$(( TOTAL_S - ($(date +%s) - began) - 30 ))
if [ "$left" -lt 200 ]; then
  echo "only $left s left after the build: not enough for the compile benchmark" >&2
  exit 1
fi
echo "== benchmarks/compile_peers.py (time budget $left s)"
cd "$ROOT"
set +e
timeout $(( left + 25 )) "$PY" -m benchmarks.compile_peers --out "$OUT" --time-budget-s "$left" "$@"
status=$?
set -e
if [ "$status" -eq 124 ]; then
  echo "compile_peers.py ran past its budget and was stopped"
fi
exit "$status"
