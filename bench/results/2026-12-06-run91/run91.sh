#!/usr/bin/env bash
# Run 91 (kernels/GPU.md, sim/CAMPAIGNS.md): the campaigns of issue 30's acceptance at the
# argument records, on the GPU machine's CPU cores (no GPU used): 2,000 default seeds and 600
# `pd` seeds, with the staged `tierkv` (its simulator does not depend on the `cuda` feature).
# `run91.sh default` runs the default profile only (run 92: after f3a412f's allocation fault
# factor, which the pd profile never draws).
set -u
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nproc | tee "$OUT/cpus.txt"
echo "=== default profile, seeds 0..2000"
timeout 470 "$G/bin/tierkv" sim --seeds 0..2000 --jobs 16 --keep-going --no-shrink --coverage > "$OUT/default2000.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/default2000.log" | grep -vE "^progress" | tail -14
[ "${1:-}" = default ] && exit 0
echo "=== pd profile, seeds 0..600"
timeout 150 "$G/bin/tierkv" sim --profile pd --seeds 0..600 --jobs 16 --keep-going --no-shrink --coverage > "$OUT/pd600.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/pd600.log" | grep -vE "^progress" | tail -10
