#!/bin/bash
# conda-build script: build PyTorch with the LMS series applied (conda-build applied the
# patches listed in meta.yaml to the source already) and install it into $PREFIX.
# The USE_* settings and TORCH_CUDA_ARCH_LIST are those of `lmstool build` (lmstool/plan.py and
# config/toolchain.yaml), written into the lms-env block by `lmstool recipe sync`.
set -euxo pipefail

# BEGIN lms-env (written by `lmstool recipe sync` from lmstool/plan.py and config/; do not edit)
export USE_CUDA=1
export USE_CUDNN=1
export USE_NCCL=1
export USE_DISTRIBUTED=1
export USE_KINETO=1
export USE_ROCM=0
export USE_XPU=0
export BUILD_TEST=0
export USE_SYSTEM_NCCL=0
export CMAKE_BUILD_TYPE=Release
if [[ "${target_platform}" == "linux-ppc64le" ]]; then
  export USE_MKLDNN=0
  export USE_FBGEMM=0
else
  export USE_MKLDNN=1
  export USE_FBGEMM=1
fi
case "${target_platform}/${cuda_compiler_version}" in
  linux-64/11.6) arch_list="3.7;5.0;6.0;7.0;7.5;8.0;8.6" ;;
  linux-64/11.7) arch_list="3.7;5.0;6.0;7.0;7.5;8.0;8.6" ;;
  linux-64/11.8) arch_list="3.7;5.0;6.0;7.0;7.5;8.0;8.6;9.0" ;;
  linux-64/12.4) arch_list="5.0;6.0;7.0;7.5;8.0;8.6;9.0" ;;
  linux-64/12.6) arch_list="5.0;6.0;7.0;7.5;8.0;8.6;9.0" ;;
  linux-ppc64le/11.6) arch_list="6.0;7.0;8.0" ;;
  linux-ppc64le/11.7) arch_list="6.0;7.0;8.0" ;;
  linux-ppc64le/11.8) arch_list="6.0;7.0;8.0" ;;
  linux-ppc64le/12.4) arch_list="6.0;7.0;8.0" ;;
  *)
    echo "build.sh: no TORCH_CUDA_ARCH_LIST for ${target_platform} CUDA ${cuda_compiler_version} in config/toolchain.yaml" >&2
    exit 1
    ;;
esac
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${arch_list}}"
# END lms-env
export MAX_JOBS="${MAX_JOBS:-${CPU_COUNT}}"
export PYTORCH_BUILD_VERSION="${PKG_VERSION}+lms.cu${cuda_compiler_version//./}"
export PYTORCH_BUILD_NUMBER="$((PKG_BUILDNUM + 1))"
export CUDA_HOME="${CUDA_HOME:-${PREFIX}}"
export CMAKE_PREFIX_PATH="${PREFIX}"

"${PYTHON}" -m pip install . --no-deps --no-build-isolation -vv
