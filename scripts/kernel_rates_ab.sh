#!/usr/bin/env bash
# Compares two builds of bench/micro/kernel_rates on this machine: runs them in turn, N rounds
# (which runs first alternates), and prints each benchmark's median and best ns per token-head
# and the median (and range) of new / base within a round. Interleaving matters on a shared host,
# where the same binary's rate moves by 10-30% from one minute to the next (up to 2x on a bad
# day); the ratio within a round is what those minutes affect least.
#   cp build/bench/micro/kernel_rates /tmp/kr_base   # before the change
#   ... change, rebuild ...
#   scripts/kernel_rates_ab.sh /tmp/kr_base build/bench/micro/kernel_rates 'Decode/fp8_e4m3/g4' 5
# Extra kernel_rates flags go in KERNEL_RATES_ARGS, e.g. KERNEL_RATES_ARGS=--target=AVX2.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
base=$1 new=$2 filter=$3 rounds=${4:-5}
for ((i = 0; i < rounds; ++i)); do
  # Alternate which runs first, so a slow stretch of the host does not always fall on one.
  order="base new"
  ((i % 2 == 0)) || order="new base"
  for tag in $order; do
    bin=$base
    [[ $tag == new ]] && bin=$new
    # shellcheck disable=SC2086  # the extra flags are meant to split
    "$bin" --benchmark_filter="$filter" ${KERNEL_RATES_ARGS:-} 2>/dev/null |
      awk -v tag="$tag" -v round="$i" '/^(Decode|Prefill)/ { for (i = 1; i <= NF; ++i)
        if ($i ~ /^ns_per/) { split($i, kv, "="); print round, tag, $1, kv[2] + 0 } }'
  done
done | python3 -c '
import collections, statistics, sys
runs = collections.defaultdict(dict)  # (name, round) -> {tag: ns}
for line in sys.stdin:
    round_, tag, name, ns = line.split()
    runs[name, round_][tag] = float(ns)
for name in sorted({name for name, _ in runs}):
    pairs = [r for (n, _), r in runs.items() if n == name and len(r) == 2]
    b = [r["base"] for r in pairs]
    n = [r["new"] for r in pairs]
    ratios = [r["new"] / r["base"] for r in pairs]
    print(f"{name:36s} median {statistics.median(b):7.2f} -> {statistics.median(n):7.2f}"
          f"  best {min(b):7.2f} -> {min(n):7.2f}  new/base in a round: median"
          f" {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
          f" ({len(pairs)} rounds)")
'
