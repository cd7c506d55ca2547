#!/usr/bin/env bash
# The CPU performance sweep of docs/cpu-performance.md, start to finish: builds (Release, build/),
# runs `mjolnir bench --sweep` (raw JSON into bench/results/, named with the date and the
# machine), the cache-resident kernel rates (bench/micro/kernel_rates, JSON beside it) and its
# variant pairs (kernel-pairs-*.json), and renders the doc's tables and plot from those files. About 20 minutes on 2 cores; run it on an
# otherwise idle machine, since the bench divides by a bandwidth it measures at the start.
# The sweep runs in the backend's default numerics modes (--q-mode / --p-mode auto, what
# `mjolnir bench` and the vLLM plugin use: per format, the fastest mode within the accuracy
# bound of docs/numerics.md); --q-mode / --p-mode flags given here replace them.
#   scripts/sweep.sh [extra mjolnir bench flags, e.g. --threads 4 --min-time 2 --q-mode fp32]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra_cmake_args[@]}" >/dev/null
cmake --build build -j "$jobs" --target mjolnir_cli kernel_rates
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install --quiet matplotlib

mkdir -p bench/results
log=$(mktemp)
build/tools/mjolnir bench --sweep "$@" | tee "$log"
results=$(sed -n 's/^results: //p' "$log")
rm -f "$log"
rates="${results%.json}"
rates="${rates/cpu-sweep-/kernel-rates-}.json"
# Five runs of each, interleaved, and their medians: on a shared host one run can be 30% off.
build/bench/micro/kernel_rates --benchmark_filter='Decode|FmaPeak' --benchmark_min_time=0.2 \
  --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
  --benchmark_report_aggregates_only=true --benchmark_out="$rates" --benchmark_out_format=json
# The kernel's variant choices on this CPU, each pair timed call by call in one process
# (kernel_rates' Pair benchmarks; docs/cpu-experiments.md, "Variant pairs"), kept beside them.
pairs="${rates/kernel-rates-/kernel-pairs-}"
build/bench/micro/kernel_rates --benchmark_filter='Pair/' --benchmark_min_time=0.5 \
  --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
  --benchmark_out="$pairs" --benchmark_out_format=json
python3 scripts/render_bench.py "$results" --kernel-rates "$rates" --doc docs/cpu-performance.md \
  --plot docs/img/cpu-sweep.svg
echo "sweep: $results, $rates, $pairs -> docs/cpu-performance.md, docs/img/cpu-sweep.svg"
