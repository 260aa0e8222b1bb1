#!/usr/bin/env bash
# The lookahead shortened by the page-in traffic (period/8 divided by clamp(in/limit, 1, 2))
# against the derived default (period/8), one process per setting.
set -u
ROOT=$(pwd)
O=$OUT/lookahead; mkdir -p $O
PYTHON=python3 scripts/gpu/build-extension.sh $O/build.log --if-missing
export PYTHONPATH=$ROOT/extension PYTHONUNBUFFERED=1
args_for() { case $1 in resnet152) echo "--amp --batch 64";; *) echo "";; esac; }
run() { # model factor tag conf
  local model=$1 f=$2 tag=$3 conf=$4
  echo "== $model ${f}x $tag PYTORCH_LMS_CONF=$conf"
  PYTORCH_LMS_CONF="$conf" timeout 85 python3 benchmarks/compare.py --model $model $(args_for $model) --out $O/$model-$f-$tag \
    --factors $f --methods lms --no-overhead --no-search --time-budget-s 70 > $O/$model-$f-$tag.log 2>&1
  python3 - "$O/$model-$f-$tag/compare-$model.json" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['measurements']:
  if r['method']=='lms':
    G=2**30
    print(f"  {r['status']} {r.get('iteration_s') or 0:.3f} s out {(r.get('out_bytes_per_iter') or 0)/G:.2f} GiB in {(r.get('in_bytes_per_iter') or 0)/G:.2f} stall {r.get('stall_ms_per_iter') or 0:.0f} ms | {r.get('lms_schedule')}")
PY
}
run gpt 4 default ""
run gpt 4 la168 "lms_lookahead:168"
run vit_l 4 default ""
run vit_l 4 la212 "lms_lookahead:212"
run gpt 2 default ""
run gpt 2 la268 "lms_lookahead:268"
run vit_l 2 default ""
run vit_l 2 la335 "lms_lookahead:335"
run resnet152 4 default ""
run resnet152 4 la114 "lms_lookahead:114"
cd $OUT && tar czf lookahead.tgz lookahead
