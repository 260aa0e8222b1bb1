#!/usr/bin/env bash
# Engine tier on a real GPU (T2): extracts TAG's source tarball, applies its committed series,
# builds libc10 + libc10_cuda against the real CUDA runtime (standalone/, never a full PyTorch
# build), runs the engine suites (engine, learned schedule, host tier) and the page-out/page-in
# throughput benchmark.
#
#   [TAG=v2.6.0] scripts/gpu/run-engine.sh     results under $OUT (default: out/engine)
#
# TAG defaults to the tag matrix's default tag (config/tags.yaml); its series folder and
# tarball name come from the matrix too, through lmstool, or on a machine whose Python lacks
# lmstool's dependencies from .carry/matrix-<tag>.env (scripts/prepare-carry.sh writes them).
# Needs .carry/ (scripts/prepare-carry.sh) with the tag's tarball copied into it, for machines
# without network or Debian's fmt/cpuinfo packages.
# Writes: run-engine.log, environment.txt, engine-tests.txt, bench-copy.txt, bench-copy.csv.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/engine}
TAG=${TAG:-}
if ! matrix=$(cd "$ROOT" && "${PYTHON:-python3}" -m lmstool tags --shell $TAG 2>/dev/null); then
  env_file="$ROOT/.carry/matrix-${TAG:-default}.env"
  if [[ ! -f "$env_file" ]]; then
    echo "run-engine.sh: cannot read the tag matrix: lmstool does not run here and" \
         "$env_file is missing (scripts/prepare-carry.sh writes it)" >&2
    exit 2
  fi
  matrix=$(cat "$env_file")
fi
eval "$matrix"
if [[ -z "$LMS_SERIES" ]]; then
  echo "run-engine.sh: $LMS_TAG has no LMS series; pass TAG= with a tag that has one" >&2
  exit 2
fi
TARBALL=${TARBALL:-$ROOT/.carry/${LMS_TARBALLS%% *}}
WORK=${WORK:-/tmp/lms-engine}
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/run-engine.log") 2>&1

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -n 2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
    2>/dev/null || true
} | tee "$OUT/environment.txt"

echo "== source and series"
rm -rf "$WORK/src"
mkdir -p "$WORK/src"
tar xf "$TARBALL" -C "$WORK/src"
tree=$(echo "$WORK"/src/*)
(cd "$tree" && git apply --whitespace=nowarn "$ROOT/$LMS_SERIES"/*.patch)
echo "applied $(ls "$ROOT/$LMS_SERIES"/*.patch | wc -l) patches of $LMS_TAG to $tree"

echo "== build (real CUDA runtime)"
bash "$ROOT/standalone/build.sh" --source "$tree" --build "$WORK/build" --runtime real \
  --jobs "$(nproc)"

echo "== engine suites: engine, learned schedule, host tier"
# The host suite's processes share a ledger of their own, not the host's.
export PYTORCH_LMS_HOST_LEDGER="$WORK/host-ledger"
rm -f "$PYTORCH_LMS_HOST_LEDGER"
suite=0
: >"$OUT/engine-tests.txt"
for name in test_lms_engine test_lms_schedule test_lms_host; do
  echo "== $name" | tee -a "$OUT/engine-tests.txt"
  set +e
  "$WORK/build/$name" 2>&1 | tee -a "$OUT/engine-tests.txt"
  status=${PIPESTATUS[0]}
  set -e
  [[ $status -eq 0 ]] || suite=$status
done

echo "== page-out / page-in throughput"
"$WORK/build/bench_lms_copy" --csv "$OUT/bench-copy.csv" 2>&1 | tee "$OUT/bench-copy.txt"

exit "$suite"
