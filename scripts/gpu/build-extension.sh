#!/usr/bin/env bash
# Builds the drop-in extension torch_lms in place (extension/torch_lms/_C*.so) against this
# machine's PyTorch, offline: no pip downloads. Shared by the scripts/gpu/run-*.sh runners.
#
#   scripts/gpu/build-extension.sh LOG [--if-missing]
#
# LOG: the build's output (shown in part when it fails). --if-missing: keep an extension that
# is already built from the same sources (engine/, extension/csrc, setup files; their hash is
# kept in extension/torch_lms/.sources.sha256). Environment: PYTHON (default python3),
# CUDA_HOME (default /usr/local/cuda), MAX_JOBS (parallel compile jobs, default 8). Exits 1
# when the build fails.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
log=${1:?usage: build-extension.sh LOG [--if-missing]}
PY=${PYTHON:-python3}

# The sources the extension is built from; a build records their hash next to the module,
# so that an extension built from other sources (a machine that keeps build outputs between
# runs of different checkouts) is never taken for this one.
sources_hash() {
  (cd "$ROOT" && find engine extension/csrc extension/setup.py extension/setup.cfg -type f \
    -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}
stamp=$ROOT/extension/torch_lms/.sources.sha256
hash=$(sources_hash)
if [[ "${2:-}" == "--if-missing" ]] && compgen -G "$ROOT/extension/torch_lms/_C*.so" >/dev/null &&
  [[ -f "$stamp" && "$(cat "$stamp")" == "$hash" ]]; then
  echo "== torch_lms already built from these sources: $(ls "$ROOT"/extension/torch_lms/_C*.so)"
  exit 0
fi
echo "== build torch_lms (offline)"
start=$(date +%s)
(
  cd "$ROOT/extension"
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export MAX_JOBS=${MAX_JOBS:-8}
  "$PY" setup.py build_ext --inplace
) >"$log" 2>&1 || { tail -n 60 "$log"; echo "build failed"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
echo "$hash" >"$stamp"
