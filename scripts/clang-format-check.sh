#!/usr/bin/env bash
# Check the C++ under the given folders against PyTorch's style (.clang-format at the root,
# PyTorch v2.6.0's own file), with the clang-format of the virtual environment (pinned in
# pyproject.toml: PyTorch's style file needs clang-format 17 or later).
#
#   scripts/clang-format-check.sh DIR...          list every file off style, exit 1 if any
#   scripts/clang-format-check.sh --fix FILE...   reformat those files in place
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cf="${CLANG_FORMAT:-$root/.venv/bin/clang-format}"
if [[ ! -x "$cf" ]]; then
  echo "clang-format-check: $cf not found; run \`make venv\` (or set CLANG_FORMAT=PATH)" >&2
  exit 2
fi
if [[ "${1:-}" == "--fix" ]]; then
  shift
  exec "$cf" -i --style=file "$@"
fi

cd "$root"
mapfile -t files < <(git ls-files -- "$@" | grep -E '\.(h|hpp|cpp|cc|cu|cuh)$' || true)
bad=()
for f in "${files[@]}"; do
  if ! "$cf" --style=file --dry-run --Werror "$f" >/dev/null 2>&1; then
    bad+=("$f")
  fi
done
echo "clang-format ($("$cf" --version | awk '{print $NF}')): ${#files[@]} files checked, ${#bad[@]} off style"
if [[ ${#bad[@]} -gt 0 ]]; then
  printf '  %s\n' "${bad[@]}"
  echo "reformat with: scripts/clang-format-check.sh --fix FILE..."
  exit 1
fi
