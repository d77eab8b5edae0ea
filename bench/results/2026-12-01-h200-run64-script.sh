#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
export PATH=/usr/local/cuda/bin:$PATH
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
echo "=== harness $(el)"
timeout 150 $G/h/harness > "$OUT/harness.txt" 2>&1; echo "rc=$?"; grep -E "^---|rows  1 len  65536 k 2048 C 4|rows  8 len   8192|MISMATCH|differ" "$OUT/harness.txt" | cut -c1-120
echo "=== memcheck harness quick $(el)"
timeout 120 compute-sanitizer --tool memcheck $G/h/harness quick > "$OUT/memcheck.txt" 2>&1; echo "rc=$?"; grep -E "ERROR SUMMARY|MISMATCH" "$OUT/memcheck.txt" | sort | uniq -c
echo "=== kernel conformance $(el)"
timeout 120 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
echo "=== engine cuda_device $(el)"
timeout 100 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked" "$OUT/engine_cuda.log"
echo "=== sim --device cuda $(el)"
timeout 80 "$G/bin/tierkv" sim --device cuda --seeds 0..24 --jobs 12 --no-shrink --keep-going --out-dir "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^\[" > "$OUT/sim.log"; grep -E "seeds run|coverage|fail" "$OUT/sim.log" | head -5
echo "=== tierkv bench $(el)"
timeout 200 "$G/bin/tierkv" bench --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"; grep -E "device copy 2|wgmma\) 64 x 64K|topk k" "$OUT/bench.md" | cut -c1-140
echo "=== done $(el)"
