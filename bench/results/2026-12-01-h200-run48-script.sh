#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "=== kernel conformance"
"$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
echo "=== the production CUDA device"
"$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "test result|digest rows|panicked" "$OUT/engine_cuda.log" | head -20
echo "=== replay 4 layers"
timeout 60 $G/bin/tierkv replay --device cuda --trace $G/data/trace.jsonl --requests 120 --layers 4 --time-scale 5 > "$OUT/replay-4.log" 2>&1; echo "rc=$?"; tail -6 "$OUT/replay-4.log"
echo "=== replay 61 layers"
timeout 90 $G/bin/tierkv replay --device cuda --trace $G/data/trace.jsonl --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61.log" 2>&1; echo "rc=$?"; tail -6 "$OUT/replay-61.log"
echo "=== sim --device cuda"
timeout 60 "$G/bin/tierkv" sim --device cuda --seeds 0..24 --jobs 12 --no-shrink --out-dir "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^\[" > "$OUT/sim.log"; grep -E "seeds run|coverage" "$OUT/sim.log"
