#!/usr/bin/env bash
# Installs a CPU build of PyTorch into the test environment when pip can take one from a local
# wheel folder (pip's find-links), for the CPU-side tests of the torch.cuda LMS API and the
# drop-in extension's compile check. A CUDA build from the package index is several GB, so it
# is never downloaded here: without a local wheel those tests skip and say why.
#
#   scripts/install-test-torch.sh PYTHON [REQUIREMENT]     (default requirement: torch==2.13.0)
set -euo pipefail
py=${1:?usage: install-test-torch.sh PYTHON [REQUIREMENT]}
req=${2:-torch==2.13.0}

if "$py" -c 'import torch' 2>/dev/null; then
  exit 0
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
# --no-index: succeeds only when a find-links folder holds the wheel.
if "$py" -m pip download --quiet --no-deps --no-index --only-binary=:all: -d "$probe" "$req" \
    >/dev/null 2>&1 && ls "$probe"/torch-*+cpu-*.whl >/dev/null 2>&1; then
  echo "installing $(basename "$probe"/torch-*.whl) for the CPU-side torch tests"
  "$py" -m pip install --quiet "$probe"/torch-*.whl
else
  echo "no local CPU wheel for $req: the torch API and extension compile tests will skip"
fi
