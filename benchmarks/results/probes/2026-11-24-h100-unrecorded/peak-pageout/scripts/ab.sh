#!/usr/bin/env bash
# A/B: engine with page-outs ahead of the peak (this checkout, 471e710) against the engine
# before it (OLD_TREE: a checkout of 779ef70, e.g. `git worktree add ../lms-779ef70 779ef70`).
# The same compare.py (this checkout's) runs both; LMS rows at 1.5x/2x/4x with a profile.
# Run from the repository root: OUT=out T=170 ab.sh resnet152 gpt vit_l
set -u
: "${OLD_TREE:?a checkout of the engine before, 779ef70}"
ROOT=$(pwd)
O=$OUT/ab; mkdir -p $O
export MAX_JOBS=16
PYTHON=python3 scripts/gpu/build-extension.sh $O/build-new.log --if-missing &
(cd "$OLD_TREE" && PYTHON=python3 scripts/gpu/build-extension.sh $O/build-old.log --if-missing) &
wait
args_for() { case $1 in resnet152) echo "--amp --batch 64";; *) echo "";; esac; }
run() { # model tag root
  local model=$1 tag=$2 root=$3
  echo "== $model $tag $(date +%T)"
  (cd $ROOT && PYTHONPATH=$root/extension PYTHONUNBUFFERED=1 timeout ${T:-200} python3 benchmarks/compare.py --model $model $(args_for $model) \
    --out $O/$model-$tag --factors ${F:-1.5,2,4} --methods lms --no-overhead --no-search --profile-iterations 1 \
    --time-budget-s $(( ${T:-200} - 15 )) > $O/$model-$tag.log 2>&1)
  echo "rc=$?"
  python3 - "$O/$model-$tag/compare-$model.json" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
G=2**30
for r in d['measurements']:
  if r['method']=='lms':
    p=r.get('profile') or {}
    print(f"  {r['factor']}x {r['status']} {r.get('iteration_s') or 0:.3f} s out {(r.get('out_bytes_per_iter') or 0)/G:.2f} in {(r.get('in_bytes_per_iter') or 0)/G:.2f} deficit {(r.get('deficit_bytes') or 0)/G:.2f} stall {r.get('stall_ms_per_iter') or 0:.0f} ms ser {r.get('serial_efficiency')} busy {p.get('compute_busy_ms')} idle_copy {p.get('idle_while_copying_ms')} idle_gpu {p.get('idle_gpu_idle_ms')} both {p.get('both_directions_ms')} | {r.get('lms_schedule')}")
PY
}
for m in "$@"; do
  run $m new $ROOT
  run $m old "$OLD_TREE"
done
cd $OUT && tar czf ab-$(date +%H%M%S).tgz ab && rm -rf ab/*/
