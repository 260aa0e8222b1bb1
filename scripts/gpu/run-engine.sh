#!/usr/bin/env bash
# Engine tier on a real GPU (T2): extracts the v2.6.0 source tarball, applies the committed
# series, builds libc10 + libc10_cuda against the real CUDA runtime (standalone/, never a full
# PyTorch build), runs the engine suite and the page-out/page-in throughput benchmark.
#
#   scripts/gpu/run-engine.sh            results under $OUT (default: out/engine)
#
# Needs .carry/ (scripts/prepare-carry.sh) with the v2.6.0 tarball copied into it, for
# machines without network or Debian's fmt/cpuinfo packages.
# Writes: run-engine.log, environment.txt, engine-tests.txt, bench-copy.txt, bench-copy.csv.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/engine}
TARBALL=${TARBALL:-$ROOT/.carry/pytorch_2.6.0+dfsg.orig.tar.xz}
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
(cd "$tree" && git apply --whitespace=nowarn "$ROOT"/patches/v2.6.0/*.patch)
echo "applied $(ls "$ROOT"/patches/v2.6.0/*.patch | wc -l) patches to $tree"

echo "== build (real CUDA runtime)"
bash "$ROOT/standalone/build.sh" --source "$tree" --build "$WORK/build" --runtime real \
  --jobs "$(nproc)"

echo "== engine suite"
set +e
"$WORK/build/test_lms_engine" 2>&1 | tee "$OUT/engine-tests.txt"
suite=${PIPESTATUS[0]}
set -e

echo "== page-out / page-in throughput"
"$WORK/build/bench_lms_copy" --csv "$OUT/bench-copy.csv" 2>&1 | tee "$OUT/bench-copy.txt"

exit "$suite"
