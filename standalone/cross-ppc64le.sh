#!/usr/bin/env bash
# Cross-build libc10, libc10_cuda, simgpu and the simgpu tests for ppc64le on
# an x86_64 Debian host, and run the tests under qemu-user.
#
#   standalone/cross-ppc64le.sh --source <pytorch tree> --build <dir>
#                               [--jobs N] [--carry DIR] [--no-test]
#
# Needs g++-powerpc64le-linux-gnu and qemu-user (Debian packages), the x86_64
# CUDA toolkit's headers (CUDA has no ppc64le toolkit after 12.4; the runtime
# API headers are architecture-neutral and accepted by a plain g++ for
# ppc64le) and a .carry folder from scripts/prepare-carry.sh for fmt and nvml
# headers. cpuinfo is not used on ppc64le (as upstream). Only the simgpu
# runtime is possible: there is no ppc64le libcudart 13.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
source_dir=""
build_dir=""
jobs="$(nproc 2>/dev/null || echo 2)"
carry="$repo/.carry"
run_tests=1
triple="powerpc64le-linux-gnu"
sysroot="/usr/$triple"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) source_dir="$2"; shift 2 ;;
    --build) build_dir="$2"; shift 2 ;;
    --jobs|-j) jobs="$2"; shift 2 ;;
    --carry) carry="$2"; shift 2 ;;
    --no-test) run_tests=0; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cross-ppc64le.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n "$source_dir" && -n "$build_dir" ]] || {
  echo "usage: $0 --source <tree> --build <dir>" >&2; exit 2; }
for tool in "$triple-g++" "$triple-gcc" qemu-ppc64le; do
  command -v "$tool" >/dev/null || {
    echo "cross-ppc64le.sh: $tool missing (apt-get install" \
         "g++-powerpc64le-linux-gnu qemu-user)" >&2; exit 2; }
done
[[ -f "$carry/root/usr/include/fmt/format.h" &&
   -f "$carry/nvml/include/nvml.h" ]] || {
  echo "cross-ppc64le.sh: run scripts/prepare-carry.sh first" >&2; exit 2; }

cuda_include="${CUDA_HOME:-/usr/local/cuda}/include"
mkdir -p "$build_dir"
build_dir="$(cd "$build_dir" && pwd)"
source_dir="$(cd "$source_dir" && pwd)"
carry="$(cd "$carry" && pwd)"

# Only the target's sysroot is searched for libraries and headers; the host's
# /usr/include must never reach the cross compiler, which is why fmt comes
# from the carry folder (it holds nothing else but cpuinfo/clog headers).
toolchain="$build_dir/ppc64le-toolchain.cmake"
cat > "$toolchain" <<TOOLCHAIN
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR ppc64le)
set(CMAKE_C_COMPILER $triple-gcc)
set(CMAKE_CXX_COMPILER $triple-g++)
set(CMAKE_FIND_ROOT_PATH $sysroot)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-ppc64le;-L;$sysroot)
TOOLCHAIN

args=(
  -S "$here" -B "$build_dir"
  -DCMAKE_TOOLCHAIN_FILE="$toolchain"
  -DPYTORCH_SOURCE="$source_dir"
  -DLMS_CUDA_RUNTIME=sim
  -DCUDA_INCLUDE_DIR="$cuda_include"
  -DFMT_INCLUDE_DIR="$carry/root/usr/include"
  -DNVML_INCLUDE_DIR="$carry/nvml/include"
)
[[ -f "$build_dir/CMakeCache.txt" ]] || args+=(-G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')")
if command -v ccache >/dev/null 2>&1; then
  launcher="env;CCACHE_BASEDIR=${CCACHE_BASEDIR:-/};ccache"
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"
         -DCMAKE_C_COMPILER_LAUNCHER="$launcher")
fi

echo "== configure (ppc64le, simgpu runtime)"
start=$(date +%s)
cmake "${args[@]}"
echo "== build: $jobs jobs"
cmake --build "$build_dir" --parallel "$jobs"
echo "== built in $(( $(date +%s) - start )) s"
file "$build_dir/libc10_cuda.so" | sed 's/, BuildID.*//'

if [[ $run_tests == 1 ]]; then
  echo "== test under qemu-ppc64le"
  (cd "$build_dir" && ctest --output-on-failure)
fi
