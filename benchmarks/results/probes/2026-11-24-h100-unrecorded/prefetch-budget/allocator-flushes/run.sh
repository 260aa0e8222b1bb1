#!/usr/bin/env bash
set -u
ROOT=$(pwd); O=$OUT/flush; mkdir -p $O
PYTHON=python3 scripts/gpu/build-extension.sh $O/build.log --if-missing
export PYTHONPATH=$ROOT/extension PYTHONUNBUFFERED=1
for m in gpt vit_l; do
  timeout 140 python3 benchmarks/compare.py --model $m --out $O/$m --factors 2,4 --methods lms --no-overhead --no-search --time-budget-s 120 > $O/$m.log 2>&1
  python3 - "$O/$m/compare-$m.json" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['measurements']:
  if r['method']=='lms': print(r['model'], r['factor'], r['status'], round(r.get('iteration_s') or 0,3), r.get('lms_schedule'))
PY
done
cd $OUT && tar czf flush.tgz flush
