#!/usr/bin/env bash
# Fuzzes the C API's entry points with libFuzzer under AddressSanitizer + UBSan (clang), each
# target for a fixed time, starting from its committed corpus (tests/fuzz/corpus/<target>/).
#
#   bash scripts/fuzz.sh                 every target, MJOLNIR_FUZZ_SECONDS each (default 60)
#   bash scripts/fuzz.sh decode_step     one target
#   bash scripts/fuzz.sh --merge         after a run: fold what the run found into the committed
#                                        corpus, minimized (libFuzzer's -set_cover_merge=1)
#
# Targets (tests/fuzz/*.cc): scales_parse (the scales-file parser), cache_write (the cache
# descriptor, its layouts and strides against the pool, and mjolnir_write_kv), decode_step
# (plan, step arguments, workspace and the decode itself). A crash stops the run with the input
# saved under build-fuzz/crashes/<target>/; fix it, then copy the input into
# tests/fuzz/regressions/<target>/ (never merged away), where every test build replays it with the
# corpus (ctest -R fuzz_).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

targets=(scales_parse cache_write decode_step)
seconds=${MJOLNIR_FUZZ_SECONDS:-60}
merge=0
selected=()
for arg in "$@"; do
  case "$arg" in
    --merge) merge=1 ;;
    scales_parse | cache_write | decode_step) selected+=("$arg") ;;
    *) echo "usage: scripts/fuzz.sh [--merge] [${targets[*]}]" >&2; exit 2 ;;
  esac
done
((${#selected[@]})) && targets=("${selected[@]}")

command -v clang++ >/dev/null || { echo "fuzz.sh: needs clang (bash scripts/setup-debian.sh)" >&2; exit 1; }

# The library with coverage feedback and both sanitizers, -O1 -g like the sanitizer suite; only
# the fuzz binaries, no tests, CLI or benchmarks.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" -DMJOLNIR_FUZZ=ON -DMJOLNIR_SANITIZE=ON -DMJOLNIR_CUDA=OFF \
  -DMJOLNIR_BUILD_TESTS=OFF -DMJOLNIR_BUILD_TOOLS=OFF -DMJOLNIR_BUILD_BENCHMARKS=OFF \
  "${extra_cmake_args[@]}" >/dev/null
cmake --build build-fuzz -j "$jobs" --target "${targets[@]/#/fuzz_}"

export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
summary=()
for target in "${targets[@]}"; do
  binary=build-fuzz/tests/fuzz/fuzz_$target
  committed=tests/fuzz/corpus/$target
  regressions=tests/fuzz/regressions/$target
  mkdir -p "$regressions"
  work=build-fuzz/corpus/$target
  crashes=build-fuzz/crashes/$target
  mkdir -p "$work" "$crashes"
  if ((merge)); then
    # A fresh minimized set: what still adds coverage, from the committed and the found inputs.
    fresh=$(mktemp -d)
    "$binary" -set_cover_merge=1 "$fresh" "$committed" "$work" 2>/dev/null
    rm -rf "$committed" && mkdir -p "$committed" && cp "$fresh"/* "$committed"/ && rm -rf "$fresh"
    echo "fuzz.sh: $target corpus: $(ls "$committed" | wc -l) inputs, $(du -sh "$committed" | cut -f1)"
    continue
  fi
  log=build-fuzz/fuzz-$target.log
  echo "fuzz.sh: $target for ${seconds}s (log: $log)"
  # -rss_limit_mb: the decode target's buffers are bounded far below it; a leak or runaway
  # allocation is a finding. -timeout: one input taking 10 s is a hang.
  if ! "$binary" "$work" "$committed" "$regressions" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 \
      -artifact_prefix="$crashes/" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz.sh: $target FAILED; the input is in $crashes/ (replay: $binary <file>)" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  elapsed=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log")
  coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  summary+=("$(printf '%-13s %9s runs in %3ss, %s, corpus %s inputs' "$target" "$runs" \
    "$elapsed" "$coverage" "$(ls "$work" | wc -l)")")
done
((merge)) && exit 0
echo "fuzz.sh: no crash, leak, UB or broken API promise:"
printf '  %s\n' "${summary[@]}"
