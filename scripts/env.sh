# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this
# Sourced by the build scripts: the toolchain environment and build parallelism.
# CUDA's default install location is not on PATH for non-login shells (CI); nvcc there enables
# the CUDA backend.
if [[ -x /usr/local/cuda/bin/nvcc && ":$PATH:" != *":/usr/local/cuda/bin:"* ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# MJOLNIR_JOBS overrides the parallelism of builds and ctest (default: every core).
jobs="${MJOLNIR_JOBS:-$(nproc)}"
# MJOLNIR_CMAKE_ARGS adds configure options, e.g. "-DMJOLNIR_CUDA=OFF" or
# "-DCMAKE_CUDA_ARCHITECTURES=90a-real" to build for one GPU only.
read -r -a extra_cmake_args <<<"${MJOLNIR_CMAKE_ARGS:-}"
