#!/usr/bin/env bash
# Install the system packages listed in scripts/apt-packages.txt (one a line, '#' comments),
# or in the list file given as the argument.
#
# Quiet and does nothing when everything is installed. When something is missing it runs
# `apt-get update && apt-get install -y --no-install-recommends ...` as root, or through sudo
# when it is there; otherwise it prints the command to run and exits 1.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
list="${1:-$here/apt-packages.txt}"

if [[ ! -r "$list" ]]; then
    echo "install-deps: $list not found; run from a project checkout" >&2
    exit 1
fi

mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$' || true)
[[ ${#packages[@]} -eq 0 ]] && exit 0

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install-deps: not a Debian-based system; install the equivalents of: ${packages[*]}" >&2
    exit 0
fi

missing=()
for pkg in "${packages[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ "$(id -u)" -eq 0 ]]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo env DEBIAN_FRONTEND=noninteractive)
    echo "install-deps: installing ${missing[*]} with sudo (see $list for why each)"
else
    echo "install-deps: missing system packages: ${missing[*]}" >&2
    echo "install-deps: run as root: $0 (or: apt-get install ${missing[*]})" >&2
    exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
