#!/usr/bin/env bash
# The checks an engine change must pass on real GPUs, spread over the GPUs of one host at
# once: the 16 capped rows of the regression matrix (scripts/gpu/run-matrix.sh) and the
# compile rows of the regression suite (scripts/gpu/run-regression.sh), in parts balanced by
# their earlier run times (about 6 minutes on four H200s). The extension is built once first;
# each part then keeps it (--if-missing). Results of every part go under OUT/<part>/, and
# OUT/checks.tgz packs them all.
#
#   scripts/gpu/run-checks.sh                results under $OUT (default: out/checks)
#
# Environment: OUT, PYTHON (default python3), PART_TIMEOUT (seconds for each part's pytest
# run, default 420), GPUS (4, or 2 for the capped matrix rows alone), EXTRA_GPU3 (optional pytest -k expression of more regression tests to
# run on GPU 3 after the compile rows, e.g. new rows of an engine change).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/checks}
PY=${PYTHON:-python3}
T=${PART_TIMEOUT:-420}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHON="$PY" TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}

"$ROOT/scripts/gpu/environment.sh" "$PY" torchvision "the matrix's DDP row is not run here" \
  | tee "$OUT/environment.txt"
"$ROOT/scripts/gpu/build-extension.sh" "$OUT/build.log"

matrix() { # GPU PART K
  CUDA_VISIBLE_DEVICES=$1 OUT="$OUT/$2" MATRIX_TIMEOUT=$T PYTEST_ARGS="-k \"$3\"" \
    "$ROOT/scripts/gpu/run-matrix.sh" >"$OUT/$2.out" 2>&1 || true
}
compiled() { # GPU PART PYTEST_ARGS
  CUDA_VISIBLE_DEVICES=$1 OUT="$OUT/$2" REGRESSION_TIMEOUT=$T \
    TORCHINDUCTOR_CACHE_DIR="$TORCHINDUCTOR_CACHE_DIR/$2" \
    REGRESSION_TESTS=tests/regression/test_compile.py PYTEST_ARGS="$3" \
    "$ROOT/scripts/gpu/run-regression.sh" >"$OUT/$2.out" 2>&1 || true
}

decoder=tests/regression/test_compile.py::test_compiled_decoder_under_a_share_of_its_compiled_peak
# The compile-mode rows (reduce-overhead after an uncapped run, max-autotune, dynamic shapes)
# take about as long again as the compile rows here: they are left to calls of their own
# (run-regression.sh with PYTEST_ARGS="-k \"$modes\"", split in two).
modes="after_an_uncapped_run or max_autotune or dynamic_shape_decoder"
if [[ "${GPUS:-4}" == 2 ]]; then
  # Two GPUs: the 16 capped matrix rows alone (about 400 s a GPU); the compile rows do not fit
  # in one call beside them and are left out (run them with run-regression.sh).
  echo "== two GPUs: the capped matrix rows only; the compile rows are not run"
  { matrix 0 capped-b "capped and ((lstm and quarter) or moe or tied_lm)"
    matrix 0 grad-accum "capped and grad_accum"; } &
  { matrix 1 capped-a "capped and (cnn2d or unet3d or (lstm and half))"
    matrix 1 capped-c "capped and (amp_fp16 or adamw_foreach)"; } &
else
  matrix 0 capped-b "capped and ((lstm and quarter) or moe or tied_lm)" &
  { matrix 1 capped-a "capped and (cnn2d or unet3d or (lstm and half))"
    matrix 1 grad-accum "capped and grad_accum"; } &
  { matrix 2 capped-c "capped and (amp_fp16 or adamw_foreach)"
    compiled 2 compile-decoder "-k \"decoder and not ($modes)\""; } &
  { compiled 3 compile "--deselect=$decoder -k \"not ($modes)\""
    if [[ -n "${EXTRA_GPU3:-}" ]]; then
      CUDA_VISIBLE_DEVICES=3 OUT="$OUT/extra" REGRESSION_TIMEOUT=$T \
        PYTEST_ARGS="-k \"$EXTRA_GPU3\"" "$ROOT/scripts/gpu/run-regression.sh" \
        >"$OUT/extra.out" 2>&1 || true
    fi; } &
fi
wait

for part in "$OUT"/*.out; do
  echo "== $(basename "$part" .out): $(grep -E '^(=+ .*(passed|failed|skipped|error).* =+)$' "$part" | tail -1)"
done
tar czf "$OUT/checks.tgz" -C "$OUT" --exclude=checks.tgz .
