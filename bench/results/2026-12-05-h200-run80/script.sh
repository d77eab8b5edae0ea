#!/usr/bin/env bash
# Run 80 (kernels/GPU.md): CPU only, on the GPU machine's 16 cores, at d5626af (arrivals, aborts
# and synchronize returns as schedule decisions, PCT over op starts). Staged by bench/stage.sh, plus
# .gpu/bin/tierkv-zoo (`--features mutants`). Run from the checkout with .gpu/ beside it.
set -u
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "=== sim 0..2000"
timeout 330 "$G/bin/tierkv" sim --seeds 0..2000 --jobs 16 --keep-going --no-shrink --coverage --json "$OUT/sim-2000.json" > "$OUT/sim-2000.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim-2000.log" | grep -vE "^\[|^progress" | tail -130
echo "=== pd 0..600"
timeout 90 "$G/bin/tierkv" sim --profile pd --seeds 0..600 --jobs 16 --keep-going --no-shrink > "$OUT/pd-600.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/pd-600.log" | grep -E "seeds run|wall time|failing|finding" | head
echo "=== zoo"
timeout 160 "$G/bin/tierkv-zoo" zoo --seeds 100 --jobs 16 --no-clean > "$OUT/zoo.log" 2>&1; echo "rc=$?"
tail -60 "$OUT/zoo.log"
