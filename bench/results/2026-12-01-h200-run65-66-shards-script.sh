#!/usr/bin/env bash
# As shards.sh, but only two files come back: the shard results in one tarball, the logs in one.
set -u
OUT=${OUT:-/tmp/out}; W=/tmp/shards; mkdir -p $W/out
budget=$1; need=$2; shift 2
T0=$(date +%s)
for i in "$@"; do
  left=$(( budget - ($(date +%s) - T0) ))
  [ $left -lt $need ] && { echo "stop before shard $i: ${left} s left"; break; }
  s=$(date +%s)
  timeout $((left - 5)) .gpu/campaign/tierkv sim --profile quick --seeds 0..100000 --shard $i/20 --jobs 16 --keep-going --out-dir $W/out --json $W/shard-$i.json > $W/shard-$i.log 2> $W/shard-$i.err
  echo "shard $i rc=$? $(( $(date +%s) - s )) s"; grep -E "seeds run|throughput" $W/shard-$i.log
done
cd $W && tar czf "$OUT/shards.tgz" shard-*.json shard-*.log && ls out | head
