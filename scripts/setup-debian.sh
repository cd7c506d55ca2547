#!/usr/bin/env bash
# Installs what building and testing mjolnir needs on Debian 12. Run as root (or with sudo
# available). Idempotent and quiet: packages already installed are not touched.
# The CUDA backend additionally needs the CUDA toolkit (nvcc), found in /usr/local/cuda or on PATH;
# without it the CPU backend, the emulator and the CLI are built alone.
set -euo pipefail

packages=(
  cmake ninja-build g++ make pkg-config
  libgtest-dev        # the test suite
  libbenchmark-dev    # microbenchmarks
  libhwy-dev          # Google Highway: one SIMD source for SSE4 / AVX2 / AVX-512 / NEON
  libcli11-dev        # the mjolnir CLI
  nlohmann-json3-dev  # scales files, bench --json
  clang               # libFuzzer (scripts/fuzz.sh); its FuzzedDataProvider for the corpus replays
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

as_root=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "setup-debian.sh: run as root (or install sudo)" >&2; exit 1; }
  as_root=(sudo)
fi
echo "setup-debian.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
