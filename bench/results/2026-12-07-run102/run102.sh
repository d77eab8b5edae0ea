#!/usr/bin/env bash
# Run 102 (kernels/GPU.md): the hunt for the CUDA executor's one-off findings (run 95's seed 22,
# a top-k finding; run 101's seed 39, a layout finding), each seen once under 16 workers sharing
# one GPU and never again. Campaigns of `sim --device cuda --jobs 16` one after another, every
# log and every failing seed's trace kept under $OUT, until the time is spent.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
budget=${1:-540}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
k=0
for seeds in ${SEEDS:-0..48 0..48 48..96 0..48 0..48 96..144 0..48 0..48}; do
    left=$((budget - ($(date +%s) - start)))
    [ "$left" -gt 60 ] || break
    d="$OUT/c$k"; mkdir -p "$d"
    t0=$(date +%s)
    timeout "$left" .gpu/bin/tierkv sim --device cuda --seeds "$seeds" --jobs 16 --no-shrink \
        --keep-going --out-dir "$d" > "$d/sim.log" 2>&1
    rc=$?
    t1=$(date +%s)
    tr '\r' '\n' < "$d/sim.log" | grep -vE "^progress|^\[" > "$d/sim.txt"
    echo "campaign $k seeds $seeds rc=$rc $((t1 - t0)) s: $(grep -E 'seeds run|failing' "$d/sim.txt" | head -2 | tr '\n' ' ')"
    rm -f "$d/sim.log"
    # A trace over 20 MB would not come back: keep its head.
    for f in "$d"/*.trace.json; do
        [ -f "$f" ] || continue
        if [ "$(stat -c %s "$f")" -gt 20000000 ]; then head -c 20000000 "$f" > "$f.head"; rm "$f"; fi
    done
    k=$((k + 1))
done
ls -la "$OUT"/c*/ | head -40
