#!/bin/bash
# conda-build script: build PyTorch with the LMS series applied (conda-build applied the
# patches listed in meta.yaml to the source already) and install it into $PREFIX.
# The USE_* settings match `lmstool build` (lmstool/build.py: build_environment).
set -euxo pipefail

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
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-6.0;7.0;8.0}"
else
  export USE_MKLDNN=1
  export USE_FBGEMM=1
  if [[ "${cuda_compiler_version}" == 11.* ]]; then
    export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-3.7;5.0;6.0;7.0;7.5;8.0;8.6;9.0}"
  else
    export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-5.0;6.0;7.0;7.5;8.0;8.6;9.0}"
  fi
fi
export MAX_JOBS="${MAX_JOBS:-${CPU_COUNT}}"
export PYTORCH_BUILD_VERSION="${PKG_VERSION}+lms.cu${cuda_compiler_version//./}"
export PYTORCH_BUILD_NUMBER="$((PKG_BUILDNUM + 1))"
export CUDA_HOME="${CUDA_HOME:-${PREFIX}}"
export CMAKE_PREFIX_PATH="${PREFIX}"

"${PYTHON}" -m pip install . --no-deps --no-build-isolation -vv
