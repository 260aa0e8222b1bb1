#!/usr/bin/env bash
# Installs the prebuilt drop-in wheel (built without a GPU by `lmstool dropin`, no compiler
# here) into this machine's stock PyTorch with pip, offline, exactly as a user would, and
# trains a capped model with it: examples/ManyModel.py under a memory cap, without LMS (the
# control: expected to run out of memory) and with LMS.
#
#   scripts/gpu/run-dropin-wheel.sh            results under $OUT (default: out/dropin-wheel)
#
# Environment: PYTHON (default python3: the interpreter with torch and torchvision),
# WHEELS (default .carry/dropin/cu130: the folder `lmstool dropin --out .carry/dropin` filled),
# MODEL, IMAGE_SIZE, BATCH, CAP_GB, ITERATIONS (default resnet152, 512, 16, 8, 10: the capped
# example of examples/README.md).
# Writes: run-dropin-wheel.log, environment.txt, pip-install.txt, import.txt,
# train-nolms.txt, train-lms.txt, train-lms.csv, summary.txt.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/out/dropin-wheel}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.carry/dropin/cu130}
MODEL=${MODEL:-resnet152}
IMAGE_SIZE=${IMAGE_SIZE:-512}
BATCH=${BATCH:-16}
CAP_GB=${CAP_GB:-8}
ITERATIONS=${ITERATIONS:-10}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/run-dropin-wheel.log") 2>&1

"$ROOT/scripts/gpu/environment.sh" "$PY" torchvision "the capped model cannot run" \
  | tee "$OUT/environment.txt"

if ! compgen -G "$WHEELS/torch_lms-*.whl" >/dev/null; then
  echo "run-dropin-wheel.sh: no torch_lms wheel in $WHEELS: build it with" \
    "lmstool dropin --out .carry/dropin and carry .carry/dropin here" >&2
  exit 2
fi
echo "== wheels offered"
ls -l "$WHEELS"/torch_lms-*.whl

# Run everything outside the checkout so that its extension/ folder (sources, never built
# here) cannot stand in for the installed package.
cd "$OUT"
torch_before=$("$PY" -c 'import torch; print(torch.__version__)')

echo "== pip install --no-index --find-links $WHEELS torch-lms"
"$PY" -m pip install --no-index --find-links "$WHEELS" torch-lms 2>&1 | tee "$OUT/pip-install.txt"
"$PY" -m pip show torch-lms | tee -a "$OUT/pip-install.txt"
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
echo "torch before $torch_before, after $torch_after" | tee -a "$OUT/pip-install.txt"
if [[ "$torch_before" != "$torch_after" ]]; then
  echo "run-dropin-wheel.sh: installing torch-lms changed torch" >&2
  exit 1
fi

echo "== import"
"$PY" - <<'PY' 2>&1 | tee "$OUT/import.txt"
import torch
import torch_lms

print("torch_lms", torch_lms.__version__, "from", torch_lms.__file__)
assert "site-packages" in torch_lms.__file__, "torch_lms was not imported from the installation"
torch.cuda.set_enabled_lms(True)
print("enabled", torch.cuda.get_enabled_lms(), "limit", torch.cuda.get_limit_lms())
torch.cuda.set_enabled_lms(False)
PY

args=("$ROOT/examples/ManyModel.py" "$MODEL" --image-size "$IMAGE_SIZE" --batch-size "$BATCH"
  --memory-cap-gb "$CAP_GB" --iterations "$ITERATIONS")
echo "== $MODEL under a ${CAP_GB} GB cap without LMS (control)"
set +e
"$PY" "${args[@]}" --no-lms >"$OUT/train-nolms.txt" 2>&1
nolms=$?
echo "== $MODEL under a ${CAP_GB} GB cap with LMS (the installed wheel)"
"$PY" "${args[@]}" --lms --stats-csv "$OUT/train-lms.csv" >"$OUT/train-lms.txt" 2>&1
lms=$?
set -e
tail -n 15 "$OUT/train-nolms.txt"
tail -n 25 "$OUT/train-lms.txt"
{
  echo "torch-lms $("$PY" -m pip show torch-lms | sed -n 's/^Version: //p')"
  echo "torch $torch_after"
  echo "model $MODEL image $IMAGE_SIZE batch $BATCH cap ${CAP_GB}GB iterations $ITERATIONS"
  echo "without LMS: exit $nolms (3: out of device memory)"
  echo "with LMS: exit $lms"
} | tee "$OUT/summary.txt"
exit "$lms"
