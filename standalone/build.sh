#!/usr/bin/env bash
# Configure and build libc10 + libc10_cuda (and the engine tests, benchmarks
# and simgpu tests) from a PyTorch source tree with standalone/CMakeLists.txt.
#
#   standalone/build.sh --source <pytorch tree> --build <dir>
#                       [--runtime sim|real] [--jobs N] [--type Release]
#                       [--carry <dir>] [--overlay <dir>] [--test]
#                       [-- <extra cmake -D arguments>]
#
#   --runtime  sim (default): link c10_cuda to simgpu, the host-memory CUDA
#              stand-in; real: link it to the toolkit's libcudart
#   --carry    a folder prepared by scripts/prepare-carry.sh (unpacked fmt,
#              cpuinfo and nvml headers) for machines without those packages;
#              default: <repo>/.carry when it exists
#   --overlay  LMS_ENGINE_OVERLAY: build the engine sources from this folder
#              (e.g. <repo>/engine) into c10_cuda of an unpatched tree
#   --test     run ctest after building
#
# Environment: CUDA_HOME (default /usr/local/cuda), CCACHE_DIR as usual.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

source_dir=""
build_dir=""
runtime="sim"
jobs="$(nproc 2>/dev/null || echo 2)"
build_type="Release"
carry=""
overlay=""
run_tests=0
extra=()

usage() {
  sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) source_dir="$2"; shift 2 ;;
    --build) build_dir="$2"; shift 2 ;;
    --runtime) runtime="$2"; shift 2 ;;
    --jobs|-j) jobs="$2"; shift 2 ;;
    --type) build_type="$2"; shift 2 ;;
    --carry) carry="$2"; shift 2 ;;
    --overlay) overlay="$2"; shift 2 ;;
    --test) run_tests=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; extra+=("$@"); break ;;
    *) echo "build.sh: unknown argument: $1" >&2; usage 2 ;;
  esac
done

[[ -n "$source_dir" && -n "$build_dir" ]] || usage 2
[[ "$runtime" == sim || "$runtime" == real ]] || {
  echo "build.sh: --runtime must be sim or real" >&2; exit 2; }
[[ -f "$source_dir/c10/cuda/CMakeLists.txt" ]] || {
  echo "build.sh: $source_dir is not a PyTorch source tree" >&2; exit 2; }

source_dir="$(cd "$source_dir" && pwd)"
mkdir -p "$build_dir"
build_dir="$(cd "$build_dir" && pwd)"

args=(
  -S "$here" -B "$build_dir"
  -DPYTORCH_SOURCE="$source_dir"
  -DLMS_CUDA_RUNTIME="$runtime"
  -DCMAKE_BUILD_TYPE="$build_type"
)

if command -v ninja >/dev/null 2>&1; then
  generator="Ninja"
else
  generator="Unix Makefiles"
fi
# An existing build directory keeps its generator.
if [[ -f "$build_dir/CMakeCache.txt" ]]; then
  generator="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' \
    "$build_dir/CMakeCache.txt")"
else
  args+=(-G "$generator")
fi

cuda_home="${CUDA_HOME:-/usr/local/cuda}"
if [[ -x "$cuda_home/bin/nvcc" ]]; then
  args+=(-DCUDAToolkit_ROOT="$cuda_home")
fi

if command -v ccache >/dev/null 2>&1; then
  # CCACHE_BASEDIR makes the hashed command lines use relative paths, so
  # build directories and source trees in different places share entries. It
  # is part of the launcher so a later plain `ninja` in the build directory
  # hits the same entries.
  launcher="env;CCACHE_BASEDIR=${CCACHE_BASEDIR:-/};ccache"
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"
         -DCMAKE_C_COMPILER_LAUNCHER="$launcher")
  use_ccache=1
else
  use_ccache=0
fi

# Headers and libraries unpacked by scripts/prepare-carry.sh: always used when
# --carry is given; <repo>/.carry only for what the system lacks.
explicit_carry=0
if [[ -n "$carry" ]]; then
  explicit_carry=1
elif [[ -d "$repo/.carry/root" ]]; then
  carry="$repo/.carry"
fi
use_from_carry() { # <file in carry> <system file>
  [[ -f "$1" ]] && { [[ $explicit_carry == 1 ]] || [[ ! -f "$2" ]]; }
}
if [[ -n "$carry" ]]; then
  carry="$(cd "$carry" && pwd)"
  root="$carry/root"
  [[ -d "$root" ]] || {
    echo "build.sh: $carry has no root/ (run scripts/prepare-carry.sh)" >&2
    exit 2; }
  if use_from_carry "$root/usr/include/fmt/format.h" \
       /usr/include/fmt/format.h; then
    args+=(-DFMT_INCLUDE_DIR="$root/usr/include")
  fi
  if use_from_carry "$root/usr/include/cpuinfo.h" /usr/include/cpuinfo.h; then
    args+=(-DCPUINFO_ROOT="$root")
    # The unpacked libcpuinfo.so.0 must be found at run time too.
    libdir="$(dirname "$(find "$root" -name 'libcpuinfo.so*' | head -n1)")"
    export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    args+=(-DCMAKE_BUILD_RPATH="$libdir")
  fi
  if [[ -f "$carry/nvml/include/nvml.h" ]]; then
    args+=(-DNVML_INCLUDE_DIR="$carry/nvml/include")
  fi
fi

# nvml.h: the carry folder above, else the CUDA toolkit, else the nvidia-nvml-dev wheel in
# the Python environment ($PYTHON, default python3).
if ! printf '%s\n' "${args[@]}" | grep -q '^-DNVML_INCLUDE_DIR=' &&
   [[ ! -f "${CUDA_HOME:-/usr/local/cuda}/include/nvml.h" ]]; then
  nvml_dir="$("${PYTHON:-python3}" - 2>/dev/null <<'PY' || true
import glob
import os
import sys

for base in sys.path:
    for header in sorted(glob.glob(os.path.join(base, "nvidia", "*", "include", "nvml.h"))):
        print(os.path.dirname(header))
        sys.exit()
PY
)"
  if [[ -n "$nvml_dir" ]]; then
    args+=(-DNVML_INCLUDE_DIR="$nvml_dir")
  fi
fi

# The engine manifest (lmstool/manifest.py) runs with the same Python.
args+=(-DLMS_PYTHON="${PYTHON:-python3}")
if [[ -n "$overlay" ]]; then
  args+=(-DLMS_ENGINE_OVERLAY="$(cd "$overlay" && pwd)")
fi

args+=("${extra[@]}")

echo "== configure: $source_dir ($runtime runtime, $generator, $build_type)"
start=$(date +%s)
cmake "${args[@]}"

echo "== build: $jobs jobs$([[ $use_ccache == 1 ]] && echo ', ccache')"
[[ $use_ccache == 1 ]] && ccache -z >/dev/null 2>&1 || true
cmake --build "$build_dir" --parallel "$jobs"
end=$(date +%s)
if [[ $use_ccache == 1 ]]; then
  ccache -s 2>/dev/null | grep -E '^ *(Hits|Misses):' || true
fi
echo "== built in $((end - start)) s: $build_dir/libc10.so $build_dir/libc10_cuda.so"

if [[ $run_tests == 1 ]]; then
  echo "== test"
  (cd "$build_dir" && ctest --output-on-failure)
fi
