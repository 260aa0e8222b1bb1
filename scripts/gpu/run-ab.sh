#!/usr/bin/env bash
# Two engines measured side by side in one call on one GPU: a base engine (an earlier commit)
# and this tree's (the head). Both drop-in extensions are built first; then every cell runs
# benchmarks/compare.py on the base and right after on the head, so that both see the same
# machine, driver and host memory. benchmarks/ab.py sets the rows side by side at the end.
#
#   scripts/gpu/run-ab.sh --prepare BASE   on a checkout with git: writes AB_DIR/base.diff
#                                          (what turns this tree's engine into BASE's) and
#                                          AB_DIR/commits.env; carry AB_DIR with the tree
#   scripts/gpu/run-ab.sh CELL...          on the GPU host: results under $OUT (default
#                                          AB_DIR/run)
#
# AB_DIR (default out/ab, relative to the tree) holds one prepared base: two bases, two
# folders.
#
# CELL is MODEL:REGIME:FACTOR:METHODS[:BASE_METHODS]: compare.py's --model, --regime, one
# factor, and the methods the head runs (comma-separated); the base runs BASE_METHODS (default
# lms). For example gpt:nocap:1.5:lms,lms_residual,checkpoint resnet152:capped:2:lms.
# Environment: AB_ARGS (compare.py options of every call, default "--amp --warmup 3
# --iterations 10 --profile-iterations 1"), AB_HOST_GIB (--host-budget-gib of no-cap calls,
# default: compare.py's), AB_PAIRS (benchmarks.ab --pair options, e.g. "lms_residual=lms"),
# AB_MAX_SLOWDOWN (benchmarks.ab --max-slowdown, a rule fixed before the run), CALL_TIMEOUT_S
# (each compare.py call, default 300), TOTAL_S (default 540: a cell's pair of calls starts only
# while the time left exceeds the longest pair so far; later cells are then skipped and say
# so), AB_BASE_TREE (where the base is built, default /tmp/lms-ab-base), OUT, PYTHON (python3),
# MAX_JOBS (compile jobs of each build, default 8).
# Writes under OUT: run-ab.log, build-base.log, build-head.log, base/ and head/ (per cell
# MODEL-REGIME-FACTOR/: compare.py's output and results), ab.md (benchmarks.ab's report) and
# ab.tgz (all of it).
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  # The comment block at the top of this file, without its '#'.
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PREPARED=$ROOT/${AB_DIR:-out/ab}
# The sources an engine build reads (scripts/gpu/build-extension.sh hashes the same).
ENGINE_PATHS=(engine extension/csrc extension/setup.py extension/setup.cfg)

if [[ "${1:-}" == "--prepare" ]]; then
  base=${2:?usage: run-ab.sh --prepare BASE (a commit)}
  cd "$ROOT"
  base_commit=$(git rev-parse --verify "$base^{commit}") || {
    echo "run-ab.sh: $base is no commit of this repository (git log --oneline shows them)" >&2
    exit 2
  }
  dirty=0
  git diff --quiet HEAD -- "${ENGINE_PATHS[@]}" || dirty=1
  mkdir -p "$PREPARED"
  # From this tree (uncommitted changes included) to the base: the reverse of base -> tree.
  git diff --binary -R "$base_commit" -- "${ENGINE_PATHS[@]}" >"$PREPARED/base.diff"
  {
    echo "BASE_COMMIT=$base_commit"
    echo "HEAD_COMMIT=$(git rev-parse HEAD)"
    echo "HEAD_DIRTY=$dirty"
  } >"$PREPARED/commits.env"
  echo "wrote $PREPARED/base.diff ($(wc -l <"$PREPARED/base.diff") lines: this tree's engine" \
    "into ${base_commit:0:7}'s) and commits.env (head $(git rev-parse --short HEAD)," \
    "dirty $dirty); carry ${AB_DIR:-out/ab} to the GPU host"
  exit 0
fi

(($# > 0)) || {
  echo "usage: run-ab.sh --prepare BASE, then run-ab.sh CELL... (--help)" >&2
  exit 2
}
[[ -f "$PREPARED/base.diff" && -f "$PREPARED/commits.env" ]] || {
  echo "run-ab.sh: no $PREPARED/base.diff: run scripts/gpu/run-ab.sh --prepare BASE on a" \
    "checkout with git first, and carry ${AB_DIR:-out/ab}" >&2
  exit 2
}
# shellcheck source=/dev/null
source "$PREPARED/commits.env"
for cell in "$@"; do
  IFS=: read -r model regime factor methods _ <<<"$cell"
  if [[ -z "$model" || -z "$regime" || -z "$factor" || -z "$methods" ]]; then
    echo "run-ab.sh: cell '$cell' is not MODEL:REGIME:FACTOR:METHODS[:BASE_METHODS]" \
      "(e.g. gpt:nocap:1.5:lms,checkpoint)" >&2
    exit 2
  fi
done

OUT=${OUT:-$PREPARED/run}
PY=${PYTHON:-python3}
BASE_TREE=${AB_BASE_TREE:-/tmp/lms-ab-base}
read -ra compare_args <<<"${AB_ARGS:---amp --warmup 3 --iterations 10 --profile-iterations 1}"
mkdir -p "$OUT"
exec > >(tee "$OUT/run-ab.log") 2>&1
began=$(date +%s)
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}

LMS_ENGINE_COMMIT=$HEAD_COMMIT LMS_ENGINE_DIRTY=$HEAD_DIRTY \
  "$ROOT/scripts/gpu/environment.sh" "$PY" torchvision "the resnet152 and vit_l cells cannot run"
echo "== base engine ${BASE_COMMIT:0:7}, head engine ${HEAD_COMMIT:0:7} (dirty $HEAD_DIRTY)"

# The base tree: this tree without build outputs or results, its engine turned into the base's.
rm -rf "$BASE_TREE"
mkdir -p "$BASE_TREE"
tar -C "$ROOT" -cf - --exclude=./out --exclude=./work --exclude=./.git --exclude=./.venv \
  --exclude=./extension/build --exclude='./extension/torch_lms/_C*.so' . | tar -C "$BASE_TREE" -xf -
if ! (cd "$BASE_TREE" && patch -p1 -s --no-backup-if-mismatch <"$PREPARED/base.diff"); then
  echo "run-ab.sh: $PREPARED/base.diff does not apply to this tree: prepare it again from the" \
    "checkout this tree was sent from"
  exit 1
fi

# Both builds at once, half the compile jobs each.
jobs=${MAX_JOBS:-8}
MAX_JOBS=$jobs PYTHON="$PY" "$BASE_TREE/scripts/gpu/build-extension.sh" "$OUT/build-base.log" &
base_build=$!
MAX_JOBS=$jobs PYTHON="$PY" "$ROOT/scripts/gpu/build-extension.sh" "$OUT/build-head.log" \
  --if-missing &
head_build=$!
status=0
wait "$base_build" || status=1
wait "$head_build" || status=1
((status == 0)) || { echo "run-ab.sh: a build failed (its log is above)"; exit 1; }
echo "== both builds done at $(($(date +%s) - began)) s"

measure() { # SIDE TREE COMMIT DIRTY MODEL REGIME FACTOR METHODS
  local side=$1 tree=$2 commit=$3 dirty=$4 model=$5 regime=$6 factor=$7 methods=$8
  local out="$OUT/$side/$model-$regime-$factor"
  local -a extra=(--no-search --no-overhead)
  [[ "$regime" == nocap && -n "${AB_HOST_GIB:-}" ]] && extra+=(--host-budget-gib "$AB_HOST_GIB")
  mkdir -p "$out"
  echo "== $side $model $regime ${factor}x: $methods (at $(($(date +%s) - began)) s)"
  local rc=0
  (
    cd "$tree"
    LMS_ENGINE_COMMIT=$commit LMS_ENGINE_DIRTY=$dirty \
      PYTHONPATH="$tree:$tree/extension${PYTHONPATH:+:$PYTHONPATH}" \
      timeout -k 30 "${CALL_TIMEOUT_S:-300}" "$PY" benchmarks/compare.py --model "$model" \
      --regime "$regime" --factors "$factor" --methods "$methods" "${compare_args[@]}" \
      "${extra[@]}" --out "$out"
  ) >"$out/compare.log" 2>&1 || rc=$?
  ((rc == 0)) || echo "   compare.py exited $rc (its log: $side/$model-$regime-$factor/compare.log)"
  grep -E "^   [a-z_]+ +x[0-9.]+ +batch|profile of [a-z_]+ x[0-9.]+: (forward|backward):" \
    "$out/compare.log" | cut -c1-240 || true
}

longest=0
for cell in "$@"; do
  IFS=: read -r model regime factor methods base_methods <<<"$cell"
  started=$(date +%s)
  left=$((${TOTAL_S:-540} - (started - began)))
  if ((left <= longest)); then
    echo "== $cell: skipped, ${left} s left and the longest cell so far took ${longest} s"
    continue
  fi
  measure base "$BASE_TREE" "$BASE_COMMIT" 0 "$model" "$regime" "$factor" "${base_methods:-lms}"
  measure head "$ROOT" "$HEAD_COMMIT" "$HEAD_DIRTY" "$model" "$regime" "$factor" "$methods"
  took=$(($(date +%s) - started))
  ((took > longest)) && longest=$took
done

echo "== side by side"
ab_args=()
for pair in ${AB_PAIRS:-}; do ab_args+=(--pair "$pair"); done
[[ -n "${AB_MAX_SLOWDOWN:-}" ]] && ab_args+=(--max-slowdown "$AB_MAX_SLOWDOWN")
verdict=0
(cd "$ROOT" && PYTHONPATH="$ROOT" "$PY" -m benchmarks.ab "$OUT/base" "$OUT/head" \
  "${ab_args[@]}" --out "$OUT/ab.md") || verdict=$?
tar -C "$OUT" -czf "$OUT/ab.tgz" --exclude=ab.tgz .
echo "== done in $(($(date +%s) - began)) s; ab.md and ab.tgz under $OUT"
exit "$verdict"
