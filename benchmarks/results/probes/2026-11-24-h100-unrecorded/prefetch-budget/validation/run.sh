#!/usr/bin/env bash
# The derived prefetch budget against the fixed eighth of the limit, one process per setting.
set -u
ROOT=$(pwd)
O=$OUT/budget; mkdir -p $O
PYTHON=python3 scripts/gpu/build-extension.sh $O/build.log --if-missing
export PYTHONPATH=$ROOT/extension PYTHONUNBUFFERED=1
args_for() { case $1 in resnet152) echo "--amp --batch 64";; *) echo "";; esac; }
summ() {
  python3 - "$1" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['measurements']:
  if r['method']=='lms':
    G=2**30
    print(f"  {r['factor']}x {r['status']} {r.get('iteration_s') or 0:.3f} s out {(r.get('out_bytes_per_iter') or 0)/G:.2f} GiB deficit {(r.get('deficit_bytes') or 0)/G:.2f} stall {r.get('stall_ms_per_iter') or 0:.0f} ms | {r.get('lms_schedule')}")
PY
}
for model in gpt vit_l resnet152; do
  echo "== $model derived budget"
  timeout 150 python3 benchmarks/compare.py --model $model $(args_for $model) --out $O/$model-derived \
    --factors 1.5,2,4 --methods lms --no-overhead --no-search --time-budget-s 130 > $O/$model-derived.log 2>&1
  summ $O/$model-derived/compare-$model.json
done
for model in gpt vit_l resnet152; do
  for f in 1.5 2.0 4.0; do
    mib=$(python3 - "$O/$model-derived/compare-$model.json" $f <<'PY'
import json,re,sys
d=json.load(open(sys.argv[1]))
for r in d['measurements']:
  if r['method']=='lms' and r['factor']==float(sys.argv[2]):
    m=re.search(r'of a (\d+) MiB limit', r.get('lms_schedule') or '')
    print(int(m.group(1))//8 if m else '')
PY
)
    [ -z "$mib" ] && { echo "== $model $f: no limit recorded"; continue; }
    echo "== $model ${f}x fixed budget ${mib} MiB (an eighth of the limit)"
    PYTORCH_LMS_CONF="lms_prefetch_budget_mb:$mib" timeout 100 python3 benchmarks/compare.py --model $model $(args_for $model) \
      --out $O/$model-eighth-$f --factors $f --methods lms --no-overhead --no-search --time-budget-s 80 > $O/$model-eighth-$f.log 2>&1
    summ $O/$model-eighth-$f/compare-$model.json
  done
done
cd $OUT && tar czf budget.tgz budget
