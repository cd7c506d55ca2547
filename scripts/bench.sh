#!/usr/bin/env bash
# Builds mjolnir (Release, in build/) and runs `mjolnir bench`: the default workload, or the
# flags given (scripts/bench.sh --format fp8_e4m3,fp4_e2m1 --context 4096,32768).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra_cmake_args[@]}" >/dev/null
cmake --build build -j "$jobs" --target mjolnir_cli
build/tools/mjolnir info
build/tools/mjolnir bench "$@"
