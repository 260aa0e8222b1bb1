#!/usr/bin/env bash
# Prepare .carry/: the third-party build inputs of the standalone c10 build
# (standalone/build.sh) for a machine that has neither network access nor the
# Debian -dev packages (the GPU machine).
#
#   scripts/prepare-carry.sh [--dest DIR]     download and unpack (networked
#                                             Debian host)
#   scripts/prepare-carry.sh --unpack [--dest DIR]
#                                             only unpack DIR/debs into
#                                             DIR/root (no network; uses dpkg
#                                             -x, or ar + tar without dpkg)
#
# Layout (DIR defaults to <repo>/.carry, which git ignores):
#   debs/*.deb          libfmt-dev libfmt9 libcpuinfo-dev libcpuinfo0
#   root/usr/...        the .debs unpacked (fmt headers, cpuinfo.h and lib)
#   nvml/include/nvml.h from the nvidia-nvml-dev wheel (NVML 13.0)
#   matrix-<tag>.env    the tag matrix as shell assignments (lmstool tags --shell)
#
# standalone/build.sh picks up <repo>/.carry automatically. On the GPU machine
# pass .carry with the run (it is about 3 MiB) and call
#   scripts/prepare-carry.sh --unpack      # only if root/ was not carried
#   standalone/build.sh --source <tree> --build build/real --runtime real
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo/.carry"
unpack_only=0
# Debian bookworm names: fmt 9 is header-usable as fmt::fmt-header-only,
# cpuinfo is needed by c10/core/thread_pool.cpp on x86_64 and aarch64.
debs=(libfmt-dev libfmt9 libcpuinfo-dev libcpuinfo0)
nvml_wheel="nvidia-nvml-dev==13.0.*"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dest) dest="$2"; shift 2 ;;
    --unpack) unpack_only=1; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "prepare-carry.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

unpack_deb() {
  local deb="$1" root="$2"
  if command -v dpkg-deb >/dev/null 2>&1; then
    dpkg-deb -x "$deb" "$root"
  else
    # A .deb is an ar archive holding data.tar.{xz,zst,gz}.
    local tmp
    tmp="$(mktemp -d)"
    (cd "$tmp" && ar x "$deb")
    tar -xf "$tmp"/data.tar.* -C "$root"
    rm -rf "$tmp"
  fi
}

if [[ $unpack_only == 0 ]]; then
  echo "== downloading ${debs[*]}"
  mkdir -p "$dest/debs"
  rm -f "$dest"/debs/*.deb
  (cd "$dest/debs" && apt-get download "${debs[@]}")

  echo "== downloading $nvml_wheel"
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --dest "$tmp" "$nvml_wheel"
  rm -rf "$dest/nvml"
  mkdir -p "$dest/nvml/include"
  python3 - "$tmp" "$dest/nvml/include" <<'PY'
import pathlib, sys, zipfile
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(src.glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/include/nvml.h"))
    (out / "nvml.h").write_bytes(z.read(name))
print(f"nvml.h from {wheel.name}")
PY
  rm -rf "$tmp"
fi

echo "== unpacking into $dest/root"
rm -rf "$dest/root"
mkdir -p "$dest/root"
shopt -s nullglob
found=0
for deb in "$dest"/debs/*.deb; do
  unpack_deb "$deb" "$dest/root"
  found=1
done
[[ $found == 1 ]] || { echo "no .deb files in $dest/debs" >&2; exit 1; }

# The tag matrix as shell assignments, for scripts/gpu/run-engine.sh on a machine whose Python
# lacks lmstool's dependencies: matrix-<tag>.env per tag, matrix-default.env for the default.
if [[ $unpack_only == 0 ]]; then
  py="$repo/.venv/bin/python"
  [[ -x "$py" ]] || py=python3
  if "$py" -m lmstool --repo "$repo" tags --shell > "$dest/matrix-default.env"; then
    for tag in $("$py" -m lmstool --repo "$repo" tags --json |
                 "$py" -c 'import json, sys; print(*(t["tag"] for t in json.load(sys.stdin)))'); do
      "$py" -m lmstool --repo "$repo" tags --shell "$tag" > "$dest/matrix-$tag.env"
    done
  else
    echo "prepare-carry.sh: lmstool cannot read the tag matrix (make venv first)" >&2
    exit 1
  fi
fi

test -f "$dest/root/usr/include/fmt/format.h"
test -f "$dest/root/usr/include/cpuinfo.h"
test -f "$dest/nvml/include/nvml.h"
du -sh "$dest" | awk '{print "== ready: " $2 " (" $1 ")"}'
