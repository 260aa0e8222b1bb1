#!/usr/bin/env bash
# Variants of the packing rule on the nine seeds of engine 2b4cdbd's stress run that fit and
# failed (seeds.jsonl, their records there), one GPU each: run from the checkout's root as
#   OUT=out/variants bash benchmarks/results/stress/2026-11-26-h100x4-9d94d4a-variants/variants.sh COMMIT
set -u
ROOT=$(pwd)
SEEDS=$(cd "$(dirname "$0")" && pwd)/seeds.jsonl
mkdir -p $OUT
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
scripts/gpu/environment.sh python3 > $OUT/env.log 2>&1
E=engine/c10/cuda/LargeModelSupport.cpp
prep() { # name sed-expr...
  local name=$1; shift
  local d=/tmp/var-$name
  rm -rf $d; mkdir -p $d; cp -a . $d/ ; rm -rf $d/out $d/extension/torch_lms/_C*.so
  for ex in "$@"; do sed -i "$ex" $d/$E; done
  (cd $d && git diff --stat > $OUT/$name.diff 2>&1; git diff >> $OUT/$name.diff)
  (cd $d && PYTHON=python3 MAX_JOBS=4 scripts/gpu/build-extension.sh $OUT/$name-build.log > $OUT/$name-build.out 2>&1)
}
prep A &
prep B 's/constexpr double kPackShare = 0.75;/constexpr double kPackShare = 0.0;/' &
prep C 's/constexpr double kPackShare = 0.75;/constexpr double kPackShare = 0.0;/' 's/constexpr size_t kPackSpareBytes = 20 \* kMiB;/constexpr size_t kPackSpareBytes = 200 * kMiB;/' &
prep D 's/constexpr double kPackShare = 0.75;/constexpr double kPackShare = 0.0;/' 's/    return same->second;/    return std::max(same->second, static_cast<size_t>(footprint.inside_per_input * input));/' &
wait
g=0
for v in A B C D; do
  ( cd /tmp/var-$v && CUDA_VISIBLE_DEVICES=$g PYTORCH_LMS_PACK_LOG=1 LMS_ENGINE_COMMIT=$1 LMS_ENGINE_DIRTY=$([ $v = A ] && echo false || echo true) \
    PYTHONPATH=/tmp/var-$v/extension PYTHONUNBUFFERED=1 timeout 480 python3 -m tests.regression.stress.runner \
    --failed-of $SEEDS --jobs 9 --no-triage --out $OUT/$v > $OUT/$v.log 2>&1 ) &
  g=$((g+1))
done
wait
for v in A B C D; do echo "== $v"; grep -E "^gate|classes" $OUT/$v.log; done
