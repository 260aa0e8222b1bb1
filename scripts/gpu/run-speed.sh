#!/usr/bin/env bash
# The speed table's measurements on one GPU (benchmarks/speed.py run): one benchmarks/compare.py
# call per model and regime, 3 warm-up and 10 timed iterations a row, each call given its share
# of the time left after the extension's build, the whole script within TOTAL_S (default 540 s:
# 9 minutes). By default the most important subset: ResNet-152 and GPT, no cap at 1.5x and 2x
# the device and capped at 1/2 of the peak, checkpointing, LMS with its defaults (recompute
# on) and LMS paging only (in that order, factor by factor: where a call's share runs out, its
# last rows are skipped and say so), with the in-memory figure of each run's fitting batches.
#
#   scripts/gpu/run-speed.sh                    results under $OUT (default: out/speed)
#   DRY_RUN=1 scripts/gpu/run-speed.sh          the cells and their estimated times; no GPU
#
# Environment (each a benchmarks/speed.py option; a larger subset with more of them, split over
# calls with one OUT each, merged by `python -m benchmarks.speed table OUT1 OUT2...`):
#   SPEED_MODELS (resnet152,gpt), SPEED_REGIMES (nocap,capped), SPEED_NOCAP_FACTORS (1.5,2; the
#   table's full set 1.25,1.5,2,4), SPEED_CAPPED_FACTORS (2; full 1.5,2,4), SPEED_METHODS
#   (lms,checkpoint,lms_paging: LMS's defaults, which recompute, and paging only; full
#   lms,lms_hybrid,checkpoint,lms_paging,compile_budget,offload), SPEED_WARMUP (3), SPEED_ITERATIONS (10), SPEED_ARGS (more compare.py arguments,
#   default --amp), SPEED_HOST_GIB (host memory no-cap rows may pin; default: what is
#   available), TOTAL_S (540), OUT, PYTHON (python3), REBUILD=1 (rebuild torch_lms).
# With no cap, LMS pins about the deficit plus 5% of the device: at 2x on an H200 about 146 GiB,
# more than a one-GPU host of 128 GiB has (those rows are skipped and say so); a host of 256 GiB
# (two GPUs; the run uses one) has room for them.
# The results name their engine: from git where this tree has its .git; on a copy without it
# (a GPU host the tree was sent to) export LMS_ENGINE_COMMIT=<commit> and LMS_ENGINE_DIRTY=0|1
# of the sending checkout, or the run stops before it starts.
# Writes under OUT: run-speed.log, build.log, REGIME/MODEL/ (compare.py's CSVs, JSON, PNG),
# speed-table.md, summary.txt (the plan, each call's outcome, the table) and speed.tgz (all).
# GPUS=2 (a host of two GPUs): the models are split between GPU 0 and GPU 1 (the first, third,
# ... model on GPU 0), which run at once, each into OUT/gpuN with a host ledger of its own and
# half the host memory for its no-cap rows (SPEED_HOST_GIB, where set, is each one's); the
# extension is built once, and OUT's speed-table.md, summary.txt and speed.tgz cover both.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  # The comment block at the top of this file, without its '#'.
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
OUT=${OUT:-$ROOT/out/speed}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-540}
began=$(date +%s)
selection=(
  --models "${SPEED_MODELS:-resnet152,gpt}"
  --regimes "${SPEED_REGIMES:-nocap,capped}"
  --nocap-factors "${SPEED_NOCAP_FACTORS:-1.5,2}"
  --capped-factors "${SPEED_CAPPED_FACTORS:-2}"
  --methods "${SPEED_METHODS:-lms,checkpoint,lms_paging}"
  --warmup "${SPEED_WARMUP:-3}"
  --iterations "${SPEED_ITERATIONS:-10}"
  "--speed-args=${SPEED_ARGS---amp}"
)
# The host memory no-cap rows may pin (default: what the host has available).
[[ -n "${SPEED_HOST_GIB:-}" ]] && selection+=(--host-gib "$SPEED_HOST_GIB")
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# GPUS=2: the models of each GPU (every other one, the first on GPU 0).
models_of_gpu() { # GPU
  local -a all
  IFS=, read -ra all <<<"${SPEED_MODELS:-resnet152,gpt}"
  local i out=()
  for ((i = $1; i < ${#all[@]}; i += 2)); do out+=("${all[$i]}"); done
  (IFS=,; echo "${out[*]}")
}
two_gpus() { [[ "${GPUS:-1}" == 2 && -z "${SPEED_GPU_PART:-}" ]]; }
half_host_gib() {
  awk '/^MemAvailable:/ { printf "%d\n", $2 / 1048576 / 2 }' /proc/meminfo
}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  if two_gpus; then
    host=${SPEED_HOST_GIB:-$(half_host_gib)}
    for gpu in 0 1; do
      echo "== GPU $gpu"
      SPEED_GPU_PART=$gpu SPEED_MODELS=$(models_of_gpu "$gpu") SPEED_HOST_GIB=$host \
        bash "${BASH_SOURCE[0]}"
    done
    exit 0
  fi
  exec "$PY" -m benchmarks.speed plan "${selection[@]}" --budget-s "$TOTAL_S"
fi

# This tree's own .git, not one of a folder above it.
if [[ -z "${LMS_ENGINE_COMMIT:-}" ]] &&
  [[ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" != "$ROOT" ]]; then
  echo "run-speed.sh: this tree has no .git and LMS_ENGINE_COMMIT is not set: the table must" \
    "name the engine that ran it. Export LMS_ENGINE_COMMIT=<commit> and LMS_ENGINE_DIRTY=0|1" \
    "of the checkout this tree was copied from." >&2
  exit 2
fi
if [[ -n "${LMS_ENGINE_COMMIT:-}" && -z "${LMS_ENGINE_DIRTY:-}" ]]; then
  echo "run-speed.sh: LMS_ENGINE_COMMIT without LMS_ENGINE_DIRTY: the results will say that" \
    "whether the tree had changes is unknown" >&2
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/run-speed.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY" torchvision "the resnet152 and vit_l rows cannot run" \
  matplotlib "no plot is drawn" torchtune "offload uses the same mechanism written here"
if [[ "${REBUILD:-0}" == 1 ]]; then
  PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log"
else
  PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log" --if-missing
fi
export PYTHONPATH="$ROOT/extension:$PYTHONPATH"
export PYTHONUNBUFFERED=1

if two_gpus; then
  host=${SPEED_HOST_GIB:-$(half_host_gib)}
  left=$(( TOTAL_S - ($(date +%s) - began) ))
  echo "== two GPUs at once, $left s: GPU 0 $(models_of_gpu 0), GPU 1 $(models_of_gpu 1)," \
    "$host GiB of host memory each"
  parts=()
  for gpu in 0 1; do
    # A host ledger each: the two runs must not wait for each other's pinned memory.
    CUDA_VISIBLE_DEVICES=$gpu SPEED_GPU_PART=$gpu SPEED_MODELS=$(models_of_gpu "$gpu") \
      SPEED_HOST_GIB=$host TOTAL_S=$left OUT="$OUT/gpu$gpu" REBUILD=0 \
      PYTORCH_LMS_HOST_LEDGER="/dev/shm/pytorch-lms-speed-ledger-$(id -u)-$$-gpu$gpu" \
      bash "${BASH_SOURCE[0]}" >"$OUT/gpu$gpu.out" 2>&1 &
    parts+=("$!")
  done
  status=0
  for part in "${parts[@]}"; do
    wait "$part" || status=$?
  done
  rm -f "/dev/shm/pytorch-lms-speed-ledger-$(id -u)-$$-gpu"[01]
  "$PY" -m benchmarks.speed table "$OUT/gpu0" "$OUT/gpu1" >"$OUT/speed-table.md" || true
  {
    for gpu in 0 1; do
      echo "== GPU $gpu"
      cat "$OUT/gpu$gpu/summary.txt" 2>/dev/null || tail -n 5 "$OUT/gpu$gpu.out"
      echo
    done
    echo "== both"
    cat "$OUT/speed-table.md"
  } >"$OUT/summary.txt"
  cat "$OUT/summary.txt"
  tar czf "$OUT/speed.tgz" -C "$OUT" --exclude=speed.tgz --exclude='gpu*/speed.tgz' \
    --warning=no-file-changed . || true
  echo "== wrote $OUT/speed.tgz and $OUT/summary.txt in $(( $(date +%s) - began )) s"
  exit "$status"
fi

# What is left after the build, less the table, the tarball and the last call's grace.
left=$(( TOTAL_S - ($(date +%s) - began) - 45 ))
if [[ "$left" -lt 60 ]]; then
  echo "run-speed.sh: only $left s left after the build: not enough for a row" >&2
  exit 1
fi
echo "== benchmarks/speed.py run (budget $left s)"
set +e
# timeout signals the whole process group: compare.py saves what it measured on SIGTERM.
timeout -k 20 $(( left + 30 )) "$PY" -m benchmarks.speed run --out "$OUT" --budget-s "$left" \
  "${selection[@]}"
status=$?
set -e
[[ "$status" -eq 124 ]] && echo "speed.py ran past its budget and was stopped"
if [[ ! -s "$OUT/speed-table.md" ]]; then
  "$PY" -m benchmarks.speed table "$OUT" >"$OUT/speed-table.md" || true
fi
{
  "$PY" -m benchmarks.speed plan "${selection[@]}" --budget-s "$left"
  echo
  grep -E '^== (capped|nocap)/|ran past|not run,' "$OUT/run-speed.log" || true
  echo
  cat "$OUT/speed-table.md"
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
tar czf "$OUT/speed.tgz" -C "$OUT" --exclude=speed.tgz --warning=no-file-changed . || true
echo "== wrote $OUT/speed.tgz and $OUT/summary.txt in $(( $(date +%s) - began )) s"
exit "$status"
