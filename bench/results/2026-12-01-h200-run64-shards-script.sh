#!/usr/bin/env bash
# Shards of the 100k-seed quick campaign (20 shards of 5,000), in the order given, while at
# least $2 seconds of the call's $1-second budget remain.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/out"
budget=$1; need=$2; shift 2
T0=$(date +%s)
nproc
for i in "$@"; do
  left=$(( budget - ($(date +%s) - T0) ))
  [ $left -lt $need ] && { echo "stop before shard $i: ${left} s left"; break; }
  s=$(date +%s)
  timeout $((left - 5)) .gpu/campaign/tierkv sim --profile quick --seeds 0..100000 --shard $i/20 --jobs 16 --keep-going --out-dir "$OUT/out" --json "$OUT/shard-$i.json" > "$OUT/shard-$i.log" 2> "$OUT/shard-$i.err"
  echo "shard $i rc=$? $(( $(date +%s) - s )) s"; grep -E "seeds run|throughput" "$OUT/shard-$i.log"
done
