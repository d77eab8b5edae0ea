#!/usr/bin/env bash
# Run 94 (kernels/GPU.md): issue 35's first part (`19363e1`), the arrays of a step uploaded once and the
# checks of a step's layers made once, against the build before it (`8424557`,
# staged as .gpu/bin/tierkv-old). `run94.sh check`: kernel conformance, `engine_it cuda_device`,
# `tierkv sim --device cuda` over 48 seeds. `run94.sh replay`: `tierkv replay --device cuda`,
# built-in excerpt, arrivals /5, one step ahead, at 61 layers (60 requests) and 4 layers (120
# requests), the two builds alternated, two replays each; and `host_cost` (no GPU) on this
# machine's CPU. `run94.sh all`: one replay of each build at each depth, then the checks (one
# call, when machines are scarce); `run94.sh quick`: the replays and `engine_it cuda_device`. Staged by bench/stage.sh. Run from the checkout, .gpu/
# beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
MODE=${1:-check}
checks() {
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head -24
echo "=== engine_it cuda_device"
timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -8
echo "=== sim --device cuda 0..${SIM_SEEDS:-48}"
timeout 200 "$G/bin/tierkv" sim --device cuda --seeds 0..${SIM_SEEDS:-48} --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | tail -8
}
replays() {
echo "=== host_cost (no GPU)"
"$G/bin/host_cost" 61 60 1 | tee "$OUT/host_cost.log"
"$G/bin/host_cost" 4 120 1 | tee -a "$OUT/host_cost.log"
for layers in 61 4; do
  req=60; [ "$layers" = 4 ] && req=120
  for i in $(seq 1 "$1"); do
    for b in tierkv-old tierkv; do
      f="$OUT/replay-$layers-$b-$i.log"
      timeout 150 "$G/bin/$b" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 --overlap > "$f" 2>&1
      echo "=== $b $layers layers #$i rc=$?"
      grep -E "^finished|^step latency|computing steps|device ms per step|per op kind" "$f" | cut -c1-700
    done
  done
done
}
case "$MODE" in
  check) checks ;;
  replay) replays 2 ;;
  all) replays 1; checks ;;
  quick) replays 1
    echo "=== engine_it cuda_device"
    timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
    grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -8 ;;
esac
