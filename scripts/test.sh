#!/usr/bin/env bash
# Builds mjolnir and runs the whole test suite: every GoogleTest (ctest), then `mjolnir verify
# --quick` over every backend usable on this machine.
#   scripts/test.sh             Release build in build/
#   scripts/test.sh --sanitize  AddressSanitizer + UBSan build in build-asan/ (CPU only: nvcc
#                               does not take the sanitizer flags), its ctest suite with the
#                               quick case matrix
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

sanitize=0
case "${1:-}" in
  "") ;;
  --sanitize) sanitize=1 ;;
  *) echo "usage: scripts/test.sh [--sanitize]" >&2; exit 2 ;;
esac

if ((sanitize)); then
  # -O1 -g: readable reports at a fraction of -O2's compile time. The CLI is not run here.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
    -DMJOLNIR_SANITIZE=ON -DMJOLNIR_CUDA=OFF -DMJOLNIR_BUILD_TOOLS=OFF \
    "${extra_cmake_args[@]}" >/dev/null
  cmake --build build-asan -j "$jobs"
  # Leaks and every UB report fail the run; halt_on_error keeps the first report readable.
  # MJOLNIR_TEST_QUICK=1: the case-matrix tests run the covering subset, which exercises every
  # code path; the full matrix under ASan would take the better part of an hour.
  MJOLNIR_TEST_QUICK=1 \
    ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs"
else
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra_cmake_args[@]}" >/dev/null
  cmake --build build -j "$jobs"
  ctest --test-dir build --output-on-failure -j "$jobs"
  build/tools/mjolnir verify --quick
fi
