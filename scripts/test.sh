#!/usr/bin/env bash
# Builds mjolnir and runs the whole test suite: every GoogleTest (ctest), then `mjolnir verify
# --quick` over every backend usable on this machine.
#   scripts/test.sh             Release build in build/
#   scripts/test.sh --sanitize  AddressSanitizer + UBSan build in build-asan/ (CPU only: nvcc
#                               does not take the sanitizer flags), its ctest suite with the
#                               quick case matrix
#   scripts/test.sh --tsan      ThreadSanitizer build in build-tsan/ (CPU only) of the tests that
#                               run threads against each other: test_concurrency (the
#                               thread-safety contract) and test_cpu_executor (the thread pool)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

sanitize=0
tsan=0
case "${1:-}" in
  "") ;;
  --sanitize) sanitize=1 ;;
  --tsan) tsan=1 ;;
  *) echo "usage: scripts/test.sh [--sanitize | --tsan]" >&2; exit 2 ;;
esac

if ((tsan)); then
  # Only the two test targets and the library they link: the rest of the suite is
  # single-threaded, and ASan covers it. -O1 -g as for ASan. About 1.5 minutes from a clean
  # build-tsan on 2 cores, almost all of it the library's build.
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
    -DMJOLNIR_TSAN=ON -DMJOLNIR_CUDA=OFF -DMJOLNIR_BUILD_TOOLS=OFF \
    -DMJOLNIR_BUILD_BENCHMARKS=OFF "${extra_cmake_args[@]}" >/dev/null
  # GCC 12's TSan runtime cannot place its shadow memory when the kernel randomizes mappings
  # with more than 28 bits (vm.mmap_rnd_bits = 32 on some newer hosts): the test binaries (run
  # by the build too, to list their tests) run without address randomization where allowed.
  no_aslr=()
  if setarch "$(uname -m)" -R true 2>/dev/null; then no_aslr=(setarch "$(uname -m)" -R); fi
  "${no_aslr[@]}" cmake --build build-tsan -j "$jobs" --target test_concurrency test_cpu_executor
  # Every report fails the run; halt_on_error keeps the first one readable. die_after_fork=0:
  # test_cpu_executor forks after the pool's threads exist and the child starts threads of its
  # own, the case it checks (vLLM forks its workers so); TSan refuses that by default. The
  # child's alarm() ends it should it hang.
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0 \
    "${no_aslr[@]}" ctest --test-dir build-tsan --output-on-failure -j "$jobs" \
    --no-tests=error -R '^(Concurrency|CpuExecutor)\.'
elif ((sanitize)); then
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
