#!/usr/bin/env bash
# Half the derived prefetch budget at 1.5x (engine 471e710), against the default, one process
# per setting. Run from the repository root: OUT=out budget.sh
set -u
ROOT=$(pwd)
O=$OUT/budget; mkdir -p $O
export MAX_JOBS=16
PYTHON=python3 scripts/gpu/build-extension.sh $O/build.log --if-missing
export PYTHONPATH=$ROOT/extension PYTHONUNBUFFERED=1
args_for() { case $1 in resnet152) echo "--amp --batch 64";; *) echo "";; esac; }
run() { # model factor tag conf
  local model=$1 f=$2 tag=$3 conf=$4
  echo "== $model ${f}x $tag PYTORCH_LMS_CONF=$conf $(date +%T)"
  PYTORCH_LMS_CONF="$conf" timeout 100 python3 benchmarks/compare.py --model $model $(args_for $model) --out $O/$model-$f-$tag \
    --factors $f --methods lms --no-overhead --no-search --time-budget-s 85 > $O/$model-$f-$tag.log 2>&1
  python3 - "$O/$model-$f-$tag/compare-$model.json" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['measurements']:
  if r['method']=='lms':
    G=2**30
    print(f"  {r['status']} {r.get('iteration_s') or 0:.3f} s out {(r.get('out_bytes_per_iter') or 0)/G:.2f} GiB in {(r.get('in_bytes_per_iter') or 0)/G:.2f} deficit {(r.get('deficit_bytes') or 0)/G:.2f} stall {r.get('stall_ms_per_iter') or 0:.0f} ms | {r.get('lms_schedule')}")
PY
}
run resnet152 1.5 half "lms_prefetch_budget_mb:1170"
run resnet152 1.5 default ""
run vit_l 1.5 half "lms_prefetch_budget_mb:548"
run vit_l 1.5 default ""
run gpt 1.5 half "lms_prefetch_budget_mb:782"
run gpt 1.5 default ""
cd $OUT && tar czf budget.tgz budget && rm -rf budget/*/
