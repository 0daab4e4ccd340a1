#!/bin/bash
# Alternating A/B of builds of examples/chunk_cost.rs (BENCHMARKS.md, "Per-chunk cost against
# 02fefa8"). Three sets; in each set every build runs 5 times, the order rotated each time, and
# each build's median is given as a ratio to the first build's median in the same set, by the wall
# clock and by the thread's CPU time, with the 5 wall-clock figures in brackets.
#
# usage: bash benches/chunk_ab.sh WORKLOAD HANDOVER RUNS BIN...
#   e.g. bash benches/chunk_ab.sh chat_61_byte_splits static 200 /tmp/old/chunk_cost target/release/examples/chunk_cost
set -euo pipefail
w=$1; h=$2; n=$3; shift 3
bins=("$@")
med() { echo "$1" | tr ' ' '\n' | grep . | sort -g | sed -n 3p; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
for set in 1 2 3; do
  declare -A wall=() cpu=()
  k=${#bins[@]}
  for i in 0 1 2 3 4; do
    for j in $(seq 0 $((k - 1))); do
      b=${bins[$(((i + j) % k))]}
      out=$("$b" "$w" "$h" "$n")
      wall[$b]="${wall[$b]:-} $(echo "$out" | sed 's/.*each, \([0-9.]*\) MiB\/s.*/\1/')"
      cpu[$b]="${cpu[$b]:-} $(echo "$out" | sed 's/.*cpu \([0-9.]*\) MiB\/s.*/\1/')"
    done
  done
  bw=$(med "${wall[${bins[0]}]}"); bc=$(med "${cpu[${bins[0]}]}")
  echo "set $set (load average $(cut -d' ' -f1 /proc/loadavg)):"
  for b in "${bins[@]}"; do
    mw=$(med "${wall[$b]}"); mc=$(med "${cpu[$b]}")
    echo "  $b: wall $mw MiB/s ($(ratio "$mw" "$bw")), cpu $mc MiB/s ($(ratio "$mc" "$bc")) [${wall[$b]} ]"
  done
  unset wall cpu
done
