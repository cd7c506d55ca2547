#!/usr/bin/env bash
# Builds the Python package into a virtual environment and runs its pytest suite.
#
#   bash scripts/python-check.sh            # venv in build-python/venv (reused when present)
#   MJOLNIR_PY_FRESH=1 bash scripts/python-check.sh     # delete the venv and start from scratch
#   bash scripts/python-check.sh -k decode  # extra arguments go to pytest
#
# Needs what the C++ build needs (bash scripts/setup-debian.sh), python3 with venv, and PyPI.
# Environment:
#   MJOLNIR_PY_VENV     the venv (default build-python/venv)
#   MJOLNIR_PY_TORCH    the torch requirement (default "torch==2.13.0", the version vLLM's CPU
#                       build 0.32.0 pins, so scripts/vllm-check.sh can add vLLM to the same
#                       venv). PyPI's Linux x86-64 torch wheel
#                       is the CUDA build: it pulls the nvidia-* / cuda-* wheels (about 3 GB
#                       downloaded, 5 GB installed); nothing else is reachable here. A venv that
#                       already has torch keeps it.
#   MJOLNIR_PY_CUDA=ON  also build the CUDA backend (needs nvcc; its tests, test_cuda_ops.py,
#                       skip without a GPU; scripts/device-check.sh runs them on one), in
#                       build-python/<wheel tag>-cuda, for MJOLNIR_PY_CUDA_ARCH (default 90a-real)
#   MJOLNIR_JOBS        build parallelism (default 2)
#   MJOLNIR_TEST_SEED   the tests' random seed (default: a new one, printed in pytest's header)
set -euo pipefail

cd "$(dirname "$0")/.."
venv=$(realpath -m "${MJOLNIR_PY_VENV:-build-python/venv}")
python=${PYTHON:-python3}
start=$SECONDS

if [[ ${MJOLNIR_PY_FRESH:-0} == 1 ]]; then
  rm -rf "$venv" build-python/cp3*
fi
if [[ ! -x $venv/bin/python ]]; then
  echo "python-check: creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# Build requirements are installed into the venv and the build runs without isolation, so a
# re-run reuses them and CMake's build directory (build-python/<wheel tag>) stays incremental.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "python-check: installing ${MJOLNIR_PY_TORCH:-torch==2.13.0} (PyPI)"
  "${pip[@]}" install -q "${MJOLNIR_PY_TORCH:-torch==2.13.0}"
fi
"${pip[@]}" install -q "scikit-build-core>=0.10" "nanobind>=2.0" pytest numpy
echo "python-check: deps ready after $((SECONDS - start)) s"

export CMAKE_BUILD_PARALLEL_LEVEL=${MJOLNIR_JOBS:-2}
export MJOLNIR_PYTHON_CUDA=${MJOLNIR_PY_CUDA:-OFF}
build_args=()
if [[ $MJOLNIR_PYTHON_CUDA == ON ]]; then
  # A build folder of its own, and one architecture, to keep the compile short.
  build_args=(--config-settings=build-dir="build-python/{wheel_tag}-cuda"
    --config-settings=cmake.define.MJOLNIR_CUDA_ARCHITECTURES="${MJOLNIR_PY_CUDA_ARCH:-90a-real}")
fi
"${pip[@]}" install -q --no-build-isolation "${build_args[@]}" ./
echo "python-check: mjolnir built and installed after $((SECONDS - start)) s"

# From another directory, so the tests import the installed package, not python/mjolnir.
cd python/tests
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" .
echo "python-check: done in $((SECONDS - start)) s"
