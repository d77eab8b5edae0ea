#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "=== kernel conformance"
"$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
echo "=== the production CUDA device"
"$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "test |test result|digest rows|panicked" "$OUT/engine_cuda.log" | head -20
echo "=== sim --device cuda (drawn) and --overlap on"
timeout 80 "$G/bin/tierkv" sim --device cuda --seeds 0..24 --jobs 12 --no-shrink --keep-going --out-dir "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^\[" > "$OUT/sim.log"; grep -E "seeds run|coverage" "$OUT/sim.log"
timeout 80 "$G/bin/tierkv" sim --device cuda --overlap on --seeds 0..24 --jobs 12 --no-shrink --keep-going --out-dir "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^\[" > "$OUT/sim-overlap.log"; grep -E "seeds run|coverage" "$OUT/sim-overlap.log"
for L in 4 61; do
  R=120; [ $L = 61 ] && R=60
  for mode in in-order overlap; do
    flag=""; [ $mode = overlap ] && flag="--overlap"
    echo "=== replay $L layers $mode"
    timeout 110 $G/bin/tierkv replay --device cuda --trace $G/data/trace.jsonl --requests $R --layers $L --time-scale 5 $flag > "$OUT/replay-$L-$mode.log" 2>&1; echo "rc=$?"; grep -E "step latency|computing steps|device ms|TTFT|finished|per op" "$OUT/replay-$L-$mode.log" | cut -c1-400
  done
done
