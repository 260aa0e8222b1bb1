#!/usr/bin/env bash
# Prints what a GPU run depends on, at the top of its log: the date, the engine that runs (its
# commit, whether the tree had changes and its sources hash: lmsbench/lms_setup.py's
# provenance, so a log names its engine even when the run is stopped before it writes
# results), the GPUs, host memory, torch and CUDA, and the version of each optional module
# named (or, where one is missing, what the run does without it). Shared by the
# scripts/gpu/run-*.sh runners.
#
#   scripts/gpu/environment.sh PYTHON [MODULE "without it: what happens"]...
set -euo pipefail

py=${1:?usage: environment.sh PYTHON [MODULE MESSAGE]...}
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
echo "== environment"
date -u +%Y-%m-%dT%H:%M:%SZ
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'PY' \
  || echo "engine: unknown (lmsbench/lms_setup.py did not load)"
from lmsbench.lms_setup import provenance

found = provenance()
print(
    "engine", found["engine_commit"], "dirty", found["engine_dirty"],
    "sources", found["engine_sources_sha256"],
)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
grep MemTotal /proc/meminfo || true
"$py" - "$@" <<'PY'
import sys

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
args = sys.argv[1:]
for name, without in zip(args[::2], args[1::2]):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "(no version)"))
    except ImportError:
        print(name, "missing:", without)
PY
