#!/usr/bin/env bash
# Builds the torch_lms extension against this machine's stock PyTorch (offline, exactly as
# scripts/gpu/run-regression.sh does) and runs benchmarks/compare.py for one model group.
#
#   scripts/gpu/run-benchmarks.sh MODEL [compare.py arguments...]
#       MODEL: resnet152 | vit_l | gpt; results under $OUT (default: out/benchmarks)
#
# Environment: PYTHON (default python3, the interpreter with torch, torchvision, matplotlib),
# CUDA_HOME (default /usr/local/cuda), MAX_JOBS (parallel compile jobs, default 8),
# TOTAL_S (whole-script budget in seconds, default 530: the build's time is taken from it and
# the rest given to compare.py --time-budget-s, so the script ends within ~9 minutes),
# REBUILD=1 (rebuild torch_lms even when it is built already).
# One call does not hold every method at every cap of a large model: split it with
# compare.py's --factors, --methods, --no-overhead and --no-search, one OUT per call
# (benchmarks/README.md, "Splitting a run", lists the calls).
# Writes: run-benchmarks-MODEL.log, build.log, compare-MODEL.csv, compare-MODEL-goals.csv,
# compare-MODEL.json, compare-MODEL.png.
set -euo pipefail

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -ge 1 ] && exit 0 || exit 2
fi
MODEL=$1
shift
case "$MODEL" in
  resnet152|vit_l|gpt) ;;
  *) echo "run-benchmarks.sh: unknown model group '$MODEL' (resnet152, vit_l or gpt)" >&2; exit 2 ;;
esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/benchmarks}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-530}
began=$(date +%s)
mkdir -p "$OUT"
exec > >(tee "$OUT/run-benchmarks-$MODEL.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY" torchvision "the resnet152 and vit_l groups cannot run" \
  matplotlib "no plot is drawn"

if [ "${REBUILD:-0}" = 1 ]; then
  PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log"
else
  PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log" --if-missing
fi

export PYTHONPATH="$ROOT/extension${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
left=$(( TOTAL_S - ($(date +%s) - began) - 30 ))
if [ "$left" -lt 120 ]; then
  echo "only $left s left after the build: not enough for a benchmark run" >&2
  exit 1
fi
echo "== benchmarks/compare.py --model $MODEL (time budget $left s)"
cd "$ROOT"
set +e
timeout $(( left + 25 )) "$PY" -m benchmarks.compare --model "$MODEL" --out "$OUT" \
  --time-budget-s "$left" --search-budget-s $(( left / 2 )) "$@"
status=$?
set -e
if [ "$status" -eq 124 ]; then
  echo "compare.py ran past its budget and was stopped"
fi
exit "$status"
