#!/bin/bash
# usage: ramp.sh OUT ARGS... : each mutant, seeds 0..100, CPU to catch
out=$1; shift
Z=/tmp/zoo-ramp
: > $out
while read m p; do
  r=$($Z sim --profile $p --mutant $m --seeds 0..100 --jobs 1 --no-shrink --out-dir /tmp/rampout "$@" 2>/dev/null | tr '\r' '\n')
  seed=$(echo "$r" | grep -m1 "^FAIL seed" | awk '{print $3}')
  cpu=$(echo "$r" | grep -m1 "first failure after" | awk '{print $4}')
  echo "$m ${seed:-none} ${cpu:-none}" >> $out
done < /tmp/mutants.txt
